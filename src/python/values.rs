//! Values and pads from Python objects: element bytes of a dtype, refusing what does not fit,
//! and numpy's assignment rule for `dst[:n] = values`.

use numpy::{PyArrayDescrMethods, PyUntypedArray, PyUntypedArrayMethods};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList, PyTuple};

use super::errors::type_name;
use super::errors::{type_err, value_err};
use crate::Error;
use crate::dlpack::DType;

/// Element bytes of `values` and their shape: borrowed from a matching numpy array, or
/// converted.
pub(crate) struct Values<'py> {
    data: Data<'py>,
    /// The values' shape (`[n]` for a flat sequence).
    pub shape: Dims,
}

/// A shape kept inline up to 4 dimensions (no allocation on the copy path).
pub(crate) struct Dims {
    n: usize,
    inline: [usize; 4],
    heap: Vec<usize>,
}

impl Dims {
    pub(crate) fn new(dims: &[usize]) -> Self {
        let mut inline = [0usize; 4];
        if dims.len() <= 4 {
            inline[..dims.len()].copy_from_slice(dims);
            Self {
                n: dims.len(),
                inline,
                heap: Vec::new(),
            }
        } else {
            Self {
                n: dims.len(),
                inline,
                heap: dims.to_vec(),
            }
        }
    }

    pub(crate) fn as_slice(&self) -> &[usize] {
        if self.n <= 4 {
            &self.inline[..self.n]
        } else {
            &self.heap
        }
    }
}

enum Data<'py> {
    Borrowed {
        ptr: *const u8,
        len: usize,
        _keep: Bound<'py, PyAny>,
    },
    Owned(Vec<u8>),
}

impl Values<'_> {
    pub(crate) fn bytes(&self) -> &[u8] {
        match &self.data {
            // SAFETY: `_keep` holds the numpy array, whose buffer is valid for `len` bytes.
            Data::Borrowed { ptr, len, .. } => unsafe { std::slice::from_raw_parts(*ptr, *len) },
            Data::Owned(v) => v,
        }
    }

    fn owned(v: Vec<u8>, shape: &[usize]) -> Self {
        Self {
            data: Data::Owned(v),
            shape: Dims::new(shape),
        }
    }
}

/// numpy's assignment rule for `dst[:n] = values`: values of `dst`'s shape past the first axis
/// (any number of rows), or 1-D values into a 1-D destination.
pub(crate) fn check_shape(values: &Dims, dst: &[i64]) -> PyResult<()> {
    let values = values.as_slice();
    let ok = match (values.len(), dst.len()) {
        (1, 0) | (1, 1) => true,
        (v, d) => {
            v == d
                && v > 0
                && values[1..]
                    .iter()
                    .zip(&dst[1..])
                    .all(|(&a, &b)| a as i64 == b)
        }
    };
    if ok {
        Ok(())
    } else {
        Err(Error::ShapeMismatch {
            values: values.to_vec(),
            dst: dst.to_vec(),
        }
        .into())
    }
}

fn int_range(d: DType) -> Option<(i128, i128)> {
    Some(match d {
        DType::I8 => (i8::MIN as i128, i8::MAX as i128),
        DType::I16 => (i16::MIN as i128, i16::MAX as i128),
        DType::I32 => (i32::MIN as i128, i32::MAX as i128),
        DType::I64 => (i64::MIN as i128, i64::MAX as i128),
        DType::U8 => (0, u8::MAX as i128),
        DType::U16 => (0, u16::MAX as i128),
        DType::U32 => (0, u32::MAX as i128),
        DType::U64 => (0, u64::MAX as i128),
        DType::Bool => (0, 1),
        _ => return None,
    })
}

