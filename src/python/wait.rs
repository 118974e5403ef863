//! Waiting for an event with the GIL released, answering Ctrl-C.

use std::time::{Duration, Instant};

use pyo3::prelude::*;

use crate::cuda::Event;

/// How long a wait runs without the GIL before it takes it back to let Python handle signals.
const SIGNAL_CHECK: Duration = Duration::from_millis(20);
/// The longest nap between two queries of the event.
const MAX_NAP: Duration = Duration::from_micros(100);

/// Waits until `ev` completed (`Ok(true)`) or `deadline` passed (`Ok(false)`), with the GIL
/// released; every [`SIGNAL_CHECK`] it runs Python's signal handlers, so Ctrl-C raises
/// `KeyboardInterrupt` here within about 20 ms while the copy keeps running, still guarded by
/// whoever owns it.
pub(crate) fn wait_interruptibly(
    py: Python<'_>,
    ev: &Event,
    deadline: Option<Instant>,
) -> PyResult<bool> {
    loop {
        let until = Instant::now() + SIGNAL_CHECK;
        let until = deadline.map_or(until, |d| d.min(until));
        let done = py.detach(|| -> crate::Result<bool> {
            let mut nap = Duration::from_micros(2);
            loop {
                if ev.query()? {
                    return Ok(true);
                }
                if Instant::now() >= until {
                    return Ok(false);
                }
                if nap < Duration::from_micros(20) {
                    std::thread::yield_now();
                } else {
                    std::thread::sleep(nap);
                }
                nap = (nap * 2).min(MAX_NAP);
            }
        })?;
        if done {
            return Ok(true);
        }
        py.check_signals()?;
        if deadline.is_some_and(|d| Instant::now() >= d) {
            return Ok(false);
        }
    }
}
