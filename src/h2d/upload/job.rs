//! One pageable upload shared by its workers: pieces filled unit by unit into bounce slots,
//! each piece issued by whoever fills its last unit (or, before the destination exists, left
//! pending for the caller).

use std::sync::atomic::{AtomicBool, AtomicU8, AtomicU64, AtomicUsize, Ordering};

use crossbeam_utils::CachePadded;

use crate::cuda::wait::copy_time;
use crate::cuda::{Current, Event, StreamHandle};
use crate::driver;
use crate::error::{Error, Result};
use crate::host::bounce::{self, BounceSlot};

/// Issues one H2D copy and records `ev` after it.
///
/// # Safety
/// 1. `src..src+n` pinned host memory unchanged until `ev` completed; `dst` device memory of the
///    current device of `n` bytes.
pub(super) unsafe fn issue(
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

/// One pageable upload shared by its workers.
pub(super) struct Upload<'a, 's> {
    pub(super) src: &'a [u8],
    /// The destination's address, valid once `dst_ready`.
    pub(super) dst: AtomicU64,
    /// Whether `dst` holds the address (from the start, or once the caller's thread made the
    /// destination).
    pub(super) dst_ready: AtomicBool,
    /// Whether the pieces filled before the address existed were issued (from the start
    /// without a maker). Until then a copy thread claims no unit past the slots' first round:
    /// its fill would wait for a copy only the caller issues.
    pub(super) flushed: AtomicBool,
    /// Per piece: filled before the address existed and not yet issued ([`PENDING`]), then
    /// claimed by whoever issues it ([`CLAIMED`]).
    pub(super) pending: Vec<AtomicU8>,
    /// (offset, bytes) of each piece.
    pub(super) pieces: &'a [(usize, usize)],
    /// (piece, offset, bytes) of each unit, in address order.
    pub(super) units: &'a [(usize, usize, usize)],
    pub(super) nt: bool,
    pub(super) slots: &'a [BounceSlot],
    /// Per piece: its units not yet done (filled, or given up after a failure). Whoever takes
    /// it to zero issues the piece's copy.
    pub(super) left: Vec<AtomicUsize>,
    /// Per slot: one more than the latest use issued (or given up after a failure). Piece `i`
    /// is slot `i % slots`'s use number `i / slots`; its units wait until the use before it
    /// was issued, then for that copy's event.
    pub(super) issued: Vec<CachePadded<AtomicUsize>>,
    /// Per slot: the uses known free to fill (a worker saw the event of the use before them
    /// complete), so the other units of a piece skip the driver query.
    pub(super) free: Vec<CachePadded<AtomicUsize>>,
    pub(super) next: AtomicUsize,
    pub(super) failed: AtomicBool,
    pub(super) error: parking_lot::Mutex<Option<Error>>,
    pub(super) stream: StreamHandle<'s>,
    /// When the upload started (the laboratory's trace).
    #[cfg(feature = "lab")]
    pub(super) t0: std::time::Instant,
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
        if !job.failed.load(Ordering::Relaxed) && !job.issue_now(self.p) {
            // Pending: the caller's thread issues it once it made the destination.
            return;
        }
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
        {
            crate::h2d::trace::piece(job.t0, self.p, job.pieces[self.p].1, filled);
            crate::h2d::trace::landed(self.cur, job.stream, self.p);
        }
    }
}

/// A piece's [`Upload::pending`] states (0: not filled, or issued at once).
pub(super) const PENDING: u8 = 1;
const CLAIMED: u8 = 2;

/// Counts a copy thread out of a job when dropped (also by a panic).
pub(super) struct Leave<'a>(pub(super) &'a AtomicUsize);

impl Drop for Leave<'_> {
    fn drop(&mut self) {
        // Release: pairs with the Acquire of the caller's wait.
        self.0.fetch_sub(1, Ordering::Release);
    }
}

/// Marks an upload failed when dropped unless its destination was published (`.0`).
pub(super) struct GiveUp<'a>(pub(super) &'a AtomicBool, pub(super) &'a AtomicBool);

impl Drop for GiveUp<'_> {
    fn drop(&mut self) {
        if !self.0.load(Ordering::Relaxed) {
            self.1.store(true, Ordering::Relaxed);
        }
    }
}

