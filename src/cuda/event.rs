//! Events: one type, recycled through its device.

use std::time::{Duration, Instant};

use crate::driver::{self, CUevent};
use crate::error::Result;

use super::wait::{Backoff, wait_until};
use super::{Current, Device, StreamHandle};

/// A CUDA event with timing disabled. Events are recycled: a dropped event whose work completed
/// goes back to its [`Device`]'s spare list (destroyed with the device's last clone); one still
/// pending is destroyed.
pub struct Event {
    device: Device,
    raw: CUevent,
    /// A query saw the last record complete (no record since): dropped, recycled unasked.
    seen_done: std::sync::atomic::AtomicBool,
}

// SAFETY: CUevent handles may be used from any thread.
unsafe impl Send for Event {}
// SAFETY: record/query/synchronize are thread-safe in the driver.
unsafe impl Sync for Event {}

impl std::fmt::Debug for Event {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Event(0x{:x} on {:?})", self.raw as usize, self.device)
    }
}

impl Event {
    /// An event of `device`, recycled from the events of dropped [`Event`]s when there are any.
    ///
    /// # Errors
    /// [`Error::Driver`](crate::Error::Driver) if a new event cannot be created.
    pub fn new(device: &Device) -> Result<Self> {
        let cur = device.enter()?;
        Self::new_in(&cur)
    }

    /// An event of the current device: a spare one, or a new one.
    pub(crate) fn new_in(cur: &Current<'_>) -> Result<Self> {
        let device = cur.device();
        let recycled = device.inner.spare_events.lock().pop();
        let raw = match recycled {
            Some(raw) => raw as CUevent,
            // SAFETY: the device's context is current (`cur`).
            None => unsafe { driver::event::event_create() }?,
        };
        Ok(Self {
            device: device.clone(),
            raw,
            seen_done: std::sync::atomic::AtomicBool::new(false),
        })
    }

    /// Records the event after the work queued on `stream` (context current: `_cur`).
    #[inline]
    pub(crate) fn record_in(&self, _cur: &Current<'_>, stream: StreamHandle) -> Result<()> {
        self.seen_done
            .store(false, std::sync::atomic::Ordering::Relaxed);
        // SAFETY: our live event; the stream is a special handle, ours, or vouched for by its
        // maker (`StreamHandle::from_raw`); the context is current.
        unsafe { driver::event::event_record(self.raw, stream.raw()) }?;
        Ok(())
    }

    /// Records the event after all work currently queued on `stream`.
    ///
    /// # Errors
    /// [`Error::Driver`](crate::Error::Driver) if the driver refuses the record (a stream of
    /// another device, for one).
    pub fn record(&self, stream: StreamHandle) -> Result<()> {
        let cur = self.device.enter()?;
        self.record_in(&cur, stream)
    }

    /// `true` once the work captured by the last record completed (or if never recorded).
    ///
    /// # Errors
    /// [`Error::Driver`](crate::Error::Driver) if that work failed.
    #[inline]
    pub fn query(&self) -> Result<bool> {
        // SAFETY: our live event. cuEventQuery needs no current context.
        let done = unsafe { driver::event::event_query(self.raw) }?;
        if done {
            self.seen_done
                .store(true, std::sync::atomic::Ordering::Relaxed);
        }
        Ok(done)
    }

    /// Blocks until the work captured by the last record completed, as
    /// [`Event::wait_expecting`] with no expected time (busy for the first millisecond).
    ///
    /// # Errors
    /// [`Error::Driver`](crate::Error::Driver) if that work failed.
    #[inline]
    pub fn synchronize(&self) -> Result<()> {
        self.wait_expecting(Duration::ZERO)
    }

    /// Blocks until the work captured by the last record completed, which should take about
    /// `expected`: the event is asked again and again (spinning, then yielding the core) for
    /// about that long, then between sleeps of at most a sixteenth of the time waited so far
    /// (at most 1 ms), so a long wait costs no core and oversleeps by a small fraction.
    ///
    /// # Errors
    /// [`Error::Driver`](crate::Error::Driver) if that work failed.
    pub fn wait_expecting(&self, expected: Duration) -> Result<()> {
        self.wait_until(&Backoff::new(expected), None).map(|_| ())
    }

