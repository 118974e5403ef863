//! `Step`: an open step of a `StepStager`, a context manager.

use std::sync::Arc;
use std::thread::ThreadId;

use numpy::npyffi::{self, NPY_ARRAY_WRITEABLE};
use parking_lot::Mutex;
use pyo3::prelude::*;

use crate::cuda::StreamHandle;
use crate::error::Error;
use crate::python::args::count_arg;
use crate::python::arrays::array_over;
use crate::python::values::{scalar_bytes, to_values};
use crate::step::{RawStep, StepStager};

use super::export::{Keep, Order, StepTensor};
use super::{PyStepStager, field_name};

/// Writes `values` into field `name` of an open step (see ``Step.put``).
pub(super) fn put_values(
    st: &StepStager,
    raw: &mut RawStep,
    name: &str,
    values: &Bound<'_, PyAny>,
    pad: Option<&Bound<'_, PyAny>>,
    rows: Option<&Bound<'_, PyAny>>,
) -> PyResult<()> {
    put_id(st, raw, st.layout().id(name)?, values, pad, rows)
}

/// [`put_values`] for a resolved field.
pub(super) fn put_id(
    st: &StepStager,
    raw: &mut RawStep,
    id: crate::step::FieldId,
    values: &Bound<'_, PyAny>,
    pad: Option<&Bound<'_, PyAny>>,
    rows: Option<&Bound<'_, PyAny>>,
) -> PyResult<()> {
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
/// waiting for the interpreter's switch interval. A zero-copy commit only records an event
/// (a few hundred ns, nothing waited for): it keeps the GIL, which costs less than handing it
/// over and back.
pub(super) fn commit_detached(
    py: Python<'_>,
    st: &StepStager,
    raw: RawStep,
    stream: StreamHandle<'static>,
) -> PyResult<crate::step::CommitOutcome> {
    if st.mode() == crate::step::StepMode::ZeroCopy {
        return Ok(st.commit_raw(raw, stream)?);
    }
    Ok(py.detach(move || st.commit_raw(raw, stream))?)
}

pub(super) struct StepState {
    pub(super) raw: Option<RawStep>,
    /// numpy views handed out: read-only once the step ends.
    pub(super) views: Vec<Py<PyAny>>,
    pub(super) block: Option<Py<StepTensor>>,
    /// How the step ended (meaningful once `raw` is gone).
    pub(super) ended: Ended,
}

/// How a step ended.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum Ended {
    /// Aborted, dropped, or still open.
    Aborted,
    CommitOutcome,
    /// The commit was tried and failed (the slot was released all the same).
    Failed,
    /// Aborted when the thread that opened it exited with it open.
    ThreadExited,
}

impl Ended {
    /// What a call of a step aborted at its thread's exit is told.
    const THREAD_EXITED: &'static str =
        "this step was aborted when the thread that opened it exited with it open";
}

/// A step open on this thread, as [`OPEN_HERE`] keeps it: weak references only (an open step's
/// `Step` keeps its stager alive; an entry must not).
struct OpenedHere {
    state: std::sync::Weak<Mutex<StepState>>,
    stager: std::sync::Weak<StepStager>,
    counts: std::sync::Weak<super::OpenSteps>,
}

/// The steps open on one thread, aborted when the thread exits. Only the thread that opened a
/// step may end it; one its thread left open (kept alive by a stored traceback, say) would
/// otherwise hold its slot for good, and every other thread's `step()` / `stage()` would wait
/// for it forever.
struct OpenHere(std::cell::RefCell<Vec<OpenedHere>>);

impl Drop for OpenHere {
    fn drop(&mut self) {
        // The thread is exiting (no GIL): only the slot is released; views handed out keep
        // their writeable flag (documented), the Python objects are left alone.
        let me = std::thread::current().id();
        for o in self.0.get_mut().drain(..) {
            let (Some(state), Some(stager)) = (o.state.upgrade(), o.stager.upgrade()) else {
                continue;
            };
            // Waits for a call of the step's running elsewhere (a repr, a getter): none waits
            // for this thread while holding the lock.
            let raw = {
                let mut g = state.lock();
                let raw = g.raw.take();
                if raw.is_some() {
                    g.ended = Ended::ThreadExited;
                }
                raw
            };
            if let Some(raw) = raw {
                // Outside the lock. No stream: the step's may be gone by now; a zero-copy step
                // whose fields went to the device synchronizes the context instead (its readers
                // complete first).
                stager.abort_raw_on(raw, None);
                if let Some(counts) = o.counts.upgrade() {
                    super::count_open_in(&counts, me, false);
                }
            }
        }
    }
}

