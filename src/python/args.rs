//! Argument parsing shared by the Python classes and functions: devices and counts, each
//! refused with an error that names the parameter.

use pyo3::prelude::*;

use super::errors::type_name;
use super::errors::{type_err, value_err};
use crate::Error;

/// A device ordinal argument: None (device 0), an int, `'cuda'`, `'cuda:N'` or a device object
/// (`torch.device`, `cupy.cuda.Device`), checked against the devices the driver reports.
pub(crate) fn parse_device(obj: Option<&Bound<'_, PyAny>>) -> PyResult<i32> {
    parse_device_with(obj, 0)
}

/// As [`parse_device`], but None names the device whose context is current on this thread (as
/// `torch.cuda.set_device` or cupy's `Device.use()` leave it), else device 0: for the objects
/// that hold device memory of their own (stagers, step stagers).
pub(crate) fn parse_device_or_current(obj: Option<&Bound<'_, PyAny>>) -> PyResult<i32> {
    let none = obj.is_none_or(|o| o.is_none());
    parse_device_with(obj, if none { current_or_0() } else { 0 })
}

fn current_or_0() -> i32 {
    crate::cuda::current_device().unwrap_or(0)
}

fn parse_device_with(obj: Option<&Bound<'_, PyAny>>, default: i32) -> PyResult<i32> {
    let ordinal = match obj.filter(|o| !o.is_none()) {
        None => default,
        Some(obj) => device_ordinal(obj)?,
    };
    if ordinal < 0 {
        return Err(value_err(format!(
            "device={ordinal}: expected a CUDA device ordinal >= 0"
        )));
    }
    match crate::cuda::device_count() {
        Ok(count) if ordinal >= count => Err(Error::NoSuchDevice { ordinal, count }.into()),
        Err(Error::CudaUnavailable { reason }) if ordinal != 0 => Err(Error::CudaUnavailable {
            reason: format!(
                "device={ordinal} needs CUDA ({reason}); without it only device 0 (host \
                 destinations) can be named"
            ),
        }
        .into()),
        _ => Ok(ordinal),
    }
}

fn device_ordinal(obj: &Bound<'_, PyAny>) -> PyResult<i32> {
    if obj.is_instance_of::<pyo3::types::PyBool>() {
        return Err(type_err(
            "device must be an int, 'cuda:N' or a device object; got a bool",
        ));
    }
    if let Some(i) = as_index(obj)? {
        return i
            .extract::<i32>()
            .map_err(|_| value_err(format!("device={obj}: expected a CUDA device ordinal")));
    }
    if let Ok(s) = obj.extract::<String>() {
        return match s.as_str() {
            // As torch reads "cuda": the current device.
            "cuda" => Ok(current_or_0()),
            _ => s
                .strip_prefix("cuda:")
                .and_then(|n| n.parse().ok())
                .ok_or_else(|| value_err(format!("device={s:?}: expected an int or 'cuda:N'"))),
        };
    }
    // torch.device has .type and .index (None for "cuda": the current device), cupy.cuda.Device
    // has .id; other objects with such attributes (bytes.index is a method) are not devices.
    if let Ok(t) = obj.getattr("type")
        && let Ok(t) = t.extract::<String>()
        && t != "cuda"
    {
        return Err(type_err(format!(
            "device must be a CUDA device; got a {t} device ({})",
            obj.repr()?
        )));
    }
    for attr in ["index", "id"] {
        if let Ok(v) = obj.getattr(attr) {
            if v.is_none() {
                return Ok(current_or_0());
            }
            if let Ok(i) = v.extract::<i32>()
                && !v.is_instance_of::<pyo3::types::PyBool>()
            {
                return Ok(i);
            }
        }
    }
    Err(type_err(format!(
        "device must be an int, 'cuda:N' or a device object; got {}",
        type_name(obj)
    )))
}

/// `obj` as a Python int when it is an integer: an `int` (not a `bool`) or an object whose type
/// defines `__index__` (numpy's integer scalars, 0-d integer arrays), as `operator.index` reads
/// it; `None` for anything else (floats, bools, numpy bools, strings).
pub(crate) fn as_index<'py>(obj: &Bound<'py, PyAny>) -> PyResult<Option<Bound<'py, PyAny>>> {
    if obj.is_instance_of::<pyo3::types::PyBool>() {
        return Ok(None);
    }
    if obj.is_instance_of::<pyo3::types::PyInt>() {
        return Ok(Some(obj.clone()));
    }
    if !obj
        .get_type()
        .hasattr(pyo3::intern!(obj.py(), "__index__"))?
    {
        return Ok(None);
    }
    // SAFETY: a live object, GIL held; PyNumber_Index returns a new reference or NULL with an
    // exception set.
    let r = unsafe { pyo3::ffi::PyNumber_Index(obj.as_ptr()) };
    if r.is_null() {
        let py = obj.py();
        let err = PyErr::take(py)
            .unwrap_or_else(|| pyo3::exceptions::PySystemError::new_err("__index__ failed"));
        // numpy's bool defines __index__ only to refuse it (TypeError): not an integer. Any
        // other exception (KeyboardInterrupt, MemoryError, the object's own) is the caller's.
        if err.is_instance_of::<pyo3::exceptions::PyTypeError>(py) {
            return Ok(None);
        }
        return Err(err);
    }
    // SAFETY: a new reference we own.
    Ok(Some(unsafe { Bound::from_owned_ptr(obj.py(), r) }))
}

