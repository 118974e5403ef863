//! `PinnedStager` and `StagedTarget` for Python.

use std::sync::Arc;

use parking_lot::Mutex;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyTuple};

use super::args::{count_arg, parse_device_or_current};
use super::dtype::parse_dtype;
use super::errors::type_name;
use super::errors::{type_err, value_err};
use super::import::{Imported, import_destination};
use super::mirror::PyMirror;
use super::stream::parse_stream;
use super::values::{check_shape, scalar_bytes, to_values};
use super::wait::take_interrupt;
use crate::cuda::StreamHandle;
use crate::dlpack::DType;
use crate::h2d::stager::{RawStager as Stager, WaitFn};
use crate::{Error, H2DMirror as CoreMirror};

fn stats_dict<'py>(
    py: Python<'py>,
    s: crate::h2d::PinnedStagerStats,
) -> PyResult<Bound<'py, PyDict>> {
    let d = super::helpers::stats(py, "PinnedStager.stats()", &[("skipped", "skipped_copies")])?;
    d.set_item("copies", s.copies)?;
    d.set_item("host_copies", s.host_copies)?;
    d.set_item("skipped_copies", s.skipped_copies)?;
    d.set_item("bytes", s.bytes)?;
    d.set_item("waits", s.waits)?;
    d.set_item("queries", s.queries)?;
    d.set_item("growths", s.growths)?;
    d.set_item("pinned_bytes", s.pinned_bytes)?;
    Ok(d)
}

/// PinnedStager(dtype, numel=256, depth=16, *, device=None)
///
/// A ring of ``depth`` pinned host slots for small host-to-device copies: each ``copy_`` writes the
/// values (and padding) into one slot and issues ONE non-blocking copy from it; a slot is reused
/// only once its copy completed. Also copies into host (numpy) destinations, directly, with or
/// without a driver. Thread-safe; a context manager (``close()`` on exit).
///
/// Parameters:
///     dtype: the element dtype (numpy, torch, jax or cupy dtype, or its name).
///     numel (int): initial slot capacity in elements, >= 1 (a larger copy grows its slot).
///     depth (int): number of slots, 1 to 65536.
///     device (int | str | device, optional): the CUDA device served (default: the device
///         current on this thread, else 0).
///
/// Raises:
///     PinstageTypeError: an unknown dtype, a non-int ``numel``/``depth``. PinstageValueError: a
///     value out of range, a device that does not exist. CudaDriverError: pinned memory or events
///     cannot be had. Without a driver the stager is made and serves host destinations only.
///
/// Example:
///     >>> st = pinstage.PinnedStager(numpy.int32, numel=256)
///     >>> dst = numpy.zeros(8, numpy.int32)
///     >>> st.copy_(dst, [1, 2], pad_value=-1)
///     True
///     >>> dst.tolist()
///     [1, 2, -1, -1, -1, -1, -1, -1]
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
    fn stager(&self) -> PyResult<Arc<Stager>> {
        self.inner
            .read()
            .clone()
            .ok_or_else(|| value_err("this PinnedStager is closed; create a new one"))
    }

    /// Runs one copy with the GIL released, as torch's calls do (a thread copying at full rate
    /// must not hold up another thread's Python, e.g. a CUDA graph's launches, for a switch
    /// interval); a wait for a busy slot takes it back only to answer Ctrl-C, and a mirror
    /// another thread holds is waited for without it too.
    fn run_copy(
        &self,
        py: Python<'_>,
        view: &crate::DeviceView<'static>,
        values: &[u8],
        pad: Option<&[u8]>,
        mirror: Option<&Mutex<CoreMirror>>,
        stream: StreamHandle<'static>,
    ) -> PyResult<bool> {
        // A thread waiting for the mirror while holding the GIL would deadlock with the holder
        // (which may be waiting for the GIL): lock it with the GIL released when contended.
        let mut guard = mirror.map(|m| m.try_lock().unwrap_or_else(|| py.detach(|| m.lock())));
        let stager = self.stager()?;
        let mut interrupt: Option<PyErr> = None;
        let mut copy = |wait: &mut WaitFn<'_>| {
            let mut c = options(stager.to(view), stream, pad).wait_with(wait);
            if let Some(m) = guard.as_deref_mut() {
                c = c.mirror(m);
            }
            c.copy(values)
        };
        #[cfg(not(pinstage_seeded_bug = "copy_gil_held"))]
        let r = py
            .detach(|| copy(&mut |ev| super::wait::slot_wait_detached(ev.event(), &mut interrupt)));
        // The seeded-bug harness (`copy_gil_held`, scripts/seeded.tsv): the copy as it was, the
        // GIL held but for a busy slot's wait, must fail the GPU tests (a thread waiting for the
        // only slot needs the GIL back, which the thread spinning for that slot holds).
        #[cfg(pinstage_seeded_bug = "copy_gil_held")]
        let r = copy(&mut |ev| super::wait::slot_wait(py, ev.event(), &mut interrupt));
        let outcome = r.map_err(|e| take_interrupt(e, interrupt))?;
        Ok(outcome.wrote())
    }
}

