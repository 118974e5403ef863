//! `StepStager`: a ring of pinned slots laid out like a `StepLayout`, one driver call per step.

use super::super::errors::type_err;
use super::super::errors::value_err;
use super::super::stream::parse_stream;
use super::context::PyStep;
use super::layout::PyStepLayout;
use super::names::FieldNames;
use super::names::dict_arg;
use super::names::field_name;
use super::names::for_each_item;
use super::state::Ended;
use super::state::OpenSteps;
use super::state::StepState;
use super::state::claim;
use super::state::commit_detached;
use super::state::count_open_in;
use super::state::opened_here;
use super::state::put_id;
use crate::cuda::Stream;
use crate::cuda::StreamHandle;
use crate::dlpack::DType;
use crate::python::args::count_arg;
use crate::python::args::parse_device_or_current;
use crate::python::export::BoundArena;
use crate::python::export::DeviceArray;
use crate::python::export::Keep;
use crate::python::export::Order;
use crate::python::import::import_writable;
use crate::step::StepMode;
use crate::step::StepStager;
use parking_lot::Mutex;
use pyo3::prelude::*;
use pyo3::types::PyDict;
use pyo3::types::PyString;
use std::sync::Arc;

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
///     ``"fresh"``: every commit returns a ``DeviceArray`` over a fresh device block (1-D uint8 of
///         ``layout.nbytes``) that is never rewritten while any import of it lives: import it once
///         into JAX (``jax.dlpack.from_dlpack``) and split it with ``layout.unpack`` inside jit.
///         Fields not written in a step hold unspecified bytes in its block.
///     ``"zero_copy"``: no copy at all; ``Step.field(name)`` exports the slot's field itself
///         (mapped pinned memory, read by kernels over PCIe) and the commit records the slot's
///         event after the consumer's work on the step's stream. Wins for small fields read once
///         per step; loses for data read many times, and with CUDA graphs (they would capture one
///         slot's address).
///
/// Parameters:
///     layout (StepLayout): the fields.
///     device: the CUDA device (int, ``"cuda:N"`` or a device object; default: the device
///         current on this thread, else 0).
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
///         another device, a JAX array). PinstageTypeError: a layout that is not a StepLayout,
///         a depth that is not an int (a bool or a float). MemoryError: slots (or an arena) the
///         host or the device cannot hold. CudaDriverError: the driver refused the setup.
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
    pub(super) bound: Option<Arc<BoundArena>>,
    /// The stream of fresh-mode commits without a `stream=`.
    pub(super) own_stream: Option<Stream>,
    /// The fields by name, and their numpy dtypes for the fast path of `stage`.
    pub(super) fields: FieldNames,
    /// Open `Step` objects per thread: a thread whose own open steps hold every slot would wait
    /// for itself forever, so its next step is refused instead.
    pub(super) open_steps: Arc<OpenSteps>,
}

pub(super) fn mode_arg(obj: Option<&Bound<'_, PyAny>>) -> PyResult<StepMode> {
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
        let raw = claim(slf.py(), &me.inner, &me.open_steps)?;
        me.count_open(std::thread::current().id(), true);
        let state = Arc::new(Mutex::new(StepState {
            raw: Some(raw),
            views: Vec::new(),
            block: None,
            ended: Ended::Aborted,
        }));
        opened_here(&state, &me.inner, &me.open_steps);
        Ok(PyStep {
            owner: slf.clone().into_any().unbind(),
            inner: Arc::clone(&me.inner),
            bound: me.bound.clone(),
            open_steps: Arc::clone(&me.open_steps),
            thread: std::thread::current().id(),
            stream,
            state,
        })
    }
}

