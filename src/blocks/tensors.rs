//! A mover's tensors as planning sees them: the pairs, their block counts, how moves are issued
//! between them, and the checks of a move's ids. Shared by the mover and its issuing threads.

use std::sync::atomic::{AtomicU8, AtomicUsize, Ordering};

use parking_lot::Mutex;

use super::copy::{Choice, Direction, MovePlan, Strategy};
use super::issue::Issue;
use super::plan::{Pair, Run, check_ids, runs, segments_of};
use super::staged::{self, Shape, Staging};
use super::strides::{batch_threads, two_d_wins};
use super::tuning::{Pick, Tuning, Way};
use crate::cuda::{Current, StreamHandle};
use crate::error::{Error, Result};

/// A mover's tensors and how moves between them are issued: what planning a move needs, on the
/// caller's thread or on an issuing thread.
#[derive(Debug)]
pub(super) struct Tensors {
    pub(super) pairs: Box<[Pair]>,
    pub(super) device_blocks: usize,
    pub(super) host_blocks: usize,
    /// The bytes of one block id across every tensor.
    pub(super) block_bytes: usize,
    /// Parts per block id across every tensor (a copy each per run): the device layouts'
    /// `outer`s summed.
    pub(super) parts: usize,
    batched: bool,
    /// The address strides (device, host) between consecutive tensors when every side's
    /// tensors share one layout at one stride within one allocation (2D copies can then cross
    /// all tensors at once).
    strides: Option<(usize, usize)>,
    /// One bit per destination block for [`Tensors::check_unmerged`] (all zeros between checks).
    seen: Mutex<Vec<u64>>,
    /// The first read-only destination tensor of an offload (a host tensor) and of a load (a
    /// device tensor), found once: a check reads this, not every pair (a cache line or two
    /// each, which a call made after a long wait finds in no cache).
    read_only: [Option<usize>; 2],
    /// Which way moves between tensors at one stride go, timed on this device.
    tuning: Tuning,
    /// [`Staging`] as a number (its order), and the staging chunk's bytes: set on the mover,
    /// read by its issuing threads at each move.
    staging: AtomicU8,
    chunk: AtomicUsize,
    /// Per direction: the chunk size whose ring could not be made (0: none), so moves of that
    /// direction go unstaged (and `plan` says so) until the chunk size changes.
    refused: [AtomicUsize; 2],
    /// Bytes of staging memory the issuing threads hold (device and pinned host).
    pub(super) staging_held: AtomicUsize,
    /// The direction (its number + 1; 0: none) whose move goes through staging now, under
    /// [`Staging::Auto`]: one direction at a time ([`Tensors::take_staging`]).
    staging_now: AtomicU8,
}

impl Tensors {
    pub(super) fn new(pairs: Vec<Pair>, batched: bool, strides: Option<(usize, usize)>) -> Self {
        let read_only = [Direction::Offload, Direction::Load].map(|direction| {
            pairs.iter().position(|p| match direction {
                Direction::Offload => p.host_read_only,
                Direction::Load => p.device_read_only,
            })
        });
        Self {
            read_only,
            strides,
            device_blocks: pairs.iter().map(|p| p.device.num_blocks).min().unwrap_or(0),
            host_blocks: pairs.iter().map(|p| p.host.num_blocks).min().unwrap_or(0),
            block_bytes: pairs.iter().map(|p| p.device.bytes * p.device.outer).sum(),
            parts: pairs.iter().map(|p| p.device.outer).sum(),
            pairs: pairs.into(),
            batched,
            seen: Mutex::new(Vec::new()),
            tuning: Tuning::default(),
            staging: AtomicU8::new(0),
            chunk: AtomicUsize::new(staged::DEFAULT_CHUNK),
            refused: [AtomicUsize::new(0), AtomicUsize::new(0)],
            staging_held: AtomicUsize::new(0),
            staging_now: AtomicU8::new(0),
        }
    }

    /// Sets whether moves in the background go through staging, in chunks of `chunk` bytes.
    pub(super) fn set_staging(&self, staging: Staging, chunk: usize) {
        let n = match staging {
            Staging::Auto => 0,
            Staging::Always => 1,
            Staging::Never => 2,
        };
        self.staging.store(n, Ordering::Relaxed);
        self.chunk.store(chunk, Ordering::Relaxed);
    }