/// Fast path for a list/tuple of Python ints or floats; `Ok(None)` means "use numpy".
fn convert_sequence(items: &[Bound<'_, PyAny>], d: DType) -> PyResult<Option<Vec<u8>>> {
    let mut out = Vec::with_capacity(items.len() * d.itemsize());
    if let Some((lo, hi)) = int_range(d) {
        for (i, it) in items.iter().enumerate() {
            let v: i128 = if let Ok(b) = it.cast::<pyo3::types::PyBool>() {
                b.is_true() as i128
            } else if let Ok(v) = it.extract::<i64>() {
                v as i128
            } else if let Ok(v) = it.extract::<u64>() {
                v as i128
            } else if it.is_instance_of::<pyo3::types::PyInt>() {
                return Err(value_err(format!(
                    "value {} at index {i} does not fit {d} (from {lo} to {hi})",
                    it.repr()?
                )));
            } else {
                return Ok(None);
            };
            if v < lo || v > hi {
                return Err(value_err(format!(
                    "value {v} at index {i} does not fit {d} (from {lo} to {hi})"
                )));
            }
            out.extend_from_slice(&v.to_le_bytes()[..d.itemsize()]);
        }
        return Ok(Some(out));
    }
    match d {
        DType::F32 | DType::F64 | DType::F16 => {
            for (i, it) in items.iter().enumerate() {
                if it.is_instance_of::<pyo3::types::PyComplex>() {
                    return Ok(None);
                }
                let Ok(v) = it.extract::<f64>() else {
                    return Ok(None);
                };
                match d {
                    DType::F32 => {
                        let x = v as f32;
                        overflow_check(v, x.is_infinite(), i, d)?;
                        out.extend_from_slice(&x.to_le_bytes());
                    }
                    DType::F64 => out.extend_from_slice(&v.to_le_bytes()),
                    _ => {
                        let x = half::f16::from_f64(v);
                        overflow_check(v, x.is_infinite(), i, d)?;
                        out.extend_from_slice(&x.to_le_bytes());
                    }
                }
            }
            Ok(Some(out))
        }
        _ => Ok(None),
    }
}

/// Refuses a finite value that became infinite in a narrower float dtype (1e5 as float16):
/// numpy would store inf and warn; pinstage stores nothing and says which value.
fn overflow_check(v: f64, infinite: bool, i: usize, d: DType) -> PyResult<()> {
    if infinite && v.is_finite() {
        return Err(value_err(format!(
            "value {v} at index {i} does not fit {d} (it would become inf)"
        )));
    }
    Ok(())
}

/// Converts `values` to element bytes of `d`, refusing values that do not fit.
pub(crate) fn to_values<'py>(values: &Bound<'py, PyAny>, d: DType) -> PyResult<Values<'py>> {
    let py = values.py();
    if let Ok(arr) = values.cast::<PyUntypedArray>() {
        let want = super::dtype::descr(py, d)?;
        if let Some(v) = borrowed_exact(arr, &want, d) {
            return Ok(v);
        }
    } else if let Ok(list) = values.cast::<PyList>() {
        let items: Vec<_> = list.iter().collect();
        if let Some(v) = convert_sequence(&items, d)? {
            return Ok(Values::owned(v, &[items.len()]));
        }
    } else if let Ok(tuple) = values.cast::<PyTuple>() {
        let items: Vec<_> = tuple.iter().collect();
        if let Some(v) = convert_sequence(&items, d)? {
            return Ok(Values::owned(v, &[items.len()]));
        }
    } else if !is_array_like(values)? {
        let scalar = values.is_instance_of::<pyo3::types::PyInt>()
            || values.is_instance_of::<pyo3::types::PyFloat>()
            || values.is_instance_of::<pyo3::types::PyComplex>();
        let what = if scalar { "a scalar of type" } else { "a" };
        return Err(type_err(format!(
            "values must be a list, a tuple or an array of numbers (numpy, a torch CPU tensor, \
             anything numpy.asarray takes); got {what} {}",
            type_name(values)
        )));
    }
    convert_with_numpy(values, d)
}

/// A C-contiguous array of exactly the wanted dtype, borrowed as it is (no copy); `None` for
/// any other array.
fn borrowed_exact<'py>(
    arr: &Bound<'py, PyUntypedArray>,
    want: &Bound<'py, numpy::PyArrayDescr>,
    d: DType,
) -> Option<Values<'py>> {
    let have = arr.dtype();
    // The builtin dtypes are singletons: a pointer compare settles the common case.
    if !((have.as_ptr() == want.as_ptr() || have.is_equiv_to(want)) && arr.is_c_contiguous()) {
        return None;
    }
    // SAFETY: reading the data pointer of a live, C-contiguous numpy array.
    let ptr = unsafe { (*arr.as_array_ptr()).fields.data as *const u8 };
    Some(Values {
        data: Data::Borrowed {
            ptr,
            len: arr.len() * d.itemsize(),
            _keep: arr.clone().into_any(),
        },
        shape: Dims::new(arr.shape()),
    })
}

/// Whether numpy can take `values` as an array of numbers: an array (`__array__`,
/// `__array_interface__`, `__dlpack__`), a memoryview or a range; not a str, bytes, dict, set or
/// iterator (none of them has any of these).
fn is_array_like(values: &Bound<'_, PyAny>) -> PyResult<bool> {
    let py = values.py();
    Ok(values.hasattr(pyo3::intern!(py, "__array__"))?
        || values.hasattr(pyo3::intern!(py, "__array_interface__"))?
        || values.hasattr(pyo3::intern!(py, "__dlpack__"))?
        || values.is_instance_of::<pyo3::types::PyMemoryView>()
        || values.is_instance_of::<pyo3::types::PyRange>())
}

