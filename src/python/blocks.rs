//! `BlockMover`: paged KV-cache blocks between device tensors and pinned host tensors.

use parking_lot::Mutex;
use pyo3::prelude::*;
use pyo3::types::PyDict;

use super::errors::{describe, type_err, value_err};
use super::import::{Exchange, Imported, import, import_writable};
use super::pending::PendingCopy;
use super::stream::{parse_stream, stream_on};
use crate::blocks::{Choice, Direction, Staging, Strategy};
use crate::cuda::StreamHandle;
use crate::dlpack::{DType, DeviceView, MemoryKind};
use crate::stamps::stamp;

/// Moves lists of KV-cache blocks between device tensors and pinned host tensors with the copy
/// engines (no kernel), on the caller's stream: runs of adjacent ids merged, a move's copies in
/// one batched driver call, or, when each side's tensors are views of one allocation (one pool
/// tensor split per layer), one 2D copy per run across every tensor (every load, and offloads
/// unless the copies average 9-31 KiB, where a batch is faster).
///
/// Parameters:
///     device_tensors: a list of C-contiguous DLPack tensors on one CUDA device (torch, cupy;
///         one per layer and K/V, or one cross-layer tensor), or one tensor.
///     host_tensors: as many pinned host arrays (``empty_host``, a ``PinnedPool`` block, a
///         ``pin``-ned array, a torch ``pin_memory()`` tensor), paired in order; each pair has
///         one dtype, one block size and one number of parts; the host side may hold more or
///         fewer blocks.
///     block_dim: the dimension that indexes blocks, the same in every tensor: 1 for
///         ``[2, num_blocks, ...]`` (K and V first), 0 for ``[num_blocks, ...]`` and a
///         cross-layer ``[num_blocks, layers, 2, ...]``. The dimensions before it are parts of
///         a block (each copied), those after it one part's bytes.
///     staging: moves in the background (``background=True``) of small blocks through staging
///         buffers: 2D copies gather (offload) or scatter (load) the blocks inside device
///         memory, one copy per chunk crosses the link, and pinstage's copy threads scatter or
///         gather the host blocks. ``"auto"`` (default): moves of 8 MiB or more whose copies
///         average under 128 KiB, between tensors that are views of one allocation on each side
///         (or one tensor each), one direction at a time (a move that starts while the other
///         direction's goes through staging goes unstaged, unless its copies average under 12
///         KiB: then both stage; from 32 KiB the staged one hands its chunks not yet begun over
///         to 2D copies across the link; in between, a load stages beside a staged offload,
///         which hands over); ``"always"``: every move in the background there; ``"never"``.
///         A staged offload completes (``wait``, ``done``, ``stream_wait``) once the host blocks
///         hold the data, and its ``stream_wait`` waits on the host until then; a staged load
///         reads the host blocks once the work queued on ``stream`` before the call completed,
///         and its ``stream_wait`` waits on the host until its copies are queued.
///         ``staging_bytes`` says what the mover holds.
///     staging_chunk: bytes of one staging chunk (default 16 MiB; 64 KiB to 1 GiB); each
///         direction keeps four in device memory and four in pinned host memory from its first
///         staged move until the mover goes.
///
/// Host arrays on both sides make a mover whose moves are plain memcpys (no driver needed).
///
/// Raises:
///     PinstageValueError: lists of different lengths or empty, a pageable or device host
///         tensor, a non-contiguous tensor, a JAX device tensor (immutable), a pair whose block
///         sizes or parts differ, ``block_dim`` out of range. PinstageTypeError: a pair of two
///         dtypes, not a DLPack producer, a ``block_dim`` that is not an int. CudaUnavailableError: device tensors without a driver.
///
/// Example:
///     >>> pool = torch.empty(64, 2, 4096, 16, 8, 64, dtype=torch.bfloat16, device="cuda")
///     >>> host = torch.empty(64, 2, 1024, 16, 8, 64, dtype=torch.bfloat16).pin_memory()
///     >>> mover = pinstage.BlockMover(list(pool), list(host), block_dim=1)
///     >>> mover.offload([7, 8, 9, 100], [0, 1, 2, 3]).wait()
#[pyclass(frozen, module = "pinstage._native")]
pub(crate) struct BlockMover {
    mover: crate::blocks::BlockMover<'static>,
    /// Keeps every tensor's memory alive (the mover's addresses point into it).
    _tensors: Mutex<Vec<Imported>>,
    /// The first device tensor's producer's table: its current stream is `stream=None`'s.
    exchange: Option<Exchange>,
    /// DLPack device type and id of the device tensors.
    device: (u32, i32),
}

