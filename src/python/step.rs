//! Step staging for Python: `StepLayout`, `StepStager`, `Step` (a context manager) and
//! `StepTensor` (a DLPack producer of arena fields, fresh blocks and zero-copy slot fields).

use std::sync::Arc;
use std::thread::ThreadId;

use dlpark::ffi::{DLDevice, DLDeviceType, DLManagedTensor, DLManagedTensorVersioned};
use dlpark::python::{CudaStreamRequest, DlpackExporter, ExportRequest, export_dlpack};
use dlpark::{DlpackFlags, Managed};
use numpy::npyffi::{self, NPY_ARRAY_WRITEABLE};
use parking_lot::Mutex;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList, PyString, PyTuple};

use super::args::{count_arg, parse_device};
use super::arrays::array_over;
use super::errors::{type_err, value_err};
use super::import::{import_destination, parse_dtype, parse_stream};
use super::values::{scalar_bytes, to_values};
use super::wait::wait_interruptibly;
use crate::cuda::{Event, Stream, StreamHandle};
use crate::error::Error;
use crate::step::{RawStep, StepBlock, StepLayout, StepMode, StepStager};
use crate::view::DType;

/// How long a claimer polls a busy slot's event with the GIL held before releasing it.
const SPIN_BEFORE_DETACH: std::time::Duration = std::time::Duration::from_micros(20);

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

fn parse_shape(obj: &Bound<'_, PyAny>, name: &str) -> PyResult<Vec<usize>> {
    let dims: Vec<i64> = if let Ok(n) = obj.extract::<i64>() {
        vec![n]
    } else {
        obj.extract().map_err(|_| {
            type_err(format!(
                "field {name:?}: shape must be an int or a tuple of ints"
            ))
        })?
    };
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
    #[pyo3(signature = (fields, *, skip_unchanged=None))]
    fn new(fields: &Bound<'_, PyAny>, skip_unchanged: Option<Vec<String>>) -> PyResult<Self> {
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
        let skip = skip_unchanged.unwrap_or_default();
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

    fn __contains__(&self, name: &str) -> bool {
        self.layout.id(name).is_ok()
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
    inner: Arc<StepStager>,
    layout: Py<PyStepLayout>,
    /// A bound arena's producer, alive as long as the stager.
    _bound: Option<super::import::Imported>,
    /// The stream of fresh-mode commits without a `stream=`.
    own_stream: Option<Stream>,
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
        let claim = match st.try_claim() {
            Some(c) => c,
            // Every slot is in another thread's open step: wait without the GIL (that thread
            // may need it to finish).
            None => py.detach(|| st.claim_blocking()),
        };
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
            st.open(Some(claim), &mut wait)
        };
        match (r, interrupt) {
            (Err(Error::Interrupted), Some(e)) => Err(e),
            (r, _) => Ok(r?),
        }
    }

    fn new_step(slf: &Bound<'_, Self>, stream: Option<&Bound<'_, PyAny>>) -> PyResult<PyStep> {
        let me = slf.get();
        let stream = me.stream_of(stream)?;
        let raw = me.open(slf.py())?;
        Ok(PyStep {
            stager: slf.clone().unbind(),
            thread: std::thread::current().id(),
            stream,
            state: Mutex::new(StepState {
                raw: Some(raw),
                views: Vec::new(),
                block: None,
                committed: false,
            }),
        })
    }
}

