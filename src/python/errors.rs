//! The one place where [`crate::Error`] becomes a Python exception.
//!
//! Exceptions (all subclasses of `pinstage.PinstageError`):
//! `CudaUnavailableError(RuntimeError)`, `CudaDriverError(RuntimeError)`,
//! `StreamCaptureError(RuntimeError)`, `PinstageValueError(ValueError)`,
//! `PinstageTypeError(TypeError)`, `StepStateError(RuntimeError)`, `UnknownFieldError(KeyError)`,
//! `PoolExhaustedError(RuntimeError)`.

use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::PyType;

use crate::dlpack::DlpackError;
use crate::error::Error;

const DEFS: &std::ffi::CStr = cr#"
class PinstageError(Exception):
    """Base class of every pinstage error."""

class CudaUnavailableError(PinstageError, RuntimeError):
    """No usable CUDA driver or device (missing, disabled, or a forked child)."""

class CudaDriverError(PinstageError, RuntimeError):
    """A CUDA driver call failed; the message names the call and the CUDA error."""

class StreamCaptureError(PinstageError, RuntimeError):
    """A staged copy was issued on a stream that is capturing a CUDA graph."""

class PinstageValueError(PinstageError, ValueError):
    """A bad argument value (sizes, devices, layouts)."""

class PinstageTypeError(PinstageError, TypeError):
    """A bad argument type (dtypes, objects without DLPack)."""

class StepStateError(PinstageError, RuntimeError):
    """A step used after its commit or abort, committed twice, or used from another thread."""

class PoolExhaustedError(PinstageError, RuntimeError):
    """A PinnedPool's max_outstanding_bytes would be passed (the message names the budget)."""

class UnknownFieldError(PinstageError, KeyError):
    """A step layout has no field of that name."""

    def __str__(self):
        return str(self.args[0]) if self.args else ""
"#;

static CLASSES: PyOnceLock<Py<PyModule>> = PyOnceLock::new();

fn module(py: Python<'_>) -> &Bound<'_, PyModule> {
    CLASSES
        .get_or_init(py, || {
            PyModule::from_code(py, DEFS, c"pinstage/_errors.py", c"pinstage._errors")
                .expect("static exception definitions compile")
                .unbind()
        })
        .bind(py)
}

/// Which Python class an error maps to.
#[derive(Clone, Copy)]
pub(crate) enum Kind {
    Unavailable,
    Driver,
    Capture,
    Value,
    Type,
    StepState,
    UnknownField,
    PoolExhausted,
}

impl Kind {
    fn name(self) -> &'static str {
        match self {
            Kind::Unavailable => "CudaUnavailableError",
            Kind::Driver => "CudaDriverError",
            Kind::Capture => "StreamCaptureError",
            Kind::Value => "PinstageValueError",
            Kind::Type => "PinstageTypeError",
            Kind::StepState => "StepStateError",
            Kind::UnknownField => "UnknownFieldError",
            Kind::PoolExhausted => "PoolExhaustedError",
        }
    }
}

/// A Python exception of `kind` with `msg`.
pub(crate) fn new_err(py: Python<'_>, kind: Kind, msg: impl Into<String>) -> PyErr {
    match module(py)
        .getattr(kind.name())
        .and_then(|c| Ok(c.cast_into::<PyType>()?))
    {
        Ok(cls) => PyErr::from_type(cls, msg.into()),
        Err(e) => e,
    }
}

/// A `PinstageValueError`.
pub(crate) fn value_err(msg: impl Into<String>) -> PyErr {
    Python::attach(|py| new_err(py, Kind::Value, msg))
}

/// A `PinstageTypeError`.
pub(crate) fn type_err(msg: impl Into<String>) -> PyErr {
    Python::attach(|py| new_err(py, Kind::Type, msg))
}

/// Converts a core error: `?` carries a [`crate::Error`] into Python.
impl From<Error> for PyErr {
    #[cold]
    fn from(e: Error) -> PyErr {
        let kind = match &e {
            Error::CudaUnavailable { .. } => Kind::Unavailable,
            Error::Driver(_) => Kind::Driver,
            Error::StreamCapturing => Kind::Capture,
            Error::StepState(_) => Kind::StepState,
            Error::UnknownField { .. } => Kind::UnknownField,
            Error::PoolExhausted { .. } => Kind::PoolExhausted,
            Error::Interrupted => {
                return pyo3::exceptions::PyKeyboardInterrupt::new_err(e.to_string());
            }
            Error::OutOfMemory { .. } => {
                return pyo3::exceptions::PyMemoryError::new_err(e.to_string());
            }
            Error::DtypeMismatch { .. }
            | Error::Dlpack(DlpackError::UnsupportedDtype { .. })
            | Error::BadCast { .. } => Kind::Type,
            _ => Kind::Value,
        };
        Python::attach(|py| new_err(py, kind, e.to_string()))
    }
}

/// The exception class of `kind`.
pub(crate) fn class(py: Python<'_>, kind: Kind) -> PyResult<Bound<'_, PyAny>> {
    module(py).getattr(kind.name())
}

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let defs = module(m.py());
    for name in [
        "PinstageError",
        "CudaUnavailableError",
        "CudaDriverError",
        "StreamCaptureError",
        "PinstageValueError",
        "PinstageTypeError",
        "StepStateError",
        "UnknownFieldError",
        "PoolExhaustedError",
    ] {
        let cls = defs.getattr(name)?;
        cls.setattr("__module__", "pinstage")?;
        m.add(name, cls)?;
    }
    Ok(())
}

/// "a numpy array of dtype >i4", "a torch Tensor", ...: for messages.
pub(crate) fn describe(obj: &Bound<'_, PyAny>) -> String {
    let ty = type_name(obj);
    match obj
        .getattr("dtype")
        .and_then(|d| d.str().map(|s| s.to_string()))
    {
        Ok(d) => format!("a {ty} of dtype {d}"),
        Err(_) => format!("a {ty}"),
    }
}

/// The name of an object's type, for messages.
pub(crate) fn type_name(obj: &Bound<'_, PyAny>) -> String {
    obj.get_type()
        .name()
        .map(|n| n.to_string())
        .unwrap_or_else(|_| "?".into())
}

/// Warns that `old` is deprecated: the message every renamed spelling raises, "`old` is
/// deprecated (removed in pinstage 0.4); write `new`", pointing at the caller's line.
///
/// # Errors
/// The warning itself, when warnings are turned into errors (`-W error`).
pub(crate) fn deprecated(py: Python<'_>, old: &str, new: &str) -> PyResult<()> {
    let msg = std::ffi::CString::new(format!(
        "{old} is deprecated (removed in pinstage 0.4); write {new}"
    ))
    .unwrap_or_default();
    PyErr::warn(
        py,
        &py.get_type::<pyo3::exceptions::PyDeprecationWarning>(),
        &msg,
        1,
    )
}