#[pymethods]
impl BlockMover {
    #[new]
    #[pyo3(
        signature = (device_tensors, host_tensors, *, block_dim=None, staging="auto", staging_chunk=None),
        text_signature = "(device_tensors, host_tensors, *, block_dim=0, staging='auto', staging_chunk=16777216)"
    )]
    fn new(
        device_tensors: &Bound<'_, PyAny>,
        host_tensors: &Bound<'_, PyAny>,
        block_dim: Option<&Bound<'_, PyAny>>,
        staging: &str,
        staging_chunk: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Self> {
        let staging = match staging {
            "auto" => Staging::Auto,
            "always" => Staging::Always,
            "never" => Staging::Never,
            other => {
                return Err(value_err(format!(
                    "staging must be \"auto\", \"always\" or \"never\"; got {other:?}"
                )));
            }
        };
        let staging_chunk = match staging_chunk {
            Some(c) => {
                let range = crate::blocks::CHUNK_RANGE;
                super::args::count_arg(c, "staging_chunk", *range.start(), *range.end())?
            }
            None => crate::blocks::DEFAULT_CHUNK,
        };
        // A dimension of a DLPack tensor: numpy's limit of 64 dimensions.
        let block_dim = match block_dim {
            Some(b) => super::args::count_arg(b, "block_dim", 0, 63)?,
            None => 0,
        };
        let devs = tensor_list(device_tensors)?;
        let hosts = tensor_list(host_tensors)?;
        let mut imported = Vec::with_capacity(devs.len() + hosts.len());
        for (i, t) in devs.iter().enumerate() {
            imported.push(import_writable(t, None, &format!("device_tensors[{i}]"))?);
        }
        for t in &hosts {
            imported.push(import(t, None)?);
        }
        let views: Vec<DeviceView<'static>> = imported.iter().map(|i| i.view.clone()).collect();
        let (dv, hv) = views.split_at(devs.len());
        let mover = crate::blocks::BlockMover::new(dv, hv, block_dim)?;
        mover.set_staging(staging, staging_chunk)?;
        let device = dv.first().map_or((0, 0), |v| match v.memory() {
            MemoryKind::Cuda(id) => (v.device_type(), id),
            MemoryKind::Host => (v.device_type(), 0),
        });
        let exchange = imported.first().and_then(|i| i.exchange);
        Ok(Self {
            mover,
            _tensors: Mutex::new(imported),
            exchange,
            device,
        })
    }

    /// Starts copying device blocks ``device_ids[i]`` into host blocks ``host_ids[i]`` of every
    /// tensor pair, and returns at once.
    ///
    /// Parameters:
    ///     device_ids, host_ids: block ids of equal count: lists of ints, or 1-D integer numpy
    ///         arrays or CPU torch tensors. Sources may repeat; a destination may not.
    ///     stream: the stream the move is ordered on (after the work queued there); None: the
    ///         device tensors' producer's current stream (torch), else the legacy default
    ///         stream. Give offload and load different streams to run them at once.
    ///     background: False (default): the copies are issued on this thread, on ``stream``,
    ///         and work queued there later sees them. True: the call returns once the move is
    ///         checked, not once the driver took its copies; a thread of the mover issues them
    ///         on its own stream after the work queued on ``stream`` before the call. Work
    ///         queued on ``stream`` later does NOT wait for them: join with
    ///         ``stream_wait(stream)`` or ``wait()`` before using (or reusing) the moved
    ///         blocks. Background moves of one direction run in call order; an offload and a
    ///         load are not ordered against each other. The first such call starts the
    ///         thread, which polls for the next move for 50 us after each before it sleeps
    ///         (a move soon after the one before costs no wake-up); a mover over host memory
    ///         copies in the call either way.
    ///
    /// Returns:
    ///     PendingCopy: ``wait()`` (returns None), ``done()``, ``stream_wait(stream)``; it
    ///     keeps the mover and its tensors alive until the move completed.
    ///
    /// Raises:
    ///     PinstageValueError: counts differ, an id out of range or negative, a destination id
    ///         twice, a read-only destination. PinstageTypeError: ids that are not integers.
    ///     StreamCaptureError: the stream is capturing a graph. CudaDriverError: the driver
    ///     refused the move. Nothing is issued when a call raises. A move in the background
    ///     that the driver refuses raises CudaDriverError from its ``wait()``,
    ///     ``stream_wait()`` or ``done()``.
    #[pyo3(signature = (device_ids, host_ids, *, stream=None, background=false))]
    fn offload(
        slf: &Bound<'_, Self>,
        device_ids: &Bound<'_, PyAny>,
        host_ids: &Bound<'_, PyAny>,
        stream: Option<&Bound<'_, PyAny>>,
        background: bool,
    ) -> PyResult<PendingCopy> {
        start(
            slf,
            Direction::Offload,
            device_ids,
            host_ids,
            stream,
            background,
        )
    }

    /// Starts copying host blocks ``host_ids[i]`` into device blocks ``device_ids[i]`` of every
    /// tensor pair, and returns at once. Parameters, result and errors as ``offload``. The
    /// host blocks must not change until the move completed.
    #[pyo3(signature = (host_ids, device_ids, *, stream=None, background=false))]
    fn load(
        slf: &Bound<'_, Self>,
        host_ids: &Bound<'_, PyAny>,
        device_ids: &Bound<'_, PyAny>,
        stream: Option<&Bound<'_, PyAny>>,
        background: bool,
    ) -> PyResult<PendingCopy> {
        start(
            slf,
            Direction::Load,
            host_ids,
            device_ids,
            stream,
            background,
        )
    }

    /// What a move would issue, checked as the move checks it; nothing is issued.
    ///
    /// Parameters:
    ///     direction: ``"offload"`` or ``"load"``.
    ///     src_ids, dst_ids: as the move's (device then host ids for ``"offload"``).
    ///     background: plan the move as ``background=True`` would issue it (it may be staged).
    ///
    /// Returns:
    ///     dict: ``direction``, ``strategy`` (``"batched"``, ``"strided"``, ``"staged"``
    ///     (``background=True`` only), ``"per_copy"`` or ``"empty"``),
    ///     ``blocks``, ``runs`` (merged runs of adjacent ids), ``copies``, ``calls`` (driver
    ///     calls), ``threads`` (issuing at once, each on its own stream; staged: the copy
    ///     threads that move the host blocks), ``bytes``, ``reason``,
    ///     ``choice``: what chose between 2D copies and a batch where the tensors allow both:
    ///     ``"table"`` (one way only, as between host arrays, or the table measured on an H200),
    ///     ``"timing"`` (this move would be timed: a mover's
    ///     first moves of 8 MiB or more of each direction and copy size go every way, timed on
    ///     the GPU) or ``"measured"`` (the faster timed on this device; ``measured_gbps``:
    ///     ``{"strided": GB/s, "batched": GB/s}``, the mean of each, with
    ///     ``"batched_one_thread"`` where a batch would be issued from several threads and the
    ///     same batch from one thread was timed too).
    #[pyo3(signature = (direction, src_ids, dst_ids, *, background=false))]
    fn plan<'py>(
        &self,
        py: Python<'py>,
        direction: &str,
        src_ids: &Bound<'py, PyAny>,
        dst_ids: &Bound<'py, PyAny>,
        background: bool,
    ) -> PyResult<Bound<'py, PyDict>> {
        let dir = match direction {
            "offload" => Direction::Offload,
            "load" => Direction::Load,
            other => {
                return Err(value_err(format!(
                    "direction must be \"offload\" or \"load\"; got {other:?}"
                )));
            }
        };
        let (src_arg, dst_arg) = arg_names(dir);
        let (src, dst) = (block_ids(src_ids, src_arg)?, block_ids(dst_ids, dst_arg)?);
        let p = if background {
            self.mover.plan_in_background(dir, &src, &dst)?
        } else {
            self.mover.plan(dir, &src, &dst)?
        };
        let d = PyDict::new(py);
        d.set_item("direction", p.direction.name())?;
        d.set_item(
            "strategy",
            match p.strategy {
                Strategy::Batched => "batched",
                Strategy::Strided => "strided",
                Strategy::Staged => "staged",
                Strategy::PerCopy => "per_copy",
                Strategy::Empty => "empty",
            },
        )?;
        d.set_item("blocks", p.blocks)?;
        d.set_item("runs", p.runs)?;
        d.set_item("copies", p.copies)?;
        d.set_item("calls", p.calls)?;
        d.set_item("threads", p.threads)?;
        d.set_item("bytes", p.bytes)?;
        d.set_item("reason", p.reason)?;
        match p.choice {
            Choice::Table => d.set_item("choice", "table")?,
            Choice::Timing => d.set_item("choice", "timing")?,
            Choice::Measured {
                strided,
                batched,
                batched_one_thread,
            } => {
                d.set_item("choice", "measured")?;
                let rates = PyDict::new(py);
                rates.set_item("strided", strided as f64 / 1e9)?;
                rates.set_item("batched", batched as f64 / 1e9)?;
                if let Some(one) = batched_one_thread {
                    rates.set_item("batched_one_thread", one as f64 / 1e9)?;
                }
                d.set_item("measured_gbps", rates)?;
            }
        }
        Ok(d)
    }

    /// Bytes of staging memory the mover holds now (device and pinned host memory, both
    /// directions; 0 until its first staged move).
    #[getter]
    fn staging_bytes(&self) -> usize {
        self.mover.staging_bytes()
    }

    /// Number of tensor pairs.
    #[getter]
    fn num_tensors(&self) -> usize {
        self.mover.len()
    }

    /// Blocks each device tensor holds (the fewest of any).
    #[getter]
    fn device_blocks(&self) -> usize {
        self.mover.device_blocks()
    }

    /// Blocks each host tensor holds (the fewest of any).
    #[getter]
    fn host_blocks(&self) -> usize {
        self.mover.host_blocks()
    }

    /// Bytes one block id moves, summed over every tensor and part.
    #[getter]
    fn block_bytes(&self) -> usize {
        self.mover.block_bytes()
    }

    fn __repr__(&self) -> String {
        format!(
            "BlockMover(tensors={}, device_blocks={}, host_blocks={}, block_bytes={})",
            self.mover.len(),
            self.mover.device_blocks(),
            self.mover.host_blocks(),
            self.mover.block_bytes()
        )
    }
}

