//! Moves through staging buffers ([`Strategy::Staged`](super::Strategy::Staged)), for moves in
//! the background between tensors at one stride: the copy engines gather (offload) or scatter
//! (load) the blocks inside device memory with 2D copies, ONE contiguous copy per chunk crosses
//! the link, and pinstage's copy threads scatter (offload) or gather (load) the host blocks.
//! Small blocks cross the link as single rows far below its rate; inside device memory the same
//! rows move at hundreds of GB/s, and the host side's rows are plain memory copies
//! (lab/c/blocks_stage.c measures both; benches/RESULTS.md has the figures).
//!
//! A mover's thread of each direction owns a ring of [`SLOTS`] chunks of [`Staging`]'s chunk size
//! in device memory and as many in pinned host memory, and a stream of its own for the 2D copies
//! inside device memory (the copies across the link go on the thread's stream: on one stream the
//! two would run one after the other), made at its first staged move, made anew when the chunk size
//! changes, and kept until the mover goes. The host rows of every chunk are cut into tasks of about
//! 128 KiB; a chunk opens to the copy threads when its host slot may be used, and they take its
//! tasks in order with no barrier between chunks ([`super::flow`]; the issuing thread queues the
//! copies and polls their events meanwhile, and takes tasks itself when it has nothing else to
//! do). Per chunk `j` in slot `k = j % SLOTS`:
//! - offload: the 2D gathers into device slot `k` on the ring's stream (after the caller's
//!   fork), then, once they ran, one device-to-host copy into host slot `k` and event `k` on the
//!   thread's stream; chunk `j` opens once event `k` completed, and chunk `j + SLOTS` is issued
//!   once chunk `j`'s tasks are done (it lands in the slot just read). The move completes with
//!   the last task: its ticket is settled then, so `wait`, `done` and `stream_wait` see it
//!   complete only once the host blocks hold the data.
//! - load: the thread waits on the host for the caller's fork (the host blocks it reads may be
//!   written by work queued before the call); chunk `j` opens once event `k` (the copy that last
//!   read host slot `k`) completed; once its tasks are done the thread issues the host-to-device
//!   copy (after the slot's last 2D scatters) and event `k` on the thread's stream, and the 2D
//!   scatters into the device blocks on the ring's stream after it; the ticket's event is
//!   recorded on the thread's stream once the last scatters ran.
//!
//! Nothing waits on the device for a value the host writes later: every wait is on an event
//! recorded before it.
//!
//! A staged move asked to hand over (the other direction's move started beside it:
//! [`super::tensors::Tensors::take_staging`] says when) queues its chunks not yet begun as 2D copies
//! across the link on the thread's stream ([`across`]), and ends with the chunks before them:
//! every staged byte crosses the host's memory two or three times, and two directions' staged
//! bytes at once are more than it carries.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

pub(super) use super::chunks::Shape;
use super::chunks::{Piece, Work};
use super::copy::Direction;
use super::flow::Flow;
use crate::cuda::wait::{Backoff, copy_time, wait_until};
use crate::cuda::{Current, Event, Stream, StreamHandle};
use crate::driver::DriverError;
use crate::driver::mem::{Pitched, memcpy_2d_async, memcpy_async};
use crate::error::{Error, Result};
use crate::host::{DeviceMem, PinnedBuffer, PinnedFlags};

/// Chunks in a ring: one scattered (or gathered) by the copy threads while the others cross.
pub(super) const SLOTS: usize = 4;

/// Bytes of one chunk unless the mover is told otherwise ([`Staging`]).
pub const DEFAULT_CHUNK: usize = 16 << 20;

/// The fewest and the most bytes of one chunk.
pub const CHUNK_RANGE: std::ops::RangeInclusive<usize> = (64 << 10)..=(1 << 30);

/// Moves of at least this many bytes go through staging where [`Staging::Auto`] lets them.
pub(super) const AUTO_MIN_BYTES: usize = 8 << 20;

