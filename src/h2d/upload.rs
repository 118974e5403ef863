//! Host-to-device copies of whole arrays at line rate: a pinned source goes as one DMA; a
//! pageable one through pinned bounce slots, several threads filling slots while the copy
//! engine drains others.

use std::sync::atomic::{AtomicBool, AtomicU8, AtomicU64, AtomicUsize, Ordering};

use crossbeam_utils::CachePadded;

use crate::cuda::wait::copy_time;
use crate::cuda::{Current, Device, Event, StreamHandle};
use crate::dlpack::{DeviceView, MemoryKind};
use crate::driver;
use crate::error::{Error, Result};
use crate::host::bounce;
use crate::host::{CopyPath, HostRegion, PendingCopy};

mod job;
pub(crate) mod meanwhile;

use job::{GiveUp, Leave, PENDING as PENDING_MARK, Upload, issue};

/// Starts copying `src` into `dst` (all of it: the sizes must be equal). A pinned source gets
/// one truly asynchronous DMA and the event that says when the source may change; a pageable
/// one is copied through pinned bounce slots and read completely before this returns (its event
/// says when the device copy completed); a host destination is a memcpy (`None`).
///
/// # Errors
/// [`Error::ReadOnly`], [`Error::DestinationTooSmall`] (sizes differ), [`Error::WrongDevice`],
/// [`Error::CudaUnavailable`], [`Error::StreamCapturing`], [`Error::Driver`].
///
/// # Safety
/// 1. `src..src+len` is readable host memory that nothing writes until this returned and, for
///    [`CopyPath::Pinned`], until the returned event completed.
pub unsafe fn start_h2d(
    device: Option<&Device>,
    dst: &DeviceView<'_>,
    src: *const u8,
    len: usize,
    stream: StreamHandle,
) -> Result<(CopyPath, Option<Event>)> {
    let _range = crate::nvtx::NvtxRange::new(c"pinstage.copy_h2d");
    if dst.is_read_only() {
        return Err(Error::ReadOnly);
    }
    if dst.nbytes() != len {
        return Err(Error::DestinationTooSmall {
            needed: len,
            got: dst.nbytes(),
        });
    }
    let device = match dst.memory() {
        MemoryKind::Host => {
            if len > 0 {
                // SAFETY: the view's contract: `dst` is writable host memory of `len` bytes;
                // the caller's source holds `len` readable bytes (memmove tolerates overlap).
                unsafe { std::ptr::copy(src, dst.ptr() as *mut u8, len) };
            }
            return Ok((CopyPath::Host, None));
        }
        MemoryKind::Cuda(id) => {
            let device = device.ok_or_else(|| Error::unavailable("no device was given"))?;
            if id != device.ordinal() {
                return Err(Error::WrongDevice {
                    what: "copy",
                    expected: device.ordinal(),
                    got: id,
                });
            }
            device
        }
    };
    if len == 0 {
        return Ok((CopyPath::Empty, None));
    }
    crate::stamps::stamp!("start_h2d");
    let cur = stream.enter_for_copy(device)?;
    crate::stamps::stamp!("entered");
    if driver::mem::is_pinned_range(src.cast(), len) {
        let ev = Event::new_in(&cur)?;
        // SAFETY: the source is pinned and unchanged until the event completed (caller); `dst`
        // is device memory of this device of `len` bytes (view contract, device checked).
        unsafe { issue(&cur, &ev, dst.ptr(), src, len, stream) }?;
        return Ok((CopyPath::Pinned, Some(ev)));
    }
    // SAFETY: caller's contract: `len` readable bytes, unchanged until we return.
    let src = unsafe { std::slice::from_raw_parts(src, len) };
    crate::stamps::stamp!("pageable");
    let done = upload_bounced(&cur, src, Dst::Known(dst.ptr()), stream)?;
    Ok((CopyPath::Bounced, done))
}

/// A pageable upload's destination: known, or made by the caller's thread while the copy
/// threads fill the first slots (the rest of the caller's part then runs inside `unlocked`).
enum Dst<'f> {
    Known(u64),
    // Made only by `to_device` (the Python layer) and the test scaffolding.
    #[cfg_attr(not(any(feature = "python", feature = "testing")), allow(dead_code))]
    Later {
        make: &'f mut dyn FnMut() -> Option<u64>,
        unlocked: &'f mut dyn FnMut(&mut (dyn FnMut() + Send)),
    },
}