/// One tensor or a list (or tuple) of them.
fn tensor_list<'py>(obj: &Bound<'py, PyAny>) -> PyResult<Vec<Bound<'py, PyAny>>> {
    if obj.is_instance_of::<pyo3::types::PyList>() || obj.is_instance_of::<pyo3::types::PyTuple>() {
        return obj.try_iter()?.collect();
    }
    Ok(vec![obj.clone()])
}

/// Block ids from a list of ints, or a 1-D integer host array (numpy, a CPU torch tensor).
pub(crate) fn block_ids(obj: &Bound<'_, PyAny>, arg: &str) -> PyResult<Vec<usize>> {
    // The common kinds first, each told by its type alone: a list, a numpy array (read in
    // place, with its strides; slices too; no capsule). Asking for `__dlpack__` first would
    // cost an attribute lookup per call.
    if let Ok(list) = obj.cast_exact::<pyo3::types::PyList>() {
        return list_ids(list, arg);
    }
    let numpy = numpy_ids(obj)?;
    let py = obj.py();
    if numpy.is_none() && !obj.hasattr(pyo3::intern!(py, "__dlpack__"))? {
        let Ok(items) = obj.try_iter() else {
            return Err(type_err(format!(
                "{arg} must be a list of ints or a 1-D integer array; got {}",
                describe(obj)
            )));
        };
        let mut out = Vec::with_capacity(obj.len().unwrap_or(0));
        for item in items {
            let item = item?;
            // A plain int (most ids) needs no `__index__`; ids past i64 are past every
            // tensor's blocks and are read wide only to name them.
            out.push(item_id(&item, arg)?);
        }
        return Ok(out);
    }
    // Other producers through DLPack, C-contiguous.
    let (p, n, stride, dtype, _imp) = match numpy {
        Some((p, n, stride, dtype)) => (p, n, stride, dtype, None),
        None => {
            let imp = import(obj, None)?;
            let v = &imp.view;
            if v.memory() != MemoryKind::Host || v.shape().len() > 1 {
                return Err(value_err(format!(
                    "{arg} must be a 1-D integer array in host memory; got {}",
                    describe(obj)
                )));
            }
            let (p, n, d) = (v.ptr() as usize, v.numel(), v.dtype());
            (p, n, d.itemsize() as isize, d, Some(imp))
        }
    };
    if usize::BITS == 64
        && matches!(dtype, DType::I64 | DType::U64)
        && stride == 8
        && p % 8 == 0
        && n > 0
    {
        // Contiguous and aligned (most id arrays): read as a slice, every id's sign at once.
        // (Not when empty: an empty tensor's data pointer may be null, which no slice may be.)
        // SAFETY: `n > 0` aligned 8-byte elements from `p` (not null: it holds them),
        // contiguous, in host memory kept alive by `obj` (borrowed, the GIL held) or `_imp`.
        let ids = unsafe { std::slice::from_raw_parts(p as *const u64, n) };
        let signed = dtype == DType::I64;
        if !signed || ids.iter().fold(0, |m, &x| m | x) >> 63 == 0 {
            return Ok(ids.iter().map(|&x| x as usize).collect());
        }
    }
    macro_rules! read {
        ($t:ty) => {{
            let mut out = Vec::with_capacity(n);
            for i in 0..n {
                // SAFETY: element `i < n` of `$t`, `stride` bytes apart, in host memory kept
                // alive by `obj` (borrowed, the GIL held) or `_imp`; read unaligned (a producer
                // may export any address).
                let x = unsafe {
                    std::ptr::read_unaligned(p.wrapping_add_signed(i as isize * stride) as *const $t)
                };
                out.push(usize::try_from(x).map_err(|_| id_err(x as i128, arg))?);
            }
            Ok(out)
        }};
    }
    match dtype {
        DType::I8 => read!(i8),
        DType::I16 => read!(i16),
        DType::I32 => read!(i32),
        DType::I64 => read!(i64),
        DType::U8 => read!(u8),
        DType::U16 => read!(u16),
        DType::U32 => read!(u32),
        DType::U64 => read!(u64),
        other => Err(type_err(format!(
            "{arg} must hold integers; got an array of {}",
            other.name()
        ))),
    }
}

