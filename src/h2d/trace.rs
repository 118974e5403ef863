//! A trace of the pageable H2D path's pieces, for the laboratory (feature `lab`,
//! `lab/probes/probe_h2d_trace.py`): per piece, when its last unit was filled and when its copy
//! was issued, from the call's start.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use parking_lot::Mutex;

static ON: AtomicBool = AtomicBool::new(false);
/// (piece, bytes, filled µs, issued µs); a piece of `usize::MAX` marks the call's return.
static LOG: Mutex<Vec<(usize, usize, f64, f64)>> = Mutex::new(Vec::new());

/// Starts (clearing the log) or stops tracing.
#[cfg(feature = "python")]
pub(crate) fn set(on: bool) {
    LOG.lock().clear();
    ON.store(on, Ordering::Relaxed);
}

/// Records piece `p` (`usize::MAX`: the call returned) while tracing is on.
pub(crate) fn piece(t0: Instant, p: usize, bytes: usize, filled: Instant) {
    if ON.load(Ordering::Relaxed) {
        let us = |t: Instant| t.duration_since(t0).as_secs_f64() * 1e6;
        LOG.lock().push((p, bytes, us(filled), us(Instant::now())));
    }
}

#[cfg(feature = "python")]
pub(crate) fn take() -> Vec<(usize, usize, f64, f64)> {
    std::mem::take(&mut *LOG.lock())
}
