//! Which way a move between tensors at one stride goes, 2D copies across the tensors or batched
//! copies, measured on this device. [`two_d_wins`](super::strides::two_d_wins)' table was
//! measured on one H200; other machines rank the two ways otherwise at some copy sizes (an H100:
//! benches/RESULTS.md, KV-cache blocks). So a mover's first moves of [`MIN_BYTES`] or more of
//! each class (direction, copy size, a batch issued from one thread or several) alternate
//! between the two ways, the table's first, each timed on the GPU by a pair of events around its
//! copies; once each way has [`SAMPLES`] timings, the faster by its best rate (interference only
//! slows a move) takes every later move of the class of [`MIN_BYTES`] or more, the batch only
//! when it beats the 2D copies by [`BATCH_MARGIN`]. Smaller moves,
//! classes whose timings are all in flight, and classes whose timings keep failing follow the
//! table. A span starts when the stream reaches the move: on an idle stream while the host still
//! issues the copies, which then counts, as it delays the move's completion as much.

use std::time::Duration;

use parking_lot::Mutex;

use super::copy::Direction;
use crate::cuda::{Current, StreamHandle, TimedEvent};

/// The two ways a move between tensors at one stride can go.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Way {
    /// One 2D copy per run across every tensor.
    Strided = 0,
    /// The (tensor, run) copies in batched calls.
    Batched = 1,
}

/// Copy size classes: under 2 KiB, then one per power of two, the last taking all above.
const SIZES: usize = 16;

/// Classes: each copy size, with its batch issued from one thread or from several (a batch of
/// thousands of copies is split across threads and streams, and times otherwise).
const CLASSES: usize = 2 * SIZES;

/// Timed moves per way before a class is decided.
pub(super) const SAMPLES: usize = 2;

/// The fewest bytes a timed move carries: in smaller moves the engines' start and the issue's
/// own time weigh on the rate more than the way does. Smaller moves follow the table.
pub(super) const MIN_BYTES: usize = 8 << 20;

/// How much faster than the 2D copies a batch must time to take a class. The 2D copies' rate
/// holds from call to call and a batch's spreads, so a batch that wins a near tie by its best
/// timing runs slower on average (an H100, run 2026-12-06-h100-d, 64 KiB blocks: the 2D peer
/// 49.0-49.4 GB/s, the batch peer 40.4-48.6; a batch timed 3% faster was kept and the moves ran
/// 0.94x the 2D peer).
pub(super) const BATCH_MARGIN: f64 = 1.05;

/// Timings of a class that may fail (refused, or a zero span) before the class stops timing
/// and follows the table.
const MAX_FAILED: usize = 4;

/// The class of copies of `copy_bytes` on average: floor(log2), so a move of 16 KiB blocks whose
/// random ids merged into a few runs of two (copies of 16.3 KiB on average) shares the class of
/// one that merged none.
/// `split`: the move's batch would be issued from several threads.
fn class(copy_bytes: usize, split: bool) -> usize {
    let log2 = copy_bytes.max(1).ilog2() as usize;
    2 * log2.saturating_sub(10).min(SIZES - 1) + usize::from(split)
}

#[derive(Clone, Copy, Default, Debug)]
struct Class {
    /// The best rate timed per way (bytes per second).
    best: [f64; 2],
    /// Timings harvested per way.
    timed: [usize; 2],
    /// Timed moves in flight per way.
    out: [usize; 2],
    /// Timings that gave no rate.
    failed: usize,
}

/// Whether rate `a` beats rate `b`.
#[cfg(not(pinstage_seeded_bug = "timing_flipped"))]
fn faster(a: f64, b: f64) -> bool {
    a > b
}

/// Seeded bug: the slower way wins.
#[cfg(pinstage_seeded_bug = "timing_flipped")]
fn faster(a: f64, b: f64) -> bool {
    a < b
}

impl Class {
    fn decided(&self) -> Option<Way> {
        (self.timed[0] >= SAMPLES && self.timed[1] >= SAMPLES).then_some(
            if faster(self.best[1], self.best[0] * BATCH_MARGIN) {
                Way::Batched
            } else {
                Way::Strided
            },
        )
    }