fn convert_with_numpy<'py>(values: &Bound<'py, PyAny>, d: DType) -> PyResult<Values<'py>> {
    let py = values.py();
    let np = py.import("numpy")?;
    let want = super::dtype::descr(py, d)?;
    let arr = np.call_method1("asarray", (values,)).map_err(|e| {
        // Only numpy's refusals of the object become a typed error: anything else raised while
        // converting (KeyboardInterrupt, MemoryError, a producer's own error) propagates as is.
        if !(e.is_instance_of::<pyo3::exceptions::PyTypeError>(py)
            || e.is_instance_of::<pyo3::exceptions::PyValueError>(py))
        {
            return e;
        }
        type_err(format!(
            "values must be a numpy array or a (nested, rectangular) sequence of numbers; got {} \
             ({e})",
            type_name(values)
        ))
    })?;
    let arr = arr
        .cast_into::<PyUntypedArray>()
        .map_err(|_| type_err("values: not an array"))?;
    if arr.ndim() == 0 {
        return Err(type_err(format!(
            "values must be a sequence or an array; got a scalar of type {}",
            type_name(values)
        )));
    }
    let kind = arr.dtype().kind();
    if !matches!(kind, b'b' | b'i' | b'u' | b'f' | b'c' | b'V') {
        return Err(type_err(format!(
            "values of numpy kind {:?} cannot be copied as {d}",
            kind as char
        )));
    }
    if kind == b'c' && !matches!(d, DType::C64 | DType::C128) {
        return Err(type_err(format!("complex values cannot be copied as {d}")));
    }
    // Kind 'V' is let through for ml_dtypes' types (bfloat16...); structured and raw void
    // values (numpy.void) hold no numbers.
    if kind == b'V'
        && arr
            .dtype()
            .getattr("type")?
            .cast::<pyo3::types::PyType>()
            .is_ok_and(|t| {
                np.getattr("void")
                    .and_then(|v| t.is_subclass(&v))
                    .unwrap_or(false)
            })
    {
        return Err(type_err(format!(
            "values of numpy dtype {} (structured or void) cannot be copied as {d}",
            arr.dtype().str()?
        )));
    }
    // What numpy.asarray gave (a torch CPU tensor's own memory, a buffer's...) may need no
    // conversion at all, or an integer cast checked here element by element: both skip the
    // general path's several passes through numpy.
    let have = arr.dtype();
    let exact = have.as_ptr() == want.as_ptr() || have.is_equiv_to(&want);
    let int_cast = matches!(kind, b'i' | b'u')
        && d.is_integral()
        && d != DType::Bool
        && have.is_native_byteorder() != Some(false);
    if exact || int_cast {
        let arr = if arr.is_c_contiguous() {
            arr.clone()
        } else {
            np.call_method1("ascontiguousarray", (&arr,))?
                .cast_into::<PyUntypedArray>()
                .map_err(|_| type_err("values: not an array"))?
        };
        if let Some(v) = borrowed_exact(&arr, &want, d) {
            return Ok(v);
        }
        // SAFETY: a live C-contiguous array of its dtype, kept alive by `arr` for this scope
        // (the GIL is held: nothing frees it).
        let src = unsafe {
            std::slice::from_raw_parts(
                (*arr.as_array_ptr()).fields.data as *const u8,
                arr.len() * arr.dtype().itemsize(),
            )
        };
        if let Some(out) = cast_ints(src, arr.dtype().itemsize(), kind == b'i', d)? {
            return Ok(Values::owned(out, arr.shape()));
        }
    }
    // Values that do not fit are refused below with a typed error; numpy's own warning about the
    // cast (NaN or inf into an integer) would only repeat that at the caller's line.
    let quiet = PyDict::new(py);
    quiet.set_item("invalid", "ignore")?;
    quiet.set_item("over", "ignore")?;
    let guard = np.call_method("errstate", (), Some(&quiet))?;
    guard.call_method0("__enter__")?;
    let conv = arr.call_method1("astype", (&want,));
    guard.call_method1("__exit__", (py.None(), py.None(), py.None()))?;
    let conv = conv?;
    if matches!(d, DType::F16 | DType::F32 | DType::BF16 | DType::C64) {
        // Refuse finite values that overflow to inf in the narrower dtype (1e5 into float16).
        let overflow = np
            .call_method1(
                "any",
                (np.call_method1(
                    "logical_and",
                    (
                        np.call_method1("isfinite", (&arr,))?,
                        np.call_method1("logical_not", (np.call_method1("isfinite", (&conv,))?,))?,
                    ),
                )?,),
            )?
            .extract::<bool>()?;
        if overflow {
            return Err(value_err(format!(
                "values do not fit {d}: {} holds finite values that would become inf",
                arr.repr()?
            )));
        }
    }
    if d.is_integral() {
        // Refuse values that do not survive the cast (300 into int8, 0.5 into int32, 2 into bool).
        let same = np
            .call_method1("array_equal", (&conv, &arr))?
            .extract::<bool>()?;
        let bad_bool = d == DType::Bool
            && !np
                .call_method1("isin", (&arr, PyList::new(py, [0, 1])?))?
                .call_method0("all")?
                .extract::<bool>()?;
        if !same || bad_bool {
            return Err(value_err(format!(
                "values do not fit {d}: {} cannot be represented exactly",
                arr.repr()?
            )));
        }
    }
    let conv = np
        .call_method1("ascontiguousarray", (conv,))?
        .cast_into::<PyUntypedArray>()
        .map_err(|_| type_err("values: not an array"))?;
    // The converted copy is ours: borrowed as it is (it has the wanted dtype).
    borrowed_exact(&conv, &want, d).ok_or_else(|| type_err(format!("values: not {d} after astype")))
}

