//! Device-to-host copies: one DMA into pinned memory (waited for on a landing word or an
//! event), or the bounce ring into pageable memory.

use super::bounce;
use super::issue::issue_d2h;
use super::landing;
use crate::cuda::{Device, Event, StreamHandle};
use crate::dlpack::{DeviceView, MemoryKind};
use crate::driver;
use crate::error::{Error, Result};
use crate::host::{CopyPath, HostRegion, PendingCopy};

fn check_src(device: Option<&Device>, src: &DeviceView<'_>, dst_len: usize) -> Result<()> {
    if let (MemoryKind::Cuda(id), Some(device)) = (src.memory(), device)
        && id != device.ordinal()
    {
        return Err(Error::WrongDevice {
            what: "copy",
            expected: device.ordinal(),
            got: id,
        });
    }
    if dst_len < src.nbytes() {
        return Err(Error::DestinationTooSmall {
            needed: src.nbytes(),
            got: dst_len,
        });
    }
    Ok(())
}

/// Copies `src` into `dst[..src.nbytes()]` and waits. `dst` may be pinned (one DMA) or pageable
/// (bounce ring); a host `src` is a plain memcpy. `stream` orders the copy after the producer's
/// work.
///
/// # Errors
/// [`Error::DestinationTooSmall`], [`Error::CudaUnavailable`] (a device `src` without a driver),
/// [`Error::NoSuchDevice`], [`Error::StreamCapturing`], [`Error::Driver`].
pub fn copy_d2h(src: &DeviceView<'_>, dst: &mut [u8], stream: StreamHandle) -> Result<CopyPath> {
    let device = Device::of_view(src)?;
    // SAFETY: `dst` is exclusively borrowed until we return, and the copy is waited for first
    // (the completion waits when dropped, too).
    let (path, done) = unsafe {
        start_d2h(
            device.as_ref(),
            src,
            dst.as_mut_ptr(),
            dst.len(),
            stream,
            true,
            None,
        )
    }?;
    done.wait()?;
    Ok(path)
}

/// Starts copying `src` into `dst` and returns at once: a pinned `dst` gets a truly
/// asynchronous DMA; a pageable one is filled through the bounce ring before this returns (still
/// correct, not overlapped). The [`PendingCopy`] hands `dst` back once the copy completed.
///
/// # Errors
/// As [`copy_d2h`].
pub fn copy_d2h_async<B: HostRegion>(
    src: &DeviceView<'_>,
    mut dst: B,
    stream: StreamHandle,
) -> Result<PendingCopy<B>> {
    let device = Device::of_view(src)?;
    let (ptr, len) = dst.region();
    // SAFETY: the region is owned by `dst`, which the PendingCopy keeps until the copy completed
    // (also when dropped: the reaper holds it); HostRegion guarantees the address is stable.
    let (path, done) = unsafe { start_d2h(device.as_ref(), src, ptr, len, stream, false, None) }?;
    Ok(PendingCopy::new(
        dst,
        done.into_event()?,
        path,
        src.nbytes(),
    ))
}

/// How a started copy completes.
pub(crate) enum Completion<'s> {
    /// It has.
    Done,
    /// When the event completed; the copy should take about the duration.
    Event(Event, std::time::Duration),
    /// When its landing word was written (the caller waits at once; waits when dropped).
    Landing(landing::Waiter<'s>),
}

impl Completion<'_> {
    /// Waits for the copy.
    ///
    /// # Errors
    /// [`Error::Driver`]: the copy or its stream failed.
    pub(crate) fn wait(&self) -> Result<()> {
        match self {
            Completion::Done => Ok(()),
            Completion::Event(ev, expected) => ev.wait_expecting(*expected),
            Completion::Landing(w) => w.wait(),
        }
    }

    /// Whether the copy completed within `within` of spinning (landing words only: no driver
    /// call; an event is asked once). `false` also when asking failed: [`Completion::wait`]
    /// then waits, or reports the failure.
    #[cfg(feature = "python")]
    pub(crate) fn spin(&self, within: std::time::Duration) -> bool {
        match self {
            Completion::Done => true,
            Completion::Event(ev, _) => ev.query().unwrap_or(false),
            Completion::Landing(w) => w.spin(within),
        }
    }

    /// The event to wait on, for a caller who keeps the copy in flight: `None` once complete.
    /// A landing word is waited for here (only callers who wait at once get one).
    ///
    /// # Errors
    /// [`Error::Driver`]: waiting failed.
    pub(crate) fn into_event(self) -> Result<Option<Event>> {
        match self {
            Completion::Done => Ok(None),
            Completion::Event(ev, _) => Ok(Some(ev)),
            Completion::Landing(w) => w.wait().map(|()| None),
        }
    }
}

