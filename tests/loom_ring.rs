//! Loom models of the slot protocol (`src/h2d/ring.rs`), run by `scripts/test` with
//! `RUSTFLAGS="--cfg loom"` and debug assertions on.
//!
//! Loom model of the slot protocol with the simulated driver (`sim`): writer threads claim a
//! slot; when it was `IN_FLIGHT` they learn its copy completed (watermark, a query half a ring
//! ahead, or their own event, as the stager does; waiting = querying until complete), then
//! optionally grow the buffer, write their value, issue the copy, record the event and release.
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

fn writer(m: &Model, stream: usize, value: u64, grow: bool, fails: bool) {
    let read = |s: usize| m.read(s);
    let c = m.ring.claim();
    if c.was_in_flight()
        && !m
            .ring
            .check(&c, &mut |j| Ok::<_, ()>(m.sim.query(j, &read)))
            .unwrap()
    {
        while !m.sim.query(c.index, &read) {}
    }
    // SAFETY: we own the slot and its last copy completed.
    unsafe {
        m.bufs[c.index].with_mut(|b| {
            if grow {
                *b = vec![0; (*b).len() * 2];
            }
            for x in (*b).iter_mut() {
                *x = value;
            }
        })
    };
    if fails {
        // The copy call failed after the slot was written: nothing was issued, the slot goes
        // back idle, and the next owner writes it without asking the driver anything. Only the
        // claim's Acquire and the release's Release order the two writes.
        m.ring.release(c.index, Release::Idle);
        return;
    }
    let mark = m.ring.mark(Some(7 + stream as u64));
    let begin = m.ring.begin(mark);
    m.sim.copy(stream, c.index, value);
    m.sim.record(stream, c.index);
    let done = m.ring.done(mark);
    m.ring
        .release(c.index, Release::InFlight { mark, begin, done });
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