    /// The way that needs timing next (fewer timings, those in flight counted; `first` on a
    /// tie), if any.
    fn next_timed(&self, first: Way) -> Option<Way> {
        if self.failed >= MAX_FAILED {
            return None;
        }
        let n = |w: Way| self.timed[w as usize] + self.out[w as usize];
        let other = match first {
            Way::Strided => Way::Batched,
            Way::Batched => Way::Strided,
        };
        match (n(first) < SAMPLES, n(other) < SAMPLES) {
            (false, false) => None,
            (true, false) => Some(first),
            (false, true) => Some(other),
            (true, true) if n(other) < n(first) => Some(other),
            (true, true) => Some(first),
        }
    }
}

/// What a move of a class does: its way (`None`: the table's) and why.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(super) enum Pick {
    /// Too small to time, or the class's timings are all in flight: the table decides.
    Table,
    /// This move is timed, going `Way`.
    Timing(Way),
    /// Decided by the timings: the best rates (bytes per second) of the 2D copies and the batch.
    Measured {
        way: Way,
        strided: f64,
        batched: f64,
    },
}

/// The plan's reasons: one sentence per strategy and a tail per way it was chosen.
macro_rules! strided {
    ($tail:expr) => {
        concat!(
            "the tensors sit at one stride within one allocation: one 2D copy per run and part \
             crosses every tensor",
            $tail
        )
    };
}
macro_rules! batched {
    ($tail:expr) => {
        concat!(
            "the copy engines move the merged runs in batched calls (CUDA 12.8+)",
            $tail
        )
    };
}
macro_rules! timed {
    () => {
        "; this move is timed on the GPU (a mover's first moves of 8 MiB or more of each \
         direction and copy size go both ways, 2D copies and a batch, to find the faster on \
         this device)"
    };
}

impl Pick {
    /// Why a move goes as 2D copies across the tensors.
    pub(super) fn strided_reason(&self) -> &'static str {
        match self {
            Pick::Table => strided!(
                " (faster than a batch at this direction and size on the H200, where measured)"
            ),
            Pick::Timing(_) => strided!(timed!()),
            Pick::Measured { .. } => {
                strided!(
                    " (timed faster than a batch on this device for moves like this: see choice)"
                )
            }
        }
    }

    /// Why a move goes as a batch; `split`: its copies are issued from several threads.
    pub(super) fn batched_reason(&self, split: bool) -> &'static str {
        match self {
            Pick::Timing(_) => batched!(timed!()),
            Pick::Measured { .. } => batched!(
                ", timed faster than 2D copies across the tensors on this device for moves like \
                 this: see choice"
            ),
            Pick::Table if split => batched!(
                ", issued from several threads at once, each on its own stream (the driver takes \
                 a batch of many small copies only as fast as one queue drains)"
            ),
            Pick::Table => "the copy engines move the merged runs in one batched call (CUDA 12.8+)",
        }
    }
}

impl Pick {
    pub(super) fn way(&self) -> Option<Way> {
        match *self {
            Pick::Table => None,
            Pick::Timing(w) | Pick::Measured { way: w, .. } => Some(w),
        }
    }
}

/// A timed move whose copies are being issued: its start recorded.
pub(super) struct Open {
    direction: Direction,
    class: usize,
    way: Way,
    bytes: usize,
    start: TimedEvent,
}

/// A timed move in flight: both records made.
struct Timing {
    open: Open,
    end: TimedEvent,
}

/// The timings of one mover's moves, by direction and class.
#[derive(Default)]
pub(super) struct Tuning {
    state: Mutex<State>,
}

#[derive(Default)]
struct State {
    classes: [[Class; CLASSES]; 2],
    pending: Vec<Timing>,
}

impl std::fmt::Debug for Tuning {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let st = self.state.lock();
        f.debug_struct("Tuning")
            .field("classes", &st.classes)
            .field("pending", &st.pending.len())
            .finish()
    }
}

