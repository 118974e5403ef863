//! Moves through staging buffers ([`Strategy::Staged`](super::Strategy::Staged)), for moves in
//! the background between tensors at one stride: the copy engines gather (offload) or scatter
//! (load) the blocks inside device memory with 2D copies, ONE contiguous copy per chunk crosses
//! the link, and pinstage's copy threads scatter (offload) or gather (load) the host blocks.
//! Small blocks cross the link as single rows far below its rate; inside device memory the same
//! rows move at hundreds of GB/s, and the host side's rows are plain memory copies
//! (lab/c/blocks_stage.c: on an H100, 4-32 KiB blocks at 39-49 GB/s against 16-39 for 2D copies
//! across the link).
//!
//! A mover's thread of each direction owns a ring of [`SLOTS`] chunks of [`Staging`]'s chunk
//! size in device memory and as many in pinned host memory, and a stream of its own for the 2D
//! copies inside device memory (the copies across the link go on the thread's stream: on one
//! stream the two would run one after the other), made at its first staged move and kept until
//! the mover goes. Per chunk `j` in slot `k = j % SLOTS`:
//! - offload: the 2D gathers into device slot `k` on the ring's stream (after the caller's
//!   fork), then, once they ran, one device-to-host copy into host slot `k` and event `k` on the
//!   thread's stream; the thread waits for event `k` on the host, the copy threads scatter the
//!   host slot into the host blocks, and only then is chunk `j + SLOTS` issued (it lands in the
//!   slot just read). The move completes with the last scatter: its ticket is settled then, so
//!   `wait`, `done` and `stream_wait` see it complete only once the host blocks hold the data.
//! - load: the thread waits on the host for the caller's fork (the host blocks it reads may be
//!   written by work queued before the call), then per chunk waits for event `k` (the copy that
//!   last read host slot `k`), the copy threads gather the host blocks into host slot `k`, and
//!   it issues the host-to-device copy (after the slot's last 2D scatters) and event `k` on the
//!   thread's stream, and the 2D scatters into the device blocks on the ring's stream after it;
//!   the ticket's event is recorded on the thread's stream once the last scatters ran.
//!
//! Nothing waits on the device for a value the host writes later: every wait is on an event
//! recorded before it.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use rayon::prelude::*;

use super::chunks::Piece;
use super::copy::Direction;
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

/// ... and copies (a run's bytes in one tensor and part, on average) of less than this: at 64
/// KiB the 2D copies across the link already run near one contiguous copy's rate.
pub(super) const AUTO_BELOW_COPY: usize = 48 << 10;

/// Whether a mover's moves in the background go through staging buffers
/// ([`BlockMover::set_staging`](super::BlockMover::set_staging)).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Staging {
    /// Where it pays as measured (default): moves of 8 MiB or more whose copies average less
    /// than 48 KiB, between tensors at one stride within one allocation on each side (or one
    /// tensor each).
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

    /// Waits on the host for the last crossing of slot `k`.
    fn wait_crossed(&self, k: usize) -> Result<()> {
        match &self.crossed[k] {
            Some(e) => wait_for(e, self.chunk),
            None => Ok(()),
        }
    }

    /// Records `slot`'s event on `stream`, after the work just queued there.
    fn record(slot: &mut Option<Event>, cur: &Current<'_>, stream: StreamHandle) -> Result<()> {
        let e = match slot.take() {
            Some(e) => e,
            None => Event::new_in(cur)?,
        };
        e.record_in(cur, stream)?;
        *slot = Some(e);
        Ok(())
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
/// made anew when the chunk size changes), and the pieces of the move at hand.
#[derive(Default)]
pub(super) struct Stage {
    pub(super) ring: Option<Ring>,
    pub(super) pieces: Vec<Piece>,
    pub(super) ends: Vec<(usize, usize)>,
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

    /// Lets the ring go (the thread is ending), `held` kept up to date.
    pub(super) fn release(&mut self, held: &AtomicUsize) {
        if let Some(r) = self.ring.take() {
            held.fetch_sub(r.bytes(), Ordering::Relaxed);
        }
    }
}

/// Waits on the host for `event` (about `bytes` crossing the link).
fn wait_for(event: &Event, bytes: usize) -> Result<()> {
    wait_until(&Backoff::new(copy_time(bytes)), None, || event.query()).map(|_| ())
}

/// The layout of a staged move: the 2D segments' rows and the strides of both sides.
#[derive(Clone, Copy, Debug)]
pub(super) struct Shape {
    /// Rows of every segment: one per tensor.
    pub(super) rows: usize,
    /// Bytes between consecutive tensors on the device side and on the host side.
    pub(super) device_pitch: usize,
    pub(super) host_pitch: usize,
}

/// Moves `pieces` (packed by [`pack`](super::chunks::pack) into `ends`) through `ring`, the
/// copies across the link on `stream` and the 2D copies inside device memory on the ring's own
/// stream (the engines run both at once: one stream would serialize them), after `fork`;
/// records `done` on `stream` after every copy. Returns once the move completed (offload: the
/// last host row stored) or, for a load, once every copy is queued.
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
    chunks: (&[Piece], &[(usize, usize)]),
    shape: Shape,
    stream: StreamHandle,
    fork: &Event,
    done: &Event,
) -> Result<()> {
    // SAFETY: the caller's contract.
    let moved = unsafe { run_on(cur, ring, direction, chunks, shape, stream, fork, done) };
    if moved.is_err() {
        // Copies queued before the failure cannot be followed: drained before the error returns.
        let _ = ring.device.handle().synchronize(cur);
        let _ = stream.synchronize(cur);
    }
    moved
}

