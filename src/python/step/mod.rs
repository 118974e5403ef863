//! Step staging for Python: `StepLayout`, `StepStager`, `Step` (a context manager) and
//! `StepTensor` (a DLPack producer of arena fields, fresh blocks and zero-copy slot fields).

use std::sync::Arc;

use parking_lot::Mutex;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList, PyString, PyTuple};

use crate::cuda::{Event, Stream, StreamHandle};
use crate::dlpack::DType;
use crate::error::Error;
use crate::python::args::{count_arg, parse_device_or_current};
use crate::python::dtype::parse_dtype;
use crate::python::errors::{type_err, value_err};
use crate::python::import::import_writable;
use crate::python::stream::parse_stream;
use crate::python::wait::{slot_wait, take_interrupt};
use crate::step::FieldId;
use crate::step::{RawStep, StepLayout, StepMode, StepStager};
use numpy::npyffi;

pub(super) mod export;
mod open;

use export::{Keep, Order, StepTensor};
use open::{PyStep, StepState, commit_detached, put_id};

/// Named fields placed in one arena: each a dtype and a capacity shape ``(rows,)`` or
/// ``(rows, cols)``, at offsets aligned to 256 bytes, in declaration order. A ``StepStager``
/// keeps pinned slots laid out the same way, so a step's fields travel in ONE copy.
///
/// Parameters:
///     fields: a dict ``{name: (dtype, shape)}`` or a sequence of ``(name, dtype, shape)``;
///         ``shape`` is an int or a 1- or 2-tuple of ints >= 1. Declare densely written fields
///         first and large, sparsely used capacities last.
///     skip_unchanged (sequence of str, optional): fields whose commit is skipped when their
///         values and rows equal the last committed ones (the arena still holds them).
///
/// Raises:
///     PinstageValueError: no fields, a repeated or empty name, a bad shape, an unknown name in
///         ``skip_unchanged``. PinstageTypeError: an unsupported dtype or a malformed entry.
///
/// Example:
///     >>> layout = pinstage.StepLayout({"ids": ("int32", 8192), "table": ("int32", (256, 128))})
///     >>> layout.nbytes
///     163840
#[pyclass(frozen, name = "StepLayout", module = "pinstage._native")]
pub struct PyStepLayout {
    layout: StepLayout,
}

/// A field-name argument: a str, else a typed error naming the parameter.
pub(super) fn field_name(obj: &Bound<'_, PyAny>) -> PyResult<String> {
    match obj.cast::<PyString>() {
        Ok(s) => Ok(name_text(s)?.into_owned()),
        Err(_) => Err(type_err(format!(
            "name must be a str (a field name), got {}",
            crate::python::errors::type_name(obj)
        ))),
    }
}

/// The text of a field name; a str that is not valid UTF-8 (a lone surrogate) names no field:
/// `UnknownFieldError` (a `KeyError`), as any other name the layout lacks.
pub(super) fn name_text<'a>(s: &'a Bound<'_, PyString>) -> PyResult<std::borrow::Cow<'a, str>> {
    s.to_cow().map_err(|_| {
        Error::UnknownField {
            name: s.repr().map(|r| r.to_string()).unwrap_or_default(),
            known: "none is named by a str that is not valid UTF-8".into(),
        }
        .into()
    })
}

/// An optional dict argument `param`, else a typed error naming it.
fn dict_arg<'a, 'py>(
    obj: Option<&'a Bound<'py, PyAny>>,
    param: &str,
) -> PyResult<Option<&'a Bound<'py, PyDict>>> {
    match obj.filter(|o| !o.is_none()) {
        None => Ok(None),
        Some(o) => o.cast::<PyDict>().map(Some).map_err(|_| {
            type_err(format!(
                "{param} must be a dict {{field name: ...}}, got {}",
                crate::python::errors::type_name(o)
            ))
        }),
    }
}

/// `skip_unchanged`: None, one name, or an iterable of names.
fn skip_names(obj: Option<&Bound<'_, PyAny>>) -> PyResult<Vec<String>> {
    let Some(obj) = obj.filter(|o| !o.is_none()) else {
        return Ok(Vec::new());
    };
    let bad = || type_err("skip_unchanged must be a field name or a sequence of field names");
    if let Ok(s) = obj.cast::<PyString>() {
        return Ok(vec![s.to_cow()?.into_owned()]);
    }
    obj.try_iter()
        .map_err(|_| bad())?
        .map(|it| it?.extract::<String>().map_err(|_| bad()))
        .collect()
}

fn parse_shape(obj: &Bound<'_, PyAny>, name: &str) -> PyResult<Vec<usize>> {
    let dims = crate::python::args::shape_dims(obj)?.ok_or_else(|| {
        type_err(format!(
            "field {name:?}: shape must be an int or a tuple of ints, got {}",
            crate::python::errors::type_name(obj)
        ))
    })?;
    dims.iter()
        .map(|&d| {
            usize::try_from(d).map_err(|_| {
                value_err(format!(
                    "field {name:?}: shape {dims:?} has a negative dimension"
                ))
            })
        })
        .collect()
}