    /// `plan` (of a move in the background in `runs`) as a staged move issues it where
    /// [`Tensors::staged`] stages it: its 2D copies, and a copy per chunk across the link.
    pub(super) fn staged_plan(&self, plan: MovePlan, runs: &[Run]) -> MovePlan {
        let Some((shape, chunk)) = self.staged(plan.direction, plan.blocks, runs.len()) else {
            return plan;
        };
        let mut segments = Vec::new();
        if segments_of(&self.pairs, plan.direction, runs, true, &mut segments).is_err() {
            return plan;
        }
        let (mut pieces, mut ends) = (Vec::new(), Vec::new());
        super::chunks::pack(&segments, shape.rows, chunk, &mut pieces, &mut ends);
        MovePlan {
            strategy: Strategy::Staged,
            copies: pieces.len(),
            calls: pieces.len() + ends.len(),
            threads: crate::host::workers::workers().map_or(1, |w| w.current_num_threads()),
            reason: staged_reason(self.staging().0, chunk == staged::DEFAULT_CHUNK),
            choice: Choice::Table,
            ..plan
        }
    }

    /// Whether a move of `direction` that [`Tensors::staged`] stages, in copies of `copy_bytes`
    /// on average, may go through staging now. Under [`Staging::Auto`] one direction at a time
    /// (two staged at once move about what one moves: the host's memory carries both
    /// directions' staged bytes). A move that starts while the other direction's stages:
    /// - in copies under [`staged::PAIR_BELOW_COPY`] stages too (unstaged, they would cross the
    ///   link slower still);
    /// - from [`staged::PAIR_UNSTAGED_FROM`] goes unstaged and asks the staged move to hand its
    ///   chunks not yet begun over to 2D copies ([`StagingTurn::hand_over`]): neither stages;
    /// - between the two, a load stages and asks the offload to hand over (a load's rows cross
    ///   the link unstaged slower than an offload's), an offload goes unstaged.
    ///
    /// The turn ends when the returned value drops, once `staged::run` returned: an offload's
    /// move complete, a load's last copies queued (up to a ring's worth of them may still run
    /// beside the other direction's next move).
    pub(super) fn take_staging(
        &self,
        direction: Direction,
        copy_bytes: usize,
    ) -> Option<StagingTurn<'_>> {
        let mine = direction as u8 + 1;
        let turn = Some(StagingTurn {
            mark: &self.staging_now,
            mine,
            copy_bytes,
        });
        if self.staging().0 != Staging::Auto {
            return turn;
        }
        let small = copy_bytes < staged::PAIR_BELOW_COPY;
        let large = copy_bytes >= staged::PAIR_UNSTAGED_FROM;
        let beside = small || (direction == Direction::Load && !large);
        let asks = !small && (large || beside);
        let was = self
            .staging_now
            .fetch_update(Ordering::Acquire, Ordering::Relaxed, |v| {
                take_or_ask(v, mine, asks)
            })
            .unwrap_or_else(|v| v);
        // The mark taken (it was free); else a turn without it beside the other direction's:
        // its drop finds the other's mark (or none) and leaves it, and this direction's next
        // move runs after this one, on the same thread.
        (was & MARK == 0 || beside).then_some(turn).flatten()
    }

    /// Records that `direction`'s ring of `chunk`-byte chunks could not be made.
    pub(super) fn refuse_staging(&self, direction: Direction, chunk: usize) {
        self.refused[direction as usize].store(chunk, Ordering::Relaxed);
    }

    /// The staging mode and chunk bytes set.
    pub(super) fn staging(&self) -> (Staging, usize) {
        let mode = match self.staging.load(Ordering::Relaxed) {
            0 => Staging::Auto,
            1 => Staging::Always,
            _ => Staging::Never,
        };
        (mode, self.chunk.load(Ordering::Relaxed))
    }

    /// Whether a move in the background of `blocks` blocks in `runs` runs goes through staging
    /// ([`Staging`]): its shape and the chunk's bytes. Only between device tensors at one
    /// stride within one allocation (one 2D copy per run then gathers or scatters a chunk's
    /// rows of every tensor), or a single tensor, and host tensors likewise.
    pub(super) fn staged(
        &self,
        direction: Direction,
        blocks: usize,
        runs: usize,
    ) -> Option<(Shape, usize)> {
        let (device_pitch, host_pitch) = match (self.strides, self.pairs.len()) {
            (Some(s), _) => s,
            // One tensor: one row per piece, the pitch unused.
            (None, 1) => (0, 0),
            _ => return None,
        };
        let rows = self.pairs.len();
        let (mode, chunk) = self.staging();
        if self.refused[direction as usize].load(Ordering::Relaxed) == chunk {
            return None;
        }
        let go = match mode {
            Staging::Never => false,
            Staging::Always => true,
            Staging::Auto => {
                blocks * self.block_bytes >= staged::AUTO_MIN_BYTES
                    && self.copy_bytes(blocks, runs) < staged::AUTO_BELOW_COPY
            }
        };
        (go && runs > 0 && super::chunks::fits(rows, chunk)).then_some((
            Shape {
                rows,
                device_pitch,
                host_pitch,
            },
            chunk,
        ))
    }

    /// The (block count, id list name) of a move's source and destination sides.
    fn sides(&self, direction: Direction) -> ((usize, &'static str), (usize, &'static str)) {
        match direction {
            Direction::Offload => (
                (self.device_blocks, "device_ids"),
                (self.host_blocks, "host_ids"),
            ),
            Direction::Load => (
                (self.host_blocks, "host_ids"),
                (self.device_blocks, "device_ids"),
            ),
        }
    }

    /// The runs of a move of `src_ids[i]` into `dst_ids[i]` in `direction`.
    ///
    /// # Errors
    /// As [`runs`].
    pub(super) fn runs(
        &self,
        direction: Direction,
        src_ids: &[usize],
        dst_ids: &[usize],
    ) -> Result<Vec<Run>> {
        let (src, dst) = self.sides(direction);
        runs((src_ids, src.1), (dst_ids, dst.1), src.0, dst.0)
    }

    /// How a move of `blocks` blocks in `runs` runs is issued: as 2D copies across the tensors
    /// when they sit at one stride and 2D copies beat a batch there (as timed on this device,
    /// [`Tuning`]; until then [`two_d_wins`]' table), else batched where the driver can.
    /// `cur`: the device's context, where the caller has it entered: the timings that completed
    /// are taken in first.
    pub(super) fn how(
        &self,
        direction: Direction,
        blocks: usize,
        runs: usize,
        cur: Option<&Current<'_>>,
    ) -> (Issue, Pick) {
        if let Some(cur) = cur {
            self.tuning.harvest(cur);
        }
        let table = two_d_wins(direction, blocks, self.pairs[0].device.bytes, runs);
        let pick = match self.strides {
            Some(_) if self.batched && runs > 0 => self.tuning.pick(
                direction,
                self.copy_class(direction, blocks, runs),
                blocks * self.block_bytes,
                if table { Way::Strided } else { Way::Batched },
            ),
            _ => Pick::Table,
        };
        let two_d = pick.way().map_or(table, |way| way == Way::Strided);
        let issue = match self.strides {
            Some((device_pitch, host_pitch)) if two_d => {
                let (src_pitch, dst_pitch) = match direction {
                    Direction::Offload => (device_pitch, host_pitch),
                    Direction::Load => (host_pitch, device_pitch),
                };
                Issue::Strided {
                    src_pitch,
                    dst_pitch,
                    rows: self.pairs.len(),
                    to_host: direction == Direction::Offload,
                }
            }
            // The batch from one thread where the timings chose it over the split batch.
            _ if self.batched && pick.way() == Some(Way::BatchedOne) => {
                Issue::Batched { threads: 1 }
            }
            _ if self.batched => Issue::Batched {
                threads: batch_threads(direction, runs * self.parts, self.copy_bytes(blocks, runs)),
            },
            _ => Issue::PerCopy,
        };
        (issue, pick)
    }

    /// What sets a move's class for [`Tuning`]: its copies' bytes on average, and whether its
    /// batch would be issued from several threads.
    fn copy_class(&self, direction: Direction, blocks: usize, runs: usize) -> (usize, bool) {
        let copy_bytes = self.copy_bytes(blocks, runs);
        (
            copy_bytes,
            batch_threads(direction, runs * self.parts, copy_bytes) > 1,
        )
    }

    /// The bytes of one copy of a move of `blocks` blocks in `runs` runs, on average.
    pub(super) fn copy_bytes(&self, blocks: usize, runs: usize) -> usize {
        blocks * self.pairs[0].device.bytes / runs.max(1)
    }

    /// Issues a move's copies with `issue` (which issues them on `stream`), timed on the GPU
    /// when `pick` says so ([`Tuning`]); returns what `issue` returned.
    pub(super) fn issue_timed<T, E>(
        &self,
        cur: &Current<'_>,
        stream: StreamHandle,
        direction: Direction,
        (blocks, runs): (usize, usize),
        pick: Pick,
        issue: impl FnOnce() -> std::result::Result<T, E>,
    ) -> std::result::Result<T, E> {
        let Pick::Timing(way) = pick else {
            return issue();
        };
        let (class, bytes) = (
            self.copy_class(direction, blocks, runs),
            blocks * self.block_bytes,
        );
        let open = self.tuning.begin(cur, stream, direction, class, bytes, way);
        let issued = issue();
        if let Some(open) = open {
            self.tuning.end(cur, stream, open, issued.is_ok());
        }
        issued
    }

    /// Checks a move of `src_ids[i]` into `dst_ids[i]` in `direction`: its runs.
    pub(super) fn check(
        &self,
        direction: Direction,
        src_ids: &[usize],
        dst_ids: &[usize],
    ) -> Result<Vec<Run>> {
        let runs = self.runs(direction, src_ids, dst_ids)?;
        self.writable(direction, src_ids.len())?;
        Ok(runs)
    }

    /// Checks a move as [`Tensors::check`] does (the same errors in the same order) without
    /// merging its runs, for a move the issuing thread merges: the ids are read twice and one
    /// bit per destination block is marked, then cleared. (The bits are kept from call to call;
    /// a call that finds them in use by another thread, or the first call, allocates
    /// `blocks / 64` words.)
    pub(super) fn check_unmerged(
        &self,
        direction: Direction,
        src_ids: &[usize],
        dst_ids: &[usize],
    ) -> Result<()> {
        let (src, dst) = self.sides(direction);
        let mut guard = self.seen.try_lock();
        let mut own = Vec::new();
        let seen = guard.as_deref_mut().unwrap_or(&mut own);
        check_ids((src_ids, src.1), (dst_ids, dst.1), src.0, dst.0, seen)?;
        self.writable(direction, src_ids.len())
    }

    /// Refuses a move of `blocks` blocks (none: nothing to refuse) into a read-only tensor.
    fn writable(&self, direction: Direction, blocks: usize) -> Result<()> {
        match (self.read_only[direction as usize], blocks) {
            (Some(i), 1..) => Err(Error::arg(
                match direction {
                    Direction::Offload => "host_tensors",
                    Direction::Load => "device_tensors",
                },
                format!("tensor {i}, read-only"),
                "writable destinations",
            )),
            _ => Ok(()),
        }
    }
}