/// [`run`]'s work, without the drain on failure.
///
/// # Safety
/// As [`run`].
#[allow(clippy::too_many_arguments)]
unsafe fn run_on(
    cur: &Current<'_>,
    ring: &mut Ring,
    direction: Direction,
    (pieces, ends): (&[Piece], &[(usize, usize)]),
    shape: Shape,
    stream: StreamHandle,
    fork: &Event,
    done: &Event,
) -> Result<()> {
    let chunk_of = |j: usize| {
        let start = if j == 0 { 0 } else { ends[j - 1].0 };
        (&pieces[start..ends[j].0], ends[j].1)
    };
    let device = Arc::clone(&ring.device);
    let dev = device.handle();
    match direction {
        Direction::Offload => {
            fork.wait_on_in(cur, dev)?;
            // Chunk j: the gathers into device slot k on the ring's stream (its last reader,
            // chunk j - SLOTS's copy across, completed: the host waited for it), then the copy
            // across on `stream` once they ran.
            let issue = |ring: &mut Ring, j: usize| -> Result<()> {
                let (part, used) = chunk_of(j);
                let k = j % SLOTS;
                for p in part {
                    // SAFETY: the caller's contract 1 for the device rows; the staging rows lie
                    // within slot k (packed: `off + rows * len <= used <= chunk`).
                    unsafe { rows_2d(true, ring.dev_slot(k), p, shape, dev) }?;
                }
                Ring::record(&mut ring.staged[k], cur, dev)?;
                // Seeded bug `staged_no_join`: the copy across does not wait for the gathers.
                #[cfg(not(pinstage_seeded_bug = "staged_no_join"))]
                ring.staged[k]
                    .as_ref()
                    .expect("recorded")
                    .wait_on_in(cur, stream)?;
                // SAFETY: slot k of both rings, `used` bytes; the host slot was scattered
                // (or never used) before this call, as `run` issues chunk j after chunk
                // j - SLOTS's scatter.
                unsafe { memcpy_async(ring.host_slot(k), ring.dev_slot(k), used, stream.raw()) }?;
                Ring::record(&mut ring.crossed[k], cur, stream)
            };
            for j in 0..ends.len().min(SLOTS) {
                issue(ring, j)?;
            }
            for j in 0..ends.len() {
                let k = j % SLOTS;
                #[cfg(not(pinstage_seeded_bug = "staged_early_scatter"))]
                ring.wait_crossed(k)?;
                let (part, _) = chunk_of(j);
                // SAFETY: the host slot landed (event k, recorded after its copy); the caller's
                // contract 1 for the host rows.
                unsafe { host_rows(Direction::Offload, ring.host_slot(k), part, shape) };
                if j + SLOTS < ends.len() {
                    issue(ring, j + SLOTS)?;
                }
            }
            // Every copy's completion was seen on the host (a failed copy fails its event).
            Ok(done.record_in(cur, stream)?)
        }
        Direction::Load => {
            // The host rows are read on the host: after the work before the call.
            wait_for(fork, 0)?;
            fork.wait_on_in(cur, stream)?;
            for j in 0..ends.len() {
                let k = j % SLOTS;
                let (part, used) = chunk_of(j);
                ring.wait_crossed(k)?;
                // SAFETY: the host slot's last copy completed (event k); the caller's contract
                // 1 for the host rows.
                unsafe { host_rows(Direction::Load, ring.host_slot(k), part, shape) };
                // The device slot's last readers (the scatters of the chunk before in slot k,
                // this move's or an earlier one's) ran before the copy across rewrites it.
                if let Some(e) = &ring.staged[k] {
                    e.wait_on_in(cur, stream)?;
                }
                // SAFETY: slot k of both rings, `used` bytes, ordered after its last readers.
                unsafe { memcpy_async(ring.dev_slot(k), ring.host_slot(k), used, stream.raw()) }?;
                Ring::record(&mut ring.crossed[k], cur, stream)?;
                ring.crossed[k]
                    .as_ref()
                    .expect("recorded")
                    .wait_on_in(cur, dev)?;
                for p in part {
                    // SAFETY: the caller's contract 1 for the device rows; the staging rows
                    // lie within slot k, landed (the wait above).
                    unsafe { rows_2d(false, ring.dev_slot(k), p, shape, dev) }?;
                }
                Ring::record(&mut ring.staged[k], cur, dev)?;
            }
            // `done` after the last scatters: the ring's stream joined back.
            let last = (ends.len() + SLOTS - 1) % SLOTS;
            if let Some(e) = &ring.staged[last] {
                e.wait_on_in(cur, stream)?;
            }
            Ok(done.record_in(cur, stream)?)
        }
    }
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

/// Row copies of one task of the copy threads: about 32 KiB (a 16 MiB chunk is 512 tasks).
const TASK_BYTES: usize = 32 << 10;

/// Copies every host row of `part` between the host blocks and host staging at `slot` (offload:
/// staging into the blocks; load: the blocks into staging), on pinstage's copy threads, with
/// non-temporal stores where the destination allows.
///
/// # Safety
/// The staged rows lie within host staging (`slot`), the host rows within the host tensors; no
/// one else touches either until the call returns.
unsafe fn host_rows(direction: Direction, slot: u64, part: &[Piece], shape: Shape) {
    let rows = shape.rows;
    let row = move |t: usize| {
        let (p, i) = (&part[t / rows], t % rows);
        let staged = slot + (p.off + i * p.len) as u64;
        let host = match direction {
            Direction::Offload => p.dst,
            Direction::Load => p.src,
        } + (i * shape.host_pitch) as u64;
        let (dst, src) = match direction {
            Direction::Offload => (host, staged),
            Direction::Load => (staged, host),
        };
        // SAFETY: the caller's contract; a host row and a staged row never overlap (staging is
        // the mover's own memory); `fill` takes non-temporal stores only at 16-byte alignment.
        unsafe {
            crate::host::bounce::fill(dst as *mut u8, src as *const u8, p.len, dst % 16 == 0)
        };
    };
    let n = part.len() * rows;
    let per_task = (TASK_BYTES / part.first().map_or(1, |p| p.len.max(1))).max(1);
    match crate::host::workers::workers() {
        Some(pool) if n > per_task => pool.install(|| {
            (0..n).into_par_iter().with_min_len(per_task).for_each(row);
        }),
        _ => (0..n).for_each(row),
    }
}

/// Why a move in the background is staged.
pub(super) fn reason(staging: Staging, default_chunk: bool) -> &'static str {
    macro_rules! staged {
        ($why:expr) => {
            concat!(
                "2D copies gather (offload) or scatter (load) the blocks inside device memory, \
                 one copy per chunk crosses the link, and pinstage's copy threads scatter or \
                 gather the host blocks",
                $why
            )
        };
    }
    match (staging, default_chunk) {
        (Staging::Auto, true) => staged!(
            " (a move in the background of 8 MiB or more whose copies average under 48 KiB, \
             which cross the link as single rows far below its rate; chunks of 16 MiB)"
        ),
        (Staging::Auto, false) => staged!(
            " (a move in the background of 8 MiB or more whose copies average under 48 KiB, \
             which cross the link as single rows far below its rate)"
        ),
        _ => staged!(" (staging set to always)"),
    }
}

/// The driver error of a staged move's failure (a refused allocation never gets here).
pub(super) fn driver_error(e: Error) -> DriverError {
    match e {
        Error::Driver(e) => e,
        _ => DriverError::new(
            "pinstage: staged block move",
            cudarc::driver::sys::CUresult::CUDA_ERROR_UNKNOWN,
        ),
    }
}