/// ... and copies (a run's bytes in one tensor and part, on average) of less than this: at 256
/// KiB the 2D copies across the link already run near one contiguous copy's rate.
pub(super) const AUTO_BELOW_COPY: usize = 128 << 10;

/// ... and, while the other direction's move goes through staging, copies of less than this:
/// below it two staged moves at once outrun a staged and an unstaged one, above it the
/// unstaged one's copies cross the link fast enough (benches/RESULTS.md, both at once).
pub(super) const PAIR_BELOW_COPY: usize = 12 << 10;

/// ... and of this or more: the other direction's staged move hands its chunks not yet begun
/// over to 2D copies across the link, and neither stages (two unstaged moves at once outrun a
/// staged and an unstaged one there). Between the two cuts the load is the one staged.
pub(super) const PAIR_UNSTAGED_FROM: usize = 32 << 10;

/// Whether a mover's moves in the background go through staging buffers
/// ([`BlockMover::set_staging`](super::BlockMover::set_staging)).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Staging {
    /// Where it pays as measured (default): moves of 8 MiB or more whose copies average less
    /// than 128 KiB, between tensors at one stride within one allocation on each side (or one
    /// tensor each), one direction at a time: a move that starts while the other direction's
    /// goes through staging goes unstaged (two staged at once move about what one moves),
    /// unless its copies average under 12 KiB (unstaged, they would cross the link slower
    /// still); from 32 KiB the staged move then hands its chunks not yet begun over to 2D
    /// copies across the link (two unstaged moves at once outrun a staged and an unstaged one
    /// there); in between a load stages beside a staged offload, which hands over (unstaged, a
    /// load's rows cross the link slower than an offload's).
    Auto,
    /// Every move in the background between tensors at one stride (or one tensor each): tests,
    /// measurements.
    Always,
    /// Never: moves in the background go as moves on the caller's thread do.
    Never,
}

/// A thread's staging: [`SLOTS`] chunks in device memory and in pinned host memory, the stream
/// of the 2D copies inside device memory, and per slot the event after the last copy across
/// the link that used it (`crossed`) and after the last 2D copies that used its device chunk
/// (`staged`).
pub(super) struct Ring {
    dev: DeviceMem,
    host: PinnedBuffer,
    device: Arc<Stream>,
    chunk: usize,
    crossed: Vec<Option<Event>>,
    staged: Vec<Option<Event>>,
}

impl Ring {
    /// A ring of chunks of `chunk` bytes.
    ///
    /// # Errors
    /// [`Error::OutOfMemory`] and the like: no memory (the move then goes unstaged).
    pub(super) fn new(cur: &Current<'_>, chunk: usize) -> Result<Self> {
        Ok(Self {
            dev: DeviceMem::new(cur, SLOTS * chunk, "block mover staging")?,
            host: PinnedBuffer::new(cur.device(), SLOTS * chunk, PinnedFlags::PORTABLE)?,
            device: Arc::new(Stream::new(cur.device())?),
            chunk,
            crossed: (0..SLOTS).map(|_| None).collect(),
            staged: (0..SLOTS).map(|_| None).collect(),
        })
    }

    /// Bytes of one chunk.
    pub(super) fn chunk(&self) -> usize {
        self.chunk
    }

    /// Bytes the ring holds: device and pinned host memory.
    fn bytes(&self) -> usize {
        2 * SLOTS * self.chunk
    }

    fn dev_slot(&self, k: usize) -> u64 {
        self.dev.ptr() + (k * self.chunk) as u64
    }

    fn host_slot(&self, k: usize) -> u64 {
        self.host.as_ptr() as u64 + (k * self.chunk) as u64
    }

    /// Whether the last crossing of slot `k` completed (a failed copy fails it).
    fn crossed(&self, k: usize) -> Result<bool> {
        match &self.crossed[k] {
            Some(e) => Ok(e.query()?),
            None => Ok(true),
        }
    }

