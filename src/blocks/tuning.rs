//! Which way a move between tensors at one stride goes, 2D copies across the tensors or batched
//! copies (from the threads [`batch_threads`](super::strides::batch_threads) gives, or from one),
//! measured on this device. [`two_d_wins`](super::strides::two_d_wins)' table and the thread
//! counts were measured on one H200; other machines rank the ways otherwise at some copy sizes
//! (H100s: benches/RESULTS.md, KV-cache blocks). So a mover's first moves of [`MIN_BYTES`] or
//! more of each class (direction, copy size, a batch issued from one thread or several)
//! take the class's ways in turn (2D copies and a batch; where the batch would be split over
//! threads, also the batch from one thread), the table's first, each timed on the GPU by a pair
//! of events around its copies; once each way has [`SAMPLES`] timings, the faster by its mean
//! rate takes every later move of the class of [`MIN_BYTES`] or more, a batch only when it beats
//! the 2D copies by [`BATCH_MARGIN`]. (Not the best rate of each way: that favours the batch,
//! whose rate spreads from call to call more than the 2D copies'.) Smaller moves,
//! classes whose timings are all in flight, and classes whose timings keep failing follow the
//! table. A span starts when the stream reaches the move: on an idle stream while the host still
//! issues the copies, which then counts, as it delays the move's completion as much.

use std::time::Duration;

use parking_lot::Mutex;

use super::copy::{Choice, Direction};
use crate::cuda::{Current, StreamHandle, TimedEvent};

/// The ways a move between tensors at one stride can go.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Way {
    /// One 2D copy per run across every tensor.
    Strided = 0,
    /// The (tensor, run) copies in batched calls, from the threads
    /// [`batch_threads`](super::strides::batch_threads) gives.
    Batched = 1,
    /// The same batch issued from one thread, where `batch_threads` gives several (which
    /// H100s ran slower than one batch for some loads: benches/RESULTS.md, KV-cache blocks).
    BatchedOne = 2,
}

/// How many ways there are.
const WAYS: usize = 3;

/// The ways a class times: a split batch's class also times the batch from one thread.
fn ways(split: bool) -> &'static [Way] {
    if split {
        &[Way::Strided, Way::Batched, Way::BatchedOne]
    } else {
        &[Way::Strided, Way::Batched]
    }
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
/// holds from call to call and a batch's spreads, so a batch that wins a near tie in a few
/// timings may run slower on average (64 KiB blocks on H100s: benches/RESULTS.md).
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
    /// The sum of the rates timed per way (bytes per second).
    sum: [f64; WAYS],
    /// Timings harvested per way.
    timed: [usize; WAYS],
    /// Timed moves in flight per way.
    out: [usize; WAYS],
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
    /// The mean rate timed for `way` (0 before any timing).
    fn mean(&self, way: Way) -> f64 {
        let w = way as usize;
        self.sum[w] / self.timed[w].max(1) as f64
    }

    /// The way this class keeps once each of its `ways` has its timings: the faster batch, if
    /// it beats the 2D copies by the margin, else the 2D copies.
    fn decided(&self, ways: &[Way]) -> Option<Way> {
        if ways.iter().any(|&w| self.timed[w as usize] < SAMPLES) {
            return None;
        }
        let batch = ways[1..].iter().copied().reduce(|a, b| {
            if faster(self.mean(b), self.mean(a)) {
                b
            } else {
                a
            }
        })?;
        Some(
            if faster(self.mean(batch), self.mean(Way::Strided) * BATCH_MARGIN) {
                batch
            } else {
                Way::Strided
            },
        )
    }

    /// The way of `ways` that needs timing next (the fewest timings, those in flight counted;
    /// `first` on a tie, then the order of `ways`), if any.
    fn next_timed(&self, first: Way, ways: &[Way]) -> Option<Way> {
        if self.failed >= MAX_FAILED {
            return None;
        }
        debug_assert!(ways.contains(&first), "{first:?} is not among {ways:?}");
        let n = |w: Way| self.timed[w as usize] + self.out[w as usize];
        std::iter::once(first)
            .chain(ways.iter().copied().filter(|&w| w != first))
            .filter(|&w| n(w) < SAMPLES)
            .min_by_key(|&w| n(w))
    }
}

/// What a move of a class does: its way (`None`: the table's) and why.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(super) enum Pick {
    /// Too small to time, or the class's timings are all in flight: the table decides.
    Table,
    /// This move is timed, going `Way`.
    Timing(Way),
    /// Decided by the timings: the mean rates (bytes per second) of the 2D copies, the batch,
    /// and the batch from one thread where the batch is split over threads.
    Measured {
        way: Way,
        strided: f64,
        batched: f64,
        batched_one_thread: Option<f64>,
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
         direction and copy size go every way, 2D copies and a batch, and where the batch is \
         split over threads the batch from one thread, to find the faster on this device)"
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
            Pick::Measured {
                way: Way::BatchedOne,
                ..
            } => batched!(
                " from one thread, timed faster than 2D copies across the tensors and than the \
                 batch split over threads on this device for moves like this: see choice"
            ),
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

    /// What the plan reports of this pick.
    pub(super) fn choice(&self) -> Choice {
        match *self {
            Pick::Table => Choice::Table,
            Pick::Timing(_) => Choice::Timing,
            Pick::Measured {
                strided,
                batched,
                batched_one_thread,
                ..
            } => Choice::Measured {
                strided: strided as u64,
                batched: batched as u64,
                batched_one_thread: batched_one_thread.map(|r| r as u64),
            },
        }
    }

    /// The way a timing or a measurement chose; `None` for the table's choice.
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
                    c.sum[w] += o.bytes as f64 / d.as_secs_f64();
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
        if let Some(way) = c.decided(ways(split)) {
            return Pick::Measured {
                way,
                strided: c.mean(Way::Strided),
                batched: c.mean(Way::Batched),
                batched_one_thread: split.then(|| c.mean(Way::BatchedOne)),
            };
        }
        c.next_timed(table, ways(split))
            .map_or(Pick::Table, Pick::Timing)
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
mod tests;
