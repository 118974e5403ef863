//! The Python module `pinstage._native`: what it finds of the driver, and the registration of
//! every class and function.

use pyo3::prelude::*;

use super::{
    arrays, blocks, d2h, errors, export, fresh, h2d, host, linger, nvtx, pool, stager, step,
};

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
    init(m)
}

/// Fills the module `m` with every name of `pinstage._native`.
pub(crate) fn init(m: &Bound<'_, PyModule>) -> PyResult<()> {
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
    export::register(m)?;
    step::register(m)?;
    pool::register(m)?;
    host::register(m)?;
    nvtx::register(m)?;
    blocks::register(m)?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
