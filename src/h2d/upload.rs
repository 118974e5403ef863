//! Host-to-device copies of whole arrays at line rate: a pinned source goes as one DMA; a
//! pageable one through pinned bounce slots, several threads filling slots while the copy
//! engine drains others.

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};

use crossbeam_utils::CachePadded;

use crate::cuda::wait::copy_time;
use crate::cuda::{Current, Device, Event, StreamHandle};
use crate::dlpack::{DeviceView, MemoryKind};
use crate::driver;
use crate::error::{Error, Result};
use crate::host::bounce::{self, BounceSlot};
use crate::host::{CopyPath, HostRegion, PendingCopy};

pub(crate) mod meanwhile;

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
    let cur = stream.enter_for_copy(device)?;
    if driver::mem::is_pinned_range(src.cast(), len) {
        let ev = Event::new_in(&cur)?;
        // SAFETY: the source is pinned and unchanged until the event completed (caller); `dst`
        // is device memory of this device of `len` bytes (view contract, device checked).
        unsafe { issue(&cur, &ev, dst.ptr(), src, len, stream) }?;
        return Ok((CopyPath::Pinned, Some(ev)));
    }
    // SAFETY: caller's contract: `len` readable bytes, unchanged until we return.
    let src = unsafe { std::slice::from_raw_parts(src, len) };
    let done = upload_bounced(&cur, src, Dst::Known(dst.ptr()), stream)?;
    Ok((CopyPath::Bounced, done))
}

/// A pageable upload's destination: known, or made by the caller's thread while the copy
/// threads fill the first slots (the rest of the caller's part then runs inside `unlocked`).
enum Dst<'f> {
    Known(u64),
    Later {
        make: &'f mut dyn FnMut() -> Option<u64>,
        unlocked: &'f mut dyn FnMut(&mut (dyn FnMut() + Send)),
    },
}

/// Issues one H2D copy and records `ev` after it.
///
/// # Safety
/// 1. `src..src+n` pinned host memory unchanged until `ev` completed; `dst` device memory of the
///    current device of `n` bytes.
unsafe fn issue(
    cur: &Current<'_>,
    ev: &Event,
    dst: u64,
    src: *const u8,
    n: usize,
    stream: StreamHandle,
) -> Result<()> {
    // SAFETY: caller's contract; context current (`cur`); the stream is a special handle, ours,
    // or vouched for by its maker.
    unsafe { driver::mem::memcpy_htod_async(dst, src.cast(), n, stream.raw()) }?;
    // Untracked, the copy is waited for: the source is free when the error returns.
    stream.drained_on_err(cur, ev.record_in(cur, stream))
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
    let done = Event::new_in(cur)?;
    let (lent, later) = match later {
        None => (bounce::Lent::take(cur, nslots, tune.max_piece)?, None),
        Some(l) => match bounce::Lent::take_cached(cur, nslots, tune.max_piece) {
            Some(lent) => (lent, Some(l)),
            // Slots to allocate (a first copy, or many at once): pinned allocation may wait
            // long, so the destination first and the whole copy unlocked, as without a maker.
            None => return made_first(cur, src, l, stream),
        },
    };
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
    // The destination made meanwhile (the copy threads fill slots; a piece filled first waits
    // for it), or given up: nothing is issued then.
    let mut make = || {
        if let Some(f) = make.as_mut() {
            // Gives the upload up unless the address was published (also when `f` panics), so
            // no copy thread waits for it forever.
            let _give_up = GiveUp(&job.dst_ready, &job.failed);
            if let Some(a) = f() {
                job.dst.store(a, Ordering::Relaxed);
                // Release: pairs with the Acquire in `Upload::dst`.
                job.dst_ready.store(true, Ordering::Release);
            }
        }
    };
    // The caller's share of the fill: here, or (a destination made meanwhile) inside the
    // caller's `unlocked`, on a context entered there, then waiting until every copy thread
    // left the job (the scope's own wait then finds them gone).
    let running = AtomicUsize::new(0);
    // While a destination is made, one pool thread stays free for other copies.
    let free = usize::from(unlocked.is_some());
    let rest = |cur: &Current<'_>| match unlocked {
        None => job.work(cur),
        Some(u) => u(&mut || {
            match device.enter() {
                Ok(c) => job.work(&c),
                Err(e) => job.fail(e),
            }
            let backoff = crossbeam_utils::Backoff::new();
            // Acquire: the copy threads' fills and issues happened before their leaving.
            while running.load(Ordering::Acquire) != 0 {
                backoff.snooze();
            }
            if job.failed.load(Ordering::Relaxed) {
                // Copies issued before the failure may still write into `dst`: waited for
                // here, unlocked (the drain below then finds the stream idle).
                if let Ok(c) = device.enter() {
                    let _ = stream.synchronize(&c);
                }
            }
        }),
    };
    match pool {
        Some(pool) if workers > 1 && units.len() > 1 => pool.in_place_scope(|scope| {
            let spawn = (workers.min(units.len()) - 1).min(threads - 1 - free);
            for _ in 0..spawn {
                running.fetch_add(1, Ordering::Relaxed);
                // A worker that cannot make the context current leaves the units to the others
                // (the caller alone can finish them).
                scope.spawn(|_| {
                    let _left = Leave(&running);
                    if let Ok(c) = device.enter() {
                        job.work(&c);
                    }
                });
            }
            make();
            rest(cur);
        }),
        _ => {
            make();
            rest(cur)
        }
    }
    #[cfg(feature = "lab")]
    super::trace::piece(t0, usize::MAX, 0, std::time::Instant::now());
    let error = job.error.into_inner();
    let gave_up = !job.dst_ready.load(Ordering::Acquire);
    drop(lent);
    if gave_up && error.is_none() {
        // No destination: no piece was issued (their issuers found the upload failed).
        return Ok(None);
    }
    // A failure (copies issued before it may still write into `dst`), or copies that cannot
    // be tracked: the stream is waited for before the error returns.
    let tracked = error.map_or_else(|| done.record_in(cur, stream), Err);
    stream.drained_on_err(cur, tracked).map(|()| Some(done))
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

