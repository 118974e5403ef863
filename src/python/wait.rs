//! Waiting for an event with the GIL released, answering Ctrl-C.

use std::time::{Duration, Instant};

use pyo3::prelude::*;

use super::errors::{type_err, type_name, value_err};
use crate::cuda::Event;
use crate::cuda::wait::Backoff;

/// How long a wait runs without the GIL before it takes it back to let Python handle signals.
const SIGNAL_CHECK: Duration = Duration::from_millis(20);

/// Waits until `ev` completed (`Ok(true)`) or `deadline` passed (`Ok(false)`): [`wait_for`] on
/// the event.
pub(crate) fn wait_interruptibly(
    py: Python<'_>,
    ev: &Event,
    deadline: Option<Instant>,
    expected: Duration,
) -> PyResult<bool> {
    // The lab variant `sync_wait` (a control): the driver's own wait (no Ctrl-C, no timeout).
    if cfg!(pinstage_lab_variant = "sync_wait") && deadline.is_none() {
        return py
            .detach(|| ev.synchronize())
            .map(|()| true)
            .map_err(Into::into);
    }
    wait_for(py, deadline, expected, || ev.query())
}

/// Waits until `done()` says so (`Ok(true)`) or `deadline` passed (`Ok(false)`), with the GIL
/// released, on the schedule of [`Backoff`] for work expected to take `expected`; every
/// [`SIGNAL_CHECK`] it runs Python's signal handlers, so Ctrl-C raises `KeyboardInterrupt` here
/// within about 20 ms while the work keeps running, still guarded by whoever owns it.
pub(crate) fn wait_for(
    py: Python<'_>,
    deadline: Option<Instant>,
    expected: Duration,
    done: impl Fn() -> crate::Result<bool> + Sync,
) -> PyResult<bool> {
    // Done already (or failed): no need to give the GIL away.
    if done()? {
        return Ok(true);
    }
    let backoff = Backoff::new(expected);
    loop {
        let until = Instant::now() + SIGNAL_CHECK;
        let until = deadline.map_or(until, |d| d.min(until));
        if py.detach(|| {
            // One capture-mode swap per turn, not one per query.
            crate::driver::relaxed(|| crate::cuda::wait::wait_until(&backoff, Some(until), &done))
        })? {
            return Ok(true);
        }
        py.check_signals()?;
        if deadline.is_some_and(|d| Instant::now() >= d) {
            return Ok(false);
        }
    }
}

/// A `timeout=` argument: None or a finite number of seconds >= 0; the seconds and the
/// deadline they give.
///
/// # Errors
/// `PinstageTypeError` for a bool or a non-number, `PinstageValueError` for a negative, NaN or
/// infinite value (or one past about 10^11 s).
pub(crate) fn parse_timeout(
    timeout: Option<&Bound<'_, PyAny>>,
) -> PyResult<(Option<f64>, Option<Instant>)> {
    let secs = match timeout.filter(|t| !t.is_none()) {
        None => return Ok((None, None)),
        Some(t) if t.is_instance_of::<pyo3::types::PyBool>() => {
            return Err(type_err(
                "timeout must be None or a number of seconds; got a bool",
            ));
        }
        Some(t) => t.extract::<f64>().map_err(|_| {
            type_err(format!(
                "timeout must be None or a number of seconds; got {}",
                type_name(t)
            ))
        })?,
    };
    let deadline = Duration::try_from_secs_f64(secs)
        .ok()
        .and_then(|d| Instant::now().checked_add(d))
        .ok_or_else(|| {
            value_err(format!(
                "timeout must be None or a finite number of seconds >= 0; got {secs}"
            ))
        })?;
    Ok((Some(secs), Some(deadline)))
}

/// How long a claimer polls a busy slot's event with the GIL held before it releases the GIL.
/// A slot's small copy completes within microseconds; giving the GIL away for that (and queueing
/// to get it back behind other threads) costs more than the wait itself.
const SPIN_BEFORE_DETACH: Duration = Duration::from_micros(20);

/// The wait of a claimer whose slot's last copy still runs, holding the GIL (the step stager's;
/// the stager copies without it: [`slot_wait_detached`]): polls the event briefly with the GIL
/// held, then waits with it released, answering Ctrl-C.
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

/// [`slot_wait`] for a caller that released the GIL: waits without it on the schedule of every
/// pinstage wait, taking it back only to run Python's signal handlers every [`SIGNAL_CHECK`]
/// (a `KeyboardInterrupt` is kept in `interrupt`, as [`slot_wait`] keeps it).
pub(crate) fn slot_wait_detached(ev: &Event, interrupt: &mut Option<PyErr>) -> crate::Result<()> {
    let backoff = Backoff::new(Duration::ZERO);
    loop {
        if ev.wait_until(&backoff, Some(Instant::now() + SIGNAL_CHECK))? {
            return Ok(());
        }
        if let Err(e) = Python::attach(|py| py.check_signals()) {
            *interrupt = Some(e);
            return Err(crate::Error::Interrupted);
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
