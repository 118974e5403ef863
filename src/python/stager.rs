//! `PinnedStager` and `StagedTarget` for Python.

use std::sync::Arc;

use parking_lot::Mutex;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyTuple};

use super::args::{count_arg, parse_device};
use super::errors::{type_err, value_err};
use super::import::{
    Imported, describe, import, is_jax_array, parse_dtype, parse_stream, type_name,
};
use super::mirror::PyMirror;
use super::values::{check_shape, scalar_bytes, to_values};
use super::wait::wait_interruptibly;
use crate::cuda::{Event, StreamHandle};
use crate::h2d::write::PARALLEL_WRITE_MIN;
use crate::view::DType;
use crate::{Error, H2DMirror as CoreMirror, Stager};

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