/// Piece `p`'s bounce slot among `n` and how many uses of that slot come before it (the
/// pieces take the slots in turn).
pub(super) fn slot_and_round(p: usize, n: usize) -> (usize, usize) {
    (p % n, p / n)
}

/// Waits until a slot's `issued` mark reaches `round` (every earlier use of the slot was
/// issued); `false` once the upload failed (the caller gives up).
pub(super) fn wait_issued(issued: &AtomicUsize, round: usize, failed: &AtomicBool) -> bool {
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
    pub(super) fn fail(&self, e: Error) {
        self.failed.store(true, Ordering::Relaxed);
        self.error.lock().get_or_insert(e);
    }

    /// Claims units until none is left (or one failed). Every claimed unit counts as done
    /// when its iteration ends, even after a failure, so no worker waits forever for it.
    pub(super) fn work(&self, cur: &Current<'_>) {
        let n = self.slots.len();
        #[cfg(pinstage_lab_variant = "stamps")]
        let mut first = true;
        // Relaxed: the failure flag stops new claims early; the error itself is under a lock.
        // (Units that skip their waits after a failure fill nothing: see `MarkIssued`.)
        while !self.failed.load(Ordering::Relaxed) {
            let u = self.next.load(Ordering::Relaxed);
            let Some(&(p, off, len)) = self.units.get(u) else {
                break;
            };
            // Before the caller issued the pieces filled ahead of the destination, a piece past
            // the slots' first round would wait for one of those copies: this thread leaves it
            // to those after.
            if p >= n && !self.flushed.load(Ordering::Acquire) {
                break;
            }
            if self
                .next
                .compare_exchange_weak(u, u + 1, Ordering::Relaxed, Ordering::Relaxed)
                .is_err()
            {
                continue;
            }
            let _done = UnitDone { job: self, cur, p };
            let (s, round) = slot_and_round(p, n);
            if let Err(e) = self.fill(s, round, off - self.pieces[p].0, off, len) {
                self.fail(e);
            }
            #[cfg(pinstage_lab_variant = "stamps")]
            if std::mem::take(&mut first) {
                crate::stamps::stamp!("first unit filled");
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

    /// Whether filled piece `p` is issued now: the destination is known, or became known while
    /// the piece was marked pending and this side claimed it first. Otherwise it stays pending
    /// for [`Upload::issue_pending`]. SeqCst here and there: either this side sees the address
    /// published after marking the piece, or the caller sees the mark after publishing (or
    /// both, and the exchange decides), so the piece is issued exactly once. (The seeded-bug
    /// harness, `dst_not_waited`: a piece issued before the destination was made must fail the
    /// GPU tests.)
    fn issue_now(&self, p: usize) -> bool {
        if cfg!(pinstage_seeded_bug = "dst_not_waited") || self.dst_ready.load(Ordering::SeqCst) {
            return true;
        }
        self.pending[p].store(PENDING, Ordering::SeqCst);
        self.dst_ready.load(Ordering::SeqCst)
            && self.pending[p]
                .compare_exchange(PENDING, CLAIMED, Ordering::SeqCst, Ordering::SeqCst)
                .is_ok()
    }

    /// Issues the pieces left pending (filled before the destination existed), once it was
    /// published: on the caller's thread, in order.
    pub(super) fn issue_pending(&self, cur: &Current<'_>) {
        let n = self.slots.len();
        for (p, state) in self.pending.iter().enumerate() {
            if state
                .compare_exchange(PENDING, CLAIMED, Ordering::SeqCst, Ordering::SeqCst)
                .is_ok()
            {
                let (s, round) = slot_and_round(p, n);
                let _mark = MarkIssued(&self.issued[s], round + 1, &self.failed);
                if !self.failed.load(Ordering::Relaxed)
                    && let Err(e) = self.send(cur, p, s)
                {
                    self.fail(e);
                }
            }
        }
    }

    /// Issues piece `p`'s copy out of slot `s` (filled) and records the slot's event after it.
    fn send(&self, cur: &Current<'_>, p: usize, s: usize) -> Result<()> {
        let slot = &self.slots[s];
        let (off, n) = self.pieces[p];
        // Relaxed: published before `dst_ready`, which the issuer read (SeqCst) first.
        let dst = self.dst.load(Ordering::Relaxed);
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