/// A shape argument: an int, or a sequence (not a str or bytes) of ints; ints as
/// [`count_arg`] takes them (numpy integers too, never bools). `Ok(None)`: not a shape (the
/// caller names what it expected); a dimension past `i64` is a value error.
pub(crate) fn shape_dims(obj: &Bound<'_, PyAny>) -> PyResult<Option<Vec<i64>>> {
    let dim = |x: &Bound<'_, PyAny>| -> PyResult<Option<i64>> {
        match as_index(x)? {
            Some(i) => i
                .extract::<i64>()
                .map(Some)
                .map_err(|_| value_err(format!("shape dimension {i} is out of range"))),
            None => Ok(None),
        }
    };
    if let Some(n) = dim(obj)? {
        return Ok(Some(vec![n]));
    }
    // A sequence (a tuple, a list, a numpy array): not a set, a dict or an iterator, whose order
    // or contents a shape must not depend on.
    if obj.is_instance_of::<pyo3::types::PyString>()
        || obj.is_instance_of::<pyo3::types::PyBytes>()
        || obj.is_instance_of::<pyo3::types::PyByteArray>()
        || obj.is_instance_of::<pyo3::types::PyBool>()
    {
        return Ok(None);
    }
    // SAFETY: a live object, GIL held; PySequence_Check only looks at its type (0 for dicts
    // and sets; 1 for tuples, lists, numpy arrays).
    if unsafe { pyo3::ffi::PySequence_Check(obj.as_ptr()) } != 1 {
        return Ok(None);
    }
    let mut out = Vec::new();
    for i in 0..obj.len()? {
        match dim(&obj.get_item(i)?)? {
            Some(n) => out.push(n),
            None => return Ok(None),
        }
    }
    Ok(Some(out))
}

/// A bool as Python spells it, for reprs.
pub(crate) fn py_bool(b: bool) -> &'static str {
    if b { "True" } else { "False" }
}

/// A count argument (`numel`, `depth`): an int (or a numpy integer) in `lo..=hi`, else a typed
/// error naming it.
pub(crate) fn count_arg(
    obj: &Bound<'_, PyAny>,
    name: &str,
    lo: usize,
    hi: usize,
) -> PyResult<usize> {
    let Some(int) = as_index(obj)? else {
        return Err(type_err(format!(
            "{name} must be an int from {lo} to {hi}; got {}",
            type_name(obj)
        )));
    };
    match int.extract::<usize>() {
        Ok(v) if (lo..=hi).contains(&v) => Ok(v),
        _ => Err(value_err(format!(
            "{name} must be an int from {lo} to {hi}; got {}",
            obj.repr()?
        ))),
    }
}

/// Positional arguments past a call's operands, for parameters now keyword-only: each goes to
/// its parameter (by `names`' order) with a `DeprecationWarning` saying how to write the call
/// (`old` and `new` name the two spellings); one given both ways, or too many, is a
/// `PinstageTypeError`.
///
/// # Errors
/// As above; the warning itself under `-W error`.
pub(crate) fn legacy_positional<'py>(
    legacy: &Bound<'py, pyo3::types::PyTuple>,
    names: &[&str],
    params: &mut [&mut Option<Bound<'py, PyAny>>],
    old: &str,
    new: &str,
) -> PyResult<()> {
    use pyo3::types::{PyTuple, PyTupleMethods};
    let _: &Bound<'py, PyTuple> = legacy;
    if legacy.is_empty() {
        return Ok(());
    }
    if legacy.len() > names.len() {
        return Err(type_err(format!(
            "{old} takes at most {} argument(s) after the operands; got {}; write {new}",
            names.len(),
            legacy.len()
        )));
    }
    for (i, v) in legacy.iter().enumerate() {
        if params[i].as_ref().is_some_and(|p| !p.is_none()) {
            return Err(type_err(format!(
                "{} was given both by position and by keyword; write {new}",
                names[i]
            )));
        }
        *params[i] = Some(v);
    }
    super::errors::deprecated(legacy.py(), old, new)
}