/// The pageable path. Piece `i` of the source goes through bounce slot `i % slots` once piece
/// `i - slots`'s copy completed. The pieces are cut into units; several workers (pinstage's
/// copy threads and the caller) each claim the next unit in address order and fill it into its
/// piece's slot, and whoever fills a piece's last unit issues the piece's copy and records the
/// slot's event. The workers thus fill the pieces together, one after the other, so the copy
/// engine starts on the first piece while the others fill and the last copy follows the last
/// fill by one piece, not by a wave of pieces; a worker the OS deschedules holds up only its
/// unit's piece (and, once the ring comes round, that piece's slot) while the others fill on.
/// Returns once every unit was read from `src`; the last copies may still be in flight: the
/// returned event completes after all of them (the slots go back to the cache guarded by their
/// own events); `None` when a [`Dst::Later`] gave up (nothing was issued). On an error the
/// stream is drained first, so no copy still writes into `dst`.
fn upload_bounced(
    cur: &Current<'_>,
    src: &[u8],
    dst: Dst<'_>,
    stream: StreamHandle,
) -> Result<Option<Event>> {
    #[cfg(feature = "lab")]
    let t0 = std::time::Instant::now();
    #[cfg(feature = "lab")]
    super::trace::origin(cur, stream, t0);
    let tune = super::tuning::h2d_tuning();
    let pool = crate::host::workers::workers();
    let threads = pool.map_or(1, |p| p.current_num_threads() + 1);
    // The per-thread default stream is a different stream on every thread: the pieces must all
    // be issued from the caller's thread, where the returned event is recorded. (Issuing them on
    // the legacy default stream instead, which the per-thread one is ordered with, would let
    // every copy thread fill, but ties the copy to every blocking stream of the context and
    // fails while any of them captures a graph.) The seeded-bug harness, `scripts/gpu-run
    // broken-ptds`: workers issuing on their own per-thread streams must fail the GPU tests.
    let workers =
        if stream == StreamHandle::PER_THREAD && !cfg!(pinstage_seeded_bug = "ptds_workers") {
            1
        } else {
            tune.workers_for(src.len()).min(threads)
        };
    let (known, later) = match dst {
        Dst::Known(a) => (a, None),
        Dst::Later { make, unlocked } => (0, Some((make, unlocked))),
    };
    if src.len() < tune.driver_below {
        let Some(dst) = later.map_or(Some(known), |(f, _)| f()) else {
            return Ok(None);
        };
        let done = Event::new_in(cur)?;
        // SAFETY: `src` pageable: the driver stages it before returning; `dst` holds `len`
        // bytes of this device (checked by the caller).
        unsafe { issue(cur, &done, dst, src.as_ptr(), src.len(), stream) }?;
        return Ok(Some(done));
    }
    let pieces = tune.cut(src.len(), workers);
    let units = tune.units(&pieces);
    let nslots = tune.slots.min(pieces.len());
    crate::stamps::stamp!("cut");
    let done = Event::new_in(cur)?;
    crate::stamps::stamp!("event");
    let (lent, later) = match later {
        None => (bounce::Lent::take(cur, nslots, tune.max_piece)?, None),
        Some(l) => match bounce::Lent::take_cached(cur, nslots, tune.max_piece) {
            Some(lent) => (lent, Some(l)),
            // Slots to allocate (a first copy, or many at once): pinned allocation may wait
            // long, so the destination first and the whole copy unlocked, as without a maker.
            None => return made_first(cur, src, l, stream),
        },
    };
    crate::stamps::stamp!("slots");
    let slots = &lent.slots;
    let zeros = |n: usize| -> Vec<AtomicUsize> { (0..n).map(|_| AtomicUsize::new(0)).collect() };
    // The per-slot words are spun on: one cache line each.
    let padded = |n: usize| -> Vec<CachePadded<AtomicUsize>> {
        (0..n)
            .map(|_| CachePadded::new(AtomicUsize::new(0)))
            .collect()
    };
    let mut left = zeros(pieces.len());
    for u in &units {
        *left[u.0].get_mut() += 1;
    }
    let job = Upload {
        src,
        dst: AtomicU64::new(known),
        dst_ready: AtomicBool::new(later.is_none()),
        flushed: AtomicBool::new(later.is_none()),
        pending: (0..pieces.len()).map(|_| AtomicU8::new(0)).collect(),
        pieces: &pieces,
        units: &units,
        nt: src.len() <= tune.nt_upto,
        slots,
        left,
        issued: padded(nslots),
        free: padded(nslots),
        next: AtomicUsize::new(0),
        failed: AtomicBool::new(false),
        error: parking_lot::Mutex::new(None),
        stream,
        #[cfg(feature = "lab")]
        t0,
    };
    let device = cur.device();
    let (mut make, unlocked) = match later {
        Some((make, unlocked)) => (Some(make), Some(unlocked)),
        None => (None, None),
    };
    // The destination made meanwhile (the copy threads fill the first round of the slots and
    // leave the pieces they filled pending), or given up: nothing is issued then.
    let mut make = || {
        if let Some(f) = make.as_mut() {
            // Gives the upload up unless the address was published (also when `f` panics).
            let _give_up = GiveUp(&job.dst_ready, &job.failed);
            if let Some(a) = f() {
                job.dst.store(a, Ordering::Relaxed);
                // SeqCst: see `Upload::issue_now`.
                job.dst_ready.store(true, Ordering::SeqCst);
            }
        }
    };
    crate::stamps::stamp!("job");
    let running = AtomicUsize::new(0);
    let want = workers.min(units.len()).saturating_sub(1);
    // The caller's share of the fill: here, or (a destination made meanwhile) inside the
    // caller's `unlocked`, on a context entered there: the pending pieces issued, the copy
    // threads that left for want of the address replaced, the fill, then `Finish`.
    let ran = AtomicBool::new(false);
    let later_mode = unlocked.is_some();
    let rest = |cur: &Current<'_>, staff: Option<&(dyn Fn() + Sync)>| match unlocked {
        None => job.work(cur),
        Some(u) => u(&mut || {
            ran.store(true, Ordering::Relaxed);
            // Waits for the copy threads and drains a failed copy when dropped, also when the
            // fill below panics (the caller's array may be freed right after).
            let _finish = Finish {
                job: &job,
                running: &running,
                device,
            };
            match device.enter() {
                Ok(c) if !job.failed.load(Ordering::Relaxed) => {
                    job.issue_pending(&c);
                    // Release: the pending pieces' issued marks before any later-round claim.
                    job.flushed.store(true, Ordering::Release);
                    if let Some(staff) = staff {
                        staff();
                    }
                    job.work(&c)
                }
                Ok(_) => {}
                Err(e) => job.fail(e),
            }
        }),
    };
    match pool {
        Some(pool) if want > 0 => pool.in_place_scope(|scope| {
            // Starts copy threads until `want` are in the job (one that cannot make the context
            // current leaves the units to the others; the caller alone can finish them).
            let staff = || {
                for _ in running.load(Ordering::Relaxed)..want {
                    running.fetch_add(1, Ordering::Relaxed);
                    scope.spawn(|_| {
                        let _left = Leave(&running);
                        if let Ok(c) = device.enter() {
                            job.work(&c);
                        }
                    });
                }
            };
            staff();
            crate::stamps::stamp!("staffed");
            make();
            rest(cur, Some(&staff));
            crate::stamps::stamp!("caller's part done");
        }),
        _ => {
            make();
            rest(cur, None)
        }
    }
    #[cfg(feature = "lab")]
    super::trace::piece(t0, usize::MAX, 0, std::time::Instant::now());
    if later_mode && !ran.load(Ordering::Relaxed) {
        // The caller's part never ran: pieces may be pending and units unclaimed.
        job.fail(Error::unavailable(
            "the copy's unlocked section did not run it",
        ));
    }
    if !job.failed.load(Ordering::Relaxed)
        && job
            .pending
            .iter()
            .any(|p| p.load(Ordering::SeqCst) == PENDING_MARK)
    {
        // A piece filled but never issued: a broken handshake, not a copy to report as done.
        job.fail(Error::unavailable(
            "pinstage: a filled piece was never issued (a bug)",
        ));
    }
    let error = job.error.into_inner();
    let gave_up = !job.dst_ready.load(Ordering::Acquire);
    drop(lent);
    if gave_up {
        // No destination: no piece was issued (their issuers found the upload failed), so
        // nothing needs draining.
        return error.map_or(Ok(None), Err);
    }
    // A failure (copies issued before it may still write into `dst`), or copies that cannot
    // be tracked: the stream is waited for before the error returns.
    crate::stamps::stamp!("copy threads left");
    let tracked = error.map_or_else(|| done.record_in(cur, stream), Err);
    crate::stamps::stamp!("recorded");
    stream.drained_on_err(cur, tracked).map(|()| Some(done))
}