/// Block ids from a list: read by index, a plain int straight from its object (most ids), any
/// other item as [`item_id`] reads it. The length is read again at every item: an item's
/// `__index__` may change the list.
fn list_ids(list: &Bound<'_, pyo3::types::PyList>, arg: &str) -> PyResult<Vec<usize>> {
    use pyo3::types::PyListMethods;
    let mut out = Vec::with_capacity(list.len());
    let mut i = 0;
    while i < list.len() {
        // SAFETY: a live list, the GIL held, `i` below its length: a borrowed reference, used
        // before anything can run Python code (a plain int's value is read without any).
        let item = unsafe { pyo3::ffi::PyList_GetItem(list.as_ptr(), i as pyo3::ffi::Py_ssize_t) };
        // SAFETY: `item` is a live object when not null.
        let plain = !item.is_null() && unsafe { pyo3::ffi::PyLong_CheckExact(item) } != 0;
        let mut overflow = 0;
        // SAFETY: a plain int object: read without running Python code or raising (a value
        // past i64 sets `overflow` instead).
        let v =
            plain.then(|| unsafe { pyo3::ffi::PyLong_AsLongLongAndOverflow(item, &mut overflow) });
        let v = v.filter(|_| overflow == 0);
        let b = match v {
            Some(v) => id(i128::from(v), arg)?,
            None => item_id(&list.get_item(i)?, arg)?,
        };
        out.push(b);
        i += 1;
    }
    Ok(out)
}