impl Tuning {
    /// Takes the rates of the timed moves that completed (a query each, no wait; the driver
    /// asked outside the lock, in the events' context `cur`).
    pub(super) fn harvest(&self, cur: &Current<'_>) {
        let pending = {
            let mut st = self.state.lock();
            if st.pending.is_empty() {
                return;
            }
            std::mem::take(&mut st.pending)
        };
        let results: Vec<_> = pending
            .into_iter()
            .map(|t| (t.end.since(cur, &t.open.start), t))
            .collect();
        let mut st = self.state.lock();
        for (result, t) in results {
            let span = match result {
                Ok(None) => {
                    st.pending.push(t);
                    continue;
                }
                Ok(Some(d)) => Some(d).filter(|d| *d > Duration::ZERO),
                Err(_) => None,
            };
            let o = &t.open;
            let c = &mut st.classes[o.direction as usize][o.class];
            let w = o.way as usize;
            match span {
                Some(d) => {
                    c.best[w] = c.best[w].max(o.bytes as f64 / d.as_secs_f64());
                    c.timed[w] += 1;
                }
                // A zero span or a refused query: not counted.
                None => c.failed += 1,
            }
            c.out[w] -= 1;
        }
    }

    /// How a move of `bytes` in copies of `copy_bytes` on average (`split`: its batch issued
    /// from several threads) goes in `direction`; `table`: the way the table gives it (timed
    /// first, so a class's first move goes as before).
    pub(super) fn pick(
        &self,
        direction: Direction,
        (copy_bytes, split): (usize, bool),
        bytes: usize,
        table: Way,
    ) -> Pick {
        if bytes < MIN_BYTES {
            return Pick::Table;
        }
        let st = self.state.lock();
        let c = &st.classes[direction as usize][class(copy_bytes, split)];
        if let Some(way) = c.decided() {
            return Pick::Measured {
                way,
                strided: c.best[0],
                batched: c.best[1],
            };
        }
        c.next_timed(table).map_or(Pick::Table, Pick::Timing)
    }

    /// Records the start of a timed move (`pick` said [`Pick::Timing`]) on `stream`, before its
    /// copies; `None` (the move goes untimed) when the driver refuses an event.
    pub(super) fn begin(
        &self,
        cur: &Current<'_>,
        stream: StreamHandle,
        direction: Direction,
        (copy_bytes, split): (usize, bool),
        bytes: usize,
        way: Way,
    ) -> Option<Open> {
        let start = TimedEvent::new_in(cur).ok()?;
        start.record_in(cur, stream).ok()?;
        let class = class(copy_bytes, split);
        self.state.lock().classes[direction as usize][class].out[way as usize] += 1;
        Some(Open {
            direction,
            class,
            way,
            bytes,
            start,
        })
    }

