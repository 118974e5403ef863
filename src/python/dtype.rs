//! Dtypes between Python and pinstage: a dtype argument (numpy, torch, jax, cupy, strings), and
//! numpy's descriptors of pinstage's dtypes.

use numpy::{PyArrayDescr, PyArrayDescrMethods};
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;

use super::errors::type_err;
use crate::dlpack::DType;
use pyo3::types::PyString;

/// Resolves a dtype argument: numpy dtypes/types/strings, torch dtypes, jax and cupy dtypes.
pub(crate) fn parse_dtype(obj: &Bound<'_, PyAny>) -> PyResult<crate::DType> {
    let py = obj.py();
    if obj.is_none() {
        return Err(type_err(
            "dtype=None: name a dtype (e.g. numpy.int32, 'float32' or torch.int64)",
        ));
    }
    // As numpy reads it: the dtype's name, refused when its byte order is not the host's.
    let numpy_name = |obj: &Bound<'_, PyAny>| -> PyResult<Option<String>> {
        let Ok(d) = py.import("numpy")?.call_method1("dtype", (obj,)) else {
            return Ok(None);
        };
        if !d.getattr("isnative")?.is_truthy()? {
            return Err(type_err(format!(
                "dtype must be in the host's byte order; got {}; use a native one, e.g. \
                 numpy.dtype('{}').newbyteorder('=')",
                d.repr()?,
                d.getattr("str")?
            )));
        }
        Ok(Some(d.getattr("name")?.extract()?))
    };
    // What the message shows: the string given, or the object as Python prints it.
    let shown = obj.repr()?.to_string();
    let name: String = if let Ok(s) = obj.cast::<PyString>() {
        let s = s.to_string();
        if crate::DType::from_name(&s).is_some() {
            s
        } else {
            // Type strings such as '<f4', '=i8', '|u1' (dtype.str, .npy headers).
            numpy_name(obj)?.unwrap_or(s)
        }
    } else {
        let module = obj
            .get_type()
            .module()
            .map(|m| m.to_string())
            .unwrap_or_default();
        if module.starts_with("torch") {
            obj.str()?.to_string()
        } else {
            match numpy_name(obj)? {
                Some(n) => n,
                None => obj.str()?.to_string(),
            }
        }
    };
    crate::DType::from_name(&name).ok_or_else(|| {
        type_err(format!(
            "dtype must be bool, int8-64, uint8-64, float16/32/64, bfloat16 or complex64/128; \
             got {shown}"
        ))
    })
}

static DESCRS: PyOnceLock<Vec<Py<PyArrayDescr>>> = PyOnceLock::new();

/// The numpy dtype of `d`; bfloat16 needs `ml_dtypes`.
pub(crate) fn descr<'py>(py: Python<'py>, d: DType) -> PyResult<Bound<'py, PyArrayDescr>> {
    if d == DType::BF16 {
        let ml = py.import("ml_dtypes").map_err(|_| {
            type_err(
                "bfloat16 results need the ml_dtypes package (pip install ml_dtypes), which \
                 provides numpy's bfloat16 dtype",
            )
        })?;
        let np = py.import("numpy")?;
        return Ok(np
            .call_method1("dtype", (ml.getattr("bfloat16")?,))?
            .cast_into()?);
    }
    let table = DESCRS.get_or_try_init(py, || -> PyResult<_> {
        let np = py.import("numpy")?;
        DType::ALL
            .iter()
            .map(|d| {
                let name = if *d == DType::BF16 {
                    "uint16"
                } else {
                    d.name()
                };
                Ok(np
                    .call_method1("dtype", (name,))?
                    .cast_into::<PyArrayDescr>()?
                    .unbind())
            })
            .collect()
    })?;
    let i = DType::ALL
        .iter()
        .position(|x| *x == d)
        .expect("every dtype is in ALL");
    Ok(table[i].bind(py).clone())
}

/// The pinstage dtype of a numpy dtype that is one of numpy's own (native byte order) dtype
/// objects; `None` for any other (bfloat16, big-endian, structured...: the general paths).
pub(crate) fn dtype_of(py: Python<'_>, have: &Bound<'_, PyArrayDescr>) -> PyResult<Option<DType>> {
    descr(py, DType::F32)?; // fills the table
    let table = DESCRS.get(py).expect("filled above");
    let found = DType::ALL
        .iter()
        .zip(table)
        .find(|(d, t)| **d != DType::BF16 && t.as_ptr() == have.as_ptr())
        .map(|(d, _)| *d);
    if found.is_some() {
        return Ok(found);
    }
    // ml_dtypes' bfloat16: a user dtype, known by its scalar type (asked only off the fast path).
    let bf16 = have.itemsize() == 2
        && have.kind() == b'V'
        && have.typeobj().name()? == "bfloat16"
        && have
            .typeobj()
            .module()
            .is_ok_and(|m| m.to_cow().is_ok_and(|m| m.starts_with("ml_dtypes")));
    Ok(bf16.then_some(DType::BF16))
}
