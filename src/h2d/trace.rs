//! A trace of the pageable H2D path's pieces, for the laboratory (feature `lab`,
//! `lab/probes/probe_h2d_trace.py`): per piece, when its last unit was filled, when its copy
//! was issued and when the copy engine finished it, from the call's start.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use parking_lot::Mutex;

use crate::cuda::{Current, Device, StreamHandle, TimedEvent};

static ON: AtomicBool = AtomicBool::new(false);
/// (piece, bytes, filled µs, issued µs); a piece of `usize::MAX` marks the call's return.
static LOG: Mutex<Vec<(usize, usize, f64, f64)>> = Mutex::new(Vec::new());
/// The GPU side: an event recorded on the copy's stream at the call's start (and when, in µs
/// from the start), then one per piece recorded right after its copy was issued.
#[allow(clippy::type_complexity)]
static GPU: Mutex<Option<(Device, TimedEvent, f64, Vec<(usize, TimedEvent)>)>> = Mutex::new(None);

/// Starts (clearing the log) or stops tracing.
#[cfg(feature = "python")]
pub(crate) fn set(on: bool) {
    LOG.lock().clear();
    *GPU.lock() = None;
    ON.store(on, Ordering::Relaxed);
}

/// Records piece `p` (`usize::MAX`: the call returned) while tracing is on.
pub(crate) fn piece(t0: Instant, p: usize, bytes: usize, filled: Instant) {
    if ON.load(Ordering::Relaxed) {
        let us = |t: Instant| t.duration_since(t0).as_secs_f64() * 1e6;
        LOG.lock().push((p, bytes, us(filled), us(Instant::now())));
    }
}

/// While tracing: records the GPU origin of a call that started at `t0` on `stream` (on an
/// idle stream, as the probe leaves it, the event's GPU time is the record's on the host).
pub(crate) fn origin(cur: &Current<'_>, stream: StreamHandle, t0: Instant) {
    if ON.load(Ordering::Relaxed)
        && let Ok(ev) = TimedEvent::new_in(cur)
        && ev.record_in(cur, stream).is_ok()
    {
        let at = t0.elapsed().as_secs_f64() * 1e6;
        *GPU.lock() = Some((cur.device().clone(), ev, at, Vec::new()));
    }
}

/// While tracing: records piece `p`'s landing after its copy on `stream` (an event recorded
/// just after the issue: it may also cover a piece another thread issued in between).
pub(crate) fn landed(cur: &Current<'_>, stream: StreamHandle, p: usize) {
    if ON.load(Ordering::Relaxed)
        && let Ok(ev) = TimedEvent::new_in(cur)
        && ev.record_in(cur, stream).is_ok()
        && let Some((_, _, _, all)) = GPU.lock().as_mut()
    {
        all.push((p, ev));
    }
}

#[cfg(feature = "python")]
pub(crate) fn take() -> Vec<(usize, usize, f64, f64)> {
    std::mem::take(&mut *LOG.lock())
}

/// (piece, µs from the call's start until the copy engine finished it) of the last traced
/// call, once the stream was synchronized (pieces still running are left out).
#[cfg(feature = "python")]
pub(crate) fn take_landed() -> Vec<(usize, f64)> {
    let Some((device, origin, at, all)) = GPU.lock().take() else {
        return Vec::new();
    };
    let Ok(cur) = device.enter() else {
        return Vec::new();
    };
    all.iter()
        .filter_map(|(p, ev)| {
            let d = ev.since(&cur, &origin).ok()??;
            Some((*p, at + d.as_secs_f64() * 1e6))
        })
        .collect()
}
