//! `PinnedStager`, `StagedTarget` and `H2DMirror` for Python.

use std::sync::Arc;

use numpy::{PyArrayDescrMethods, PyUntypedArray, PyUntypedArrayMethods};
use parking_lot::Mutex;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList, PyTuple};

use super::errors::{IntoPy, type_err, value_err};
use super::import::{Imported, import, parse_dtype, parse_stream, type_name};
use crate::device::StreamHandle;
use crate::dtype::DType;
use crate::mirror::H2DMirror as CoreMirror;
use crate::stager::{CopyOutcome, Stager};

/// Element bytes of `values`: borrowed from a matching numpy array, or converted.
pub(crate) enum Values<'py> {
    Borrowed {
        ptr: *const u8,
        len: usize,
        _keep: Bound<'py, PyAny>,
    },
    Owned(Vec<u8>),
}

impl Values<'_> {
    pub(crate) fn bytes(&self) -> &[u8] {
        match self {
            // SAFETY: `_keep` holds the numpy array, whose buffer is valid for `len` bytes.
            Values::Borrowed { ptr, len, .. } => unsafe { std::slice::from_raw_parts(*ptr, *len) },
            Values::Owned(v) => v,
        }
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
            return Ok(Values::Borrowed {
                ptr,
                len,
                _keep: values.clone(),
            });
        }
    } else if let Ok(list) = values.cast::<PyList>() {
        let items: Vec<_> = list.iter().collect();
        if let Some(v) = convert_sequence(&items, d)? {
            return Ok(Values::Owned(v));
        }
    } else if let Ok(tuple) = values.cast::<PyTuple>() {
        let items: Vec<_> = tuple.iter().collect();
        if let Some(v) = convert_sequence(&items, d)? {
            return Ok(Values::Owned(v));
        }
    }
    convert_with_numpy(values, d).map(Values::Owned)
}

