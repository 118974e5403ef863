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
//! size in device memory and as many in pinned host memory, made at its first staged move and
//! kept until the mover goes. Per chunk `j` in slot `k = j % SLOTS`:
//! - offload: on the thread's stream (after the caller's fork), the 2D gathers into device slot
//!   `k`, one device-to-host copy into host slot `k`, event `k`; the thread waits for event `k`
//!   on the host, the copy threads scatter the host slot into the host blocks, and only then is
//!   chunk `j + SLOTS` issued (it lands in the slot just read). The move completes with the last
//!   scatter: its ticket is settled then, so `wait`, `done` and `stream_wait` see it complete
//!   only once the host blocks hold the data.
//! - load: the thread waits on the host for the caller's fork (the host blocks it reads may be
//!   written by work queued before the call), then per chunk waits for event `k` (the copy that
//!   last read host slot `k`), the copy threads gather the host blocks into host slot `k`, and
//!   it issues the host-to-device copy, event `k`, and the 2D scatters into the device blocks;
//!   the ticket's event is recorded after the last scatter.
//!
//! Nothing waits on the device for a value the host writes later: every wait is on an event
//! recorded before it.

use std::sync::atomic::{AtomicUsize, Ordering};

use rayon::prelude::*;

use super::copy::Direction;
use super::plan::Segment;
use crate::cuda::wait::{Backoff, copy_time, wait_until};
use crate::cuda::{Current, Device, Event, StreamHandle};
use crate::driver::DriverError;
use crate::driver::mem::{Pitched, mem_alloc, memcpy_2d_async, memcpy_async};
use crate::error::{Error, Result};
use crate::host::{PinnedBuffer, PinnedFlags};

/// Chunks in a ring: one scattered (or gathered) by the copy threads while the others cross.
pub(super) const SLOTS: usize = 4;

/// Bytes of one chunk unless the mover is told otherwise ([`Staging`]).
pub const DEFAULT_CHUNK: usize = 16 << 20;

/// The fewest and the most bytes of one chunk.
pub const CHUNK_RANGE: std::ops::RangeInclusive<usize> = (64 << 10)..=(1 << 30);

/// The fewest bytes one row of a chunk may hold: a chunk must fit every tensor's row of a
/// piece at least this long.
const MIN_ROW: usize = 512;

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
    /// Every move in the background between tensors at one stride (tests, measurements).
    Always,
    /// Never: moves in the background go as moves on the caller's thread do.
    Never,
}

/// One piece of a chunk: a row of `len` bytes in each of `rows` tensors, from `src` and into
/// `dst` (each side stepping by its tensors' stride), staged packed at `off` (row `i` at
/// `off + i * len`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Piece {
    pub(super) src: u64,
    pub(super) dst: u64,
    pub(super) len: usize,
    pub(super) off: usize,
}

/// Whether a chunk of `chunk` bytes can hold `rows` rows of a piece.
pub(super) fn fits(rows: usize, chunk: usize) -> bool {
    rows > 0 && chunk / rows >= MIN_ROW
}

/// Packs the 2D `segments` (each `rows` rows) into chunks of at most `chunk` bytes: `pieces` in
/// order, and per chunk the end of its pieces and the bytes it uses. A segment longer than a
/// chunk's room is split (at a row length of at least [`MIN_ROW`] where it continues a chunk).
pub(super) fn pack(
    segments: &[Segment],
    rows: usize,
    chunk: usize,
    pieces: &mut Vec<Piece>,
    ends: &mut Vec<(usize, usize)>,
) {
    debug_assert!(fits(rows, chunk));
    pieces.clear();
    ends.clear();
    let most = chunk / rows;
    let mut used = 0;
    for s in segments {
        let mut at = 0;
        while at < s.len {
            let room = (chunk - used) / rows;
            let mut len = (s.len - at).min(most);
            if len > room {
                if room < MIN_ROW {
                    ends.push((pieces.len(), used));
                    used = 0;
                    continue;
                }
                len = room;
            }
            pieces.push(Piece {
                src: s.src + at as u64,
                dst: s.dst + at as u64,
                len,
                off: used,
            });
            used += len * rows;
            at += len;
        }
    }
    if used > 0 {
        ends.push((pieces.len(), used));
    }
}

/// Device memory of a ring (`cuMemAlloc`), freed on the reaper once the device drained.
struct DeviceMem {
    ptr: u64,
    device: Device,
}