#[pymethods]
impl PyStepStager {
    #[new]
    #[pyo3(signature = (layout, *, device=None, depth=None, mode=None, arena=None, max_gap=None, batch=true))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        layout: &Bound<'_, PyAny>,
        device: Option<&Bound<'_, PyAny>>,
        depth: Option<&Bound<'_, PyAny>>,
        mode: Option<&Bound<'_, PyAny>>,
        arena: Option<&Bound<'_, PyAny>>,
        max_gap: Option<&Bound<'_, PyAny>>,
        batch: bool,
    ) -> PyResult<Self> {
        let layout = layout
            .cast::<PyStepLayout>()
            .map_err(|_| type_err("layout must be a pinstage.StepLayout"))?
            .clone();
        let ordinal = parse_device(device)?;
        let depth = match depth {
            Some(d) => count_arg(d, "depth", 1, crate::MAX_DEPTH)?,
            None => crate::DEFAULT_STEP_DEPTH,
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
        let bound = match arena.filter(|a| !a.is_none()) {
            Some(a) => {
                let imp = import_destination(a, None)?;
                // SAFETY: `imp` (kept in the stager) keeps the producer's memory alive; the
                // caller hands the buffer to the stager (documented).
                b = unsafe { b.bind(&imp.view) };
                Some(imp)
            }
            None => None,
        };
        let inner = py.detach(|| b.build())?;
        let own_stream = match (mode, inner.device()) {
            (StepMode::Fresh, Some(d)) => Some(Stream::new(d)?),
            _ => None,
        };
        Ok(Self {
            inner: Arc::new(inner),
            layout: layout.unbind(),
            _bound: bound,
            own_stream,
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
        fields: &Bound<'_, PyDict>,
        pad_values: Option<&Bound<'_, PyDict>>,
        rows: Option<&Bound<'_, PyDict>>,
        stream: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Option<Py<StepTensor>>> {
        let me = slf.get();
        let py = slf.py();
        let stream = me.stream_of(stream)?;
        let st = &me.inner;
        let mut raw = me.open(py)?;
        let filled = (|| -> PyResult<()> {
            for (k, v) in fields.iter() {
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
                put_values(st, &mut raw, &name.to_cow()?, &v, pad.as_ref(), r.as_ref())?;
            }
            Ok(())
        })();
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
    ///
    /// Example:
    ///     >>> ids = torch.from_dlpack(st.field("ids"))
    fn field(&self, name: &str) -> PyResult<StepTensor> {
        let f = self.inner.layout().field(name)?;
        let ptr = self.arena_base()? + f.offset() as u64;
        Ok(StepTensor {
            ptr,
            dtype: f.dtype(),
            shape: f.shape().iter().map(|&d| d as i64).collect(),
            device: self.arena_device(),
            keep: Keep::Stager(Arc::clone(&self.inner)),
            sync: Sync::Commits(Arc::clone(&self.inner)),
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
    fn slot_field(&self, slot: usize, name: &str) -> PyResult<StepTensor> {
        let f = self.inner.layout().field(name)?;
        let ptr = self.inner.slot_device_ptr(slot, name)?;
        Ok(StepTensor {
            ptr,
            dtype: f.dtype(),
            shape: f.shape().iter().map(|&d| d as i64).collect(),
            device: Some(self.inner.ordinal()),
            keep: Keep::Stager(Arc::clone(&self.inner)),
            sync: Sync::None,
        })
    }

    /// The whole arena as a DLPack producer of 1-D uint8 (arena mode).
    ///
    /// Returns:
    ///     StepTensor: ``layout.nbytes`` bytes.
    ///
    /// Raises:
    ///     PinstageValueError: not arena mode.
    fn arena(&self) -> PyResult<StepTensor> {
        Ok(StepTensor {
            ptr: self.arena_base()?,
            dtype: DType::U8,
            shape: vec![self.inner.layout().nbytes() as i64],
            device: self.arena_device(),
            keep: Keep::Stager(Arc::clone(&self.inner)),
            sync: Sync::Commits(Arc::clone(&self.inner)),
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
    fn read_field<'py>(&self, py: Python<'py>, name: &str) -> PyResult<Bound<'py, PyAny>> {
        let st = Arc::clone(&self.inner);
        let name2 = name.to_owned();
        let bytes = py.detach(move || st.read_field(name2.as_str()))?;
        let f = self.inner.layout().field(name)?;
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
        match self.inner.mode() {
            StepMode::Arena => "arena",
            StepMode::Fresh => "fresh",
            StepMode::ZeroCopy => "zero_copy",
        }
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
            "StepStager(mode={:?}, fields={}, nbytes={}, depth={}, device={}, cuda={})",
            self.mode(),
            self.inner.layout().len(),
            self.inner.layout().nbytes(),
            self.inner.depth(),
            self.inner.ordinal(),
            self.inner.has_cuda()
        )
    }
}

impl PyStepStager {
    fn arena_base(&self) -> PyResult<u64> {
        self.inner.arena_ptr().ok_or_else(|| {
            value_err(format!(
                "this StepStager is in {:?} mode: only arena mode has a persistent arena",
                self.mode()
            ))
        })
    }

    fn arena_device(&self) -> Option<i32> {
        (!self.inner.arena_is_host()).then_some(self.inner.ordinal())
    }
}

/// Writes `values` into field `name` of an open step (see ``Step.put``).
fn put_values(
    st: &StepStager,
    raw: &mut RawStep,
    name: &str,
    values: &Bound<'_, PyAny>,
    pad: Option<&Bound<'_, PyAny>>,
    rows: Option<&Bound<'_, PyAny>>,
) -> PyResult<()> {
    let id = st.layout().id(name)?;
    let f = &st.layout().fields()[id.index()];
    let vals = to_values(values, f.dtype())?;
    let dims = vals.shape.as_slice();
    let shape = match (dims.len(), f.shape().len()) {
        (1, 1) => (dims[0], 1),
        (2, 2) => (dims[0], dims[1]),
        (1, 2) if dims[0] == 0 => (0, f.cols()),
        _ => {
            return Err(Error::ShapeMismatch {
                values: dims.to_vec(),
                dst: f.shape().iter().map(|&d| d as i64).collect(),
            }
            .into());
        }
    };
    let pad = match pad.filter(|p| !p.is_none()) {
        Some(p) => Some(scalar_bytes(p, f.dtype())?),
        None => None,
    };
    let rows = match rows.filter(|r| !r.is_none()) {
        Some(r) => Some(count_arg(r, "rows", 0, f.rows())?),
        None => None,
    };
    st.put_raw(raw, id, vals.bytes(), shape, pad.as_deref(), rows)?;
    Ok(())
}

/// Commits with the GIL released: the driver calls take a few microseconds, and a thread
/// staging steps back to back must not keep other threads (one launching a CUDA graph, say)
/// waiting for the interpreter's switch interval.
fn commit_detached(
    py: Python<'_>,
    st: &StepStager,
    raw: RawStep,
    stream: StreamHandle<'static>,
) -> PyResult<crate::step::Committed> {
    Ok(py.detach(move || st.commit_raw(raw, stream))?)
}

struct StepState {
    raw: Option<RawStep>,
    /// numpy views handed out: read-only once the step ends.
    views: Vec<Py<PyAny>>,
    block: Option<Py<StepTensor>>,
    committed: bool,
}

/// An open step of a ``StepStager``: owns one slot until ``commit`` (or the end of its ``with``
/// block) or ``abort``. Belongs to the thread that opened it.
///
/// Example:
///     >>> with st.step(stream=s) as step:
///     ...     step.put("ids", ids)
///     ...     step.view("table", 64)[:] = table
#[pyclass(frozen, name = "Step", module = "pinstage._native")]
pub struct PyStep {
    stager: Py<PyStepStager>,
    thread: ThreadId,
    stream: StreamHandle<'static>,
    state: Mutex<StepState>,
}

impl PyStep {
    fn check_thread(&self) -> PyResult<()> {
        if std::thread::current().id() != self.thread {
            return Err(Error::StepState(
                "this step belongs to the thread that opened it; open a step per thread",
            )
            .into());
        }
        Ok(())
    }

    fn with_open<R>(
        &self,
        f: impl FnOnce(&StepStager, &mut RawStep, &mut StepState) -> PyResult<R>,
    ) -> PyResult<R> {
        self.check_thread()?;
        let st = &self.stager.get().inner;
        let mut g = self.state.lock();
        let state = &mut *g;
        let Some(mut raw) = state.raw.take() else {
            return Err(Error::StepState(if state.committed {
                "this step was already committed"
            } else {
                "this step was aborted"
            })
            .into());
        };
        let r = f(st, &mut raw, state);
        state.raw = Some(raw);
        r
    }

    fn put_inner(
        &self,
        name: &str,
        values: &Bound<'_, PyAny>,
        pad: Option<&Bound<'_, PyAny>>,
        rows: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<()> {
        self.with_open(|st, raw, _| put_values(st, raw, name, values, pad, rows))
    }

    /// Ends the step: marks handed-out views read-only.
    fn end(state: &mut StepState, py: Python<'_>) {
        for v in state.views.drain(..) {
            let arr = v.bind(py).as_ptr() as *mut npyffi::PyArrayObject;
            // SAFETY: every entry is a numpy array we made; clearing WRITEABLE is what
            // `arr.flags.writeable = False` does, with the GIL held.
            unsafe { (*arr).fields.flags &= !NPY_ARRAY_WRITEABLE };
        }
    }

    fn abort_inner(&self) {
        let st = &self.stager.get().inner;
        let mut g = self.state.lock();
        if let Some(raw) = g.raw.take() {
            st.abort_raw(raw);
        }
        Python::attach(|py| Self::end(&mut g, py));
    }

    fn commit_inner(&self, py: Python<'_>) -> PyResult<Option<Py<StepTensor>>> {
        self.check_thread()?;
        let stager = self.stager.get();
        let st = &stager.inner;
        let mut g = self.state.lock();
        let Some(raw) = g.raw.take() else {
            return Err(Error::StepState(if g.committed {
                "this step was already committed"
            } else {
                "this step was aborted"
            })
            .into());
        };
        Self::end(&mut g, py);
        g.committed = true;
        let committed = commit_detached(py, st, raw, self.stream)?;
        let block = match committed.block {
            Some(b) => {
                let t = Py::new(py, StepTensor::of_block(b))?;
                g.block = Some(t.clone_ref(py));
                Some(t)
            }
            None => None,
        };
        Ok(block)
    }
}

#[pymethods]
impl PyStep {
    /// Writes ``values`` into field ``name``'s leading rows: ``field[:n] = values`` (2-D:
    /// ``field[:r, :c] = values``); ``pad_value`` fills the rest of those rows and the rows up to
    /// ``rows``. The rows sent become ``rows`` (default: the values' rows).
    ///
    /// Parameters:
    ///     name (str): the field.
    ///     values: a list, tuple or array (numpy, torch CPU tensor...) of numbers that fit the
    ///         field's dtype; 1-D for a 1-D field, 2-D for a 2-D one. Read before the call returns.
    ///     pad_value (scalar, optional): needed when the values do not fill the rows sent.
    ///     rows (int, optional): rows sent, from the values' rows to the capacity.
    ///
    /// Raises:
    ///     UnknownFieldError (a KeyError): no such field. PinstageValueError: more values than the
    ///         capacity, values that do not fit the dtype, a missing pad, rows out of range.
    ///         PinstageTypeError: values that are not numbers. StepStateError: a committed or
    ///         aborted step, another thread, or a zero-copy step whose fields went to the device.
    ///     Nothing is written when it raises.
    ///
    /// Example:
    ///     >>> step.put("ids", [5, 6, 7], pad_value=0, rows=8)
    #[pyo3(signature = (name, values, pad_value=None, rows=None))]
    fn put(
        &self,
        py: Python<'_>,
        name: &str,
        values: &Bound<'_, PyAny>,
        pad_value: Option<&Bound<'_, PyAny>>,
        rows: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<()> {
        let _ = py;
        self.put_inner(name, values, pad_value, rows)
    }

    /// A writable numpy view of the first ``rows`` rows of field ``name`` in this step's slot,
    /// for planning code to write in place (zero copies); those rows are sent at commit. The view
    /// turns read-only when the step ends.
    ///
    /// Parameters:
    ///     name (str): the field.
    ///     rows (int, optional): rows to send (default: the capacity).
    ///
    /// Returns:
    ///     numpy.ndarray: ``(rows,)`` or ``(rows, cols)`` of the field's dtype, over pinned memory.
    ///
    /// Raises:
    ///     UnknownFieldError: no such field. PinstageValueError: rows beyond the capacity.
    ///     StepStateError: as ``put``.
    ///
    /// Example:
    ///     >>> step.view("ids", 3)[:] = [1, 2, 3]
    #[pyo3(signature = (name, rows=None))]
    fn view<'py>(
        slf: &Bound<'py, Self>,
        name: &str,
        rows: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let py = slf.py();
        let me = slf.get();
        let owner = me.stager.bind(py).clone().into_any();
        me.with_open(|st, raw, state| {
            let id = st.layout().id(name)?;
            let f = &st.layout().fields()[id.index()];
            let rows = match rows.filter(|r| !r.is_none()) {
                Some(r) => count_arg(r, "rows", 0, f.rows())?,
                None => f.rows(),
            };
            let (ptr, _) = st.field_raw(raw, id, rows)?;
            let mut shape = vec![rows as i64];
            if f.shape().len() == 2 {
                shape.push(f.cols() as i64);
            }
            // SAFETY: the field's rows lie in the slot memory, which lives as long as the stager
            // (the array's base keeps the Python stager alive).
            let arr = unsafe { array_over(owner, ptr, f.dtype(), &shape) }?;
            state.views.push(arr.clone().unbind());
            Ok(arr)
        })
    }

    /// Rows of field ``name`` that the commit sends (0: not written in this step).
    ///
    /// Parameters:
    ///     name (str): the field.
    ///
    /// Returns:
    ///     int: the rows.
    ///
    /// Raises:
    ///     UnknownFieldError, StepStateError.
    fn used_rows(&self, name: &str) -> PyResult<usize> {
        self.with_open(|st, raw, _| Ok(st.used_raw(raw, st.layout().id(name)?)))
    }

    /// Zero-copy mode: a DLPack producer (CUDA device) of field ``name``'s used rows (or its
    /// capacity when not written) in this step's pinned slot, for kernels to read in place. From
    /// then on the step's fields cannot be written from the host; commit after queueing the
    /// kernels that read it.
    ///
    /// Parameters:
    ///     name (str): the field.
    ///
    /// Returns:
    ///     StepTensor: the slot's field (valid to read until the commit's event completed).
    ///
    /// Raises:
    ///     PinstageValueError: not zero-copy mode. CudaUnavailableError: no driver.
    ///     UnknownFieldError, StepStateError.
    fn device(&self, name: &str) -> PyResult<StepTensor> {
        let stager = self.stager.get();
        self.with_open(|st, raw, _| {
            let id = st.layout().id(name)?;
            let f = &st.layout().fields()[id.index()];
            let used = st.used_raw(raw, id);
            let rows = if used == 0 { f.rows() } else { used };
            let ptr = st.device_ptr_raw(raw, id)?;
            let mut shape = vec![rows as i64];
            if f.shape().len() == 2 {
                shape.push(f.cols() as i64);
            }
            Ok(StepTensor {
                ptr,
                dtype: f.dtype(),
                shape,
                device: Some(st.ordinal()),
                keep: Keep::Stager(Arc::clone(&stager.inner)),
                sync: Sync::None,
            })
        })
    }

    /// Commits the step on its stream (see ``StepStager``) and ends it; views turn read-only.
    ///
    /// Returns:
    ///     StepTensor or None: fresh mode: the block holding this step (import it once); else
    ///     None.
    ///
    /// Raises:
    ///     StepStateError: committed twice, aborted, or another thread. StreamCaptureError: the
    ///         stream is capturing. CudaDriverError. The slot is released in every case.
    fn commit(&self, py: Python<'_>) -> PyResult<Option<Py<StepTensor>>> {
        self.commit_inner(py)
    }

    /// Ends the step without sending anything; the slot is released untouched. Does nothing on
    /// an ended step.
    ///
    /// Raises:
    ///     StepStateError: another thread.
    fn abort(&self) -> PyResult<()> {
        self.check_thread()?;
        self.abort_inner();
        Ok(())
    }

    /// The slot this step owns (0 to depth - 1); see ``StepStager.slot_field``.
    #[getter]
    fn slot(&self) -> PyResult<usize> {
        self.with_open(|_, raw, _| Ok(raw.slot()))
    }

    /// Fresh mode, after commit: the step's block (else None).
    #[getter]
    fn block(&self, py: Python<'_>) -> Option<Py<StepTensor>> {
        self.state.lock().block.as_ref().map(|b| b.clone_ref(py))
    }

    /// Whether the step was committed.
    #[getter]
    fn committed(&self) -> bool {
        self.state.lock().committed
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    #[pyo3(signature = (exc_type, _exc=None, _tb=None))]
    fn __exit__(
        &self,
        py: Python<'_>,
        exc_type: Option<&Bound<'_, PyAny>>,
        _exc: Option<&Bound<'_, PyAny>>,
        _tb: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<bool> {
        let failed = exc_type.is_some_and(|t| !t.is_none());
        let open = self.state.lock().raw.is_some();
        if failed || !open {
            if open {
                self.abort_inner();
            }
            return Ok(false);
        }
        self.commit_inner(py)?;
        Ok(false)
    }

    fn __repr__(&self) -> String {
        let g = self.state.lock();
        let state = match (&g.raw, g.committed) {
            (Some(_), _) => "open",
            (None, true) => "committed",
            (None, false) => "aborted",
        };
        format!("Step({state})")
    }
}

impl Drop for PyStep {
    fn drop(&mut self) {
        let g = self.state.get_mut();
        if let Some(raw) = g.raw.take() {
            self.stager.get().inner.abort_raw(raw);
        }
    }
}

/// What keeps an export's memory alive.
enum Keep {
    Stager(Arc<StepStager>),
    Block(Arc<StepBlock>),
}

/// How a consumer's stream is ordered after the writes of the memory.
enum Sync {
    /// Wait for every commit issued so far (arena exports).
    Commits(Arc<StepStager>),
    /// Wait for the block's copy.
    Block(Arc<StepBlock>),
    /// Host-written memory: nothing to wait for.
    None,
}

/// A DLPack producer over step memory: an arena field, a whole arena, a fresh block, or a
/// zero-copy slot field. Import it with ``torch.from_dlpack``, ``cupy.from_dlpack``,
/// ``jax.dlpack.from_dlpack`` or ``numpy.from_dlpack`` (host memory, no driver); every import
/// shares the memory and keeps it alive.
///
/// Example:
///     >>> t = torch.from_dlpack(st.field("ids"))
#[pyclass(frozen, name = "StepTensor", module = "pinstage._native")]
pub struct StepTensor {
    ptr: u64,
    dtype: DType,
    shape: Vec<i64>,
    /// CUDA ordinal; None: host memory.
    device: Option<i32>,
    keep: Keep,
    sync: Sync,
}

impl StepTensor {
    fn of_block(b: StepBlock) -> Self {
        let device = b.device().map(|d| d.ordinal());
        let b = Arc::new(b);
        Self {
            ptr: b.ptr(),
            dtype: DType::U8,
            shape: vec![b.len() as i64],
            device,
            keep: Keep::Block(Arc::clone(&b)),
            sync: Sync::Block(b),
        }
    }

    fn dl_device(&self) -> DLDevice {
        match self.device {
            Some(id) => DLDevice {
                device_type: DLDeviceType(crate::dlpack::DL_CUDA),
                device_id: id,
            },
            None => DLDevice::CPU,
        }
    }

    fn managed<M: dlpark::ManagedTensorBase>(&self) -> PyResult<Managed<M>> {
        let keep: Box<KeepCtx> = Box::new(match &self.keep {
            Keep::Stager(s) => KeepCtx::Stager(Arc::clone(s)),
            Keep::Block(b) => KeepCtx::Block(Arc::clone(b)),
        });
        let mut init = dlpark::metadata::Dynamic::compact(self.shape.clone())
            .prepare_as::<M>()
            .map_err(|e| value_err(format!("DLPack export: {e}")))?
            .initialize(keep);
        let (code, bits) = self.dtype.dlpack();
        init.set_data(self.ptr as *mut std::ffi::c_void);
        init.set_dtype(dlpark::ffi::DLDataType {
            code: dlpark::ffi::DLDataTypeCode(code),
            bits,
            lanes: 1,
        });
        init.set_device(self.dl_device());
        // SAFETY: data points at `prod(shape)` elements kept alive by the context; shape and
        // compact strides were written by the metadata builder.
        Ok(unsafe { init.finish() })
    }

    fn stream_request(req: &ExportRequest<'_>) -> PyResult<Option<StreamHandle<'static>>> {
        Ok(match req.cuda_stream()? {
            CudaStreamRequest::Omitted | CudaStreamRequest::NoSync => None,
            CudaStreamRequest::LegacyDefault => Some(StreamHandle::LEGACY),
            CudaStreamRequest::PerThreadDefault => Some(StreamHandle::PER_THREAD),
            // SAFETY: the consumer's own stream, alive during its import (DLPack contract).
            CudaStreamRequest::Pointer(p) => Some(unsafe { StreamHandle::from_raw(p) }?),
        })
    }
}

/// The owning context of an export.
enum KeepCtx {
    #[allow(dead_code)]
    Stager(Arc<StepStager>),
    #[allow(dead_code)]
    Block(Arc<StepBlock>),
}

impl DlpackExporter for StepTensor {
    fn device(&self) -> DLDevice {
        self.dl_device()
    }

    fn flags(&self) -> DlpackFlags {
        DlpackFlags::empty()
    }

    fn prepare_export(&self, py: Python<'_>, request: &ExportRequest<'_>) -> PyResult<()> {
        if self.device.is_none() {
            return Ok(());
        }
        let omitted = matches!(request.cuda_stream()?, CudaStreamRequest::Omitted);
        let stream = Self::stream_request(request)?;
        py.detach(|| -> crate::Result<()> {
            match (&self.sync, stream) {
                (Sync::None, _) => Ok(()),
                (Sync::Block(b), Some(s)) => b.wait_on(s),
                (Sync::Block(b), None) if omitted => b.synchronize(),
                (Sync::Commits(st), Some(s)) => st.order_after_commits(Some(s)),
                (Sync::Commits(st), None) if omitted => st.order_after_commits(None),
                _ => Ok(()),
            }
        })?;
        Ok(())
    }

    fn export_legacy(&self, _py: Python<'_>) -> PyResult<Managed<DLManagedTensor>> {
        self.managed()
    }

    fn export_versioned(&self, _py: Python<'_>) -> PyResult<Managed<DLManagedTensorVersioned>> {
        self.managed()
    }
}

#[pymethods]
impl StepTensor {
    /// The DLPack export (the standard protocol); see the class.
    #[pyo3(signature = (*, stream=None, max_version=None, dl_device=None, copy=None))]
    fn __dlpack__(
        &self,
        py: Python<'_>,
        stream: Option<&Bound<'_, PyAny>>,
        max_version: Option<(u32, u32)>,
        dl_device: Option<(u32, i32)>,
        copy: Option<bool>,
    ) -> PyResult<Py<PyAny>> {
        let req = ExportRequest::parse(stream, max_version, dl_device, copy)?;
        export_dlpack(self, py, req)
    }

    fn __dlpack_device__(&self) -> (u32, i32) {
        let d = self.dl_device();
        (d.device_type.0, d.device_id)
    }

    /// The shape.
    #[getter]
    fn shape<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyTuple>> {
        PyTuple::new(py, &self.shape)
    }

    /// The dtype's name.
    #[getter]
    fn dtype(&self) -> &'static str {
        self.dtype.name()
    }

    /// Address of the first byte (device address, or host address without a driver).
    #[getter]
    fn address(&self) -> u64 {
        self.ptr
    }

    fn __repr__(&self) -> String {
        let dev = match self.device {
            Some(i) => format!("cuda:{i}"),
            None => "cpu".into(),
        };
        format!("StepTensor({}{:?}, {dev})", self.dtype.name(), self.shape)
    }
}

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyStepLayout>()?;
    m.add_class::<PyStepStager>()?;
    m.add_class::<PyStep>()?;
    m.add_class::<StepTensor>()?;
    Ok(())
}