    /// Records the end of a timed move on `stream`, after its copies; `issued`: whether they
    /// all were (a failed move is not counted).
    pub(super) fn end(&self, cur: &Current<'_>, stream: StreamHandle, open: Open, issued: bool) {
        let end = issued
            .then(|| TimedEvent::new_in(cur).ok())
            .flatten()
            .filter(|e| e.record_in(cur, stream).is_ok());
        let mut st = self.state.lock();
        match end {
            Some(end) => st.pending.push(Timing { open, end }),
            None => st.classes[open.direction as usize][open.class].out[open.way as usize] -= 1,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Each way a move was chosen has its own reason, and each starts with its strategy's.
    #[test]
    fn each_pick_has_its_own_reason() {
        let measured = Pick::Measured {
            way: Way::Strided,
            strided: 2.0,
            batched: 1.0,
        };
        let picks = [Pick::Table, Pick::Timing(Way::Strided), measured];
        let mut seen = std::collections::HashSet::new();
        for p in &picks {
            let r = p.strided_reason();
            assert!(r.starts_with("the tensors sit at one stride"), "{r}");
            assert!(seen.insert(r), "{r}");
            for split in [false, true] {
                let r = p.batched_reason(split);
                assert!(
                    r.starts_with("the copy engines move the merged runs"),
                    "{r}"
                );
                seen.insert(r);
            }
        }
        // Table alone tells a split batch from one call.
        assert_eq!(seen.len(), 3 + 4, "{seen:#?}");
        assert!(
            Pick::Timing(Way::Batched)
                .batched_reason(false)
                .contains("timed on the GPU")
        );
        assert!(measured.strided_reason().contains("see choice"));
        assert!(measured.batched_reason(true).contains("see choice"));
    }

    #[test]
    fn classes_are_powers_of_two() {
        let c = |b| class(b, false);
        assert_eq!(c(0), 0);
        assert_eq!(c(1), 0);
        assert_eq!(c(2047), 0);
        assert_eq!(c(2048), 2);
        assert_eq!(c(16 << 10), 8);
        assert_eq!(c(16 << 10), c((16 << 10) * 64 / 63));
        assert_eq!(c((32 << 10) - 1), 8);
        assert_eq!(c(32 << 10), 10);
        assert_eq!(c(usize::MAX), CLASSES - 2);
        assert_eq!(class(16 << 10, true), 9);
        assert_eq!(class(usize::MAX, true), CLASSES - 1);
    }

    #[test]
    fn a_class_times_both_ways_then_keeps_the_faster() {
        let mut c = Class::default();
        let mut seen = Vec::new();
        // Two timings of each way, handed out and harvested one at a time.
        while let Some(w) = c.next_timed(Way::Strided) {
            seen.push(w);
            c.timed[w as usize] += 1;
            c.best[w as usize] = if w == Way::Batched { 2.0 } else { 1.0 };
            assert!(seen.len() <= 2 * SAMPLES, "{seen:?}");
        }
        assert_eq!(
            seen,
            [Way::Strided, Way::Batched, Way::Strided, Way::Batched]
        );
        assert_eq!(c.decided(), Some(Way::Batched));
        c.best = [3.0, 2.0];
        assert_eq!(c.decided(), Some(Way::Strided));
        // A near tie keeps the 2D copies: the batch must win by the margin.
        c.best = [1.0, BATCH_MARGIN - 0.01];
        assert_eq!(c.decided(), Some(Way::Strided));
        c.best = [1.0, BATCH_MARGIN + 0.01];
        assert_eq!(c.decided(), Some(Way::Batched));
    }

    #[test]
    fn timings_in_flight_count_against_more_timing() {
        let mut c = Class {
            out: [SAMPLES, SAMPLES],
            ..Class::default()
        };
        assert_eq!(c.next_timed(Way::Strided), None);
        assert_eq!(c.decided(), None);
        c.out = [SAMPLES, 1];
        assert_eq!(c.next_timed(Way::Strided), Some(Way::Batched));
        // The table's way first on a tie.
        c.out = [1, 1];
        assert_eq!(c.next_timed(Way::Batched), Some(Way::Batched));
        assert_eq!(c.next_timed(Way::Strided), Some(Way::Strided));
        // A class whose timings keep failing stops timing.
        c.failed = MAX_FAILED;
        assert_eq!(c.next_timed(Way::Strided), None);
    }

    #[test]
    fn small_moves_and_undecided_classes_follow_the_table() {
        let t = Tuning::default();
        let s = Way::Strided;
        assert_eq!(
            t.pick(Direction::Load, (16 << 10, false), MIN_BYTES - 1, s),
            Pick::Table
        );
        assert_eq!(
            t.pick(Direction::Load, (16 << 10, false), MIN_BYTES, s),
            Pick::Timing(Way::Strided)
        );
        assert_eq!(
            t.pick(Direction::Load, (16 << 10, false), MIN_BYTES, Way::Batched),
            Pick::Timing(Way::Batched)
        );
        // Decided for loads of 16 KiB copies: offloads, and other sizes, still time.
        {
            let mut st = t.state.lock();
            let c = &mut st.classes[Direction::Load as usize][class(16 << 10, false)];
            c.timed = [SAMPLES, SAMPLES];
            c.best = [1e9, 3e9];
        }
        assert_eq!(
            t.pick(Direction::Load, (24 << 10, false), MIN_BYTES, s),
            Pick::Measured {
                way: Way::Batched,
                strided: 1e9,
                batched: 3e9
            }
        );
        // A small move of a decided class follows the table all the same.
        assert_eq!(
            t.pick(Direction::Load, (24 << 10, false), MIN_BYTES - 1, s),
            Pick::Table
        );
        assert_eq!(
            t.pick(Direction::Offload, (16 << 10, false), MIN_BYTES, s),
            Pick::Timing(Way::Strided)
        );
        assert_eq!(
            t.pick(Direction::Load, (64 << 10, false), MIN_BYTES, s),
            Pick::Timing(Way::Strided)
        );
    }
}