/// One pageable upload shared by its workers.
struct Upload<'a, 's> {
    src: &'a [u8],
    /// The destination's address, valid once `dst_ready`.
    dst: AtomicU64,
    /// Whether `dst` holds the address (at once, or once the caller's thread made it:
    /// [`Dst::Later`]).
    dst_ready: AtomicBool,
    /// (offset, bytes) of each piece.
    pieces: &'a [(usize, usize)],
    /// (piece, offset, bytes) of each unit, in address order.
    units: &'a [(usize, usize, usize)],
    nt: bool,
    slots: &'a [BounceSlot],
    /// Per piece: its units not yet done (filled, or given up after a failure). Whoever takes
    /// it to zero issues the piece's copy.
    left: Vec<AtomicUsize>,
    /// Per slot: one more than the latest use issued (or given up after a failure). Piece `i`
    /// is slot `i % slots`'s use number `i / slots`; its units wait until the use before it
    /// was issued, then for that copy's event.
    issued: Vec<CachePadded<AtomicUsize>>,
    /// Per slot: the uses known free to fill (a worker saw the event of the use before them
    /// complete), so the other units of a piece skip the driver query.
    free: Vec<CachePadded<AtomicUsize>>,
    next: AtomicUsize,
    failed: AtomicBool,
    error: parking_lot::Mutex<Option<Error>>,
    stream: StreamHandle<'s>,
    /// When the upload started (the laboratory's trace).
    #[cfg(feature = "lab")]
    t0: std::time::Instant,
}

/// Marks one unit of piece `p` done when dropped (even by a panic unwinding its worker, so no
/// other worker waits forever): the last one issues the piece's copy unless the upload failed,
/// then marks the slot's use issued.
struct UnitDone<'j, 'a, 's, 'c> {
    job: &'j Upload<'a, 's>,
    cur: &'j Current<'c>,
    p: usize,
}

impl Drop for UnitDone<'_, '_, '_, '_> {
    fn drop(&mut self) {
        let job = self.job;
        if std::thread::panicking() {
            // This unit may not be filled: its piece must not be issued.
            job.failed.store(true, Ordering::Relaxed);
        }
        // AcqRel: the other units' fills happen before the copy the last one issues.
        if job.left[self.p].fetch_sub(1, Ordering::AcqRel) != 1 {
            return;
        }
        let n = job.slots.len();
        let (s, round) = slot_and_round(self.p, n);
        // Marks the use issued however this ends (a panic in `send` included), so no unit
        // waits for it forever.
        let _mark = MarkIssued(&job.issued[s], round + 1, &job.failed);
        #[cfg(feature = "lab")]
        let filled = std::time::Instant::now();
        if !job.failed.load(Ordering::Relaxed)
            && let Err(e) = job.send(self.cur, self.p, s)
        {
            job.fail(e);
        }
        #[cfg(feature = "lab")]
        super::trace::piece(job.t0, self.p, job.pieces[self.p].1, filled);
    }
}

/// Counts a copy thread out of a job when dropped (also by a panic).
struct Leave<'a>(&'a AtomicUsize);

impl Drop for Leave<'_> {
    fn drop(&mut self) {
        // Release: pairs with the Acquire of the caller's wait.
        self.0.fetch_sub(1, Ordering::Release);
    }
}

/// Marks an upload failed when dropped unless its destination was published (`.0`).
struct GiveUp<'a>(&'a AtomicBool, &'a AtomicBool);

impl Drop for GiveUp<'_> {
    fn drop(&mut self) {
        if !self.0.load(Ordering::Relaxed) {
            self.1.store(true, Ordering::Relaxed);
        }
    }
}

/// Piece `p`'s bounce slot among `n` and how many uses of that slot come before it (the
/// pieces take the slots in turn).
fn slot_and_round(p: usize, n: usize) -> (usize, usize) {
    (p % n, p / n)
}