#[pymethods]
impl PyStepLayout {
    #[new]
    #[pyo3(signature = (fields, skip_unchanged=None))]
    fn new(fields: &Bound<'_, PyAny>, skip_unchanged: Option<&Bound<'_, PyAny>>) -> PyResult<Self> {
        let mut entries: Vec<(String, Bound<'_, PyAny>, Bound<'_, PyAny>)> = Vec::new();
        if let Ok(d) = fields.cast::<PyDict>() {
            for (k, v) in d.iter() {
                let name: String = k
                    .extract()
                    .map_err(|_| type_err("field names must be str"))?;
                let (dtype, shape): (Bound<'_, PyAny>, Bound<'_, PyAny>) =
                    v.extract().map_err(|_| {
                        type_err(format!("field {name:?}: expected a (dtype, shape) tuple"))
                    })?;
                entries.push((name, dtype, shape));
            }
        } else {
            let items: Vec<Bound<'_, PyAny>> = fields
                .try_iter()
                .map_err(|_| {
                    type_err("fields must be a dict or a sequence of (name, dtype, shape)")
                })?
                .collect::<PyResult<_>>()?;
            for it in items {
                let (name, dtype, shape): (String, Bound<'_, PyAny>, Bound<'_, PyAny>) =
                    it.extract().map_err(|_| {
                        type_err("fields must be a dict or a sequence of (name, dtype, shape)")
                    })?;
                entries.push((name, dtype, shape));
            }
        }
        let skip = skip_names(skip_unchanged)?;
        for s in &skip {
            if !entries.iter().any(|(n, _, _)| n == s) {
                return Err(Error::UnknownField {
                    name: s.clone(),
                    known: entries
                        .iter()
                        .map(|e| e.0.as_str())
                        .collect::<Vec<_>>()
                        .join(", "),
                }
                .into());
            }
        }
        let mut b = StepLayout::builder();
        for (name, dtype, shape) in entries {
            let d = parse_dtype(&dtype)?;
            let shape = parse_shape(&shape, &name)?;
            b = if skip.contains(&name) {
                b.field_skip_unchanged(name, d, &shape)
            } else {
                b.field(name, d, &shape)
            };
        }
        Ok(Self { layout: b.build()? })
    }

    /// Bytes of the arena and of each slot.
    #[getter]
    fn nbytes(&self) -> usize {
        self.layout.nbytes()
    }

    /// Layouts are equal when their fields are: the same names, dtypes, shapes and
    /// ``skip_unchanged`` flags in the same order (so the same offsets).
    fn __eq__(&self, other: &Bound<'_, PyAny>) -> bool {
        other
            .cast::<PyStepLayout>()
            .is_ok_and(|o| o.get().layout == self.layout)
    }

    fn __hash__(&self) -> u64 {
        use std::hash::{Hash, Hasher};
        let mut h = std::collections::hash_map::DefaultHasher::new();
        for f in self.layout.iter() {
            (f.name(), f.dtype().name(), f.shape(), f.skip_unchanged()).hash(&mut h);
        }
        h.finish()
    }

    /// Pickling (and ``copy.deepcopy``): rebuilt from its fields, e.g. in a worker process.
    fn __reduce__<'py>(slf: &Bound<'py, Self>) -> PyResult<Bound<'py, PyTuple>> {
        let py = slf.py();
        let me = slf.get();
        let fields = PyList::empty(py);
        let mut skip = Vec::new();
        for f in me.layout.iter() {
            fields.append((f.name(), f.dtype().name(), PyTuple::new(py, f.shape())?))?;
            if f.skip_unchanged() {
                skip.push(f.name().to_owned());
            }
        }
        PyTuple::new(
            py,
            [
                slf.get_type().into_any(),
                PyTuple::new(py, [fields.into_any(), PyList::new(py, skip)?.into_any()])?
                    .into_any(),
            ],
        )
    }

    /// Field names in declaration order.
    #[getter]
    fn names(&self) -> Vec<String> {
        self.layout.iter().map(|f| f.name().to_owned()).collect()
    }

    /// One dict per field: ``name``, ``dtype``, ``shape``, ``offset``, ``nbytes``,
    /// ``skip_unchanged``.
    #[getter]
    fn fields<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        let out = PyList::empty(py);
        for f in self.layout.iter() {
            let d = PyDict::new(py);
            d.set_item("name", f.name())?;
            d.set_item("dtype", f.dtype().name())?;
            d.set_item("shape", PyTuple::new(py, f.shape())?)?;
            d.set_item("offset", f.offset())?;
            d.set_item("nbytes", f.nbytes())?;
            d.set_item("skip_unchanged", f.skip_unchanged())?;
            out.append(d)?;
        }
        Ok(out)
    }

    /// Splits a packed step (a 1-D uint8 array of ``nbytes``, e.g. a fresh block imported into
    /// JAX) into its fields, by slicing and bitcasting: traceable inside ``jax.jit``; works on
    /// torch, cupy and numpy arrays too (views, no copy).
    ///
    /// Parameters:
    ///     packed: a 1-D uint8 array of ``nbytes`` bytes.
    ///
    /// Returns:
    ///     dict: ``{name: array of the field's dtype and capacity shape}``.
    ///
    /// Raises:
    ///     PinstageValueError: ``packed`` of the wrong size. PinstageTypeError: a 64-bit field in
    ///         JAX without ``jax_enable_x64``.
    ///
    /// Example:
    ///     >>> fields = layout.unpack(jax.dlpack.from_dlpack(stager.stage({"ids": ids})))
    fn unpack<'py>(
        slf: &Bound<'py, Self>,
        packed: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let py = slf.py();
        py.import("pinstage._unpack")?
            .getattr("unpack")?
            .call1((slf, packed))
    }

    fn __len__(&self) -> usize {
        self.layout.len()
    }

    fn __contains__(&self, name: &Bound<'_, PyAny>) -> bool {
        field_name(name).is_ok_and(|n| self.layout.id(&n).is_ok())
    }

    fn __repr__(&self) -> String {
        let fields: Vec<String> = self
            .layout
            .iter()
            .map(|f| format!("{}: {}{:?}", f.name(), f.dtype().name(), f.shape()))
            .collect();
        format!(
            "StepLayout({}; {} bytes)",
            fields.join(", "),
            self.layout.nbytes()
        )
    }
}