    /// Records `slot`'s event on `stream`, after the work just queued there (the event kept
    /// if that fails: a slot without one reads as idle).
    fn record(slot: &mut Option<Event>, cur: &Current<'_>, stream: StreamHandle) -> Result<()> {
        let e = match slot.take() {
            Some(e) => e,
            None => Event::new_in(cur)?,
        };
        let recorded = e.record_in(cur, stream);
        *slot = Some(e);
        recorded
    }
}

impl Drop for Ring {
    fn drop(&mut self) {
        // Every move that used the ring completed before its mover went; a copy still in
        // flight (a move whose failure was not drained) must not outlive the memory.
        for e in self.crossed.iter().chain(&self.staged).flatten() {
            let _ = e.synchronize();
        }
    }
}

/// What an issuing thread keeps for staged moves: its ring (made at the first staged move,
/// made anew when the chunk size changes), and the move at hand.
#[derive(Default)]
pub(super) struct Stage {
    pub(super) ring: Option<Ring>,
    pub(super) work: Work,
}

impl Stage {
    /// The ring for chunks of `chunk` bytes, made if need be (`held`: the bytes of staging
    /// memory held, kept up to date); `None` when it cannot be made.
    pub(super) fn ring(
        &mut self,
        cur: &Current<'_>,
        chunk: usize,
        held: &AtomicUsize,
    ) -> Option<&mut Ring> {
        if let Some(r) = self.ring.take_if(|r| r.chunk() != chunk) {
            held.fetch_sub(r.bytes(), Ordering::Relaxed);
        }
        if self.ring.is_none() {
            let r = Ring::new(cur, chunk).ok()?;
            held.fetch_add(r.bytes(), Ordering::Relaxed);
            self.ring = Some(r);
        }
        self.ring.as_mut()
    }
}

/// Moves `work` (packed by [`Work::pack`]) through `ring`, the copies across the link on
/// `stream` and the 2D copies inside device memory on the ring's own
/// stream (the engines run both at once: one stream would serialize them), after `fork`;
/// records `done` on `stream` after every copy. Returns once the move completed (offload: the
/// last host row stored) or, for a load, once every copy is queued. Once `hand_over` says so
/// (checked between chunks, until it says so once), the chunks not yet begun go as 2D copies
/// across the link on `stream` instead (an offload then returns once `done` completed).
///
/// # Errors
/// [`Error::Driver`]: a copy or an event refused, or a copy failed; both streams are drained
/// before it returns.
///
/// # Safety
/// 1. Every piece lies within the mover's tensors (device rows at `shape.device_pitch`, host
///    rows at `shape.host_pitch`), whose memory stays valid until `done` completed; nothing else
///    writes a destination row (or a source row) until then except work ordered before `fork`.
/// 2. `stream` is a live stream of the current context, not the legacy one.
#[allow(clippy::too_many_arguments)]
pub(super) unsafe fn run(
    cur: &Current<'_>,
    ring: &mut Ring,
    direction: Direction,
    work: &Work,
    shape: Shape,
    stream: StreamHandle,
    fork: &Event,
    done: &Event,
    hand_over: &dyn Fn() -> bool,
) -> Result<()> {
    let flow = Flow::new(
        direction,
        work,
        shape,
        (ring.host_slot(0), SLOTS, ring.chunk),
    );
    // Copies queued before a failure or a panic cannot be followed: both streams drained before
    // the move is reported failed.
    let mut drain = Drain {
        cur,
        device: Arc::clone(&ring.device),
        stream,
        armed: true,
    };
    // The issuing thread queues the copies and polls their events while the copy threads work
    // through the open chunks' host rows (and the issuing thread with them when it has nothing
    // else to do), with no barrier between chunks.
    let moved = match crate::host::workers::workers() {
        // SAFETY: the caller's contract.
        None => unsafe { drive(cur, ring, &flow, stream, (fork, done), hand_over, &|_| {}) },
        Some(pool) => pool.in_place_scope(|s| {
            let threads = pool.current_num_threads();
            // Copy threads for a chunk just opened: as many as it has tasks, up to the pool's
            // size with those still at work ([`Flow::work`]). SeqCst, with the opening before it
            // and a leaving thread's own pair: it sees the chunk, or this sees it gone.
            let spawn = |tasks: usize| {
                let want = threads
                    .saturating_sub(flow.alive.load(Ordering::SeqCst))
                    .min(tasks);
                flow.alive.fetch_add(want, Ordering::SeqCst);
                for _ in 0..want {
                    s.spawn(|_| flow.work());
                }
            };
            // SAFETY: the caller's contract.
            let driven =
                unsafe { drive(cur, ring, &flow, stream, (fork, done), hand_over, &spawn) };
            // A failure: the copy threads take no further task (the scope waits for those at
            // work).
            flow.stop.store(true, Ordering::Relaxed);
            driven
        }),
    };
    drain.armed = moved.is_err();
    moved
}