    /// Waits as `backoff` says until the event completed (`Ok(true)`) or `until` passed
    /// (`Ok(false)`).
    pub(crate) fn wait_until(&self, backoff: &Backoff, until: Option<Instant>) -> Result<bool> {
        wait_until(backoff, until, || self.query())
    }

    /// As [`Event::wait_on`], with the context current already (`_cur`).
    pub(crate) fn wait_on_in(&self, _cur: &Current<'_>, stream: StreamHandle) -> Result<()> {
        // SAFETY: our live event; the stream as in `record_in`; context current.
        unsafe { driver::stream::stream_wait_event(stream.raw(), self.raw) }?;
        Ok(())
    }

    /// Makes later work on `stream` wait for this event on the device (no host wait).
    ///
    /// # Errors
    /// [`Error::Driver`](crate::Error::Driver) if the driver refuses it.
    pub fn wait_on(&self, stream: StreamHandle) -> Result<()> {
        let _cur = self.device.enter()?;
        // SAFETY: our live event; the stream as in `record_in`; context current.
        unsafe { driver::stream::stream_wait_event(stream.raw(), self.raw) }?;
        Ok(())
    }

    /// The device.
    pub fn device(&self) -> &Device {
        &self.device
    }
}

/// A busy slot's event as a wait function sees it ([`StagedCopy::wait_with`](crate::h2d::StagedCopy::wait_with)):
/// it can be asked and waited for, not recorded again. pinstage alone records a slot's events (a
/// record elsewhere would make the slot look free while its copy still reads it).
///
/// ```
/// fn wait(e: pinstage::cuda::SlotEvent<'_>) -> pinstage::Result<()> {
///     while !e.query()? {
///         std::thread::yield_now();
///     }
///     e.synchronize()
/// }
/// ```
///
/// ```compile_fail
/// fn wait(e: pinstage::cuda::SlotEvent<'_>) -> pinstage::Result<()> {
///     e.record(pinstage::StreamHandle::LEGACY) // no such method: not recorded again
/// }
/// ```
#[derive(Clone, Copy, Debug)]
pub struct SlotEvent<'a>(&'a Event);

impl<'a> SlotEvent<'a> {
    pub(crate) fn new(event: &'a Event) -> Self {
        Self(event)
    }

    /// The event itself (inside the crate only).
    #[cfg(feature = "python")]
    pub(crate) fn event(&self) -> &'a Event {
        self.0
    }

    /// `true` once the slot's last copy completed.
    ///
    /// # Errors
    /// [`Error::Driver`](crate::Error::Driver) if that work failed.
    #[inline]
    pub fn query(&self) -> Result<bool> {
        self.0.query()
    }

    /// Blocks until the slot's last copy completed.
    ///
    /// # Errors
    /// [`Error::Driver`](crate::Error::Driver) if that work failed.
    #[inline]
    pub fn synchronize(&self) -> Result<()> {
        self.0.synchronize()
    }

    /// The device.
    pub fn device(&self) -> &'a Device {
        self.0.device()
    }
}

impl Drop for Event {
    fn drop(&mut self) {
        // Only a completed event is recycled. One whose record may still be pending (a fork a
        // stream still waits on, a dropped copy's event) is destroyed, which the driver defers
        // until it completed: a new record of an event whose earlier record is still queued on
        // another stream can read as complete before its own work ran (run i: a move forked
        // from the legacy stream behind a stall, its event a recycled fork, "completed").
        if driver::forked() {
            return; // no driver in a forked child: the handle is let go
        }
        let done = *self.seen_done.get_mut()
            // SAFETY: our live event; cuEventQuery needs no current context.
            || matches!(unsafe { driver::event::event_query(self.raw) }, Ok(true));
        if done {
            self.device
                .inner
                .spare_events
                .lock()
                .push(self.raw as usize);
        } else if let Ok(_cur) = self.device.enter() {
            // SAFETY: our live event, never used again, its context current; the driver
            // releases it once complete.
            crate::error::on_drop(unsafe { driver::event::event_destroy(self.raw) });
        }
    }
}