/// A ring of pinned slots laid out like a ``StepLayout``: each step claims a slot, its fields are
/// written in place (``Step.view``) or with ``Step.put``, and the commit sends the used rows with
/// ONE driver call (one copy when they are dense, else one batch), then records the slot's event.
/// A slot is never rewritten while its copy may still read it.
///
/// Modes:
///     ``"arena"`` (default): a persistent device arena (pinstage's allocation, or ``arena=``);
///         ``field(name)`` exports each field through DLPack with a stable address, so a CUDA
///         graph captured once reads every step's values. After a commit, a field's bytes past
///         its used rows are unspecified (a copy may span them, see ``max_gap``); fields not
///         written in a step keep their device values.
///     ``"fresh"``: every commit returns a ``StepTensor`` over a fresh device block (1-D uint8 of
///         ``layout.nbytes``) that is never rewritten while any import of it lives: import it once
///         into JAX (``jax.dlpack.from_dlpack``) and split it with ``layout.unpack`` inside jit.
///         Fields not written in a step hold unspecified bytes in its block.
///     ``"zero_copy"``: no copy at all; ``Step.device(name)`` exports the slot's field itself
///         (mapped pinned memory, read by kernels over PCIe) and the commit records the slot's
///         event after the consumer's work on the step's stream. Wins for small fields read once
///         per step; loses for data read many times, and with CUDA graphs (they would capture one
///         slot's address).
///
/// Parameters:
///     layout (StepLayout): the fields.
///     device: the CUDA device (int, ``"cuda:N"`` or a device object; default 0).
///     depth (int): slots (1 to 65536, default 4): steps in flight before a claim waits.
///     mode (str): ``"arena"``, ``"fresh"`` or ``"zero_copy"``.
///     arena: a writable, contiguous DLPack tensor of at least ``layout.nbytes`` bytes aligned to
///         256 bytes, on ``device`` (or a host array), to commit into instead of pinstage's own
///         arena (arena mode only). Kept alive by the stager.
///     max_gap (int, optional): the largest run of unused bytes between written fields that one
///         copy may span; 0 sends exactly the used rows. Default: chosen per commit from the
///         driver's measured costs (64 KiB when the spans can go as one batch, 256 KiB when each
///         would be a copy of its own: the legacy default stream).
///     batch (bool): split spans go as one ``cuMemcpyBatchAsync`` (default True) or as separate
///         copies.
///
/// Raises:
///     PinstageValueError: a bad depth, mode, device or arena (too small, misaligned, read-only,
///         another device, a JAX array). PinstageTypeError: a layout that is not a StepLayout.
///     Without a driver everything lives in host memory: steps and commits work (for tests),
///     device exports raise CudaUnavailableError.
///
/// Example:
///     >>> st = pinstage.StepStager(layout)
///     >>> ids = torch.from_dlpack(st.field("ids"))       # once: stable address
///     >>> with st.step(stream=torch.cuda.current_stream()) as step:
///     ...     step.put("ids", [1, 2, 3], pad_value=0, rows=8)
#[pyclass(frozen, name = "StepStager", module = "pinstage._native")]
pub struct PyStepStager {
    pub(super) inner: Arc<StepStager>,
    pub(super) layout: Py<PyStepLayout>,
    /// A bound arena's producer, alive as long as the stager and every export of the arena.
    pub(super) bound: Option<Arc<export::BoundArena>>,
    /// The stream of fresh-mode commits without a `stream=`.
    pub(super) own_stream: Option<Stream>,
    /// The field names as interned Python strings, in layout order: a dict key that is one of
    /// these objects (string literals are interned) resolves by pointer, without decoding.
    pub(super) names: Vec<Py<PyString>>,
    /// `{name: index}`: any other str key resolves through Python's dict, with the hash the str
    /// object caches (no decoding, no allocation).
    pub(super) name_index: Py<PyDict>,
    /// Each field's numpy dtype, for the exact-array fast path of `stage`.
    pub(super) descrs: Vec<Option<Py<numpy::PyArrayDescr>>>,
    /// Open `Step` objects per thread: a thread whose own open steps hold every slot would wait
    /// for itself forever, so its next step is refused instead.
    pub(super) open_steps: Arc<OpenSteps>,
}

