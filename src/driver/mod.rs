//! The only module that touches `cudarc::driver::sys`.
//!
//! One thin, `Result`-returning function per CUDA driver call, in the style of cudarc's
//! `driver/result.rs`. libcuda is loaded at run time by cudarc's `dynamic-loading` feature:
//! [`probe`] checks `is_culib_present()` before the first driver call (cudarc's loader panics
//! otherwise), runs `cuInit(0)` once and counts devices. Every other function here must only be
//! called after [`probe`] succeeded; the safe layers above guarantee it by holding a
//! [`crate::Device`], which can only be made through [`probe`].
//!
//! Driver API reference: <https://docs.nvidia.com/cuda/cuda-driver-api/>.

use std::ffi::CStr;
use std::fmt;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicBool, Ordering};

use cudarc::driver::sys;

pub(crate) use sys::{CUcontext, CUdevice, CUdeviceptr, CUevent, CUstream};

pub(crate) mod ctx;
pub(crate) mod event;
pub(crate) mod mem;
pub(crate) mod pool;
pub(crate) mod stream;

/// A failed CUDA driver call: the call's name and the `CUresult` it returned.
///
/// `Display` names the error through `cuGetErrorName` / `cuGetErrorString`, e.g.
/// `cuMemcpyHtoDAsync_v2: CUDA_ERROR_INVALID_VALUE (invalid argument)`.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct DriverError {
    call: &'static str,
    code: sys::CUresult,
}

impl DriverError {
    /// The driver function that failed.
    pub fn call(&self) -> &'static str {
        self.call
    }

    /// The raw `CUresult` value.
    pub fn code(&self) -> u32 {
        self.code as u32
    }

    /// Whether the memory was already registered (`CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED`).
    pub fn is_already_registered(&self) -> bool {
        self.code == sys::CUresult::CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED
    }

    /// Whether the driver refused a handle (`CUDA_ERROR_INVALID_HANDLE`, or
    /// `CUDA_ERROR_INVALID_RESOURCE_TYPE` for a handle of another kind).
    pub fn is_invalid_handle(&self) -> bool {
        matches!(
            self.code,
            sys::CUresult::CUDA_ERROR_INVALID_HANDLE
                | sys::CUresult::CUDA_ERROR_INVALID_RESOURCE_TYPE
        )
    }

    /// Whether the error is about a CUDA graph being captured (codes 900-908: a capture in
    /// another thread's global mode refuses some calls here, while queued work still runs).
    pub fn is_capture_error(&self) -> bool {
        (900..=908).contains(&(self.code as u32))
    }

    /// Whether the driver does not offer the operation here (`CUDA_ERROR_NOT_SUPPORTED`).
    pub fn is_not_supported(&self) -> bool {
        self.code == sys::CUresult::CUDA_ERROR_NOT_SUPPORTED
    }

    /// Whether the driver ran out of memory (`CUDA_ERROR_OUT_OF_MEMORY`).
    pub fn is_out_of_memory(&self) -> bool {
        self.code == sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY
    }

    /// The symbolic name of the error, e.g. `CUDA_ERROR_INVALID_VALUE`.
    pub fn name(&self) -> String {
        let mut ptr: *const std::ffi::c_char = std::ptr::null();
        // SAFETY: a DriverError only exists after the library was loaded by `probe`; the
        // out-pointer is valid; on success it points to a static NUL-terminated string.
        let ok = unsafe { sys::cuGetErrorName(self.code, &mut ptr) } == sys::CUresult::CUDA_SUCCESS;
        if ok && !ptr.is_null() {
            // SAFETY: see above: static C string owned by the driver.
            unsafe { CStr::from_ptr(ptr) }
                .to_string_lossy()
                .into_owned()
        } else {
            format!("CUresult({})", self.code as u32)
        }
    }

    /// The driver's description of the error.
    pub fn description(&self) -> String {
        let mut ptr: *const std::ffi::c_char = std::ptr::null();
        // SAFETY: as in `name`.
        let ok =
            unsafe { sys::cuGetErrorString(self.code, &mut ptr) } == sys::CUresult::CUDA_SUCCESS;
        if ok && !ptr.is_null() {
            // SAFETY: static C string owned by the driver.
            unsafe { CStr::from_ptr(ptr) }
                .to_string_lossy()
                .into_owned()
        } else {
            "unknown error".to_owned()
        }
    }
}

impl fmt::Display for DriverError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {} ({})", self.call, self.name(), self.description())
    }
}

impl fmt::Debug for DriverError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

impl std::error::Error for DriverError {}

/// Result of one driver call.
pub(crate) type DResult<T> = Result<T, DriverError>;

#[inline]
fn check(call: &'static str, code: sys::CUresult) -> DResult<()> {
    if code == sys::CUresult::CUDA_SUCCESS {
        Ok(())
    } else {
        Err(DriverError { call, code })
    }
}

/// Runs `f` with this thread's stream-capture mode relaxed, then restores the mode.
///
/// While a thread captures a CUDA graph in global mode (torch's default), the driver refuses
/// "potentially unsafe" calls such as `cuEventSynchronize` and `cuEventQuery` on every other
/// thread (codes 900-908) and invalidates that capture; the work queued before still runs. A
/// wait that guards memory must not fail then (its caller would free or reuse memory a copy
/// still reads or writes), and must not break a capture it has nothing to do with: waiting for
/// work queued outside the capture is safe. So every query and wait of pinstage's runs relaxed
/// (two thread-local mode swaps around it). pinstage never waits on a capturing stream (its
/// copies refuse them).
pub(crate) fn capture_relaxed<T>(f: impl FnOnce() -> DResult<T>) -> DResult<T> {
    // The seeded bug (`scripts/gpu-run broken-capture`): the thread's mode left as it is.
    if cfg!(pinstage_seeded_bug = "capture_strict") {
        return f();
    }
    let mut mode = sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED;
    // SAFETY: a valid in/out pointer; the call only swaps this thread's mode.
    let swapped = unsafe { sys::cuThreadExchangeStreamCaptureMode(&mut mode) };
    let r = f();
    if swapped == sys::CUresult::CUDA_SUCCESS {
        // SAFETY: as above; `mode` holds the thread's previous mode.
        unsafe { sys::cuThreadExchangeStreamCaptureMode(&mut mode) };
    }
    r
}

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