/// A block id from one item of a list (or any iterable) of ints: a plain int, or an object with
/// `__index__` (numpy integers; not bools).
fn item_id(item: &Bound<'_, PyAny>, arg: &str) -> PyResult<usize> {
    // A plain int (most ids) needs no `__index__`; ids past i64 are past every tensor's blocks
    // and are read wide only to name them.
    let int = match item.cast_exact::<pyo3::types::PyInt>() {
        Ok(i) => i.clone().into_any(),
        Err(_) => match super::args::as_index(item)? {
            Some(i) => i,
            None => {
                return Err(type_err(format!(
                    "{arg} must hold ints; got {}",
                    describe(item)
                )));
            }
        },
    };
    let v = match int.extract::<i64>() {
        Ok(v) => i128::from(v),
        Err(_) => int.extract::<i128>()?,
    };
    id(v, arg)
}

/// A 0-d or 1-D numpy array of a native dtype, as (address of element 0, elements, stride in
/// bytes, dtype); `None`: not one (the DLPack path reads it or says why not).
fn numpy_ids(obj: &Bound<'_, PyAny>) -> PyResult<Option<(usize, usize, isize, DType)>> {
    use numpy::{PyUntypedArray, PyUntypedArrayMethods};
    let Ok(a) = obj.cast::<PyUntypedArray>() else {
        return Ok(None);
    };
    if a.ndim() > 1 {
        return Ok(None);
    }
    let Some(dtype) = super::dtype::dtype_of(obj.py(), &a.dtype())? else {
        return Ok(None);
    };
    // SAFETY: reading fields of a live numpy array object; a 1-D array has one stride.
    let (data, stride) = unsafe {
        let f = &(*a.as_array_ptr()).fields;
        (f.data as usize, if a.ndim() == 1 { *f.strides } else { 0 })
    };
    Ok(Some((data, a.len(), stride, dtype)))
}