/// Calls `f` on each (key, value) of `d` in order; a dict that changes size meanwhile (a
/// value's `__array__` mutating it, say) stops the loop with an error instead of pyo3's panic.
pub(super) fn for_each_item<'py>(
    d: &Bound<'py, PyDict>,
    mut f: impl FnMut(Bound<'py, PyAny>, Bound<'py, PyAny>) -> PyResult<()>,
) -> PyResult<()> {
    let py = d.py();
    let n = d.len();
    let mut pos: pyo3::ffi::Py_ssize_t = 0;
    let mut k = std::ptr::null_mut();
    let mut v = std::ptr::null_mut();
    // SAFETY: `PyDict_Next` on a live dict with the GIL held; it hands out borrowed references,
    // which `from_borrowed_ptr` turns into owned ones before anything can run.
    while unsafe { pyo3::ffi::PyDict_Next(d.as_ptr(), &mut pos, &mut k, &mut v) } != 0 {
        // SAFETY: as above: valid borrowed pointers of this iteration.
        let (key, value) = unsafe {
            (
                Bound::from_borrowed_ptr(py, k),
                Bound::from_borrowed_ptr(py, v),
            )
        };
        f(key, value)?;
        if d.len() != n {
            return Err(value_err(
                "the dict changed size while pinstage read it (a value's conversion changed it?)",
            ));
        }
    }
    Ok(())
}

fn mode_arg(obj: Option<&Bound<'_, PyAny>>) -> PyResult<StepMode> {
    let Some(obj) = obj.filter(|o| !o.is_none()) else {
        return Ok(StepMode::Arena);
    };
    let s: String = obj
        .extract()
        .map_err(|_| type_err("mode must be 'arena', 'fresh' or 'zero_copy'"))?;
    match s.as_str() {
        "arena" => Ok(StepMode::Arena),
        "fresh" => Ok(StepMode::Fresh),
        "zero_copy" => Ok(StepMode::ZeroCopy),
        _ => Err(value_err(format!(
            "mode={s:?}: expected 'arena', 'fresh' or 'zero_copy'"
        ))),
    }
}

/// Steps open per thread on one stager (a thread's own would never end while it waited).
pub(super) type OpenSteps = parking_lot::Mutex<Vec<(std::thread::ThreadId, usize)>>;

/// Counts a `Step` opened (`true`) or ended (`false`) on `thread`.
pub(super) fn count_open_in(steps: &OpenSteps, thread: std::thread::ThreadId, opened: bool) {
    let mut v = steps.lock();
    match v.iter().position(|(t, _)| *t == thread) {
        Some(i) if opened => v[i].1 += 1,
        Some(i) => {
            v[i].1 -= 1;
            if v[i].1 == 0 {
                v.swap_remove(i);
            }
        }
        None if opened => v.push((thread, 1)),
        None => {}
    }
}

