//! `Step`: an open step of a `StepStager`, a context manager.

use super::names::field_name;
use super::state::Ended;
use super::state::OpenSteps;
use super::state::StepState;
use super::state::commit_detached;
use super::state::count_open_in;
use super::state::ended_here;
use super::state::put_values;
use crate::Error;
use crate::cuda::StreamHandle;
use crate::python::args::count_arg;
use crate::python::arrays::array_over;
use crate::python::export::BoundArena;
use crate::python::export::DeviceArray;
use crate::python::export::Keep;
use crate::python::export::Order;
use crate::step::RawStep;
use crate::step::StepStager;
use numpy::npyffi;
use numpy::npyffi::NPY_ARRAY_WRITEABLE;
use parking_lot::Mutex;
use pyo3::prelude::*;
use std::sync::Arc;
use std::thread::ThreadId;

/// An open step of a ``StepStager``: owns one slot until ``commit`` (or the end of its ``with``
/// block) or ``abort``. Belongs to the thread that opened it.
///
/// Example:
///     >>> with st.step(stream=s) as step:
///     ...     step.put("ids", ids)
///     ...     step.view("table", rows=64)[:] = table
#[pyclass(frozen, name = "Step", module = "pinstage._native")]
pub struct PyStep {
    /// The Python `StepStager`, kept alive by the step (and by the views it hands out).
    pub(super) owner: Py<PyAny>,
    pub(super) inner: Arc<StepStager>,
    /// A bound arena's producer, kept by every export of the arena.
    pub(super) bound: Option<Arc<BoundArena>>,
    /// The stager's count of open steps per thread.
    pub(super) open_steps: Arc<OpenSteps>,
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
        count_open_in(&self.open_steps, self.thread, false);
        if std::thread::current().id() == self.thread {
            ended_here(&self.state);
        }
    }

    fn with_open<R>(
        &self,
        f: impl FnOnce(&StepStager, &mut RawStep, &mut StepState) -> PyResult<R>,
    ) -> PyResult<R> {
        self.check_thread()?;
        let st = &self.inner;
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
        let st = &self.inner;
        let mut g = self.state()?;
        if let Some(raw) = g.raw.take() {
            st.abort_raw_on(raw, Some(self.stream));
            self.ended();
        }
        Python::attach(|py| Self::end(&mut g, py));
        Ok(())
    }

    fn commit_inner(&self, py: Python<'_>) -> PyResult<Option<Py<DeviceArray>>> {
        self.check_thread()?;
        let st = &self.inner;
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
        g.ended = Ended::Committed;
        let block = match committed.block {
            Some(b) => {
                let t = Py::new(py, DeviceArray::of_block(b))?;
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
    #[pyo3(
        signature = (name, values, *legacy, pad_value=None, rows=None),
        text_signature = "(self, name, values, *, pad_value=None, rows=None)"
    )]
    fn put<'py>(
        &self,
        name: &Bound<'py, PyAny>,
        values: &Bound<'py, PyAny>,
        legacy: &Bound<'py, pyo3::types::PyTuple>,
        mut pad_value: Option<Bound<'py, PyAny>>,
        mut rows: Option<Bound<'py, PyAny>>,
    ) -> PyResult<()> {
        crate::python::args::legacy_positional(
            legacy,
            &["pad_value", "rows"],
            &mut [&mut pad_value, &mut rows],
            "Step.put(name, values, pad, rows)",
            "put(name, values, pad_value=pad, rows=rows)",
        )?;
        self.put_inner(
            &field_name(name)?,
            values,
            pad_value.as_ref(),
            rows.as_ref(),
        )
    }

    /// A writable numpy view of the first ``rows`` rows of field ``name`` in this step's slot,
    /// for planning code to write in place (zero copies); those rows are sent at commit, holding
    /// whatever they hold then (a new view shows what the slot's last step left there). The view
    /// turns read-only when the step ends or its fields go to the device (``field``); arrays
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
    ///     >>> step.view("ids", rows=3)[:] = [1, 2, 3]
    #[pyo3(
        signature = (name, *legacy, rows=None),
        text_signature = "(self, name, *, rows=None)"
    )]
    fn view<'py>(
        slf: &Bound<'py, Self>,
        name: &Bound<'py, PyAny>,
        legacy: &Bound<'py, pyo3::types::PyTuple>,
        mut rows: Option<Bound<'py, PyAny>>,
    ) -> PyResult<Bound<'py, PyAny>> {
        crate::python::args::legacy_positional(
            legacy,
            &["rows"],
            &mut [&mut rows],
            "Step.view(name, rows)",
            "view(name, rows=rows)",
        )?;
        let rows = rows.as_ref();
        let py = slf.py();
        let me = slf.get();
        let name = field_name(name)?;
        let name = name.as_str();
        let owner = me.owner.bind(py).clone();
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
    ///     DeviceArray: the slot's field (valid to read until the commit's event completed).
    ///
    /// Raises:
    ///     PinstageValueError: not zero-copy mode. CudaUnavailableError: no driver.
    ///     UnknownFieldError, StepStateError.
    fn field(&self, py: Python<'_>, name: &Bound<'_, PyAny>) -> PyResult<DeviceArray> {
        let name = field_name(name)?;
        let name = name.as_str();

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
            Ok(DeviceArray {
                ptr,
                dtype: f.dtype(),
                shape,
                device: Some(st.ordinal()),
                keep: Keep::Stager(Arc::clone(&self.inner), self.bound.clone()),
                sync: Order::None,
            })
        })
    }

    /// Deprecated: ``field(name)``.
    fn device(&self, py: Python<'_>, name: &Bound<'_, PyAny>) -> PyResult<DeviceArray> {
        crate::python::errors::deprecated(py, "Step.device(name)", "Step.field(name)")?;
        self.field(py, name)
    }

    /// Commits the step on its stream (see ``StepStager``) and ends it; views turn read-only.
    ///
    /// Returns:
    ///     DeviceArray or None: fresh mode: the block holding this step (import it once); else
    ///     None.
    ///
    /// Raises:
    ///     StepStateError: committed twice, aborted, or another thread. StreamCaptureError: the
    ///         stream is capturing. CudaDriverError. The slot is released in every case.
    fn commit(&self, py: Python<'_>) -> PyResult<Option<Py<DeviceArray>>> {
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
    fn block(&self, py: Python<'_>) -> PyResult<Option<Py<DeviceArray>>> {
        Ok(self.state()?.block.as_ref().map(|b| b.clone_ref(py)))
    }

    /// Whether the step was committed.
    #[getter]
    fn committed(&self) -> PyResult<bool> {
        Ok(self.state()?.ended == Ended::Committed)
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
            (None, Ended::Committed) => "committed",
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
            self.inner.abort_raw_on(raw, Some(self.stream));
            self.ended();
        }
        // Views handed out turn read-only here too: their slot is released.
        if !g.views.is_empty() {
            Python::attach(|py| Self::end(&mut g, py));
        }
    }
}