/// The stream and pad of a copy.
fn options<'a>(
    c: crate::h2d::stager::RawCopy<'a>,
    stream: StreamHandle<'a>,
    pad: Option<&'a [u8]>,
) -> crate::h2d::stager::RawCopy<'a> {
    let c = c.stream(stream);
    match pad {
        Some(p) => c.pad(p),
        None => c,
    }
}

#[pymethods]
impl PyStager {
    /// Makes a stager; see the class.
    #[new]
    #[pyo3(
        signature = (dtype, numel=None, depth=None, *, device=None),
        text_signature = "(dtype, numel=256, depth=16, *, device=None)"
    )]
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
            None => crate::h2d::DEFAULT_NUMEL,
        };
        let depth = match depth {
            Some(n) => count_arg(n, "depth", 1, crate::h2d::MAX_DEPTH)?,
            None => crate::h2d::DEFAULT_DEPTH,
        };
        let ordinal = parse_device_or_current(device)?;
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

    /// ``dst[:n] = values`` and, with ``pad_value``, the rest of ``dst`` = pad, as ONE non-blocking
    /// host-to-device copy (a host ``dst`` is written directly).
    ///
    /// Parameters:
    ///     dst: a writable, contiguous DLPack tensor of the stager's dtype on its device (torch, cupy,
    ///         numpy; never a JAX array, which is immutable).
    ///     values: a list, tuple or array of numbers (numpy, torch CPU tensor...): numpy's assignment
    ///         rule applies (``dst``'s shape past its first axis, or 1-D into a 1-D ``dst``). May be
    ///         changed as soon as the call returns.
    ///     pad_value (scalar, optional): fills ``dst`` past the values.
    ///     mirror (H2DMirror, optional): skip the copy when it shows ``dst`` already holds these
    ///         values (sound only while the stager is ``dst``'s only writer).
    ///     stream: a torch or cupy stream, an object with ``__cuda_stream__``, or an int handle (kept
    ///         alive by the caller); None: the producer's current stream, else the legacy default.
    ///
    /// Returns:
    ///     bool: whether anything was written (False: a mirror hit, or nothing to copy).
    ///
    /// Raises:
    ///     PinstageTypeError: ``dst`` of another dtype or not a DLPack producer, values that are not
    ///         numbers. PinstageValueError: more values than ``dst`` holds, values that do not fit the
    ///         dtype, a shape ``dst[:n]`` cannot take, a read-only or JAX ``dst``, another device, a
    ///         mirror bound to another destination, a closed stager. StreamCaptureError: the stream is
    ///         capturing a CUDA graph. CudaUnavailableError: a CUDA ``dst`` without a driver.
    ///         KeyboardInterrupt: Ctrl-C while waiting for a busy slot (nothing was written).
    ///     Nothing is written when a call raises.
    ///
    /// Example:
    ///     >>> st.copy_(torch.zeros(8, dtype=torch.int32, device="cuda"), [5, 6], pad_value=0)
    ///     True
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
                type_err(format!("mirror must be an H2DMirror; got {}", type_name(m)))
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
        let stream = s.unwrap_or(imp.stream);
        let wrote = self.run_copy(
            py,
            &imp.view,
            vals.bytes(),
            pad.as_deref(),
            mirror.map(|m| &m.get().inner),
            stream,
        )?;
        if let Some(m) = mirror {
            // The mirror is bound to `dst` now: keep it alive (see `PyMirror::bound_dst`).
            let mut b = m.get().bound_dst.lock();
            if !b.as_ref().is_some_and(|o| o.is(dst)) {
                let old = b.replace(dst.clone().unbind());
                drop(b);
                drop(old);
            }
        }
        Ok(wrote)
    }

    /// Binds ``dst`` once (imported and kept alive): ``target.copy_(values)`` then pays only for
    /// the copy.
    ///
    /// Parameters:
    ///     dst: as ``copy_``.
    ///     pad_value (scalar, optional): the pad of every copy.
    ///     skip_unchanged (bool): keep a mirror and skip a copy of the values last copied (False by
    ///         default: sound only while the target is ``dst``'s only writer).
    ///
    /// Returns:
    ///     StagedTarget
    ///
    /// Raises:
    ///     As ``copy_`` for ``dst`` and ``pad_value``.
    ///
    /// Example:
    ///     >>> t = st.target(torch.zeros(256, dtype=torch.int32, device="cuda"), pad_value=0)
    ///     >>> t.copy_(numpy.arange(10, dtype=numpy.int32))
    ///     True
    #[pyo3(
        signature = (dst, *legacy, pad_value=None, skip_unchanged=false),
        text_signature = "(self, dst, *, pad_value=None, skip_unchanged=False)"
    )]
    fn target<'py>(
        slf: &Bound<'py, Self>,
        dst: &Bound<'py, PyAny>,
        legacy: &Bound<'py, PyTuple>,
        mut pad_value: Option<Bound<'py, PyAny>>,
        skip_unchanged: bool,
    ) -> PyResult<StagedTarget> {
        super::args::legacy_positional(
            legacy,
            &["pad_value"],
            &mut [&mut pad_value],
            "PinnedStager.target(dst, pad)",
            "target(dst, pad_value=pad)",
        )?;
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
            .map(|p| scalar_bytes(&p, d))
            .transpose()?;
        Ok(StagedTarget {
            stager: slf.clone().unbind(),
            imported: imp,
            pad,
            mirror: skip_unchanged.then(|| Mutex::new(CoreMirror::new())),
            _dst: dst.clone().unbind(),
        })
    }

    /// Counters: ``copies``, ``host_copies``, ``skipped_copies``, ``bytes``, ``waits``, ``queries``,
    /// ``growths``, ``pinned_bytes``.
    ///
    /// Raises:
    ///     PinstageValueError: the stager is closed.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        stats_dict(py, self.stager()?.stats())
    }

    /// Waits for every copy in flight (GIL released) and frees the ring; later calls raise
    /// ``PinstageValueError``. Calling it twice is harmless.
    fn close(&self, py: Python<'_>) {
        let taken = self.inner.write().take();
        // Dropping the last Arc waits for in-flight slots: do it with the GIL released.
        py.detach(move || drop(taken));
    }

    /// Whether ``close()`` was called.
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

    /// Whether CUDA destinations can be served (a driver and the device were found).
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

/// A destination bound to a stager (from ``PinnedStager.target``): ``copy_(values, *,
/// stream=None)``, ``invalidate()``, ``skip_unchanged``, ``numel``.
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
    /// Copies ``values`` (and the bound pad) into the bound destination, as ``PinnedStager.copy_``.
    ///
    /// Parameters:
    ///     values: as ``PinnedStager.copy_``.
    ///     stream: as ``PinnedStager.copy_``; None asks the producer for its current stream at every
    ///         call (torch), else the legacy default stream.
    ///
    /// Returns:
    ///     bool: whether anything was written (False: skipped as unchanged, or nothing to copy).
    ///
    /// Raises:
    ///     As ``PinnedStager.copy_``.
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
                (Some(ex), crate::dlpack::MemoryKind::Cuda(id)) => {
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

    /// Forgets what the mirror remembers (call it when ``dst`` was written some other way).
    fn invalidate(&self, py: Python<'_>) {
        if let Some(m) = &self.mirror {
            super::mirror::lock_detached(py, m).invalidate();
        }
    }

    /// Whether copies of the values last copied are skipped.
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