thread_local! {
    static OPEN_HERE: OpenHere = const { OpenHere(std::cell::RefCell::new(Vec::new())) };
}

/// Registers a step just opened on this thread (see [`OpenHere`]).
pub(super) fn opened_here(
    state: &Arc<Mutex<StepState>>,
    stager: &Arc<StepStager>,
    counts: &Arc<super::OpenSteps>,
) {
    // `try_with`: a thread already exiting has no list; its step is ended by its owner.
    let _ = OPEN_HERE.try_with(|l| {
        let mut l = l.0.borrow_mut();
        l.retain(|o| o.state.strong_count() > 0);
        l.push(OpenedHere {
            state: Arc::downgrade(state),
            stager: Arc::downgrade(stager),
            counts: Arc::downgrade(counts),
        });
    });
}

/// Forgets a step that ended on this thread.
fn ended_here(state: &Arc<Mutex<StepState>>) {
    let _ = OPEN_HERE.try_with(|l| {
        if let Ok(mut l) = l.0.try_borrow_mut()
            && let Some(i) = l
                .iter()
                .position(|o| std::ptr::eq(o.state.as_ptr(), Arc::as_ptr(state)))
        {
            l.swap_remove(i);
        }
    });
}

impl StepState {
    /// Why an ended step refuses a call.
    fn ended_why(&self) -> &'static str {
        match self.ended {
            Ended::CommitOutcome => "this step was already committed",
            Ended::Failed => "this step's commit failed (its slot was released); open a new step",
            Ended::Aborted => "this step was aborted",
            Ended::ThreadExited => Ended::THREAD_EXITED,
        }
    }
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
    pub(super) stager: Py<PyStepStager>,
    pub(super) thread: ThreadId,
    pub(super) stream: StreamHandle<'static>,
    /// Shared with the opening thread's list of open steps ([`OpenHere`]).
    pub(super) state: Arc<Mutex<StepState>>,
}

impl PyStep {
    /// Whether the step was aborted when its thread exited with it open.
    fn thread_exited(&self) -> bool {
        self.state
            .try_lock()
            .is_some_and(|g| g.ended == Ended::ThreadExited)
    }

    fn check_thread(&self) -> PyResult<()> {
        if std::thread::current().id() != self.thread {
            if self.thread_exited() {
                return Err(Error::StepState(Ended::THREAD_EXITED).into());
            }
            return Err(Error::StepState(
                "this step belongs to the thread that opened it; open a step per thread",
            )
            .into());
        }
        Ok(())
    }

