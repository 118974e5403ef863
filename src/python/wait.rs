//! Waiting for an event with the GIL released, answering Ctrl-C.

use std::time::{Duration, Instant};

use pyo3::prelude::*;

use crate::cuda::Event;
use crate::cuda::wait::Backoff;

/// How long a wait runs without the GIL before it takes it back to let Python handle signals.
const SIGNAL_CHECK: Duration = Duration::from_millis(20);

/// Waits until `ev` completed (`Ok(true)`) or `deadline` passed (`Ok(false)`), with the GIL
/// released, on the schedule of [`Backoff`] for work expected to take `expected`; every
/// [`SIGNAL_CHECK`] it runs Python's signal handlers, so Ctrl-C raises `KeyboardInterrupt` here
/// within about 20 ms while the copy keeps running, still guarded by whoever owns it.
pub(crate) fn wait_interruptibly(
    py: Python<'_>,
    ev: &Event,
    deadline: Option<Instant>,
    expected: Duration,
) -> PyResult<bool> {
    // Done already (or failed): no need to give the GIL away.
    if ev.query()? {
        return Ok(true);
    }
    let backoff = Backoff::new(expected);
    loop {
        let until = Instant::now() + SIGNAL_CHECK;
        let until = deadline.map_or(until, |d| d.min(until));
        if py.detach(|| ev.wait_until(&backoff, Some(until)))? {
            return Ok(true);
        }
        py.check_signals()?;
        if deadline.is_some_and(|d| Instant::now() >= d) {
            return Ok(false);
        }
    }
}

/// How long a claimer polls a busy slot's event with the GIL held before it releases the GIL.
/// A slot's small copy completes within microseconds; giving the GIL away for that (and queueing
/// to get it back behind other threads) costs more than the wait itself.
const SPIN_BEFORE_DETACH: Duration = Duration::from_micros(20);

/// The wait of a claimer whose slot's last copy still runs (the stager's and the step stager's):
/// polls the event briefly with the GIL held, then waits with it released, answering Ctrl-C.
/// A Python exception raised meanwhile (KeyboardInterrupt) is kept in `interrupt` and reported
/// to the core as [`crate::Error::Interrupted`]; [`take_interrupt`] turns it back.
pub(crate) fn slot_wait(
    py: Python<'_>,
    ev: &Event,
    interrupt: &mut Option<PyErr>,
) -> crate::Result<()> {
    let spin = Backoff::new(Duration::ZERO);
    if ev.wait_until(&spin, Some(Instant::now() + SPIN_BEFORE_DETACH))? {
        return Ok(());
    }
    match wait_interruptibly(py, ev, None, Duration::ZERO) {
        Ok(_) => Ok(()),
        Err(e) => {
            *interrupt = Some(e);
            Err(crate::Error::Interrupted)
        }
    }
}

/// The Python exception behind an [`crate::Error::Interrupted`] from [`slot_wait`], else the
/// core error as it is.
pub(crate) fn take_interrupt(e: crate::Error, interrupt: Option<PyErr>) -> PyErr {
    match (e, interrupt) {
        (crate::Error::Interrupted, Some(py_err)) => py_err,
        (e, _) => e.into(),
    }
}
