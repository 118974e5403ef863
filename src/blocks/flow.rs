//! A staged move's host half ([`super::staged`]): the host rows of its open chunks, cut into
//! tasks that pinstage's copy threads and the issuing thread take in order, with no barrier
//! between chunks; a copy thread with no open task lingers about one chunk's crossing for the
//! next before it leaves (lab variant `no_linger`: the control).

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use crossbeam_utils::CachePadded;

use super::chunks::{Shape, Work};
use super::copy::Direction;
use crate::cuda::wait::{Backoff, copy_time};

/// A staged move as the copy threads see it.
pub(super) struct Flow<'a> {
    pub(super) direction: Direction,
    pub(super) work: &'a Work,
    pub(super) shape: Shape,
    /// Host staging's first slot, and how many slots it has (chunk `j` in slot `j % slots`).
    host: u64,
    slots: usize,
    /// Bytes of one chunk.
    pub(super) chunk: usize,
    /// The next task to claim (on a line of its own: every claim writes it).
    next: CachePadded<AtomicUsize>,
    /// Chunks open to the copy threads: tasks of a chunk below it may be claimed.
    pub(super) open: AtomicUsize,
    /// Copy threads spawned and not yet done.
    pub(super) alive: AtomicUsize,
    /// The move failed: no further task.
    pub(super) stop: AtomicBool,
}

impl<'a> Flow<'a> {
    /// A move's flow through host staging at `host` (`slots` chunks of `chunk` bytes): no
    /// chunk open, no task taken, no copy thread.
    pub(super) fn new(
        direction: Direction,
        work: &'a Work,
        shape: Shape,
        (host, slots, chunk): (u64, usize, usize),
    ) -> Self {
        Self {
            direction,
            work,
            shape,
            host,
            slots,
            chunk,
            next: CachePadded::new(AtomicUsize::new(0)),
            open: AtomicUsize::new(0),
            alive: AtomicUsize::new(0),
            stop: AtomicBool::new(false),
        }
    }

    /// The next task, if its chunk is open.
    pub(super) fn claim(&self) -> Option<usize> {
        let mut t = self.next.load(Ordering::Relaxed);
        loop {
            let task = self.work.tasks.get(t)?;
            if task.chunk >= self.open.load(Ordering::Acquire) || self.stop.load(Ordering::Relaxed)
            {
                return None;
            }
            match self
                .next
                .compare_exchange_weak(t, t + 1, Ordering::Relaxed, Ordering::Relaxed)
            {
                Ok(_) => return Some(t),
                Err(now) => t = now,
            }
        }
    }

    /// A copy thread's part: takes open tasks; when none is open, lingers (spinning, then
    /// yielding) for about one chunk's crossing for the next chunk to open, as a thread woken
    /// anew starts tens of µs late; leaves once no task is left, the move failed, or it waited
    /// that long. Counted in `alive` until it leaves.
    pub(super) fn work(&self) {
        let linger = if cfg!(pinstage_lab_variant = "no_linger") {
            Duration::ZERO
        } else {
            copy_time(self.chunk)
        };
        loop {
            while let Some(t) = self.claim() {
                self.task(t);
            }
            let (since, backoff) = (Instant::now(), Backoff::new(linger));
            while !self.claimable() && !self.over() && since.elapsed() < linger {
                backoff.pause();
            }
            if self.claimable() {
                continue;
            }
            self.alive.fetch_sub(1, Ordering::SeqCst);
            // A chunk opened as it left, whose spawner saw it alive: it stays.
            if !self.claimable() {
                return;
            }
            self.alive.fetch_add(1, Ordering::SeqCst);
        }
    }

    /// Whether an open task is left.
    fn claimable(&self) -> bool {
        !self.stop.load(Ordering::Relaxed)
            && self
                .work
                .tasks
                .get(self.next.load(Ordering::Relaxed))
                .is_some_and(|t| t.chunk < self.open.load(Ordering::SeqCst))
    }

    /// Whether no task is left to take, or the move failed.
    fn over(&self) -> bool {
        self.stop.load(Ordering::Relaxed)
            || self.next.load(Ordering::Relaxed) >= self.work.tasks.len()
    }

    /// Task `t`: copies its host rows between the host blocks and host staging (offload:
    /// staging into the blocks, by non-temporal stores where the destination allows; load: the
    /// blocks into staging by plain stores, which leave the rows in the cache for the
    /// crossing's DMA to read, where non-temporal ones would send them to memory and back),
    /// then counts it done.
    pub(super) fn task(&self, t: usize) {
        let unwinding = StopOnUnwind(&self.stop);
        #[cfg(feature = "testing")]
        task_hook();
        let task = self.work.tasks[t];
        let (part, _) = self.work.chunk(task.chunk);
        let slot = self.host + ((task.chunk % self.slots) * self.chunk) as u64;
        let rows = self.shape.rows;
        // The lab variant `load_nt` (the control): the load's rows by non-temporal stores too.
        let nt_ok = self.direction == Direction::Offload || cfg!(pinstage_lab_variant = "load_nt");
        let nt = |dst: u64| nt_ok && dst % 16 == 0;
        for r in task.start..task.end {
            let (p, i) = (&part[r / rows], r % rows);
            let staged = slot + (p.off + i * p.len) as u64;
            let (dst, src) = match self.direction {
                Direction::Offload => (p.dst + (i * self.shape.host_pitch) as u64, staged),
                Direction::Load => (staged, p.src + (i * self.shape.host_pitch) as u64),
            };
            // SAFETY: `staged::run`'s contract 1 for the host rows; the staged rows lie within
            // the slot (packed), which the chunk holds while it is open; a host row and a staged
            // row never overlap (staging is the mover's own memory); `fill` takes non-temporal
            // stores only at 16-byte alignment.
            unsafe { crate::host::bounce::fill(dst as *mut u8, src as *const u8, p.len, nt(dst)) };
        }
        std::mem::forget(unwinding);
        // Release: the rows (fenced by `fill`) before the count the issuing thread reads.
        self.work.left[task.chunk].fetch_sub(1, Ordering::Release);
    }
}

/// Stops a staged move's copy threads when dropped: dropped only by a task's unwind (a panic,
/// a bug), after which the issuing thread fails the move instead of waiting for that task.
struct StopOnUnwind<'a>(&'a AtomicBool);

impl Drop for StopOnUnwind<'_> {
    fn drop(&mut self) {
        self.0.store(true, Ordering::Relaxed);
    }
}

/// Staged moves' tasks left before one panics (0: none; feature `testing`).
#[cfg(feature = "testing")]
static PANIC_AT: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);

/// Makes the `n`th task of staged block moves from now (over every thread: a copy thread's or
/// the issuing thread's) panic, as a bug there would; 0 takes it back. Tests only.
#[cfg(feature = "testing")]
pub fn panic_in_staged_task(n: u32) {
    PANIC_AT.store(n, Ordering::SeqCst);
}

#[cfg(feature = "testing")]
fn task_hook() {
    if PANIC_AT.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1)) == Ok(1) {
        panic!("pinstage testing: a staged task's injected panic");
    }
}