/// Why a move in the background is staged.
fn staged_reason(staging: Staging, default_chunk: bool) -> &'static str {
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
    macro_rules! auto {
        ($chunk:expr) => {
            staged!(concat!(
                " (a move in the background of 8 MiB or more whose copies average under 128 \
                 KiB, which cross the link as single rows far below its rate; ",
                $chunk,
                "unless the other direction's move goes through staging when it starts and these \
                 copies average 12 KiB or more; from 32 KiB, or for a load, that move then hands \
                 its chunks not yet begun over to 2D copies across the link, and a load stages \
                 under 32 KiB)"
            ))
        };
    }
    match (staging, default_chunk) {
        (Staging::Auto, true) => auto!("chunks of 16 MiB; "),
        (Staging::Auto, false) => auto!(""),
        _ => staged!(" (staging set to always)"),
    }
}

/// The direction bits of [`Tensors`]'s staging mark, and the bit the other direction sets to
/// ask the marked move to hand its chunks not yet begun over.
const MARK: u8 = 3;
const HAND_OVER: u8 = 4;

/// The staging mark `v` once direction `mine` tried to take it: its own if it was free, else
/// (`ask`) the hand-over bit added while the other direction holds it; `None`: left as it is.
fn take_or_ask(v: u8, mine: u8, ask: bool) -> Option<u8> {
    if v & MARK == 0 {
        Some(mine)
    } else {
        (ask && v & MARK != mine).then_some(v | HAND_OVER)
    }
}