impl PyStepStager {
    fn stream_of(&self, stream: Option<&Bound<'_, PyAny>>) -> PyResult<StreamHandle<'static>> {
        Ok(match parse_stream(stream)? {
            Some(s) => s,
            None => match &self.own_stream {
                // SAFETY: the stager owns the stream for its whole life; steps hold the stager.
                Some(s) => unsafe { StreamHandle::from_raw(s.handle().as_raw()) }?,
                None => StreamHandle::LEGACY,
            },
        })
    }

    /// Opens a step: claims a slot without spinning while holding the GIL, then learns that the
    /// slot's last copy completed (polling briefly, then waiting with the GIL released).
    fn open(&self, py: Python<'_>) -> PyResult<RawStep> {
        let st = &self.inner;
        let claim = loop {
            if let Some(c) = st.try_claim() {
                break c;
            }
            // Every slot is in an open step. This thread's own would never end while it waits.
            if self.open_here() >= st.depth() {
                return Err(Error::StepState(
                    "every slot of this StepStager is held by steps open on this thread: commit \
                     or abort one first (or give the stager more depth)",
                )
                .into());
            }
            // Another thread's: wait without the GIL (that thread may need it to finish),
            // answering Ctrl-C.
            if let Some(c) = py.detach(|| st.claim_within(std::time::Duration::from_millis(20))) {
                break c;
            }
            py.check_signals()?;
        };
        let mut interrupt: Option<PyErr> = None;
        let r = st.open(Some(claim), &mut |ev: &Event| {
            slot_wait(py, ev, &mut interrupt)
        });
        r.map_err(|e| take_interrupt(e, interrupt))
    }

    /// Steps open on this thread.
    fn open_here(&self) -> usize {
        let me = std::thread::current().id();
        self.open_steps
            .lock()
            .iter()
            .find(|(t, _)| *t == me)
            .map_or(0, |e| e.1)
    }

    /// Counts a `Step` opened (`true`) or ended (`false`) on `thread`.
    pub(super) fn count_open(&self, thread: std::thread::ThreadId, opened: bool) {
        count_open_in(&self.open_steps, thread, opened);
    }

    fn new_step(slf: &Bound<'_, Self>, stream: Option<&Bound<'_, PyAny>>) -> PyResult<PyStep> {
        // A bound arena let go without the GIL lingers until a call reaps it (one load when
        // nothing lingers).
        crate::python::linger::reap(slf.py());
        let me = slf.get();
        let stream = me.stream_of(stream)?;
        let raw = me.open(slf.py())?;
        me.count_open(std::thread::current().id(), true);
        let state = Arc::new(Mutex::new(StepState {
            raw: Some(raw),
            views: Vec::new(),
            block: None,
            ended: open::Ended::Aborted,
        }));
        open::opened_here(&state, &me.inner, &me.open_steps);
        Ok(PyStep {
            stager: slf.clone().unbind(),
            thread: std::thread::current().id(),
            stream,
            state,
        })
    }
}

#[pymethods]
impl PyStepStager {
    #[new]
    #[pyo3(signature = (layout, *, device=None, depth=None, mode=None, arena=None, max_gap=None, batch=None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        layout: &Bound<'_, PyAny>,
        device: Option<&Bound<'_, PyAny>>,
        depth: Option<&Bound<'_, PyAny>>,
        mode: Option<&Bound<'_, PyAny>>,
        arena: Option<&Bound<'_, PyAny>>,
        max_gap: Option<&Bound<'_, PyAny>>,
        batch: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Self> {
        crate::python::linger::reap(py);
        let batch = match batch.filter(|b| !b.is_none()) {
            None => true,
            Some(b) => b
                .cast::<pyo3::types::PyBool>()
                .map_err(|_| type_err("batch must be a bool"))?
                .is_true(),
        };
        let layout = layout
            .cast::<PyStepLayout>()
            .map_err(|_| type_err("layout must be a pinstage.StepLayout"))?
            .clone();
        let arena_imp = match arena.filter(|a| !a.is_none()) {
            Some(a) => Some(import_writable(a, None, "arena")?),
            None => None,
        };
        // Without device=, a bound CUDA arena names the device; else the current one.
        let ordinal = match (device.filter(|d| !d.is_none()), &arena_imp) {
            (None, Some(imp)) => match imp.view.memory() {
                crate::dlpack::MemoryKind::Cuda(id) => id,
                crate::dlpack::MemoryKind::Host => parse_device_or_current(None)?,
            },
            _ => parse_device_or_current(device)?,
        };
        let depth = match depth {
            Some(d) => count_arg(d, "depth", 1, crate::h2d::MAX_DEPTH)?,
            None => crate::step::DEFAULT_STEP_DEPTH,
        };
        let mode = mode_arg(mode)?;
        let mut b = StepStager::builder(&layout.get().layout)
            .device(ordinal)
            .depth(depth)
            .mode(mode)
            .batch(batch);
        if let Some(g) = max_gap.filter(|g| !g.is_none()) {
            b = b.max_gap(count_arg(g, "max_gap", 0, isize::MAX as usize)?);
        }
        let bound = match arena_imp {
            Some(imp) => {
                // SAFETY: `imp` (kept in the stager) keeps the producer's memory alive; the
                // caller hands the buffer to the stager (documented).
                b = unsafe { b.bind(&imp.view) };
                Some(Arc::new(export::BoundArena::new(imp)))
            }
            None => None,
        };
        let inner = py.detach(|| b.build())?;
        let own_stream = match (mode, inner.device()) {
            (StepMode::Fresh, Some(d)) => Some(Stream::new(d)?),
            _ => None,
        };
        let names: Vec<Py<PyString>> = inner
            .layout()
            .iter()
            .map(|f| PyString::intern(py, f.name()).unbind())
            .collect();
        let name_index = PyDict::new(py);
        for (i, n) in names.iter().enumerate() {
            name_index.set_item(n.bind(py), i)?;
        }
        let descrs = inner
            .layout()
            .iter()
            // bfloat16 without ml_dtypes has no numpy dtype: that field takes the general path.
            .map(|f| {
                crate::python::dtype::descr(py, f.dtype())
                    .ok()
                    .map(Bound::unbind)
            })
            .collect();
        Ok(Self {
            inner: Arc::new(inner),
            layout: layout.unbind(),
            bound,
            own_stream,
            names,
            name_index: name_index.unbind(),
            descrs,
            open_steps: Arc::new(parking_lot::Mutex::new(Vec::new())),
        })
    }

    /// Opens a step: claims a slot (waiting, GIL released and Ctrl-C answered, while every slot's
    /// last copy still runs). Use it as a context manager: leaving the block commits, an
    /// exception releases the slot untouched.
    ///
    /// Parameters:
    ///     stream: the stream the commit goes on (torch/cupy stream, ``__cuda_stream__`` object or
    ///         int handle, kept alive by the caller); None: the legacy default stream (fresh mode:
    ///         the stager's own stream; consumers synchronize through ``__dlpack__``).
    ///
    /// Returns:
    ///     Step: the open step.
    ///
    /// Raises:
    ///     PinstageValueError: a bad stream. KeyboardInterrupt: Ctrl-C while waiting for a slot.
    ///
    /// Example:
    ///     >>> with st.step() as step:
    ///     ...     step.view("ids", 3)[:] = [1, 2, 3]
    #[pyo3(signature = (*, stream=None))]
    fn step(slf: &Bound<'_, Self>, stream: Option<&Bound<'_, PyAny>>) -> PyResult<PyStep> {
        Self::new_step(slf, stream)
    }