impl DeviceMem {
    fn new(cur: &Current<'_>, len: usize) -> Result<Self> {
        let ptr = crate::host::retry_after_frees(|| {
            // SAFETY: a context is current (`cur`).
            unsafe { mem_alloc(len.max(1)) }
                .map_err(|e| Error::allocation(e, "block mover staging", len))
        })?;
        Ok(Self {
            ptr,
            device: cur.device().clone(),
        })
    }

    fn ptr(&self) -> u64 {
        self.ptr
    }
}

impl Drop for DeviceMem {
    fn drop(&mut self) {
        // SAFETY: allocated in `new` in the device's primary context, freed once; the ring's
        // copies completed (`Ring`'s drop waits for them first).
        unsafe { crate::host::reaper::free_device_memory(self.device.clone(), self.ptr) };
    }
}

/// A thread's staging: [`SLOTS`] chunks in device memory and in pinned host memory, and per
/// slot the event after the last copy across the link that used it.
pub(super) struct Ring {
    dev: DeviceMem,
    host: PinnedBuffer,
    chunk: usize,
    crossed: Vec<Option<Event>>,
}

impl Ring {
    /// A ring of chunks of `chunk` bytes.
    ///
    /// # Errors
    /// [`Error::Allocation`] and the like: no memory (the move then goes unstaged).
    pub(super) fn new(cur: &Current<'_>, chunk: usize) -> Result<Self> {
        Ok(Self {
            dev: DeviceMem::new(cur, SLOTS * chunk)?,
            host: PinnedBuffer::new(cur.device(), SLOTS * chunk, PinnedFlags::PORTABLE)?,
            chunk,
            crossed: (0..SLOTS).map(|_| None).collect(),
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

    /// Records slot `k`'s crossing on `stream`, after the copy just queued.
    fn record_crossed(&mut self, cur: &Current<'_>, k: usize, stream: StreamHandle) -> Result<()> {
        let e = match self.crossed[k].take() {
            Some(e) => e,
            None => Event::new_in(cur)?,
        };
        e.record_in(cur, stream)?;
        self.crossed[k] = Some(e);
        Ok(())
    }
}

impl Drop for Ring {
    fn drop(&mut self) {
        // Every move that used the ring completed before its mover went; a copy still in
        // flight (a move whose failure was not drained) must not outlive the host memory.
        for e in self.crossed.iter().flatten() {
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

/// Moves `pieces` (packed by [`pack`] into `ends`) through `ring` on `stream`, after `fork`;
/// records `done` after the last copy queued. Returns once the move completed (offload: the
/// last host row stored) or, for a load, once every copy is queued.
///
/// # Errors
/// [`Error::Driver`]: a copy or an event refused, or a copy failed; the caller drains `stream`.
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
    match direction {
        Direction::Offload => {
            fork.wait_on_in(cur, stream)?;
            let issue = |ring: &mut Ring, j: usize| -> Result<()> {
                let (part, used) = chunk_of(j);
                let k = j % SLOTS;
                for p in part {
                    // SAFETY: the caller's contract 1 for the device rows; the staging rows lie
                    // within slot k (packed: `off + rows * len <= used <= chunk`).
                    unsafe { gather_rows(ring.dev_slot(k), p, shape, stream) }?;
                }
                // SAFETY: slot k of both rings, `used` bytes; the host slot was scattered
                // (or never used) before this call, as `run` issues chunk j after chunk
                // j - SLOTS's scatter.
                unsafe { memcpy_async(ring.host_slot(k), ring.dev_slot(k), used, stream.raw()) }?;
                ring.record_crossed(cur, k, stream)
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
            done.record_in(cur, stream)?;
            // Every copy's completion was seen on the host (a failed copy fails its event).
            Ok(())
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
                // SAFETY: slot k of both rings, `used` bytes; the device slot's last readers
                // (chunk j - SLOTS's scatters) were queued before on this stream.
                unsafe { memcpy_async(ring.dev_slot(k), ring.host_slot(k), used, stream.raw()) }?;
                ring.record_crossed(cur, k, stream)?;
                for p in part {
                    // SAFETY: the caller's contract 1 for the device rows; the staging rows
                    // lie within slot k.
                    unsafe { scatter_rows(ring.dev_slot(k), p, shape, stream) }?;
                }
            }
            Ok(done.record_in(cur, stream)?)
        }
    }
}

/// Queues the 2D copy of piece `p`'s device rows into staging at `slot + p.off`.
///
/// # Safety
/// As [`run`]'s contract 1 and 2; the staging rows lie within the slot.
unsafe fn gather_rows(
    slot: u64,
    p: &Piece,
    shape: Shape,
    stream: StreamHandle,
) -> std::result::Result<(), DriverError> {
    let src = Pitched {
        addr: p.src,
        // One tensor (pitch 0): one row, any pitch of at least its width.
        pitch: shape.device_pitch.max(p.len),
        host: false,
    };
    let dst = Pitched {
        addr: slot + p.off as u64,
        pitch: p.len,
        host: false,
    };
    // SAFETY: the caller's contract; rows of `p.len <= pitch` bytes on both sides.
    unsafe { memcpy_2d_async(dst, src, p.len, shape.rows, stream.raw()) }
}

/// Queues the 2D copy of piece `p`'s staged rows at `slot + p.off` into its device rows.
///
/// # Safety
/// As [`gather_rows`].
unsafe fn scatter_rows(
    slot: u64,
    p: &Piece,
    shape: Shape,
    stream: StreamHandle,
) -> std::result::Result<(), DriverError> {
    let src = Pitched {
        addr: slot + p.off as u64,
        pitch: p.len,
        host: false,
    };
    let dst = Pitched {
        addr: p.dst,
        pitch: shape.device_pitch.max(p.len),
        host: false,
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

#[cfg(test)]
mod tests {
    use super::*;

    fn seg(src: u64, dst: u64, len: usize) -> Segment {
        Segment { src, dst, len }
    }

    /// Every byte of every row of `segments` is staged exactly once, within its chunk, and the
    /// pieces of a chunk do not overlap.
    fn covers(segments: &[Segment], rows: usize, chunk: usize) {
        let (mut pieces, mut ends) = (Vec::new(), Vec::new());
        pack(segments, rows, chunk, &mut pieces, &mut ends);
        let mut start = 0;
        for &(end, used) in &ends {
            assert!(used <= chunk && used > 0 && end > start, "{ends:?}");
            let mut at = 0;
            for p in &pieces[start..end] {
                assert_eq!(p.off, at, "pieces packed in order");
                assert!(p.len > 0);
                at += p.len * rows;
            }
            assert_eq!(at, used);
            start = end;
        }
        assert_eq!(start, pieces.len());
        // The pieces, in order, cut the segments into consecutive spans.
        let mut it = pieces.iter();
        for s in segments {
            let mut at = 0;
            while at < s.len {
                let p = it.next().expect("a piece for every span");
                assert_eq!((p.src, p.dst), (s.src + at as u64, s.dst + at as u64));
                at += p.len;
            }
            assert_eq!(at, s.len);
        }
        assert!(it.next().is_none());
    }

    #[test]
    fn pack_stages_every_row_once_within_its_chunk() {
        let small: Vec<_> = (0..100)
            .map(|i| seg(i * 100_000, 7 + i * 90_000, 4096 + 17 * i as usize))
            .collect();
        for (rows, chunk) in [(1, 1 << 20), (3, 64 << 10), (64, 16 << 20), (7, 40_000)] {
            covers(&small, rows, chunk);
        }
        // A run longer than a chunk, between short ones.
        let long = [
            seg(0, 0, 5000),
            seg(1 << 30, 1 << 31, 3 << 20),
            seg(9, 9, 1),
        ];
        covers(&long, 4, 1 << 20);
        covers(&long, 1, 1 << 20);
        covers(&[], 4, 1 << 20);
    }

    #[test]
    fn pack_fills_chunks_and_splits_only_at_their_ends() {
        let (mut pieces, mut ends) = (Vec::new(), Vec::new());
        // 10 segments of 1000 bytes x 4 rows = 4000 bytes each into 10_000-byte chunks: two per
        // chunk, then the room left (2000 bytes: 500 a row) is under MIN_ROW: no split.
        let segs: Vec<_> = (0..10).map(|i| seg(i * 5000, i * 5000, 1000)).collect();
        pack(&segs, 4, 10_000, &mut pieces, &mut ends);
        assert_eq!(pieces.len(), 10);
        assert_eq!(
            ends,
            [(2, 8000), (4, 8000), (6, 8000), (8, 8000), (10, 8000)]
        );
        // A long segment continues a chunk with what room is left (600 a row), then fills
        // whole chunks.
        pack(
            &[seg(0, 0, 100), seg(0, 0, 6000)],
            4,
            3200,
            &mut pieces,
            &mut ends,
        );
        assert_eq!(
            pieces.iter().map(|p| p.len).collect::<Vec<_>>(),
            [100, 700, 800, 800, 800, 800, 800, 800, 500]
        );
        assert_eq!(ends.len(), 8);
        assert!(fits(4, 2048) && !fits(4, 2047) && !fits(0, 1 << 20));
    }
}
