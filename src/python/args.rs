//! Argument parsing shared by the Python classes and functions: devices and counts, each
//! refused with an error that names the parameter.

use pyo3::prelude::*;

use super::errors::{type_err, value_err};
use super::import::type_name;
use crate::Error;

/// A device ordinal argument: None (device 0), an int, `'cuda'`, `'cuda:N'` or a device object
/// (`torch.device`, `cupy.cuda.Device`), checked against the devices the driver reports.
pub(crate) fn parse_device(obj: Option<&Bound<'_, PyAny>>) -> PyResult<i32> {
    let ordinal = match obj.filter(|o| !o.is_none()) {
        None => 0,
        Some(obj) => device_ordinal(obj)?,
    };
    if ordinal < 0 {
        return Err(value_err(format!(
            "device={ordinal}: expected a CUDA device ordinal >= 0"
        )));
    }
    match crate::device_count() {
        Ok(count) if ordinal >= count => Err(Error::NoSuchDevice { ordinal, count }.into()),
        Err(Error::CudaUnavailable { reason }) if ordinal != 0 => Err(value_err(format!(
            "device={ordinal}: CUDA is unavailable ({reason}); without it only device 0 (host \
             destinations) can be named"
        ))),
        _ => Ok(ordinal),
    }
}

fn device_ordinal(obj: &Bound<'_, PyAny>) -> PyResult<i32> {
    if obj.is_instance_of::<pyo3::types::PyBool>() {
        return Err(type_err(
            "device must be an int, 'cuda:N' or a device object, got a bool",
        ));
    }
    if obj.is_instance_of::<pyo3::types::PyInt>() {
        return obj
            .extract::<i32>()
            .map_err(|_| value_err(format!("device={obj}: expected a CUDA device ordinal")));
    }
    if let Ok(s) = obj.extract::<String>() {
        return match s.as_str() {
            "cuda" => Ok(0),
            _ => s
                .strip_prefix("cuda:")
                .and_then(|n| n.parse().ok())
                .ok_or_else(|| value_err(format!("device={s:?}: expected an int or 'cuda:N'"))),
        };
    }
    // torch.device has .index (None for "cuda"), cupy.cuda.Device has .id; other objects with
    // such attributes (bytes.index is a method) are not devices.
    for attr in ["index", "id"] {
        if let Ok(v) = obj.getattr(attr) {
            if v.is_none() {
                return Ok(0);
            }
            if let Ok(i) = v.extract::<i32>()
                && !v.is_instance_of::<pyo3::types::PyBool>()
            {
                return Ok(i);
            }
        }
    }
    Err(type_err(format!(
        "device must be an int, 'cuda:N' or a device object, got {}",
        type_name(obj)
    )))
}

/// A count argument (`numel`, `depth`): an int in `lo..=hi`, else a typed error naming it.
pub(crate) fn count_arg(
    obj: &Bound<'_, PyAny>,
    name: &str,
    lo: usize,
    hi: usize,
) -> PyResult<usize> {
    let int =
        obj.is_instance_of::<pyo3::types::PyInt>() && !obj.is_instance_of::<pyo3::types::PyBool>();
    if !int {
        return Err(type_err(format!(
            "{name} must be an int in {lo}..={hi}, got {}",
            type_name(obj)
        )));
    }
    match obj.extract::<usize>() {
        Ok(v) if (lo..=hi).contains(&v) => Ok(v),
        _ => Err(value_err(format!(
            "{name}={}: expected an int in {lo}..={hi}",
            obj.repr()?
        ))),
    }
}