/// Starts copying `src` into `dst_ptr..dst_ptr+len`. A pinned destination gets one truly
/// asynchronous DMA; a pageable one is filled through the bounce ring before this returns
/// ([`Completion::Done`]), as is a host source. With `wait` (the caller waits at once), a pinned
/// copy is followed by a landing word where the device has one free ([`Completion::Landing`]),
/// else by an event. `pinned`: whether the destination is known to be pinned (`None`: the driver
/// is asked).
///
/// # Safety
/// 1. `dst_ptr..dst_ptr+len` is writable host memory that nothing else touches, and that stays
///    valid, until the returned completion completed (a dropped [`Completion::Landing`] waits).
/// 2. `pinned`, when given, is true of the destination.
pub(crate) unsafe fn start_d2h<'s>(
    device: Option<&Device>,
    src: &DeviceView<'_>,
    dst_ptr: *mut u8,
    len: usize,
    stream: StreamHandle<'s>,
    wait: bool,
    pinned: Option<bool>,
) -> Result<(CopyPath, Completion<'s>)> {
    let _range = crate::nvtx::NvtxRange::new(c"pinstage.copy_d2h");
    check_src(device, src, len)?;
    let n = src.nbytes();
    if n == 0 {
        return Ok((CopyPath::Empty, Completion::Done));
    }
    if src.memory() == MemoryKind::Host {
        // SAFETY: the view's contract: `src` is readable host memory of n bytes; the caller's
        // destination holds `len >= n` bytes (memmove tolerates overlap).
        unsafe { std::ptr::copy(src.ptr() as *const u8, dst_ptr, n) };
        return Ok((CopyPath::Host, Completion::Done));
    }
    let device = device.ok_or_else(|| Error::unavailable("no device was given"))?;
    let cur = stream.enter_for_copy(device)?;
    // A wait looks flat out for about this long before it sleeps between looks.
    let expected = crate::cuda::wait::copy_time(n);
    if pinned.unwrap_or_else(|| driver::mem::is_pinned_range(dst_ptr.cast(), n)) {
        if wait
            && LANDING.load(std::sync::atomic::Ordering::Relaxed)
            && let Some(claim) = landing::landing(device).and_then(|l| l.claim())
        {
            // SAFETY: the destination is pinned and reserved for this copy until it completed
            // (caller); src is device memory of this device of n bytes (view contract, device
            // checked).
            unsafe { driver::mem::memcpy_dtoh_async(dst_ptr.cast(), src.ptr(), n, stream.raw()) }?;
            let tracked = claim.signal(&cur, stream).and_then(|landed| {
                if landed {
                    return Ok(Completion::Landing(landing::Waiter::new(
                        claim, device, stream, expected,
                    )));
                }
                // Refused (once per device): an event recorded now follows the copy.
                landing::count(1);
                let ev = Event::new_in(&cur)?;
                ev.record_in(&cur, stream)
                    .map(|()| Completion::Event(ev, expected))
            });
            return stream
                .drained_on_err(&cur, tracked)
                .map(|done| (CopyPath::Pinned, done));
        }
        if wait {
            landing::count(1);
        }
        let ev = Event::new_in(&cur)?;
        // SAFETY: the destination is pinned and reserved for this copy until the event
        // completed (caller); src is device memory of this device of n bytes (view contract,
        // device checked).
        unsafe { issue_d2h(&cur, &ev, src.ptr(), dst_ptr, n, stream) }?;
        return Ok((CopyPath::Pinned, Completion::Event(ev, expected)));
    }
    // SAFETY: caller's contract: `len >= n` writable bytes, exclusively ours until return.
    let dst = unsafe { std::slice::from_raw_parts_mut(dst_ptr, n) };
    bounce::bounce(&cur, src.ptr(), dst, stream)?;
    Ok((CopyPath::Bounced, Completion::Done))
}

/// Waits that learned of their copy from a landing word, and waited-for pinned copies that
/// took an event instead (every word in use, or stream writes refused). For tests.
#[cfg(feature = "testing")]
#[doc(hidden)]
pub fn landing_counts() -> (u64, u64) {
    use std::sync::atomic::Ordering::Relaxed;
    (
        landing::COUNTS[0].load(Relaxed) + landing::COUNTS[2].load(Relaxed),
        landing::COUNTS[1].load(Relaxed),
    )
}

/// Of the waits [`landing_counts`] counts as landed, those that saw their word only after their
/// flat-out spin (the rest saw it while spinning, with no driver call). For tests.
#[cfg(feature = "testing")]
#[doc(hidden)]
pub fn landing_after_spin() -> u64 {
    landing::COUNTS[2].load(std::sync::atomic::Ordering::Relaxed)
}

/// Waits on a landing word that learned from their idle stream that the copy was done, their
/// word still not written (its write skipped or refused, or read at the wrong place). For tests.
#[cfg(feature = "testing")]
#[doc(hidden)]
pub fn landing_from_stream() -> u64 {
    landing::COUNTS[3].load(std::sync::atomic::Ordering::Relaxed)
}

/// How many of the device's 64 landing words are free (`None`: it has none yet). For tests.
#[cfg(feature = "testing")]
#[doc(hidden)]
pub fn landing_free_words(device: &Device) -> Option<u32> {
    landing::free_words(device)
}

/// Lets the device's waits use landing words again after an injected refusal
/// ([`crate::testing::fault`]). For tests.
#[cfg(feature = "testing")]
#[doc(hidden)]
pub fn landing_reset(device: &Device) {
    landing::reset(device);
}

/// Whether waiting callers use landing words (the laboratory compares; on by default).
static LANDING: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(true);

/// Turns landing words on or off for later copies; returns the previous setting (laboratory).
#[cfg(all(feature = "lab", feature = "python"))]
pub(crate) fn set_landing(on: bool) -> bool {
    LANDING.swap(on, std::sync::atomic::Ordering::Relaxed)
}