    /// One whole step in one call: ``put`` each entry of ``fields``, then commit.
    ///
    /// Parameters:
    ///     fields (dict): ``{name: values}`` (lists, numpy arrays, torch CPU tensors...).
    ///     pad_values (dict, optional): ``{name: pad}`` for fields whose values do not fill the rows
    ///         sent.
    ///     rows (dict, optional): ``{name: rows}`` sent per field (default: the values' rows).
    ///     stream: as ``step``.
    ///
    /// Returns:
    ///     StepTensor or None: fresh mode: the step's block; else None.
    ///
    /// Raises:
    ///     As ``Step.put`` and ``Step.commit``; on any error nothing is committed and the slot is
    ///     released.
    ///
    /// Example:
    ///     >>> st.stage({"ids": ids, "table": table}, stream=torch.cuda.current_stream())
    #[pyo3(signature = (fields, *, pad_values=None, rows=None, stream=None))]
    fn stage(
        slf: &Bound<'_, Self>,
        fields: &Bound<'_, PyAny>,
        pad_values: Option<&Bound<'_, PyAny>>,
        rows: Option<&Bound<'_, PyAny>>,
        stream: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Option<Py<StepTensor>>> {
        crate::python::linger::reap(slf.py());
        let fields = dict_arg(Some(fields), "fields")?
            .ok_or_else(|| type_err("fields must be a dict {field name: values}, got None"))?;
        let pad_values = dict_arg(pad_values, "pad_values")?;
        let rows = dict_arg(rows, "rows")?;
        let me = slf.get();
        // Every name in `pad_values` and `rows` must be a field written by this call: a
        // misspelled one would be ignored otherwise.
        for (what, d) in [("pad_values", &pad_values), ("rows", &rows)] {
            if let Some(d) = d {
                for k in d.keys() {
                    let name = k
                        .cast::<PyString>()
                        .map_err(|_| type_err(format!("{what}: field names must be str")))?;
                    me.field_id(name)?;
                    if !fields.contains(name)? {
                        return Err(value_err(format!(
                            "{what} names field {name} that fields does not write"
                        )));
                    }
                }
            }
        }
        let py = slf.py();
        let stream = me.stream_of(stream)?;
        let st = &me.inner;
        let mut raw = me.open(py)?;
        let mut hint = 0usize;
        // Off the exact-numpy fast path a value's conversion may run Python code (`__array__`,
        // `__index__`) that opens steps of this stager: while it runs, this slot counts as held
        // by a step open on this thread, so such a step is refused instead of waiting forever.
        let tid = std::thread::current().id();
        let counted = std::cell::Cell::new(false);
        // Uncounted on every way out, a panic's included.
        struct Uncount<'a>(
            &'a PyStepStager,
            std::thread::ThreadId,
            &'a std::cell::Cell<bool>,
        );
        impl Drop for Uncount<'_> {
            fn drop(&mut self) {
                if self.2.replace(false) {
                    self.0.count_open(self.1, false);
                }
            }
        }
        let uncount = Uncount(me, tid, &counted);
        let filled = for_each_item(fields, |k, v| {
            let name = k
                .cast::<PyString>()
                .map_err(|_| type_err("field names must be str"))?;
            let pad = match pad_values {
                Some(p) => p.get_item(name)?,
                None => None,
            };
            let r = match rows {
                Some(p) => p.get_item(name)?,
                None => None,
            };
            let id = me.field_id_near(name, hint)?;
            hint = id.index() + 1;
            if pad.is_none() && r.is_none() && me.put_exact(&mut raw, id, &v)? {
                return Ok(());
            }
            if !counted.replace(true) {
                me.count_open(tid, true);
            }
            put_id(st, &mut raw, id, &v, pad.as_ref(), r.as_ref())
        });
        drop(uncount);
        if let Err(e) = filled {
            st.abort_raw(raw);
            return Err(e);
        }
        let committed = commit_detached(py, st, raw, stream)?;
        match committed.block {
            Some(b) => Ok(Some(Py::new(py, StepTensor::of_block(b))?)),
            None => Ok(None),
        }
    }

    /// A DLPack producer of field ``name`` in the arena (arena mode): its dtype and capacity shape
    /// at a stable address, for ``torch.from_dlpack`` / ``cupy.from_dlpack`` once; a CUDA graph may
    /// capture it. The import is ordered after every commit issued so far.
    ///
    /// Parameters:
    ///     name (str): the field.
    ///
    /// Returns:
    ///     StepTensor: the producer (keeps the arena alive).
    ///
    /// Raises:
    ///     KeyError (UnknownFieldError): no such field. PinstageValueError: not arena mode.
    ///     CudaUnavailableError: no driver (unless the arena is a bound host buffer).
    ///
    /// Example:
    ///     >>> ids = torch.from_dlpack(st.field("ids"))
    fn field(&self, name: &Bound<'_, PyAny>) -> PyResult<StepTensor> {
        let name = field_name(name)?;
        let f = self.inner.layout().field(name.as_str())?;
        let ptr = self.arena_base()? + f.offset() as u64;
        Ok(StepTensor {
            ptr,
            dtype: f.dtype(),
            shape: f.shape().iter().map(|&d| d as i64).collect(),
            device: self.arena_device(),
            keep: Keep::Stager(Arc::clone(&self.inner), self.bound.clone()),
            sync: Order::Commits(Arc::clone(&self.inner)),
        })
    }

