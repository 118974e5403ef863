//! Loom models of the slot protocol (`src/ring/protocol.rs`), run by `scripts/test` with
//! `RUSTFLAGS="--cfg loom"` and debug assertions on.
//!
//! Loom model of the slot protocol with the simulated driver (`sim`): writer threads run the
//! stager's own protocol code, `Ring::drive`, with a `SlotOwner` whose steps are the simulated
//! driver's: claim a slot; when it was `IN_FLIGHT` learn its copy completed (watermark, a query
//! ahead, or their own event; waiting = querying until complete), then optionally grow the
//! buffer, write their value, issue the copy, record the event and release.
//! The buffers are loom cells: any write to a buffer that is not ordered after the completion
//! of its last copy (where the simulated engine reads it) is a data race loom reports; the
//! engine also checks the value it reads. Copies left at the end are completed by "drop".
#![cfg(loom)]

mod common;

use common::sim::Sim;
use loom::cell::UnsafeCell;
use loom::sync::Arc;
use pinstage::testing::ring::*;

struct Model {
    ring: Ring,
    bufs: Vec<UnsafeCell<Vec<u64>>>,
    sim: Sim,
}

// SAFETY: buffers are written only by the slot owner (WRITING) after its last copy
// completed, and read by the engine at completion; loom checks exactly this.
unsafe impl Sync for Model {}
// SAFETY: see Sync.
unsafe impl Send for Model {}

impl Model {
    fn read(&self, s: usize) -> u64 {
        // SAFETY: the engine's read; loom flags it if it races with a write.
        unsafe {
            self.bufs[s].with_mut(|b| {
                let b = &*b;
                assert!(b.iter().all(|&x| x == b[0]), "torn buffer");
                b[0]
            })
        }
    }
}

/// The stager's side of `Ring::drive` against the simulated driver: `fill` writes the slot's
/// buffer (a loom cell), `send` and `record` log the copy and the event; `fails` makes the copy
/// call fail after the slot was written.
struct SimOwner<'m> {
    m: &'m Model,
    stream: usize,
    value: u64,
    grow: bool,
    fails: bool,
}

impl SlotOwner for SimOwner<'_> {
    type Error = ();

    fn query(&mut self, slot: usize) -> Result<bool, ()> {
        Ok(self.m.sim.query(slot, &|s| self.m.read(s)))
    }

    fn wait(&mut self, slot: usize) -> Result<(), ()> {
        while !self.m.sim.query(slot, &|s| self.m.read(s)) {}
        Ok(())
    }

    fn fill(&mut self, slot: usize) -> Result<(), ()> {
        let (grow, value) = (self.grow, self.value);
        // SAFETY: `drive` gave us the slot and its last copy completed; loom checks exactly that.
        unsafe {
            self.m.bufs[slot].with_mut(|b| {
                if grow {
                    *b = vec![0; (*b).len() * 2];
                }
                for x in (*b).iter_mut() {
                    *x = value;
                }
            })
        };
        Ok(())
    }

    fn stream_id(&mut self) -> Option<u64> {
        Some(7 + self.stream as u64)
    }

    fn send(&mut self, slot: usize) -> Result<(), ()> {
        if self.fails {
            // The copy call fails after the slot was written: nothing was issued, `drive` gives
            // the slot back idle, and the next owner writes it without asking the driver
            // anything. Only the claim's Acquire and the release's Release order the two writes.
            return Err(());
        }
        self.m.sim.copy(self.stream, slot, self.value);
        Ok(())
    }

    fn record(&mut self, slot: usize) -> Result<(), ()> {
        self.m.sim.record(self.stream, slot);
        Ok(())
    }

    fn settle(&mut self) -> bool {
        true
    }
}

/// One copy through the stager's own protocol code (`Ring::drive`).
fn writer(m: &Model, stream: usize, value: u64, grow: bool, fails: bool) {
    let r = m.ring.drive(&mut SimOwner {
        m,
        stream,
        value,
        grow,
        fails,
    });
    assert_eq!(r.is_err(), fails);
}

fn run(depth: usize, threads: u64, copies_each: u64, grow: bool, streams: usize) {
    run_with(depth, threads, copies_each, grow, streams, false);
}

/// `run`; with `first_fails`, thread 0's first copy fails after writing its slot.
fn run_with(
    depth: usize,
    threads: u64,
    copies_each: u64,
    grow: bool,
    streams: usize,
    first_fails: bool,
) {
    let mut builder = loom::model::Builder::new();
    if builder.preemption_bound.is_none() {
        builder.preemption_bound = Some(2);
    }
    builder.check(move || {
        let m = Arc::new(Model {
            ring: Ring::new(depth),
            bufs: (0..depth).map(|_| UnsafeCell::new(vec![0u64; 2])).collect(),
            sim: Sim::new(streams, depth, false),
        });
        let hs: Vec<_> = (0..threads)
            .map(|t| {
                let m = m.clone();
                loom::thread::spawn(move || {
                    for k in 0..copies_each {
                        let fails = first_fails && t == 0 && k == 0;
                        let v = 100 * (t + 1) + k;
                        writer(&m, t as usize % streams, v, grow && k == 0, fails);
                    }
                })
            })
            .collect();
        for h in hs {
            h.join().unwrap();
        }
        let read = |s: usize| m.read(s);
        let failed = usize::from(first_fails);
        assert_eq!(
            m.sim.drain(&read),
            (threads * copies_each) as usize - failed
        );
    });
}

#[test]
fn two_threads_depth_one() {
    run(1, 2, 1, false, 1);
}

#[test]
fn two_threads_depth_one_reuse_and_growth() {
    run(1, 2, 2, true, 1);
}

#[test]
fn two_threads_depth_two_reuse() {
    run(2, 2, 2, false, 1);
}

#[test]
fn three_threads_depth_two_growth() {
    run(2, 3, 1, true, 1);
}

/// Depth 4: claims use watermarks and queries half a ring ahead.
#[test]
fn two_threads_depth_four_one_stream_amortized() {
    run(4, 2, 3, false, 1);
}

/// Depth 4, each thread on its own stream: evidence from the other stream must not count.
#[test]
fn two_threads_depth_four_two_streams_amortized() {
    run(4, 2, 3, false, 2);
}

/// A failed copy hands its slot back idle after writing it: the next owner may write at once.
#[test]
fn two_threads_depth_one_failed_copy_then_reuse() {
    run_with(1, 2, 1, false, 1, true);
}
