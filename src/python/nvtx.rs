//! `NvtxRange` (made by `nvtx_range(message)`): NVTX ranges for Nsight, as a context manager
//! or a decorator.

use pyo3::prelude::*;
use pyo3::types::PyTuple;

/// An NVTX range for Nsight Systems (``nvtx_range(message)`` makes one), as a context manager:
/// ``with pinstage.nvtx_range("step"):``.
/// NVTX is loaded at run time (``libnvToolsExt``, shipped with the CUDA toolkit); without it this
/// does nothing. pinstage's own copies (``copy_d2h``, ``copy_h2d``, step commits) are ranges too.
/// Ranges are per thread: leave the block on the thread that entered it.
///
/// Also a decorator: ``@pinstage.nvtx_range("plan")`` runs each call of the function inside the
/// range.
///
/// Parameters:
///     message (str): the range's name.
///
/// Raises:
///     PinstageTypeError: a message that is not a str; decorating something not callable.
///
/// Example:
///     >>> with pinstage.nvtx_range("plan step"):
///     ...     pass
#[pyclass(frozen, name = "NvtxRange", module = "pinstage._native")]
pub(crate) struct NvtxRangeCtx {
    name: std::ffi::CString,
    depth: std::sync::atomic::AtomicUsize,
}

#[pymethods]
impl NvtxRangeCtx {
    #[new]
    fn new(message: &Bound<'_, PyAny>) -> PyResult<Self> {
        let s = message
            .cast::<pyo3::types::PyString>()
            .map_err(|_| super::errors::type_err("nvtx_range(message): message must be a str"))?
            .to_cow()?
            .replace('\0', " ");
        Ok(Self {
            name: std::ffi::CString::new(s).expect("NULs replaced"),
            depth: std::sync::atomic::AtomicUsize::new(0),
        })
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        let me = slf.get();
        if crate::nvtx::push(&me.name) {
            me.depth.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
        slf
    }

    #[pyo3(signature = (*_args))]
    fn __exit__(&self, _args: &Bound<'_, PyTuple>) -> bool {
        let d = &self.depth;
        if d.load(std::sync::atomic::Ordering::Relaxed) > 0 {
            d.fetch_sub(1, std::sync::atomic::Ordering::Relaxed);
            crate::nvtx::pop();
        }
        false
    }

    /// As a decorator: ``func`` wrapped so that each call runs inside this range.
    fn __call__<'py>(
        slf: &Bound<'py, Self>,
        func: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyAny>> {
        if !func.is_callable() {
            return Err(super::errors::type_err(format!(
                "nvtx_range(...) decorates a callable; got {}",
                super::errors::type_name(func)
            )));
        }
        super::helpers::wrap(slf.as_any(), func)
    }

    /// Whether NVTX was found (ranges reach a profiler when one is attached).
    #[staticmethod]
    fn available() -> bool {
        crate::nvtx::nvtx_available()
    }
}

/// A range for Nsight named ``message``: ``with nvtx_range("plan"):`` or ``@nvtx_range("plan")``
/// (the reference modules' spelling of ``NvtxRange(message)``).
///
/// Parameters:
///     message (str): the range's name.
///
/// Returns:
///     NvtxRange: a context manager, and a decorator.
///
/// Raises:
///     PinstageTypeError: a message that is not a str.
#[pyfunction]
fn nvtx_range(message: &Bound<'_, PyAny>) -> PyResult<NvtxRangeCtx> {
    NvtxRangeCtx::new(message)
}

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<NvtxRangeCtx>()?;
    m.add_function(wrap_pyfunction!(nvtx_range, m)?)
}