/// Drains a staged move's two streams when dropped armed: on a failure, and on a panic's unwind.
struct Drain<'a, 'c> {
    cur: &'a Current<'c>,
    device: Arc<Stream>,
    stream: StreamHandle<'a>,
    armed: bool,
}

impl Drop for Drain<'_, '_> {
    fn drop(&mut self) {
        if self.armed {
            let _ = self.device.handle().synchronize(self.cur);
            let _ = self.stream.synchronize(self.cur);
        }
    }
}

/// The issuing thread's part of a staged move. Chunk `j` (slot `k = j % SLOTS`) opens to the
/// copy threads once its host slot may be used (offload: its copy across landed; load: the
/// slot's last copy across completed), is `finished` once its tasks are done, and is issued
/// (offload: the 2D gathers and the copy across of chunk `j`, once chunk `j - SLOTS` finished;
/// load: the copy across and the 2D scatters of chunk `j`, once it finished). Handed over, the
/// chunks not yet begun (neither issued nor opened) go by [`across`] and the move ends with
/// the chunks before them.
///
/// # Safety
/// As [`run`].
unsafe fn drive(
    cur: &Current<'_>,
    ring: &mut Ring,
    flow: &Flow<'_>,
    stream: StreamHandle,
    (fork, done): (&Event, &Event),
    hand_over: &dyn Fn() -> bool,
    spawn: &dyn Fn(usize),
) -> Result<()> {
    let work = flow.work;
    let mut n = work.ends.len();
    // Bytes handed over to 2D copies across the link (0: none, or not yet).
    let mut handed = 0;
    let device = Arc::clone(&ring.device);
    let dev = device.handle();
    let offload = flow.direction == Direction::Offload;
    if offload {
        fork.wait_on_in(cur, dev)?;
    } else {
        // The host rows are read on the host: after the work before the call.
        wait_until(&Backoff::new(Duration::ZERO), None, || fork.query())?;
        fork.wait_on_in(cur, stream)?;
    }
    let (mut opened, mut finished, mut issued) = (0, 0, 0);
    let mut idle: Option<Backoff> = None;
    loop {
        if flow.stop.load(Ordering::Relaxed) {
            // A copy thread's task panicked: it is never done.
            return Err(Error::Driver(DriverError::new(
                "pinstage: staged block move (a copy thread panicked)",
                cudarc::driver::sys::CUresult::CUDA_ERROR_UNKNOWN,
            )));
        }
        let mut moved = false;
        // Offload: chunks from `issued` on are not begun (`opened <= issued`); load: from
        // `opened` on (`issued <= opened`).
        let begun = opened.max(issued);
        if handed == 0 && begun < n && hand_over() {
            handed = (begun..n).map(|j| work.chunk(j).1).sum::<usize>().max(1);
            if offload {
                // The copies across read the device blocks: after the work before the call.
                fork.wait_on_in(cur, stream)?;
            }
            // SAFETY: the caller's contract (the pieces of chunks `begun..n` are no chunk's
            // that the ring moves: those end at `begun`).
            unsafe { across(work, begun..n, flow.direction, flow.shape, stream) }?;
            n = begun;
            handover_counted();
        }
        if offload {
            // Chunk j's gathers into device slot k on the ring's stream (its last reader, chunk
            // j - SLOTS's copy across, completed: it opened), then the copy across on
            // `stream` once they ran; host slot k was scattered (chunk j - SLOTS finished).
            while issued < n.min(finished + SLOTS) {
                let (part, used) = work.chunk(issued);
                let k = issued % SLOTS;
                for p in part {
                    // SAFETY: the caller's contract 1 for the device rows; the staging rows lie
                    // within slot k (packed: `off + rows * len <= used <= chunk`).
                    unsafe { rows_2d(true, ring.dev_slot(k), p, flow.shape, dev) }?;
                }
                Ring::record(&mut ring.staged[k], cur, dev)?;
                // Seeded bug `staged_no_join`: the copy across does not wait for the gathers.
                #[cfg(not(pinstage_seeded_bug = "staged_no_join"))]
                ring.staged[k]
                    .as_ref()
                    .expect("recorded")
                    .wait_on_in(cur, stream)?;
                // SAFETY: slot k of both rings, `used` bytes, ordered as said above.
                unsafe { memcpy_async(ring.host_slot(k), ring.dev_slot(k), used, stream.raw()) }?;
                Ring::record(&mut ring.crossed[k], cur, stream)?;
                (issued, moved) = (issued + 1, true);
            }
            if finished == n {
                // Every copy's completion was seen on the host (a failed copy fails its event).
                done.record_in(cur, stream)?;
                if handed > 0 {
                    // The chunks handed over land with `done`: the move completes then, as
                    // every staged offload does, once the host blocks hold the data.
                    wait_until(&Backoff::new(copy_time(handed)), None, || done.query())?;
                }
                return Ok(());
            }
        } else {
            while issued < finished {
                let (part, used) = work.chunk(issued);
                let k = issued % SLOTS;
                // The device slot's last readers (the scatters of the chunk before in slot k,
                // this move's or an earlier one's) ran before the copy across rewrites it.
                if let Some(e) = &ring.staged[k] {
                    e.wait_on_in(cur, stream)?;
                }
                // SAFETY: slot k of both rings, `used` bytes, gathered (the chunk finished),
                // ordered after its last readers.
                unsafe { memcpy_async(ring.dev_slot(k), ring.host_slot(k), used, stream.raw()) }?;
                Ring::record(&mut ring.crossed[k], cur, stream)?;
                ring.crossed[k]
                    .as_ref()
                    .expect("recorded")
                    .wait_on_in(cur, dev)?;
                for p in part {
                    // SAFETY: the caller's contract 1 for the device rows; the staging rows
                    // lie within slot k, landed (the wait above).
                    unsafe { rows_2d(false, ring.dev_slot(k), p, flow.shape, dev) }?;
                }
                Ring::record(&mut ring.staged[k], cur, dev)?;
                (issued, moved) = (issued + 1, true);
            }
            if issued == n {
                // `done` after the last scatters: the ring's stream joined back.
                if let Some(e) = &ring.staged[(n + SLOTS - 1) % SLOTS] {
                    e.wait_on_in(cur, stream)?;
                }
                return done.record_in(cur, stream);
            }
        }
        // Slot k's crossing event: an offload's chunk `opened` was issued (`opened < issued`),
        // so it is that chunk's own crossing; for a load it is the last crossing out of host
        // slot k before chunk `opened`'s (chunk `opened - SLOTS`'s, issued, or an earlier
        // move's).
        let k = opened % SLOTS;
        let open = opened < n
            && if offload {
                // Seeded bug `staged_early_scatter`: the scatters do not wait for the landing.
                opened < issued
                    && (cfg!(pinstage_seeded_bug = "staged_early_scatter") || ring.crossed(k)?)
            } else {
                (opened < SLOTS || issued > opened - SLOTS) && ring.crossed(k)?
            };
        if open {
            opened += 1;
            flow.open.store(opened, Ordering::SeqCst);
            spawn(work.left[opened - 1].load(Ordering::Relaxed));
            moved = true;
        }
        while finished < opened && work.left[finished].load(Ordering::Acquire) == 0 {
            (finished, moved) = (finished + 1, true);
        }
        if moved {
            idle = None;
        } else if let Some(t) = flow.claim() {
            flow.task(t);
            idle = None;
        } else {
            idle.get_or_insert_with(|| Backoff::new(copy_time(flow.chunk)))
                .pause();
        }
    }
}

