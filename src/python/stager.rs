//! `PinnedStager`, `StagedTarget` and `H2DMirror` for Python.

use std::sync::Arc;

use numpy::{PyArrayDescrMethods, PyUntypedArray, PyUntypedArrayMethods};
use parking_lot::Mutex;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList, PyString, PyTuple};

use super::errors::{type_err, value_err};
use super::import::{
    Imported, describe, import, is_jax_array, parse_dtype, parse_stream, type_name,
};
use super::wait::wait_interruptibly;
use crate::cuda::{Event, StreamHandle};
use crate::h2d::write::PARALLEL_WRITE_MIN;
use crate::view::DType;
use crate::{Error, H2DMirror as CoreMirror, Stager};

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
                    "value {} at index {i} does not fit {d} (range {lo}..={hi})",
                    it.repr()?
                )));
            } else {
                return Ok(None);
            };
            if v < lo || v > hi {
                return Err(value_err(format!(
                    "value {v} at index {i} does not fit {d} (range {lo}..={hi})"
                )));
            }
            out.extend_from_slice(&v.to_le_bytes()[..d.itemsize()]);
        }
        return Ok(Some(out));
    }
    match d {
        DType::F32 | DType::F64 | DType::F16 => {
            for it in items {
                if it.is_instance_of::<pyo3::types::PyComplex>() {
                    return Ok(None);
                }
                let Ok(v) = it.extract::<f64>() else {
                    return Ok(None);
                };
                match d {
                    DType::F32 => out.extend_from_slice(&(v as f32).to_le_bytes()),
                    DType::F64 => out.extend_from_slice(&v.to_le_bytes()),
                    _ => out.extend_from_slice(&half::f16::from_f64(v).to_le_bytes()),
                }
            }
            Ok(Some(out))
        }
        _ => Ok(None),
    }
}

/// Converts `values` to element bytes of `d`, refusing values that do not fit.
pub(crate) fn to_values<'py>(values: &Bound<'py, PyAny>, d: DType) -> PyResult<Values<'py>> {
    let py = values.py();
    if let Ok(arr) = values.cast::<PyUntypedArray>() {
        let want = super::arrays::descr(py, d)?;
        if arr.dtype().is_equiv_to(&want) && arr.is_c_contiguous() {
            // SAFETY: reading the data pointer of a live, C-contiguous numpy array.
            let ptr = unsafe { (*arr.as_array_ptr()).fields.data as *const u8 };
            let len = arr.len() * d.itemsize();
            return Ok(Values {
                data: Data::Borrowed {
                    ptr,
                    len,
                    _keep: values.clone(),
                },
                shape: Dims::new(arr.shape()),
            });
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
             anything numpy.asarray takes), got {what} {}",
            type_name(values)
        )));
    }
    convert_with_numpy(values, d).map(|(v, shape)| Values::owned(v, &shape))
}

/// Whether numpy can take `values` as an array of numbers: an array, a buffer, or an object with
/// `__array__` or `__dlpack__`; not a str, bytes, dict, set or iterator.
fn is_array_like(values: &Bound<'_, PyAny>) -> PyResult<bool> {
    let py = values.py();
    if values.is_instance_of::<PyString>()
        || values.is_instance_of::<PyBytes>()
        || values.is_instance_of::<PyDict>()
        || values.is_instance_of::<pyo3::types::PySet>()
        || values.hasattr(pyo3::intern!(py, "__next__"))?
    {
        return Ok(false);
    }
    Ok(values.hasattr(pyo3::intern!(py, "__array__"))?
        || values.hasattr(pyo3::intern!(py, "__array_interface__"))?
        || values.hasattr(pyo3::intern!(py, "__dlpack__"))?
        || values.is_instance_of::<pyo3::types::PyMemoryView>()
        || values.is_instance_of::<pyo3::types::PyRange>())
}