/// The end of the caller's part of a [`Dst::Later`] upload, when dropped: a wait until every
/// copy thread left the job (the scope's own wait then finds them gone) and, for a failed or
/// panicking one whose destination was published, a wait for the copies already issued (here,
/// unlocked: the drain after it then finds the stream idle).
struct Finish<'j, 'a, 's, 'd> {
    job: &'j Upload<'a, 's>,
    running: &'j AtomicUsize,
    device: &'d Device,
}

impl Drop for Finish<'_, '_, '_, '_> {
    fn drop(&mut self) {
        if std::thread::panicking() {
            self.job.failed.store(true, Ordering::Relaxed);
        }
        let backoff = crossbeam_utils::Backoff::new();
        // Acquire: the copy threads' fills and issues happened before their leaving.
        while self.running.load(Ordering::Acquire) != 0 {
            backoff.snooze();
        }
        if self.job.failed.load(Ordering::Relaxed) && self.job.dst_ready.load(Ordering::Relaxed) {
            if let Ok(c) = self.device.enter() {
                let _ = self.job.stream.synchronize(&c);
            }
        }
    }
}

/// A [`Dst::Later`] upload without overlap: the destination made first, then the copy (the
/// bounce slots allocated as needed) inside `unlocked`.
fn made_first(
    cur: &Current<'_>,
    src: &[u8],
    (make, unlocked): Maker<'_>,
    stream: StreamHandle,
) -> Result<Option<Event>> {
    let Some(dst) = make() else {
        return Ok(None);
    };
    let device = cur.device();
    let mut out = None;
    unlocked(&mut || {
        out = Some(
            device
                .enter()
                .and_then(|c| upload_bounced(&c, src, Dst::Known(dst), stream)),
        );
    });
    out.unwrap_or_else(|| {
        Err(Error::unavailable(
            "the copy's unlocked section did not run it",
        ))
    })
}