/// Queues 2D copies across the link on `stream` for `chunks` of `work`: each piece's rows
/// straight between its device rows and its host rows.
///
/// # Safety
/// As [`run`].
unsafe fn across(
    work: &Work,
    chunks: std::ops::Range<usize>,
    direction: Direction,
    shape: Shape,
    stream: StreamHandle,
) -> Result<()> {
    for j in chunks {
        for p in work.chunk(j).0 {
            // One tensor (pitch 0): one row, any pitch of at least its width.
            let (device, host) = match direction {
                Direction::Offload => (p.src, p.dst),
                Direction::Load => (p.dst, p.src),
            };
            let device = Pitched {
                addr: device,
                pitch: shape.device_pitch.max(p.len),
                host: false,
            };
            let host = Pitched {
                addr: host,
                pitch: shape.host_pitch.max(p.len),
                host: true,
            };
            let (dst, src) = match direction {
                Direction::Offload => (host, device),
                Direction::Load => (device, host),
            };
            // SAFETY: the caller's contract 1; rows of `p.len <= pitch` bytes on both sides,
            // the pitches within a 2D copy's (`strides`).
            unsafe { memcpy_2d_async(dst, src, p.len, shape.rows, stream.raw()) }?;
        }
    }
    Ok(())
}

/// Staged moves that handed chunks over ([`run`]), counted for the tests (`testing`).
#[cfg(feature = "testing")]
static HANDOVERS: AtomicUsize = AtomicUsize::new(0);