/// A direction's turn at staging ([`Tensors::take_staging`]), ended when dropped (also when the
/// move panics).
pub(super) struct StagingTurn<'a> {
    mark: &'a AtomicU8,
    mine: u8,
    copy_bytes: usize,
}

impl StagingTurn<'_> {
    /// Whether the other direction's move asked this one to hand its chunks not yet begun over
    /// (only a turn that holds the mark is asked), and its copies are large enough to (below
    /// [`staged::PAIR_BELOW_COPY`] both stage).
    pub(super) fn hand_over(&self) -> bool {
        self.copy_bytes >= staged::PAIR_BELOW_COPY
            && self.mark.load(Ordering::Relaxed) == self.mine | HAND_OVER
    }
}

impl Drop for StagingTurn<'_> {
    fn drop(&mut self) {
        // Only a turn taken under `Staging::Auto` holds the mark; the hand-over bit goes with it.
        let _ = self
            .mark
            .fetch_update(Ordering::Release, Ordering::Relaxed, |v| {
                (v & MARK == self.mine).then_some(0)
            });
    }
}

#[cfg(test)]
mod tests {
    use super::super::tests::two_at_one_stride;
    use super::staged::{PAIR_BELOW_COPY, PAIR_UNSTAGED_FROM, Staging};
    use super::*;