fn convert_with_numpy(values: &Bound<'_, PyAny>, d: DType) -> PyResult<Vec<u8>> {
    let py = values.py();
    let np = py.import("numpy")?;
    let want = super::arrays::descr(py, d)?;
    let arr = np.call_method1("asarray", (values,)).map_err(|e| {
        type_err(format!(
            "values must be a numpy array or a sequence of numbers ({e})"
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
    let conv = arr.call_method1("astype", (&want,))?;
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
    let conv = np.call_method1("ascontiguousarray", (conv,))?;
    let bytes = conv.call_method0("tobytes")?;
    Ok(bytes.cast::<PyBytes>()?.as_bytes().to_vec())
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

fn parse_device(obj: Option<&Bound<'_, PyAny>>) -> PyResult<i32> {
    let Some(obj) = obj.filter(|o| !o.is_none()) else {
        return Ok(0);
    };
    if let Ok(i) = obj.extract::<i32>() {
        return Ok(i);
    }
    if let Ok(s) = obj.extract::<String>() {
        return match s.as_str() {
            "cuda" => Ok(0),
            _ => s
                .strip_prefix("cuda:")
                .and_then(|n| n.parse().ok())
                .ok_or_else(|| value_err(format!("device {s:?}: expected an int or 'cuda:N'"))),
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

fn stats_dict<'py>(py: Python<'py>, s: crate::stager::StagerStats) -> PyResult<Bound<'py, PyDict>> {
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

/// Exact-value memory of what a destination holds; see the Rust `H2DMirror`.
#[pyclass(frozen, module = "pinstage._native", name = "H2DMirror")]
pub struct PyMirror {
    inner: Mutex<CoreMirror>,
}

fn key_bytes(key: &Bound<'_, PyAny>) -> PyResult<Vec<u8>> {
    if let Ok(b) = key.cast::<PyBytes>() {
        return Ok(b.as_bytes().to_vec());
    }
    if let Ok(i) = key.extract::<i128>() {
        return Ok(i.to_le_bytes().to_vec());
    }
    if let Ok(s) = key.extract::<String>() {
        return Ok(s.into_bytes());
    }
    Err(type_err(format!(
        "mirror key must be bytes, int or str, got {}",
        type_name(key)
    )))
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

#[pymethods]
impl PyMirror {
    #[new]
    fn new() -> Self {
        Self {
            inner: Mutex::new(CoreMirror::new()),
        }
    }

    /// Whether `(key, values)` equals the last recorded pair, exactly.
    fn matches(&self, key: &Bound<'_, PyAny>, values: &Bound<'_, PyAny>) -> PyResult<bool> {
        Ok(self
            .inner
            .lock()
            .matches(&key_bytes(key)?, &raw_bytes(values)?))
    }

    /// Records `(key, values)`.
    fn record(&self, key: &Bound<'_, PyAny>, values: &Bound<'_, PyAny>) -> PyResult<()> {
        let (k, v) = (key_bytes(key)?, raw_bytes(values)?);
        self.inner.lock().record(&k, &v);
        Ok(())
    }

    /// Forgets everything (call it when the destination was written some other way).
    fn invalidate(&self) {
        self.inner.lock().invalidate();
    }

    fn __repr__(&self) -> String {
        format!("H2DMirror(valid={})", self.inner.lock().is_valid())
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

impl PyStager {
    /// Runs one copy holding the GIL (a copy costs a few microseconds of driver calls); the
    /// GIL is released only to wait for a slot's event or for a mirror another thread holds.
    fn stager(&self) -> PyResult<Arc<Stager>> {
        self.inner
            .read()
            .clone()
            .ok_or_else(|| value_err("this PinnedStager is closed; create a new one"))
    }

    fn run_copy(
        &self,
        py: Python<'_>,
        imp: &Imported,
        values: &[u8],
        pad: Option<&[u8]>,
        mirror: Option<&Mutex<CoreMirror>>,
        stream: StreamHandle,
    ) -> PyResult<bool> {
        // A thread waiting for the mirror while holding the GIL would deadlock with the holder
        // (which may be waiting for the GIL): lock it with the GIL released when contended.
        let mut guard = mirror.map(|m| m.try_lock().unwrap_or_else(|| py.detach(|| m.lock())));
        let stager = self.stager()?;
        let view = &imp.view;
        // The core splits slot writes of this size over several threads: such a copy takes a
        // while, so it runs without the GIL.
        let large_at = crate::stager::PARALLEL_WRITE_MIN;
        let large = values.len() >= large_at || (pad.is_some() && view.nbytes() >= large_at);
        let outcome = if large {
            py.detach(|| {
                stager.copy_bytes_waiting(
                    view,
                    values,
                    pad,
                    guard.as_deref_mut(),
                    stream,
                    &mut |ev| ev.synchronize(),
                )
            })
        } else {
            stager.copy_bytes_waiting(view, values, pad, guard.as_deref_mut(), stream, &mut |ev| {
                wait_for_slot(py, ev)
            })
        }
        .py_err()?;
        Ok(matches!(
            outcome,
            CopyOutcome::Issued { .. } | CopyOutcome::Host
        ))
    }
}

/// How long a claimer polls a busy slot's event with the GIL held before it releases the GIL
/// and blocks. A slot's small copy completes within microseconds; giving the GIL away for that
/// (and queueing to get it back behind other threads) costs more than the wait itself.
const SPIN_BEFORE_DETACH: std::time::Duration = std::time::Duration::from_micros(20);

fn wait_for_slot(py: Python<'_>, ev: &crate::Event) -> crate::Result<()> {
    let t0 = std::time::Instant::now();
    while t0.elapsed() < SPIN_BEFORE_DETACH {
        if ev.query()? {
            return Ok(());
        }
        std::hint::spin_loop();
    }
    py.detach(|| ev.synchronize())
}

#[pymethods]
impl PyStager {
    #[new]
    #[pyo3(signature = (dtype, numel=256, depth=16, *, device=None))]
    fn new(
        py: Python<'_>,
        dtype: &Bound<'_, PyAny>,
        numel: usize,
        depth: usize,
        device: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Self> {
        let d = parse_dtype(dtype)?;
        let ordinal = parse_device(device)?;
        let inner = py
            .detach(|| Stager::new(d, ordinal, numel, depth))
            .py_err()?;
        Ok(Self {
            inner: parking_lot::RwLock::new(Some(Arc::new(inner))),
            numel,
            dtype: d,
            depth,
            device: ordinal,
        })
    }

    /// `dst[:len(values)] = values` and, with `pad_value`, the rest of `dst` = pad, in ONE
    /// non-blocking host-to-device copy. Returns False when nothing was copied (mirror hit or
    /// 0 elements).
    #[pyo3(signature = (dst, values, pad_value=None, mirror=None, *, stream=None))]
    fn copy_(
        &self,
        py: Python<'_>,
        dst: &Bound<'_, PyAny>,
        values: &Bound<'_, PyAny>,
        pad_value: Option<&Bound<'_, PyAny>>,
        mirror: Option<&Bound<'_, PyMirror>>,
        stream: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<bool> {
        let d = self.dtype;
        let s = parse_stream(stream)?;
        let imp = import(dst, s)?;
        let vals = to_values(values, d)?;
        let pad = pad_value
            .filter(|p| !p.is_none())
            .map(|p| scalar_bytes(p, d))
            .transpose()?;
        let mirror = mirror.map(|m| &m.get().inner);
        let stream = s.unwrap_or(imp.stream);
        self.run_copy(py, &imp, vals.bytes(), pad.as_deref(), mirror, stream)
    }

    /// Binds `dst` once (imported and kept alive) with its own mirror: `target.copy_(values)`
    /// then pays only for the copy.
    #[pyo3(signature = (dst, pad_value=None))]
    fn target(
        slf: &Bound<'_, Self>,
        dst: &Bound<'_, PyAny>,
        pad_value: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<StagedTarget> {
        let me = slf.get();
        me.stager()?;
        let d = me.dtype;
        let imp = import(dst, None)?;
        if imp.view.dtype() != d {
            return Err(super::errors::to_py(crate::Error::DtypeMismatch {
                expected: d,
                got: imp.view.dtype(),
            }));
        }
        if imp.view.is_read_only() {
            return Err(super::errors::to_py(crate::Error::ReadOnly));
        }
        let pad = pad_value
            .filter(|p| !p.is_none())
            .map(|p| scalar_bytes(p, d))
            .transpose()?;
        Ok(StagedTarget {
            stager: slf.clone().unbind(),
            imported: imp,
            pad,
            mirror: Mutex::new(CoreMirror::new()),
            _dst: dst.clone().unbind(),
        })
    }

    /// Counters: copies, host_copies, skipped, bytes, waits, queries, growths, pinned_bytes.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        stats_dict(py, self.stager()?.stats())
    }

    /// Benches only: `False` makes every claim query its slot's own event (the behaviour before the watermark),
    /// `True` (the default) uses the stream's completion watermark.
    fn _set_amortized_checks(&self, on: bool) -> PyResult<()> {
        self.stager()?.set_amortized_checks(on);
        Ok(())
    }

    /// Benches only: `False` sends every copy as one `cuMemcpyHtoDAsync`, `True` (the default)
    /// sends copies of 2-32 KiB as one 2-D copy of packed rows.
    fn _set_row_copies(&self, on: bool) -> PyResult<()> {
        self.stager()?.set_row_copies(on);
        Ok(())
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

/// A destination bound to a stager, with its own mirror.
#[pyclass(frozen, module = "pinstage._native")]
pub struct StagedTarget {
    stager: Py<PyStager>,
    imported: Imported,
    pad: Option<Vec<u8>>,
    mirror: Mutex<CoreMirror>,
    _dst: Py<PyAny>,
}

#[pymethods]
impl StagedTarget {
    /// Copies `values` (and the bound pad) into the bound destination; skipped when it already
    /// holds them. `stream=None`: the producer's current work stream (torch), else the stream
    /// negotiated at bind time.
    #[pyo3(signature = (values, *, stream=None))]
    fn copy_(
        &self,
        py: Python<'_>,
        values: &Bound<'_, PyAny>,
        stream: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<bool> {
        let st = self.stager.get();
        let vals = to_values(values, st.dtype)?;
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
            &self.imported,
            vals.bytes(),
            self.pad.as_deref(),
            Some(&self.mirror),
            stream,
        )
    }

    /// Forgets what the mirror remembers (call it when dst was written some other way).
    fn invalidate(&self) {
        self.mirror.lock().invalidate();
    }

    /// Number of elements in the destination.
    #[getter]
    fn numel(&self) -> usize {
        self.imported.view.numel()
    }
}

/// Bench internals (not API): host ns per call of each step of `PinnedStager.copy_(dst,
/// values, pad)` before the copy itself: argument parsing helpers and the DLPack import.
#[pyfunction]
#[pyo3(name = "_profile_copy_path", signature = (dst, values, pad, dtype, n=10000))]
fn profile_copy_path<'py>(
    py: Python<'py>,
    dst: &Bound<'py, PyAny>,
    values: &Bound<'py, PyAny>,
    pad: &Bound<'py, PyAny>,
    dtype: &Bound<'py, PyAny>,
    n: usize,
) -> PyResult<Bound<'py, PyDict>> {
    use super::import::ns_per_call;
    let d = parse_dtype(dtype)?;
    let out = PyDict::new(py);
    for (k, v) in super::import::profile_import(dst, n)? {
        out.set_item(k, v)?;
    }
    let values_ns = ns_per_call(n, &mut || to_values(values, d).map(drop))?;
    out.set_item("values", values_ns)?;
    out.set_item(
        "pad scalar",
        ns_per_call(n, &mut || scalar_bytes(pad, d).map(drop))?,
    )?;
    let stream_ns = ns_per_call(n, &mut || parse_stream(None).map(drop))?;
    out.set_item("parse_stream(None)", stream_ns)?;
    Ok(out)
}

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(profile_copy_path, m)?)?;
    m.add_class::<PyStager>()?;
    m.add_class::<PyMirror>()?;
    m.add_class::<StagedTarget>()?;
    Ok(())
}