/// Integers of `width` bytes (signed or not, native byte order) as integers of `d`, refusing a
/// value out of `d`'s range (nothing converted then); `None` for a width or dtype not handled.
fn cast_ints(src: &[u8], width: usize, signed: bool, d: DType) -> PyResult<Option<Vec<u8>>> {
    let read = |c: &[u8]| -> i128 {
        match (width, signed) {
            (1, true) => i8::from_ne_bytes([c[0]]).into(),
            (1, false) => c[0].into(),
            (2, true) => i16::from_ne_bytes([c[0], c[1]]).into(),
            (2, false) => u16::from_ne_bytes([c[0], c[1]]).into(),
            (4, true) => i32::from_ne_bytes(c.try_into().expect("4 bytes")).into(),
            (4, false) => u32::from_ne_bytes(c.try_into().expect("4 bytes")).into(),
            (8, true) => i64::from_ne_bytes(c.try_into().expect("8 bytes")).into(),
            _ => u64::from_ne_bytes(c.try_into().expect("8 bytes")).into(),
        }
    };
    if !matches!(width, 1 | 2 | 4 | 8) {
        return Ok(None);
    }
    macro_rules! cast {
        ($t:ty) => {{
            let mut out = Vec::with_capacity(src.len() / width * std::mem::size_of::<$t>());
            for (i, c) in src.chunks_exact(width).enumerate() {
                let v = read(c);
                let Ok(x) = <$t>::try_from(v) else {
                    return Err(value_err(format!(
                        "values do not fit {d}: {v} at index {i} cannot be represented exactly"
                    )));
                };
                out.extend_from_slice(&x.to_ne_bytes());
            }
            out
        }};
    }
    Ok(Some(match d {
        DType::I8 => cast!(i8),
        DType::I16 => cast!(i16),
        DType::I32 => cast!(i32),
        DType::I64 => cast!(i64),
        DType::U8 => cast!(u8),
        DType::U16 => cast!(u16),
        DType::U32 => cast!(u32),
        DType::U64 => cast!(u64),
        _ => return Ok(None),
    }))
}

/// One element of `d` from a Python scalar (a pad): a value that does not convert is refused
/// as the pad, in the pad's words.
pub(crate) fn scalar_bytes(v: &Bound<'_, PyAny>, d: DType) -> PyResult<Vec<u8>> {
    let py = v.py();
    let as_pad = |e: PyErr| {
        let why = e.value(py).to_string();
        let msg = format!(
            "pad_value must be one number that fits {d}; got {} ({why})",
            v.repr().map_or_else(|_| type_name(v), |r| r.to_string())
        );
        if e.is_instance_of::<pyo3::exceptions::PyTypeError>(py) {
            type_err(msg)
        } else if e.is_instance_of::<pyo3::exceptions::PyValueError>(py) {
            value_err(msg)
        } else {
            e
        }
    };
    // A Python int or float (the common pad): converted directly, no list built.
    if let Some(b) = convert_sequence(std::slice::from_ref(v), d).map_err(as_pad)? {
        return Ok(b);
    }
    let list = PyList::new(py, [v])?;
    let vals = to_values(list.as_any(), d).map_err(as_pad)?;
    // A sequence of several values is no pad (refused here, where the pad is given: a bound
    // target's pad is given once and used by every copy).
    if vals.bytes().len() != d.itemsize() {
        return Err(crate::Error::PadSize {
            got: vals.bytes().len(),
            expected: d.itemsize(),
            dtype: d,
        }
        .into());
    }
    Ok(vals.bytes().to_vec())
}