fn convert_with_numpy(values: &Bound<'_, PyAny>, d: DType) -> PyResult<(Vec<u8>, Vec<usize>)> {
    let py = values.py();
    let np = py.import("numpy")?;
    let want = super::arrays::descr(py, d)?;
    let arr = np.call_method1("asarray", (values,)).map_err(|e| {
        type_err(format!(
            "values must be a numpy array or a (nested, rectangular) sequence of numbers, got {} \
             ({e})",
            type_name(values)
        ))
    })?;
    let arr = arr
        .cast_into::<PyUntypedArray>()
        .map_err(|_| type_err("values: not an array"))?;
    if arr.ndim() == 0 {
        return Err(type_err(format!(
            "values must be a sequence or an array, got a scalar of type {}",
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
    let shape = arr.shape().to_vec();
    let conv = np.call_method1("ascontiguousarray", (conv,))?;
    let bytes = conv.call_method0("tobytes")?;
    Ok((bytes.cast::<PyBytes>()?.as_bytes().to_vec(), shape))
}

/// One element of `d` from a Python scalar.
pub(crate) fn scalar_bytes(v: &Bound<'_, PyAny>, d: DType) -> PyResult<Vec<u8>> {
    // A Python int or float (the common pad): converted directly, no list built.
    if let Some(b) = convert_sequence(std::slice::from_ref(v), d)? {
        return Ok(b);
    }
    let py = v.py();
    let list = PyList::new(py, [v])?;
    let vals = to_values(list.as_any(), d)?;
    Ok(vals.bytes().to_vec())
}

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
    for attr in ["index", "id"] {
        if let Ok(v) = obj.getattr(attr) {
            return Ok(v.extract::<Option<i32>>()?.unwrap_or(0));
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

fn stats_dict<'py>(py: Python<'py>, s: crate::StagerStats) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("copies", s.copies)?;
    d.set_item("host_copies", s.host_copies)?;
    d.set_item("skipped", s.skipped)?;
    d.set_item("bytes", s.bytes)?;
    d.set_item("waits", s.waits)?;
    d.set_item("queries", s.queries)?;
    d.set_item("growths", s.growths)?;
    d.set_item("pinned_bytes", s.pinned_bytes)?;
    Ok(d)
}

/// What a mirror remembers for `matches` / `record`: a key compared with Python's `==` and the
/// values' dtype and bytes.
#[derive(Default)]
struct Recorded {
    key: Option<Py<PyAny>>,
    values: Vec<u8>,
}

/// Exact-value memory of what a destination holds; see the Rust `H2DMirror`.
#[pyclass(frozen, module = "pinstage._native", name = "H2DMirror")]
pub struct PyMirror {
    /// What stager copies recorded (`copy_(..., mirror=m)`).
    inner: Mutex<CoreMirror>,
    /// What `record` recorded.
    recorded: Mutex<Recorded>,
}

fn raw_bytes(values: &Bound<'_, PyAny>) -> PyResult<Vec<u8>> {
    if let Ok(b) = values.cast::<PyBytes>() {
        return Ok(b.as_bytes().to_vec());
    }
    let np = values.py().import("numpy")?;
    let arr = np.call_method1("ascontiguousarray", (values,))?;
    // dtype identity matters: int32 [1] and int64 [1] are different contents.
    let mut out = arr.getattr("dtype")?.str()?.to_string().into_bytes();
    out.push(0);
    out.extend_from_slice(arr.call_method0("tobytes")?.cast::<PyBytes>()?.as_bytes());
    Ok(out)
}

fn hashable(key: &Bound<'_, PyAny>) -> PyResult<()> {
    key.hash().map(drop).map_err(|e| {
        type_err(format!(
            "mirror key must be hashable (compared by ==, like a dict key), got {} ({e})",
            type_name(key)
        ))
    })
}

#[pymethods]
impl PyMirror {
    #[new]
    fn new() -> Self {
        Self {
            inner: Mutex::new(CoreMirror::new()),
            recorded: Mutex::new(Recorded::default()),
        }
    }

    /// Whether `(key, values)` equals the last recorded pair: the key by `==`, the values by
    /// dtype and bytes.
    fn matches(&self, key: &Bound<'_, PyAny>, values: &Bound<'_, PyAny>) -> PyResult<bool> {
        hashable(key)?;
        let bytes = raw_bytes(values)?;
        let stored = {
            let r = self.recorded.lock();
            match &r.key {
                Some(k) if r.values == bytes => Some(k.clone_ref(key.py())),
                _ => None,
            }
        };
        match stored {
            Some(k) => key.eq(k.bind(key.py())),
            None => Ok(false),
        }
    }

    /// Records `(key, values)`.
    fn record(&self, key: &Bound<'_, PyAny>, values: &Bound<'_, PyAny>) -> PyResult<()> {
        hashable(key)?;
        let bytes = raw_bytes(values)?;
        let old = {
            let mut r = self.recorded.lock();
            r.values = bytes;
            r.key.replace(key.clone().unbind())
        };
        drop(old);
        Ok(())
    }

    /// Forgets everything (call it when the destination was written some other way).
    fn invalidate(&self) {
        self.inner.lock().invalidate();
        let old = std::mem::take(&mut *self.recorded.lock());
        drop(old);
    }

    fn __repr__(&self) -> String {
        let valid = self.inner.lock().is_valid() || self.recorded.lock().key.is_some();
        format!("H2DMirror(valid={})", if valid { "True" } else { "False" })
    }
}

/// A ring of pinned buffers for small host-to-device copies.
#[pyclass(frozen, module = "pinstage._native", name = "PinnedStager")]
pub struct PyStager {
    /// `None` after `close()`. Copies clone the Arc, so closing while another thread copies
    /// frees the ring only when that copy is done.
    inner: parking_lot::RwLock<Option<Arc<Stager>>>,
    numel: usize,
    dtype: DType,
    depth: usize,
    device: i32,
}

/// How long a claimer polls a busy slot's event with the GIL held before it releases the GIL.
/// A slot's small copy completes within microseconds; giving the GIL away for that (and queueing
/// to get it back behind other threads) costs more than the wait itself.
const SPIN_BEFORE_DETACH: std::time::Duration = std::time::Duration::from_micros(20);

impl PyStager {
    fn stager(&self) -> PyResult<Arc<Stager>> {
        self.inner
            .read()
            .clone()
            .ok_or_else(|| value_err("this PinnedStager is closed; create a new one"))
    }

    /// Runs one copy holding the GIL (a copy costs a few microseconds of driver calls); the GIL
    /// is released to wait for a slot's event (answering Ctrl-C), for a mirror another thread
    /// holds, and for whole copies of [`PARALLEL_WRITE_MIN`] bytes or more.
    fn run_copy(
        &self,
        py: Python<'_>,
        view: &crate::DeviceView<'static>,
        values: &[u8],
        pad: Option<&[u8]>,
        mirror: Option<&Mutex<CoreMirror>>,
        stream: StreamHandle,
    ) -> PyResult<bool> {
        // A thread waiting for the mirror while holding the GIL would deadlock with the holder
        // (which may be waiting for the GIL): lock it with the GIL released when contended.
        let mut guard = mirror.map(|m| m.try_lock().unwrap_or_else(|| py.detach(|| m.lock())));
        let stager = self.stager()?;
        let large = values.len() >= PARALLEL_WRITE_MIN
            || (pad.is_some() && view.nbytes() >= PARALLEL_WRITE_MIN);
        let outcome = if large {
            py.detach(|| {
                let mut c = options(stager.to(view), stream, pad);
                if let Some(m) = guard.as_deref_mut() {
                    c = c.mirror(m);
                }
                c.copy(values)
            })
        } else {
            let mut interrupt: Option<PyErr> = None;
            let r = {
                let mut wait = |ev: &Event| -> crate::Result<()> {
                    let t0 = std::time::Instant::now();
                    while t0.elapsed() < SPIN_BEFORE_DETACH {
                        if ev.query()? {
                            return Ok(());
                        }
                        std::hint::spin_loop();
                    }
                    match wait_interruptibly(py, ev, None) {
                        Ok(_) => Ok(()),
                        Err(e) => {
                            interrupt = Some(e);
                            Err(Error::Interrupted)
                        }
                    }
                };
                let mut c = options(stager.to(view), stream, pad).wait_with(&mut wait);
                if let Some(m) = guard.as_deref_mut() {
                    c = c.mirror(m);
                }
                c.copy(values)
            };
            if let (Err(Error::Interrupted), Some(e)) = (&r, interrupt) {
                return Err(e);
            }
            r
        }?;
        Ok(outcome.wrote())
    }
}

/// The stream and pad of a copy.
fn options<'a>(
    c: crate::RawCopy<'a>,
    stream: StreamHandle,
    pad: Option<&'a [u8]>,
) -> crate::RawCopy<'a> {
    let c = c.stream(stream);
    match pad {
        Some(p) => c.pad(p),
        None => c,
    }
}

/// Imports a destination the stager may write: refuses JAX arrays (immutable, possibly shared)
/// and read-only tensors, before anything is written.
fn import_destination(dst: &Bound<'_, PyAny>, stream: Option<StreamHandle>) -> PyResult<Imported> {
    let imp = import(dst, stream)?;
    // JAX arrays offer no C exchange table: the check costs nothing on the torch path.
    if imp.exchange.is_none() && is_jax_array(dst) {
        return Err(value_err(format!(
            "dst is {}: JAX arrays are immutable (JAX may share their buffers), so pinstage \
             never writes into one; copy into a torch or cupy tensor, or make a new JAX array \
             with jax.device_put",
            describe(dst)
        )));
    }
    if imp.view.is_read_only() {
        return Err(Error::ReadOnly.into());
    }
    Ok(imp)
}

#[pymethods]
impl PyStager {
    #[new]
    #[pyo3(signature = (dtype, numel=None, depth=None, *, device=None))]
    fn new(
        py: Python<'_>,
        dtype: &Bound<'_, PyAny>,
        numel: Option<&Bound<'_, PyAny>>,
        depth: Option<&Bound<'_, PyAny>>,
        device: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Self> {
        let d = parse_dtype(dtype)?;
        let numel = match numel {
            Some(n) => count_arg(n, "numel", 1, isize::MAX as usize / d.itemsize())?,
            None => crate::DEFAULT_NUMEL,
        };
        let depth = match depth {
            Some(n) => count_arg(n, "depth", 1, crate::MAX_DEPTH)?,
            None => crate::DEFAULT_DEPTH,
        };
        let ordinal = parse_device(device)?;
        let builder = Stager::builder(d).device(ordinal).numel(numel).depth(depth);
        let inner = py.detach(|| builder.build())?;
        Ok(Self {
            inner: parking_lot::RwLock::new(Some(Arc::new(inner))),
            numel,
            dtype: d,
            depth,
            device: ordinal,
        })
    }

    /// `dst[:n] = values` and, with `pad_value`, the rest of `dst` = pad, in ONE non-blocking
    /// host-to-device copy. Returns False when nothing was copied (mirror hit or 0 elements).
    #[pyo3(signature = (dst, values, pad_value=None, mirror=None, *, stream=None))]
    fn copy_(
        &self,
        py: Python<'_>,
        dst: &Bound<'_, PyAny>,
        values: &Bound<'_, PyAny>,
        pad_value: Option<&Bound<'_, PyAny>>,
        mirror: Option<&Bound<'_, PyAny>>,
        stream: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<bool> {
        let d = self.dtype;
        let mirror = match mirror.filter(|m| !m.is_none()) {
            Some(m) => Some(m.cast::<PyMirror>().map_err(|_| {
                type_err(format!("mirror must be an H2DMirror, got {}", type_name(m)))
            })?),
            None => None,
        };
        let s = parse_stream(stream)?;
        let imp = import_destination(dst, s)?;
        let vals = to_values(values, d)?;
        check_shape(&vals.shape, imp.view.shape())?;
        let pad = pad_value
            .filter(|p| !p.is_none())
            .map(|p| scalar_bytes(p, d))
            .transpose()?;
        let mirror = mirror.map(|m| &m.get().inner);
        let stream = s.unwrap_or(imp.stream);
        self.run_copy(py, &imp.view, vals.bytes(), pad.as_deref(), mirror, stream)
    }

    /// Binds `dst` once (imported and kept alive): `target.copy_(values)` then pays only for the
    /// copy. With `skip_unchanged=True` the target keeps a mirror and skips copies of the values
    /// it last copied; only sound when the target is the destination's only writer.
    #[pyo3(signature = (dst, pad_value=None, *, skip_unchanged=false))]
    fn target(
        slf: &Bound<'_, Self>,
        dst: &Bound<'_, PyAny>,
        pad_value: Option<&Bound<'_, PyAny>>,
        skip_unchanged: bool,
    ) -> PyResult<StagedTarget> {
        let me = slf.get();
        me.stager()?;
        let d = me.dtype;
        let imp = import_destination(dst, None)?;
        if imp.view.dtype() != d {
            return Err(Error::DtypeMismatch {
                expected: d,
                got: imp.view.dtype(),
            }
            .into());
        }
        let pad = pad_value
            .filter(|p| !p.is_none())
            .map(|p| scalar_bytes(p, d))
            .transpose()?;
        Ok(StagedTarget {
            stager: slf.clone().unbind(),
            imported: imp,
            pad,
            mirror: skip_unchanged.then(|| Mutex::new(CoreMirror::new())),
            _dst: dst.clone().unbind(),
        })
    }

    /// Counters: copies, host_copies, skipped, bytes, waits, queries, growths, pinned_bytes.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        stats_dict(py, self.stager()?.stats())
    }

    /// Waits for every copy in flight and frees the ring; later copies raise.
    fn close(&self, py: Python<'_>) {
        let taken = self.inner.write().take();
        // Dropping the last Arc waits for in-flight slots: do it with the GIL released.
        py.detach(move || drop(taken));
    }

    /// Whether `close()` was called.
    #[getter]
    fn closed(&self) -> bool {
        self.inner.read().is_none()
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    #[pyo3(signature = (*_args))]
    fn __exit__(&self, py: Python<'_>, _args: &Bound<'_, PyTuple>) -> bool {
        self.close(py);
        false
    }

    /// The element dtype's numpy name.
    #[getter]
    fn dtype(&self) -> &'static str {
        self.dtype.name()
    }

    /// Initial slot capacity in elements.
    #[getter]
    fn numel(&self) -> usize {
        self.numel
    }

    /// Number of ring slots.
    #[getter]
    fn depth(&self) -> usize {
        self.depth
    }

    /// The CUDA device ordinal served.
    #[getter]
    fn device(&self) -> i32 {
        self.device
    }

    /// Whether CUDA destinations can be served.
    #[getter]
    fn cuda(&self) -> bool {
        self.inner.read().as_ref().is_some_and(|s| s.has_cuda())
    }

    fn __repr__(&self) -> String {
        format!(
            "PinnedStager(dtype={}, numel={}, depth={}, device={}, cuda={}, closed={})",
            self.dtype.name(),
            self.numel,
            self.depth,
            self.device,
            if self.cuda() { "True" } else { "False" },
            if self.closed() { "True" } else { "False" },
        )
    }
}

/// A destination bound to a stager (and, with `skip_unchanged`, its own mirror).
#[pyclass(frozen, module = "pinstage._native")]
pub struct StagedTarget {
    stager: Py<PyStager>,
    imported: Imported,
    pad: Option<Vec<u8>>,
    mirror: Option<Mutex<CoreMirror>>,
    _dst: Py<PyAny>,
}

#[pymethods]
impl StagedTarget {
    /// Copies `values` (and the bound pad) into the bound destination. `stream=None`: the
    /// producer's current work stream when it has a DLPack exchange table (torch), else the
    /// legacy default stream.
    #[pyo3(signature = (values, *, stream=None))]
    fn copy_(
        &self,
        py: Python<'_>,
        values: &Bound<'_, PyAny>,
        stream: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<bool> {
        let st = self.stager.get();
        let vals = to_values(values, st.dtype)?;
        check_shape(&vals.shape, self.imported.view.shape())?;
        let stream = match parse_stream(stream)? {
            Some(s) => s,
            None => match (&self.imported.exchange, self.imported.view.memory()) {
                (Some(ex), crate::MemoryKind::Cuda(id)) => {
                    ex.current_stream(py, self.imported.view.device_type(), id)?
                }
                _ => self.imported.stream,
            },
        };
        st.run_copy(
            py,
            &self.imported.view,
            vals.bytes(),
            self.pad.as_deref(),
            self.mirror.as_ref(),
            stream,
        )
    }

    /// Forgets what the mirror remembers (call it when dst was written some other way).
    fn invalidate(&self) {
        if let Some(m) = &self.mirror {
            m.lock().invalidate();
        }
    }

    /// Whether copies of unchanged values are skipped.
    #[getter]
    fn skip_unchanged(&self) -> bool {
        self.mirror.is_some()
    }

    /// Number of elements in the destination.
    #[getter]
    fn numel(&self) -> usize {
        self.imported.view.numel()
    }
}

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyStager>()?;
    m.add_class::<PyMirror>()?;
    m.add_class::<StagedTarget>()?;
    Ok(())
}