    /// Zero-copy mode: a DLPack producer (CUDA device) of field ``name`` in slot ``slot`` (its
    /// capacity shape), to import once per slot and reuse: a step's kernels read
    /// ``slot_field(step.slot, name)``. The memory holds whatever step owns the slot: read it only
    /// between that step's writes and its commit's event.
    ///
    /// Parameters:
    ///     slot (int): 0 to depth - 1.
    ///     name (str): the field.
    ///
    /// Returns:
    ///     StepTensor: the slot's field.
    ///
    /// Raises:
    ///     PinstageValueError: not zero-copy mode, slot out of range. CudaUnavailableError.
    ///     UnknownFieldError.
    fn slot_field(&self, slot: &Bound<'_, PyAny>, name: &Bound<'_, PyAny>) -> PyResult<StepTensor> {
        let slot = count_arg(slot, "slot", 0, self.inner.depth() - 1)?;
        let name = field_name(name)?;
        let f = self.inner.layout().field(name.as_str())?;
        let ptr = self.inner.slot_device_ptr(slot, name.as_str())?;
        Ok(StepTensor {
            ptr,
            dtype: f.dtype(),
            shape: f.shape().iter().map(|&d| d as i64).collect(),
            device: Some(self.inner.ordinal()),
            keep: Keep::Stager(Arc::clone(&self.inner), self.bound.clone()),
            sync: Order::None,
        })
    }

    /// The whole arena as a DLPack producer of 1-D uint8 (arena mode).
    ///
    /// Returns:
    ///     StepTensor: ``layout.nbytes`` bytes.
    ///
    /// Raises:
    ///     PinstageValueError: not arena mode. CudaUnavailableError: no driver (unless the arena
    ///     is a bound host buffer).
    fn arena(&self) -> PyResult<StepTensor> {
        Ok(StepTensor {
            ptr: self.arena_base()?,
            dtype: DType::U8,
            shape: vec![self.inner.layout().nbytes() as i64],
            device: self.arena_device(),
            keep: Keep::Stager(Arc::clone(&self.inner), self.bound.clone()),
            sync: Order::Commits(Arc::clone(&self.inner)),
        })
    }

    /// A numpy copy of field ``name`` as the arena holds it, after every commit so far completed
    /// (arena mode; for tests and debugging).
    ///
    /// Parameters:
    ///     name (str): the field.
    ///
    /// Returns:
    ///     numpy.ndarray: the field's capacity shape and dtype.
    ///
    /// Raises:
    ///     KeyError (UnknownFieldError): no such field. PinstageValueError: not arena mode.
    fn read_field<'py>(
        &self,
        py: Python<'py>,
        name: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let name = field_name(name)?;
        let st = Arc::clone(&self.inner);
        let name2 = name.clone();
        let bytes = py.detach(move || st.read_field(name2.as_str()))?;
        let f = self.inner.layout().field(name.as_str())?;
        let shape: Vec<i64> = f.shape().iter().map(|&d| d as i64).collect();
        let arr =
            super::arrays::array_on(py, super::arrays::Memory::Vec(bytes), f.dtype(), &shape)?;
        Ok(arr)
    }

    /// Counters: ``steps``, ``copies``, ``batches``, ``batch_entries``, ``bytes``,
    /// ``skipped_fields``, ``empty_steps``, ``aborted``, ``waits``, ``queries``, ``blocks``.
    ///
    /// Returns:
    ///     dict: the counters (monotonic).
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let s = self.inner.stats();
        let d = PyDict::new(py);
        d.set_item("steps", s.steps)?;
        d.set_item("copies", s.copies)?;
        d.set_item("batches", s.batches)?;
        d.set_item("batch_entries", s.batch_entries)?;
        d.set_item("bytes", s.bytes)?;
        d.set_item("skipped_fields", s.skipped_fields)?;
        d.set_item("empty_steps", s.empty_steps)?;
        d.set_item("aborted", s.aborted)?;
        d.set_item("waits", s.waits)?;
        d.set_item("queries", s.queries)?;
        d.set_item("blocks", s.blocks)?;
        Ok(d)
    }

    /// The layout.
    #[getter]
    fn layout(&self, py: Python<'_>) -> Py<PyStepLayout> {
        self.layout.clone_ref(py)
    }

    /// ``"arena"``, ``"fresh"`` or ``"zero_copy"``.
    #[getter]
    fn mode(&self) -> &'static str {
        self.inner.mode().name()
    }

    /// Number of slots.
    #[getter]
    fn depth(&self) -> usize {
        self.inner.depth()
    }

    /// The CUDA device ordinal.
    #[getter]
    fn device(&self) -> i32 {
        self.inner.ordinal()
    }

    /// Whether a driver was found (else slots, arena and blocks are host memory).
    #[getter]
    fn cuda(&self) -> bool {
        self.inner.has_cuda()
    }

    fn __repr__(&self) -> String {
        format!(
            "StepStager(mode='{}', fields={}, nbytes={}, depth={}, device={}, cuda={})",
            self.mode(),
            self.inner.layout().len(),
            self.inner.layout().nbytes(),
            self.inner.depth(),
            self.inner.ordinal(),
            crate::python::args::py_bool(self.inner.has_cuda())
        )
    }
}

