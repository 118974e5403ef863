//! The state of open steps: a step's slot and how it ended, the steps open on each thread
//! (aborted when the thread exits), and the puts and the commit of an open step.

use crate::Error;
use crate::cuda::Event;
use crate::cuda::StreamHandle;
use crate::python::args::count_arg;
use crate::python::export::DeviceArray;
use crate::python::values::scalar_bytes;
use crate::python::values::to_values;
use crate::python::wait::slot_wait;
use crate::python::wait::take_interrupt;
use crate::step::RawStep;
use crate::step::StepStager;
use parking_lot::Mutex;
use pyo3::prelude::*;
use std::sync::Arc;

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
    pub(super) block: Option<Py<DeviceArray>>,
    /// How the step ended (meaningful once `raw` is gone).
    pub(super) ended: Ended,
}

/// How a step ended.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum Ended {
    /// Aborted, dropped, or still open.
    Aborted,
    Committed,
    /// The commit was tried and failed (the slot was released all the same).
    Failed,
    /// Aborted when the thread that opened it exited with it open.
    ThreadExited,
}

impl Ended {
    /// What a call of a step aborted at its thread's exit is told.
    pub(super) const THREAD_EXITED: &'static str =
        "this step was aborted when the thread that opened it exited with it open";
}

/// A step open on this thread, as [`OPEN_HERE`] keeps it: weak references only (an open step's
/// `Step` keeps its stager alive; an entry must not).
pub(super) struct OpenedHere {
    state: std::sync::Weak<Mutex<StepState>>,
    stager: std::sync::Weak<StepStager>,
    counts: std::sync::Weak<OpenSteps>,
}

/// The steps open on one thread, aborted when the thread exits. Only the thread that opened a
/// step may end it; one its thread left open (kept alive by a stored traceback, say) would
/// otherwise hold its slot for good, and every other thread's `step()` / `stage()` would wait
/// for it forever.
pub(super) struct OpenHere(std::cell::RefCell<Vec<OpenedHere>>);

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
                    count_open_in(&counts, me, false);
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
    counts: &Arc<OpenSteps>,
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
pub(super) fn ended_here(state: &Arc<Mutex<StepState>>) {
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
    pub(super) fn ended_why(&self) -> &'static str {
        match self.ended {
            Ended::Committed => {
                "this step was already committed; open the next with step() or stage()"
            }
            Ended::Failed => "this step's commit failed (its slot was released); open a new step",
            Ended::Aborted => "this step was aborted; open a new step",
            Ended::ThreadExited => Ended::THREAD_EXITED,
        }
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

/// Opens a step: claims a slot without spinning while holding the GIL, then learns that the
/// slot's last copy completed (polling briefly, then waiting with the GIL released).
pub(super) fn claim(py: Python<'_>, st: &StepStager, open: &OpenSteps) -> PyResult<RawStep> {
    let claim = loop {
        if let Some(c) = st.try_claim() {
            break c;
        }
        // Every slot is in an open step. This thread's own would never end while it waits.
        if open_here(open) >= st.depth() {
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
fn open_here(open: &OpenSteps) -> usize {
    let me = std::thread::current().id();
    open.lock()
        .iter()
        .find(|(t, _)| *t == me)
        .map_or(0, |e| e.1)
}