#[pymethods]
impl PyStepStager {
    #[new]
    #[pyo3(
        signature = (layout, *, device=None, depth=None, mode=None, arena=None, max_gap=None, batch=None),
        text_signature = "(layout, *, device=None, depth=4, mode='arena', arena=None, max_gap=None, batch=True)"
    )]
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
                Some(Arc::new(BoundArena::new(imp)))
            }
            None => None,
        };
        let inner = py.detach(|| b.build())?;
        let own_stream = match (mode, inner.device()) {
            (StepMode::Fresh, Some(d)) => Some(Stream::new(d)?),
            _ => None,
        };
        let fields = FieldNames::new(py, inner.layout())?;
        Ok(Self {
            inner: Arc::new(inner),
            layout: layout.unbind(),
            bound,
            own_stream,
            fields,
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
    ///     ...     step.view("ids", rows=3)[:] = [1, 2, 3]
    #[pyo3(signature = (*, stream=None))]
    fn step(slf: &Bound<'_, Self>, stream: Option<&Bound<'_, PyAny>>) -> PyResult<PyStep> {
        Self::new_step(slf, stream)
    }

    /// One whole step in one call: ``put`` each entry of ``fields``, then commit.
    ///
    /// Parameters:
    ///     fields (dict): ``{name: values}`` (lists, numpy arrays, torch CPU tensors...).
    ///     pad_value (dict, optional): ``{name: pad}`` for fields whose values do not fill the rows
    ///         sent (``pad_values=`` is the deprecated spelling).
    ///     rows (dict, optional): ``{name: rows}`` sent per field (default: the values' rows).
    ///     stream: as ``step``.
    ///
    /// Returns:
    ///     DeviceArray or None: fresh mode: the step's block; else None.
    ///
    /// Raises:
    ///     As ``Step.put`` and ``Step.commit``; on any error nothing is committed and the slot is
    ///     released.
    ///
    /// Example:
    ///     >>> st.stage({"ids": ids, "table": table}, stream=torch.cuda.current_stream())
    #[pyo3(
        signature = (fields, *, pad_value=None, rows=None, stream=None, pad_values=None),
        text_signature = "(self, fields, *, pad_value=None, rows=None, stream=None)"
    )]
    fn stage(
        slf: &Bound<'_, Self>,
        fields: &Bound<'_, PyAny>,
        pad_value: Option<&Bound<'_, PyAny>>,
        rows: Option<&Bound<'_, PyAny>>,
        stream: Option<&Bound<'_, PyAny>>,
        pad_values: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Option<Py<DeviceArray>>> {
        crate::stamps::stamp!(">stage");
        crate::python::linger::reap(slf.py());
        let pad_value = match (pad_value, pad_values.filter(|p| !p.is_none())) {
            (Some(p), Some(_)) if !p.is_none() => {
                return Err(type_err(
                    "stage(pad_value=..., pad_values=...): give pad_value only",
                ));
            }
            (_, Some(old)) => {
                crate::python::errors::deprecated(
                    slf.py(),
                    "stage(pad_values=...)",
                    "stage(pad_value=...)",
                )?;
                Some(old)
            }
            (p, None) => p,
        };
        let fields = dict_arg(Some(fields), "fields")?
            .ok_or_else(|| type_err("fields must be a dict {field name: values}; got None"))?;
        let pad_values = dict_arg(pad_value, "pad_value")?;
        let rows = dict_arg(rows, "rows")?;
        let me = slf.get();
        // Every name in `pad_values` and `rows` must be a field written by this call: a
        // misspelled one would be ignored otherwise.
        for (what, d) in [("pad_value", &pad_values), ("rows", &rows)] {
            if let Some(d) = d {
                for k in d.keys() {
                    let name = k
                        .cast::<PyString>()
                        .map_err(|_| type_err(format!("{what}: field names must be str")))?;
                    me.fields.id(&me.inner, name)?;
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
        let mut raw = claim(py, &me.inner, &me.open_steps)?;
        crate::stamps::stamp!("claimed");
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
            let id = me.fields.id_near(&me.inner, name, hint)?;
            hint = id.index() + 1;
            if pad.is_none() && r.is_none() && me.fields.put_exact(&me.inner, &mut raw, id, &v)? {
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
        crate::stamps::stamp!("written");
        let committed = commit_detached(py, st, raw, stream)?;
        crate::stamps::stamp!("committed");
        match committed.block {
            Some(b) => Ok(Some(Py::new(py, DeviceArray::of_block(b))?)),
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
    ///     DeviceArray: the producer (keeps the arena alive).
    ///
    /// Raises:
    ///     KeyError (UnknownFieldError): no such field. PinstageValueError: not arena mode.
    ///     CudaUnavailableError: no driver (unless the arena is a bound host buffer).
    ///
    /// Example:
    ///     >>> ids = torch.from_dlpack(st.field("ids"))
    fn field(&self, name: &Bound<'_, PyAny>) -> PyResult<DeviceArray> {
        let name = field_name(name)?;
        let f = self.inner.layout().field(name.as_str())?;
        let ptr = self.arena_base()? + f.offset() as u64;
        Ok(DeviceArray {
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
    ///     DeviceArray: the slot's field.
    ///
    /// Raises:
    ///     PinstageValueError: not zero-copy mode, slot out of range. CudaUnavailableError.
    ///     UnknownFieldError.
    fn slot_field(
        &self,
        slot: &Bound<'_, PyAny>,
        name: &Bound<'_, PyAny>,
    ) -> PyResult<DeviceArray> {
        let slot = count_arg(slot, "slot", 0, self.inner.depth() - 1)?;
        let name = field_name(name)?;
        let f = self.inner.layout().field(name.as_str())?;
        let ptr = self.inner.slot_device_ptr(slot, name.as_str())?;
        Ok(DeviceArray {
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
    ///     DeviceArray: ``layout.nbytes`` bytes.
    ///
    /// Raises:
    ///     PinstageValueError: not arena mode. CudaUnavailableError: no driver (unless the arena
    ///     is a bound host buffer).
    fn arena(&self) -> PyResult<DeviceArray> {
        Ok(DeviceArray {
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
        let arr = crate::python::arrays::array_on(
            py,
            crate::python::arrays::Memory::Vec(bytes),
            f.dtype(),
            &shape,
        )?;
        Ok(arr)
    }

    /// Counters: ``steps``, ``copies``, ``batches``, ``batch_entries``, ``bytes``,
    /// ``skipped_fields``, ``empty_steps``, ``aborted``, ``waits``, ``queries``, ``blocks``.
    ///
    /// Returns:
    ///     dict: the counters (monotonic).
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let s = self.inner.stats();
        let d = crate::python::helpers::stats(py, "StepStager.stats()", &[])?;
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