/// Waits until a slot's `issued` mark reaches `round` (every earlier use of the slot was
/// issued); `false` once the upload failed (the caller gives up).
fn wait_issued(issued: &AtomicUsize, round: usize, failed: &AtomicBool) -> bool {
    let backoff = crossbeam_utils::Backoff::new();
    // Acquire: pairs with the Release in `MarkIssued`; the earlier use's record happened before.
    while issued.load(Ordering::Acquire) < round {
        if failed.load(Ordering::Relaxed) {
            return false;
        }
        backoff.snooze();
    }
    !failed.load(Ordering::Relaxed)
}

/// Raises a slot's issued mark to `.1` when dropped; by a panic, it marks the upload failed
/// first.
struct MarkIssued<'a>(&'a AtomicUsize, usize, &'a AtomicBool);

impl Drop for MarkIssued<'_> {
    fn drop(&mut self) {
        if std::thread::panicking() {
            self.2.store(true, Ordering::Relaxed);
        }
        // Release: pairs with the Acquire of the units waiting for this use; the record
        // happened before. fetch_max: a failed upload's units skip their waits, so the uses of
        // a slot may be given up out of order (whoever sees such a mark also sees the failure:
        // the unit that set it had read the flag before).
        self.0.fetch_max(self.1, Ordering::Release);
    }
}

impl Upload<'_, '_> {
    fn fail(&self, e: Error) {
        self.failed.store(true, Ordering::Relaxed);
        self.error.lock().get_or_insert(e);
    }

    /// Claims units until none is left (or one failed). Every claimed unit counts as done
    /// when its iteration ends, even after a failure, so no worker waits forever for it.
    fn work(&self, cur: &Current<'_>) {
        let n = self.slots.len();
        // Relaxed: the failure flag stops new claims early; the error itself is under a lock.
        // (Units that skip their waits after a failure fill nothing: see `MarkIssued`.)
        while !self.failed.load(Ordering::Relaxed) {
            let u = self.next.fetch_add(1, Ordering::Relaxed);
            let Some(&(p, off, len)) = self.units.get(u) else {
                break;
            };
            let _done = UnitDone { job: self, cur, p };
            let (s, round) = slot_and_round(p, n);
            if let Err(e) = self.fill(s, round, off - self.pieces[p].0, off, len) {
                self.fail(e);
            }
        }
    }

    /// Fills `len` bytes of the source at `off` into slot `s` at `at`, once the slot's use
    /// before `round` was issued and its copy completed. Gives up (Ok) once the upload failed.
    fn fill(&self, s: usize, round: usize, at: usize, off: usize, len: usize) -> Result<()> {
        let slot = &self.slots[s];
        if !wait_issued(&self.issued[s], round, &self.failed) {
            return Ok(());
        }
        // Acquire: a worker saw that use's copy complete before storing this. (The seeded-bug
        // harness (`units_no_wait`, scripts/seeded.tsv): a fill that does not wait for the slot's
        // last copy must fail the GPU tests.)
        #[cfg(not(pinstage_seeded_bug = "units_no_wait"))]
        if self.free[s].load(Ordering::Acquire) <= round {
            // The copy waited for is of at most a slot's bytes.
            slot.busy.wait_expecting(copy_time(slot.buf.len()))?;
            self.free[s].fetch_max(round + 1, Ordering::Release);
        }
        // SAFETY: this range of slot `s` (`at..at+len`, 64 KiB-aligned, within the slot's
        // `max_piece >= piece` bytes) is this worker's alone: units do not overlap, and the
        // slot's previous copy completed (above) while its next use waits for this piece to be
        // issued. The source range lies within `src`.
        unsafe {
            bounce::fill(
                slot.buf.shared_mut_ptr().add(at),
                self.src.as_ptr().add(off),
                len,
                self.nt,
            )
        };
        Ok(())
    }

    /// The destination's address once the caller's thread made it; `None` once the upload
    /// failed (or the caller gave up).
    fn dst(&self) -> Option<u64> {
        let backoff = crossbeam_utils::Backoff::new();
        loop {
            // Acquire: pairs with the Release that published the address. (The seeded-bug
            // harness, `dst_not_waited`: a piece issued before the destination was made must
            // fail the GPU tests.)
            if cfg!(pinstage_seeded_bug = "dst_not_waited")
                || self.dst_ready.load(Ordering::Acquire)
            {
                return Some(self.dst.load(Ordering::Relaxed));
            }
            if self.failed.load(Ordering::Relaxed) {
                return None;
            }
            backoff.snooze();
        }
    }

    /// Issues piece `p`'s copy out of slot `s` (filled) and records the slot's event after it;
    /// nothing once the upload failed while the destination was being made.
    fn send(&self, cur: &Current<'_>, p: usize, s: usize) -> Result<()> {
        let slot = &self.slots[s];
        let (off, n) = self.pieces[p];
        let Some(dst) = self.dst() else {
            return Ok(());
        };
        // SAFETY: the slot stays untouched until its event completed (recorded next, or the
        // stream is synchronized); dst + off..+n lies within the destination (sizes checked).
        unsafe {
            issue(
                cur,
                &slot.busy,
                dst + off as u64,
                slot.buf.shared_mut_ptr(),
                n,
                self.stream,
            )
        }
    }
}

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
