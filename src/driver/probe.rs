//! Loading libcuda and initialising the driver, once per process; fork detection.

use std::sync::OnceLock;
use std::sync::atomic::{AtomicBool, Ordering};

use cudarc::driver::sys;

use super::check;

/// What the one-time probe found.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Probe {
    /// Number of CUDA devices the driver reports.
    pub device_count: i32,
    /// Driver version as `major * 1000 + minor * 10` (e.g. 13000 for 13.0).
    pub driver_version: i32,
}

static PROBE: OnceLock<Result<Probe, String>> = OnceLock::new();
static FORKED: AtomicBool = AtomicBool::new(false);

extern "C" fn mark_forked_child() {
    FORKED.store(true, Ordering::Relaxed);
}

/// Environment variable that, when set to `1`, makes pinstage behave as if no driver existed.
pub const DISABLE_ENV: &str = "PINSTAGE_DISABLE_CUDA";

/// Loads libcuda and initialises the driver, once per process.
///
/// `Err` carries a human-readable reason: library missing, `cuInit` failed, disabled by
/// [`DISABLE_ENV`], or this is a forked child of a process that had initialised CUDA (CUDA is not
/// fork-safe).
pub fn probe() -> Result<Probe, String> {
    if FORKED.load(Ordering::Relaxed) {
        return Err(
            "CUDA cannot be used in a forked child of a process that initialised it \
                    (CUDA is not fork-safe); use the 'spawn' start method"
                .to_owned(),
        );
    }
    PROBE.get_or_init(probe_uncached).clone()
}

fn probe_uncached() -> Result<Probe, String> {
    if std::env::var(DISABLE_ENV).is_ok_and(|v| v == "1") {
        return Err(format!("disabled by {DISABLE_ENV}=1"));
    }
    // SAFETY: only tries to dlopen candidate library names; no driver call is made.
    if !unsafe { sys::is_culib_present() } {
        return Err("the CUDA driver library (libcuda.so) was not found".to_owned());
    }
    // SAFETY: the library is present (checked above), so cudarc's loader does not panic.
    let code = unsafe { sys::cuInit(0) };
    check("cuInit", code).map_err(|e| format!("cuInit failed: {e}"))?;
    let mut count = 0;
    // SAFETY: driver initialised; valid out-pointer.
    check("cuDeviceGetCount", unsafe {
        sys::cuDeviceGetCount(&mut count)
    })
    .map_err(|e| e.to_string())?;
    let mut version = 0;
    // SAFETY: valid out-pointer.
    check("cuDriverGetVersion", unsafe {
        sys::cuDriverGetVersion(&mut version)
    })
    .map_err(|e| e.to_string())?;
    // SAFETY: registers a plain extern "C" fn that only stores to a static atomic.
    unsafe { libc::pthread_atfork(None, None, Some(mark_forked_child)) };
    Ok(Probe {
        device_count: count,
        driver_version: version,
    })
}

/// Whether the process was forked after CUDA was initialised in its parent.
pub(crate) fn forked() -> bool {
    FORKED.load(Ordering::Relaxed)
}
