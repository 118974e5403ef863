//! Python bindings (feature `python`): a thin skin over the core.
//!
//! - `errors`: the one place mapping [`crate::Error`] to Python exceptions.
//! - `import`: DLPack import (C exchange API, then `__dlpack__` with fallbacks) and streams.
//! - `arrays`: numpy arrays over pinned blocks whose `base` keeps the block alive.
//! - `stager`, `d2h`: the user-facing classes and functions.
//!
//! No panic crosses into Python: pyo3 turns a panic into an exception at the boundary, and the
//! code here returns typed errors for every bad input instead of panicking.

pub(crate) mod args;
pub(crate) mod arrays;
pub(crate) mod d2h;
pub(crate) mod errors;
mod fresh;
mod h2d;
pub(crate) mod import;
mod linger;
mod mirror;
mod pool;
mod stager;
mod step;
pub(crate) mod values;
pub(crate) mod wait;

use std::sync::OnceLock;

use pyo3::prelude::*;

use crate::Device;
use crate::error::{Error, Result};
use crate::host::PinnedPool;

/// Per-device state shared by the module: the retained device and its pinned pools.
struct DeviceState {
    device: Device,
    /// `copy_d2h`'s and `empty_host`'s results (`set_pool_budget`).
    pool: PinnedPool,
    /// `alloc_pinned_numpy`'s arrays without `pool=`: recycled apart from the results, so
    /// long-lived arrays never take the results' budget.
    arrays: PinnedPool,
}

static DEVICES: OnceLock<Vec<OnceLock<DeviceState>>> = OnceLock::new();
static POOL_BUDGET: std::sync::atomic::AtomicUsize =
    std::sync::atomic::AtomicUsize::new(crate::host::DEFAULT_BUDGET);

fn device_state(ordinal: i32) -> Result<&'static DeviceState> {
    let probe = crate::driver::probe().map_err(Error::unavailable)?;
    let table = DEVICES.get_or_init(|| {
        (0..probe.device_count.max(0))
            .map(|_| OnceLock::new())
            .collect()
    });
    let slot = usize::try_from(ordinal)
        .ok()
        .and_then(|i| table.get(i))
        .ok_or(Error::NoSuchDevice {
            ordinal,
            count: probe.device_count,
        })?;
    if let Some(s) = slot.get() {
        return Ok(s);
    }
    let device = Device::new(ordinal)?;
    // Int stream handles are checked against the driver's layout, learnt from two streams made
    // for it: made here, at the first use of a device, not in a copy's call.
    crate::cuda::learn_layout();
    let pool = PinnedPool::new(
        &device,
        POOL_BUDGET.load(std::sync::atomic::Ordering::Relaxed),
    );
    let arrays = PinnedPool::new(&device, crate::host::DEFAULT_BUDGET);
    Ok(slot.get_or_init(|| DeviceState {
        device,
        pool,
        arrays,
    }))
}

/// Waits for all work queued on every device pinstage has used in this process (each one's
/// context synchronized), so no copy still reads or writes memory about to be unregistered.
/// Errors (a failed context) are left to the next call that meets them.
fn synchronize_used_devices() {
    if let Some(table) = DEVICES.get() {
        for s in table.iter().filter_map(OnceLock::get) {
            if let Ok(cur) = s.device.enter() {
                let _ = cur.synchronize();
            }
        }
    }
}

/// Whether a CUDA driver is loaded and reports at least one device.
///
/// Never raises; without a driver (or with ``PINSTAGE_DISABLE_CUDA=1``) it returns False and
/// ``driver_info()["reason"]`` says why.
///
/// Example:
///     >>> pinstage.cuda_available()
///     True
#[pyfunction]
fn cuda_available() -> bool {
    crate::cuda::cuda_available()
}

/// Number of CUDA devices the driver reports (0 without a driver). Never raises.
///
/// Example:
///     >>> pinstage.device_count()
///     1
#[pyfunction]
fn device_count() -> i32 {
    crate::cuda::device_count().unwrap_or(0)
}

/// Pinned host bytes pinstage holds in this process: stager slots, pool blocks, pinned arrays,
/// bounce buffers. Works without a driver (0). Never raises.
///
/// Example:
///     >>> pinstage.pinned_bytes() >= 0
///     True
#[pyfunction]
fn pinned_bytes(py: Python<'_>) -> usize {
    // Let go of what dropped handles kept for copies that have completed since.
    linger::reap(py);
    crate::host::live_pinned_bytes()
}

/// What the driver probe found.
///
/// Returns:
///     dict: ``available`` (bool), ``reason`` (why not, or None), ``device_count`` (int),
///     ``driver_version`` (``major * 1000 + minor * 10``, or None). Never raises.
///
/// Example:
///     >>> pinstage.driver_info()["available"]
///     True
#[pyfunction]
fn driver_info(py: Python<'_>) -> PyResult<Bound<'_, pyo3::types::PyDict>> {
    let d = pyo3::types::PyDict::new(py);
    match crate::driver::probe() {
        Ok(p) => {
            d.set_item("available", p.device_count > 0)?;
            d.set_item("reason", py.None())?;
            d.set_item("device_count", p.device_count)?;
            d.set_item("driver_version", p.driver_version)?;
        }
        Err(reason) => {
            d.set_item("available", false)?;
            d.set_item("reason", reason)?;
            d.set_item("device_count", 0)?;
            d.set_item("driver_version", py.None())?;
        }
    }
    Ok(d)
}

/// The Python module `pinstage._native`.
#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    errors::register(m)?;
    m.add_function(wrap_pyfunction!(cuda_available, m)?)?;
    m.add_function(wrap_pyfunction!(device_count, m)?)?;
    m.add_function(wrap_pyfunction!(driver_info, m)?)?;
    m.add_function(wrap_pyfunction!(pinned_bytes, m)?)?;
    arrays::register(m)?;
    stager::register(m)?;
    d2h::register(m)?;
    h2d::register(m)?;
    fresh::register(m)?;
    step::register(m)?;
    pool::register(m)?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