    #[test]
    fn a_move_beside_a_staged_one_asks_it_to_hand_over_by_copy_size() {
        let t = two_at_one_stride();
        let (mid, large) = (PAIR_BELOW_COPY, PAIR_UNSTAGED_FROM);
        // From PAIR_UNSTAGED_FROM: the second move goes unstaged and asks; the marked turn
        // hands over.
        let off = t.take_staging(Direction::Offload, large).expect("first");
        assert!(!off.hand_over());
        assert!(t.take_staging(Direction::Load, large).is_none());
        assert!(off.hand_over());
        // The bit goes with the mark: the next turn is not asked.
        drop(off);
        let load = t.take_staging(Direction::Load, large).expect("free again");
        assert!(!load.hand_over());
        // Between the cuts an offload beside a staged load goes unstaged and asks nothing ...
        assert!(t.take_staging(Direction::Offload, mid).is_none());
        assert!(!load.hand_over());
        drop(load);
        // ... and a load beside a staged offload stages (a turn without the mark) and asks it.
        let off = t.take_staging(Direction::Offload, mid).expect("first");
        let beside = t.take_staging(Direction::Load, mid).expect("a load stages");
        assert!(off.hand_over() && !beside.hand_over());
        drop(beside);
        assert!(
            off.hand_over(),
            "the mark and its bit outlive the turn beside it"
        );
        drop(off);
        // Small copies: both stage, and a small turn is never asked to hand over.
        let small = t.take_staging(Direction::Offload, mid - 1).expect("first");
        assert!(t.take_staging(Direction::Load, large).is_none());
        assert!(!small.hand_over());
        let beside = t
            .take_staging(Direction::Load, mid - 1)
            .expect("small copies");
        assert!(!beside.hand_over());
        drop((small, beside));
        // A large move that finds the mark free takes it (the holder let go meanwhile).
        let load = t.take_staging(Direction::Load, large).expect("free");
        assert!(
            t.take_staging(Direction::Offload, mid).is_none(),
            "the mark is held"
        );
        drop(load);
        // Always: no mark, no asking.
        t.set_staging(Staging::Always, staged::DEFAULT_CHUNK);
        let off = t.take_staging(Direction::Offload, large).expect("always");
        assert!(t.take_staging(Direction::Load, large).is_some());
        assert!(!off.hand_over());
        // The mark: taken when free; asked only while the other direction holds it, again
        // included; never by its own direction.
        assert_eq!(take_or_ask(0, 1, true), Some(1));
        assert_eq!(take_or_ask(0, 2, false), Some(2));
        assert_eq!(take_or_ask(2, 1, true), Some(2 | HAND_OVER));
        assert_eq!(take_or_ask(2 | HAND_OVER, 1, true), Some(2 | HAND_OVER));
        assert_eq!(take_or_ask(2, 1, false), None);
        assert_eq!(take_or_ask(1, 1, true), None);
    }
}