/// A destination's maker and the caller's unlocked section ([`Dst::Later`]).
type Maker<'f> = (
    &'f mut dyn FnMut() -> Option<u64>,
    &'f mut dyn FnMut(&mut (dyn FnMut() + Send)),
);

/// Copies `src` into `dst` (equal sizes) and waits until the source may change: a pinned source
/// as one DMA (waited for), a pageable one through the bounce ring, a host destination by memcpy.
///
/// # Errors
/// [`Error::ReadOnly`], [`Error::DestinationTooSmall`] (sizes differ), [`Error::CudaUnavailable`]
/// (a device `dst` without a driver), [`Error::NoSuchDevice`], [`Error::StreamCapturing`],
/// [`Error::Driver`].
pub fn copy_h2d(dst: &DeviceView<'_>, src: &[u8], stream: StreamHandle) -> Result<CopyPath> {
    let device = crate::cuda::Device::of_view(dst)?;
    // SAFETY: `src` is borrowed until we return, and we wait for the copy first.
    let (path, event) =
        unsafe { start_h2d(device.as_ref(), dst, src.as_ptr(), src.len(), stream) }?;
    if let Some(ev) = event {
        ev.wait_expecting(copy_time(src.len()))?;
    }
    Ok(path)
}

/// Starts copying `src` (all of it) into `dst` and returns: a pinned `src` gets one truly
/// asynchronous DMA; a pageable one was read completely before this returns (the device side
/// may still be in flight). The [`PendingCopy`] hands `src` back once the copy completed.
///
/// # Errors
/// As [`copy_h2d`].
pub fn copy_h2d_async<B: HostRegion>(
    dst: &DeviceView<'_>,
    mut src: B,
    stream: StreamHandle,
) -> Result<PendingCopy<B>> {
    let device = crate::cuda::Device::of_view(dst)?;
    let (ptr, len) = src.region();
    // SAFETY: the region is owned by `src`, which the PendingCopy keeps until the copy completed
    // (also when dropped: the reaper holds it); HostRegion guarantees the address is stable,
    // and nothing else writes it meanwhile (we own it).
    let (path, event) = unsafe { start_h2d(device.as_ref(), dst, ptr, len, stream) }?;
    Ok(PendingCopy::new(src, event, path, len))
}

#[cfg(test)]
mod tests;
