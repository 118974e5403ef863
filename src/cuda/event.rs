//! Events: one type, recycled through its device.

use std::time::{Duration, Instant};

use crate::driver::{self, CUevent};
use crate::error::Result;

use super::wait::{Backoff, wait_until};
use super::{Current, Device, StreamHandle};

/// A CUDA event with timing disabled. Events are recycled: a dropped event goes back to its
/// [`Device`]'s spare list, and is destroyed with the device's last clone.
pub struct Event {
    device: Device,
    raw: CUevent,
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
        })
    }

    /// Records the event after the work queued on `stream` (context current: `_cur`).
    #[inline]
    pub(crate) fn record_in(&self, _cur: &Current<'_>, stream: StreamHandle) -> Result<()> {
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
        Ok(unsafe { driver::event::event_query(self.raw) }?)
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
        // One capture-mode swap for the whole wait, not one per query.
        driver::relaxed(|| wait_until(backoff, until, || self.query()))
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
        let cur = self.device.enter()?;
        self.wait_on_in(&cur, stream)
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
        self.device
            .inner
            .spare_events
            .lock()
            .push(self.raw as usize);
    }
}

/// A CUDA event with timing enabled, for GPU time between two records ([`TimedEvent::since`]);
/// not recycled (few are made: the block mover's first moves of each kind).
pub(crate) struct TimedEvent {
    /// Keeps the event's context alive until the event is destroyed.
    _device: Device,
    raw: CUevent,
}

// SAFETY: CUevent handles may be used from any thread.
unsafe impl Send for TimedEvent {}
// SAFETY: record/query/elapsed are thread-safe in the driver.
unsafe impl Sync for TimedEvent {}

impl TimedEvent {
    /// A new timing event of the current device.
    pub(crate) fn new_in(cur: &Current<'_>) -> Result<Self> {
        // SAFETY: the device's context is current (`cur`).
        let raw = unsafe { driver::event::event_create_timed() }?;
        Ok(Self {
            _device: cur.device().clone(),
            raw,
        })
    }

    /// Records the event after the work queued on `stream` (context current: `_cur`).
    pub(crate) fn record_in(&self, _cur: &Current<'_>, stream: StreamHandle) -> Result<()> {
        // SAFETY: our live event; the stream is live (the caller's) in the current context.
        unsafe { driver::event::event_record(self.raw, stream.raw()) }?;
        Ok(())
    }

    /// The GPU time from `start`'s record to this one's; `None` while either is pending.
    pub(crate) fn since(&self, _cur: &Current<'_>, start: &TimedEvent) -> Result<Option<Duration>> {
        // SAFETY: two live timing events of the current context (`_cur`), both recorded (the
        // caller records before asking).
        let ms = unsafe { driver::event::event_elapsed(start.raw, self.raw) }?;
        Ok(ms.map(|ms| Duration::from_secs_f64(f64::from(ms.max(0.0)) / 1e3)))
    }
}

impl Drop for TimedEvent {
    fn drop(&mut self) {
        // In its context, as the device destroys its spare events; a refusal leaks one event.
        let _cur = self._device.enter();
        // SAFETY: our event, destroyed once (its context kept by `_device`).
        let _ = unsafe { driver::event::event_destroy(self.raw) };
    }
}