fn handover_counted() {
    #[cfg(feature = "testing")]
    HANDOVERS.fetch_add(1, Ordering::Relaxed);
}

/// How many staged moves handed their chunks not yet begun over to 2D copies so far.
#[cfg(feature = "testing")]
#[doc(hidden)]
pub fn staged_handovers() -> usize {
    HANDOVERS.load(Ordering::Relaxed)
}

/// Queues the 2D copy between piece `p`'s device rows and its staged rows at `slot + p.off`:
/// into staging (`gather`) or out of it.
///
/// # Safety
/// As [`run`]'s contract 1 and 2; the staging rows lie within the slot.
unsafe fn rows_2d(
    gather: bool,
    slot: u64,
    p: &Piece,
    shape: Shape,
    stream: StreamHandle,
) -> std::result::Result<(), DriverError> {
    let rows = Pitched {
        addr: if gather { p.src } else { p.dst },
        // One tensor (pitch 0): one row, any pitch of at least its width.
        pitch: shape.device_pitch.max(p.len),
        host: false,
    };
    let staged = Pitched {
        addr: slot + p.off as u64,
        pitch: p.len,
        host: false,
    };
    let (dst, src) = if gather {
        (staged, rows)
    } else {
        (rows, staged)
    };
    // SAFETY: the caller's contract; rows of `p.len <= pitch` bytes on both sides.
    unsafe { memcpy_2d_async(dst, src, p.len, shape.rows, stream.raw()) }
}