    /// The step's state; refused while one of its calls runs (on another thread, or a callback
    /// of its own call, e.g. a value's `__index__`): waiting would deadlock (the caller holds the
    /// GIL, which the running call may need).
    fn state(&self) -> PyResult<parking_lot::MutexGuard<'_, StepState>> {
        self.state.try_lock().ok_or_else(|| {
            Error::StepState(
                "this step is in use by another of its calls (another thread, or a callback of \
                 the call running)",
            )
            .into()
        })
    }

    /// Counts the step ended on its stager and on its thread.
    fn ended(&self) {
        self.stager.get().count_open(self.thread, false);
        if std::thread::current().id() == self.thread {
            ended_here(&self.state);
        }
    }

    fn with_open<R>(
        &self,
        f: impl FnOnce(&StepStager, &mut RawStep, &mut StepState) -> PyResult<R>,
    ) -> PyResult<R> {
        self.check_thread()?;
        let st = &self.stager.get().inner;
        let mut g = self.state()?;
        let state = &mut *g;
        let Some(mut raw) = state.raw.take() else {
            return Err(Error::StepState(state.ended_why()).into());
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

    fn abort_inner(&self) -> PyResult<()> {
        let st = &self.stager.get().inner;
        let mut g = self.state()?;
        if let Some(raw) = g.raw.take() {
            st.abort_raw_on(raw, Some(self.stream));
            self.ended();
        }
        Python::attach(|py| Self::end(&mut g, py));
        Ok(())
    }

    fn commit_inner(&self, py: Python<'_>) -> PyResult<Option<Py<StepTensor>>> {
        self.check_thread()?;
        let stager = self.stager.get();
        let st = &stager.inner;
        let mut g = self.state()?;
        let Some(raw) = g.raw.take() else {
            return Err(Error::StepState(g.ended_why()).into());
        };
        Self::end(&mut g, py);
        self.ended();
        let committed = match commit_detached(py, st, raw, self.stream) {
            Ok(c) => c,
            Err(e) => {
                g.ended = Ended::Failed;
                return Err(e);
            }
        };
        g.ended = Ended::CommitOutcome;
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
        name: &Bound<'_, PyAny>,
        values: &Bound<'_, PyAny>,
        pad_value: Option<&Bound<'_, PyAny>>,
        rows: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<()> {
        self.put_inner(&field_name(name)?, values, pad_value, rows)
    }

    /// A writable numpy view of the first ``rows`` rows of field ``name`` in this step's slot,
    /// for planning code to write in place (zero copies); those rows are sent at commit, holding
    /// whatever they hold then (a new view shows what the slot's last step left there). The view
    /// turns read-only when the step ends or its fields go to the device (``device``); arrays
    /// derived from it before (slices, ``memoryview``) keep numpy's writeable flag: write through
    /// them only inside the step.
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
        name: &Bound<'py, PyAny>,
        rows: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let py = slf.py();
        let me = slf.get();
        let name = field_name(name)?;
        let name = name.as_str();
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
    fn used_rows(&self, name: &Bound<'_, PyAny>) -> PyResult<usize> {
        let name = field_name(name)?;
        self.with_open(|st, raw, _| Ok(st.used_raw(raw, st.layout().id(&name)?)))
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
    fn device(&self, py: Python<'_>, name: &Bound<'_, PyAny>) -> PyResult<StepTensor> {
        let name = field_name(name)?;
        let name = name.as_str();
        let stager = self.stager.get();
        self.with_open(|st, raw, state| {
            let id = st.layout().id(name)?;
            let f = &st.layout().fields()[id.index()];
            let used = st.used_raw(raw, id);
            let rows = if used == 0 { f.rows() } else { used };
            let ptr = st.device_ptr_raw(raw, id)?;
            // The fields now belong to the device's readers: views handed out turn read-only.
            Self::end(state, py);
            let mut shape = vec![rows as i64];
            if f.shape().len() == 2 {
                shape.push(f.cols() as i64);
            }
            Ok(StepTensor {
                ptr,
                dtype: f.dtype(),
                shape,
                device: Some(st.ordinal()),
                keep: Keep::Stager(Arc::clone(&stager.inner), stager.bound.clone()),
                sync: Order::None,
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
    /// an ended step (one whose thread exited with it open included: that ended it).
    ///
    /// Raises:
    ///     StepStateError: another thread, while the step is open.
    fn abort(&self) -> PyResult<()> {
        if self.thread_exited() {
            return Ok(());
        }
        self.check_thread()?;
        self.abort_inner()
    }

    /// The slot this step owns (0 to depth - 1); see ``StepStager.slot_field``.
    #[getter]
    fn slot(&self) -> PyResult<usize> {
        self.with_open(|_, raw, _| Ok(raw.slot()))
    }

    /// Fresh mode, after commit: the step's block (else None).
    #[getter]
    fn block(&self, py: Python<'_>) -> PyResult<Option<Py<StepTensor>>> {
        Ok(self.state()?.block.as_ref().map(|b| b.clone_ref(py)))
    }

    /// Whether the step was committed.
    #[getter]
    fn committed(&self) -> PyResult<bool> {
        Ok(self.state()?.ended == Ended::CommitOutcome)
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
        self.check_thread()?;
        let failed = exc_type.is_some_and(|t| !t.is_none());
        let open = self.state()?.raw.is_some();
        if failed || !open {
            if open {
                self.abort_inner()?;
            }
            return Ok(false);
        }
        self.commit_inner(py)?;
        Ok(false)
    }

    fn __repr__(&self) -> String {
        let Some(g) = self.state.try_lock() else {
            return "Step(in use)".to_string();
        };
        let state = match (&g.raw, g.ended) {
            (Some(_), _) => "open",
            (None, Ended::CommitOutcome) => "committed",
            (None, Ended::Failed) => "failed",
            (None, Ended::Aborted) => "aborted",
            (None, Ended::ThreadExited) => "aborted: its thread exited",
        };
        format!("Step({state})")
    }
}

impl Drop for PyStep {
    fn drop(&mut self) {
        let state = Arc::clone(&self.state);
        let mut g = state.lock();
        if let Some(raw) = g.raw.take() {
            self.stager.get().inner.abort_raw_on(raw, Some(self.stream));
            self.ended();
        }
        // Views handed out turn read-only here too: their slot is released.
        if !g.views.is_empty() {
            Python::attach(|py| Self::end(&mut g, py));
        }
    }
}