fn id(v: i128, arg: &str) -> PyResult<usize> {
    usize::try_from(v).map_err(|_| id_err(v, arg))
}

fn id_err(v: i128, arg: &str) -> PyErr {
    if v < 0 {
        value_err(format!("{arg} holds {v}: block ids are >= 0"))
    } else {
        value_err(format!("{arg} holds {v}: past any tensor's block count"))
    }
}

/// The Python names of a move's source and destination ids.
fn arg_names(direction: Direction) -> (&'static str, &'static str) {
    match direction {
        Direction::Offload => ("device_ids", "host_ids"),
        Direction::Load => ("host_ids", "device_ids"),
    }
}

fn start(
    slf: &Bound<'_, BlockMover>,
    direction: Direction,
    src_ids: &Bound<'_, PyAny>,
    dst_ids: &Bound<'_, PyAny>,
    stream: Option<&Bound<'_, PyAny>>,
    background: bool,
) -> PyResult<PendingCopy> {
    stamp!(">py enter");
    let py = slf.py();
    super::linger::reap(py);
    stamp!("reap");
    let this = slf.get();
    let (src_arg, dst_arg) = arg_names(direction);
    let src = block_ids(src_ids, src_arg)?;
    let dst = block_ids(dst_ids, dst_arg)?;
    stamp!("ids read");
    let stream = move_stream(py, this, stream)?;
    stamp!("stream");
    let mover = &this.mover;
    let bytes = src.len() * mover.block_bytes();
    let event = py.detach(|| {
        stamp!("detached");
        // SAFETY: the tensors live as long as `this` (`_tensors`), which the PendingCopy keeps
        // until the event completed (lingering when dropped early); writes by others are the
        // caller's to order on `stream` (documented); the stream belongs to the caller.
        unsafe { mover.start(direction, src, dst, stream, background) }.map(|c| c.into_inflight())
    })?;
    stamp!("attached");
    let pending = PendingCopy::moving(event, slf.clone().into_any().unbind(), bytes);
    stamp!("pending made");
    Ok(pending)
}

/// The stream a move is ordered on: `stream=` checked to be on the device, or the producer's
/// current stream, or the legacy one.
fn move_stream(
    py: Python<'_>,
    this: &BlockMover,
    stream: Option<&Bound<'_, PyAny>>,
) -> PyResult<StreamHandle<'static>> {
    Ok(match (parse_stream(stream)?, &this.exchange, this.device) {
        (Some(s), _, _) => {
            // Only a definite answer refuses (a driver that cannot tell lets the move go on).
            if let (Some(dev), Some(obj)) = (this.mover.device(), stream)
                && stream_on(obj, s, dev).is_ok_and(|own| !own)
            {
                return Err(value_err(format!(
                    "stream= must be a stream of the device tensors' device (cuda:{}); got one \
                     of another device",
                    dev.ordinal()
                )));
            }
            s
        }
        (None, Some(ex), (dt, id)) if this.mover.device().is_some() => {
            ex.current_stream(py, dt, id)?
        }
        (None, _, _) => StreamHandle::LEGACY,
    })
}

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<BlockMover>()
}