impl PyStepStager {
    /// The field a str names: by pointer for the interned names of a small layout (string
    /// literals), else through the `{name: index}` dict.
    fn field_id(&self, name: &Bound<'_, PyString>) -> PyResult<FieldId> {
        self.field_id_near(name, usize::MAX)
    }

    /// [`Self::field_id`], trying field `hint` first (the next field in layout order, where a
    /// dict of a step's values usually has it): the same interned object, or the same text.
    fn field_id_near(&self, name: &Bound<'_, PyString>, hint: usize) -> PyResult<FieldId> {
        if let Some(n) = self.names.get(hint) {
            if n.as_ptr() == name.as_ptr() {
                return Ok(FieldId::from_index(hint));
            }
            // SAFETY: two live str objects, GIL held.
            let r = unsafe { pyo3::ffi::PyUnicode_Compare(n.as_ptr(), name.as_ptr()) };
            if r == 0 {
                return Ok(FieldId::from_index(hint));
            }
            // -1 is also "less than": an error only when one is set (a legacy string that
            // cannot be made ready, before Python 3.12).
            if r == -1
                && let Some(e) = PyErr::take(name.py())
            {
                return Err(e);
            }
        }
        if self.names.len() <= 8
            && let Some(i) = self.names.iter().position(|n| n.as_ptr() == name.as_ptr())
        {
            return Ok(FieldId::from_index(i));
        }
        match self.name_index.bind(name.py()).get_item(name)? {
            Some(i) => Ok(FieldId::from_index(i.extract()?)),
            // Not a field (the layout says which names exist).
            None => Ok(self.inner.layout().id(&name_text(name)?)?),
        }
    }

    /// The common case of `stage`, without building a `Values`: a C-contiguous numpy array of
    /// exactly the field's dtype (the same descriptor object) and rank. Returns whether it
    /// applied; `false` sends the call down the general path (which checks everything).
    fn put_exact(&self, raw: &mut RawStep, id: FieldId, v: &Bound<'_, PyAny>) -> PyResult<bool> {
        let py = v.py();
        // SAFETY: numpy's type check on a live object, GIL held.
        if unsafe { npyffi::PyArray_Check(py, v.as_ptr()) } == 0 {
            return Ok(false);
        }
        let f = &self.inner.layout().fields()[id.index()];
        let Some(want) = &self.descrs[id.index()] else {
            return Ok(false);
        };
        let want = want.as_ptr() as *mut npyffi::PyArray_Descr;
        // SAFETY: `v` is a live numpy array (checked); we read its fields with the GIL held and
        // keep `v` alive while its data is read.
        let (data, nd, dims, descr, flags) = unsafe {
            let a = &(*(v.as_ptr() as *mut npyffi::PyArrayObject)).fields;
            (a.data, a.nd, a.dimensions, a.descr, a.flags)
        };
        if descr != want
            || flags & npyffi::NPY_ARRAY_C_CONTIGUOUS == 0
            || nd as usize != f.shape().len()
        {
            return Ok(false);
        }
        // SAFETY: `nd` dimensions of a live array.
        let dims = unsafe { std::slice::from_raw_parts(dims, nd as usize) };
        let rows = dims[0] as usize;
        let cols = if nd == 2 { dims[1] as usize } else { 1 };
        if cols != f.cols() {
            return Ok(false);
        }
        let bytes = rows * cols * f.dtype().itemsize();
        // SAFETY: a C-contiguous array of `rows * cols` elements of the field's dtype.
        let values = unsafe { std::slice::from_raw_parts(data as *const u8, bytes) };
        self.inner
            .put_raw(raw, id, values, (rows, cols), None, None)?;
        Ok(true)
    }

    fn arena_base(&self) -> PyResult<u64> {
        let base = self.inner.arena_ptr().ok_or_else(|| {
            value_err(format!(
                "this StepStager is in {:?} mode: only arena mode has a persistent arena",
                self.mode()
            ))
        })?;
        if !self.inner.has_cuda() && self.bound.is_none() {
            // Without a driver the arena is host memory standing in for the device's: steps and
            // `read_field` work, a device export does not.
            return Err(self.inner.unavailable().into());
        }
        Ok(base)
    }

    fn arena_device(&self) -> Option<i32> {
        (!self.inner.arena_is_host()).then_some(self.inner.ordinal())
    }
}

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyStepLayout>()?;
    m.add_class::<PyStepStager>()?;
    m.add_class::<PyStep>()?;
    m.add_class::<StepTensor>()?;
    Ok(())
}
