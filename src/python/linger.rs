//! What must outlive a dropped handle: the source (and destination) of a copy still in flight.
//! A dropped `PendingCopy`, or a `to_device` whose pinned source is still being read, leaves
//! them here instead of blocking; every later pinstage call that starts a copy (and
//! `empty_cache`) drops those whose copies completed, with the GIL held.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use parking_lot::Mutex;
use pyo3::prelude::*;

use super::import::Imported;
use crate::blocks::Ticket;
use crate::cuda::Event;
use crate::h2d::FreshMem;

/// What says the copy completed.
pub(crate) enum Until {
    Event(Arc<Event>),
    /// A block move issued in the background: its thread has not issued it yet, or has.
    Move(Arc<Ticket>),
    Fresh(Arc<FreshMem>),
    /// Nothing to wait for: only the GIL was missing when it was let go.
    Now,
}

impl Until {
    fn done(&self) -> bool {
        // A failed copy (an error) no longer reads or writes anything.
        match self {
            Until::Event(e) => e.query().unwrap_or(true),
            Until::Move(t) => t.query().unwrap_or(true),
            Until::Fresh(m) => m.ready().query().unwrap_or(true),
            Until::Now => true,
        }
    }
}

/// Objects kept alive until `until` completed.
pub(crate) struct Lingering {
    pub(crate) until: Until,
    #[allow(dead_code, reason = "held for ownership: the copy writes it")]
    pub(crate) array: Option<Py<PyAny>>,
    #[allow(dead_code, reason = "held for ownership: the copy reads it")]
    pub(crate) src: Option<Imported>,
}

static LINGERING: Mutex<Vec<Lingering>> = Mutex::new(Vec::new());
/// Whether anything may linger: `reap` runs on every copy, and nearly always finds nothing.
static ANY: AtomicBool = AtomicBool::new(false);

/// Keeps `l`'s objects alive until its copy completed (at once dropped if it has).
pub(crate) fn linger(l: Lingering) {
    if !l.until.done() {
        LINGERING.lock().push(l);
        // Relaxed: a reap that misses this store finds the entry on a later call.
        ANY.store(true, Ordering::Relaxed);
        return;
    }
    drop(l);
}

/// Drops `imp` now if this thread holds the GIL (its producer's deleter may need it), else at
/// the next pinstage call that reaps.
pub(crate) fn drop_with_gil(imp: Imported) {
    unsafe extern "C" {
        // CPython 3.4+ exports it (outside the limited API's headers, which pyo3's abi3 bindings
        // follow); every interpreter this abi3 wheel loads into has it.
        fn PyGILState_Check() -> std::ffi::c_int;
    }
    // SAFETY: both may be called from any thread, with or without the GIL. PyGILState_Check
    // answers 1 on any thread once the interpreter is finalized (3.9-3.12): asked second.
    if unsafe { pyo3::ffi::Py_IsInitialized() } != 0 && unsafe { PyGILState_Check() } == 1 {
        drop(imp);
        return;
    }
    // Its last holder went without the GIL (a consumer's DLPack deleter on a thread of its
    // own): the next reap drops it.
    LINGERING.lock().push(Lingering {
        until: Until::Now,
        array: None,
        src: Some(imp),
    });
    // Relaxed: see `linger`.
    ANY.store(true, Ordering::Relaxed);
}

/// Drops what lingers for copies that completed. Needs the GIL (sources' deleters may).
pub(crate) fn reap(_py: Python<'_>) {
    // Relaxed: see `linger`.
    if !ANY.load(Ordering::Relaxed) {
        return;
    }
    let done: Vec<Lingering> = {
        let mut l = LINGERING.lock();
        let (done, keep): (Vec<Lingering>, Vec<Lingering>) = std::mem::take(&mut *l)
            .into_iter()
            .partition(|x| x.until.done());
        ANY.store(!keep.is_empty(), Ordering::Relaxed);
        *l = keep;
        done
    };
    // Outside the lock: a deleter may start another pinstage call.
    drop(done);
}
