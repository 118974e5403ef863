//! The slot-claim protocol of the stager ring, free of CUDA so loom can model-check it.
//!
//! # State table (one `AtomicU32` per slot)
//!
//! | state       | meaning                                                      | who may change it |
//! |-------------|--------------------------------------------------------------|-------------------|
//! | `IDLE`      | no copy was issued from the slot's buffer, or its last copy is known complete | any thread: CAS to `WRITING` |
//! | `WRITING`   | exactly one thread owns the slot: it may wait on the slot's event, grow and write the buffer, issue the copy and record the event | only the owner: store `IN_FLIGHT` or `IDLE` |
//! | `IN_FLIGHT` | a copy reading the buffer was issued and the slot's event recorded after it; the copy may still run | any thread: CAS to `WRITING`, then it must wait for the event before touching the buffer |
//!
//! Transitions: `IDLE|IN_FLIGHT --CAS(Acquire)--> WRITING --store(Release)--> IN_FLIGHT|IDLE`.
//!
//! # Orderings
//! - `ticket.fetch_add(Relaxed)`: the ticket only spreads threads over slots; it publishes no
//!   data, ownership is decided by the CAS on the slot's state.
//! - `state.load(Relaxed)` before the CAS: a hint to skip a slot being written; the CAS decides.
//! - Claim CAS `Acquire` on success: pairs with the previous owner's `Release` store, so the new
//!   owner sees that owner's buffer pointer (after growth), its recorded event and its stats.
//!   `Relaxed` on failure: nothing is read after a failed CAS.
//! - Release `store(Release)`: publishes everything the owner did to the slot to the next owner.
//!
//! A waiting owner holds no lock: it owns one slot in `WRITING`, other threads skip that slot
//! and claim others. Two threads never own one slot: only a successful CAS from a non-`WRITING`
//! state enters `WRITING`, and only the owner leaves it.

use crossbeam_utils::CachePadded;

use crate::sync::{AtomicU32, AtomicUsize, Ordering, yield_now};

/// No copy pending from the slot's buffer.
pub(crate) const IDLE: u32 = 0;
/// Owned by one thread.
pub(crate) const WRITING: u32 = 1;
/// A copy was issued from the buffer and the slot's event recorded after it.
pub(crate) const IN_FLIGHT: u32 = 2;

/// The atomics of a ring of `depth` slots.
pub(crate) struct Ring {
    ticket: CachePadded<AtomicUsize>,
    states: Box<[CachePadded<AtomicU32>]>,
}

/// A slot owned by the calling thread (state `WRITING`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Claim {
    /// Index of the slot.
    pub index: usize,
    /// The slot was `IN_FLIGHT`: its event must complete before its buffer is touched.
    pub was_in_flight: bool,
}

impl Ring {
    /// A ring of `depth >= 1` idle slots.
    pub(crate) fn new(depth: usize) -> Self {
        assert!(depth >= 1, "depth must be at least 1");
        Self {
            ticket: CachePadded::new(AtomicUsize::new(0)),
            states: (0..depth)
                .map(|_| CachePadded::new(AtomicU32::new(IDLE)))
                .collect(),
        }
    }

    /// Number of slots.
    pub(crate) fn depth(&self) -> usize {
        self.states.len()
    }

    /// Claims the next slot that nobody is writing. Never blocks on a lock; spins (yielding after
    /// every full turn of the ring) only while every slot is owned by another thread.
    pub(crate) fn claim(&self) -> Claim {
        let depth = self.states.len();
        let mut misses = 0usize;
        loop {
            // Relaxed: see the module docs; the ticket publishes nothing.
            let t = self.ticket.fetch_add(1, Ordering::Relaxed);
            let index = t % depth;
            let state = &self.states[index];
            // Relaxed: a hint only, the CAS below decides.
            let cur = state.load(Ordering::Relaxed);
            if cur != WRITING
                && state
                    // Acquire on success: see the previous owner's writes. Relaxed on failure.
                    .compare_exchange(cur, WRITING, Ordering::Acquire, Ordering::Relaxed)
                    .is_ok()
            {
                return Claim {
                    index,
                    was_in_flight: cur == IN_FLIGHT,
                };
            }
            misses += 1;
            if misses >= depth {
                misses = 0;
                yield_now();
            }
        }
    }

    /// Gives an owned slot back: `IN_FLIGHT` when a copy from its buffer was issued and its event
    /// recorded, `IDLE` when nothing is pending.
    pub(crate) fn release(&self, index: usize, in_flight: bool) {
        let next = if in_flight { IN_FLIGHT } else { IDLE };
        debug_assert_eq!(self.states[index].load(Ordering::Relaxed), WRITING);
        // Release: publish the owner's writes to the next owner (pairs with the claim CAS).
        self.states[index].store(next, Ordering::Release);
    }

    /// Whether slot `index` is `IN_FLIGHT`; for `Drop`, which has exclusive access.
    pub(crate) fn is_in_flight(&mut self, index: usize) -> bool {
        // Acquire: pairs with the last owner's Release store.
        self.states[index].load(Ordering::Acquire) == IN_FLIGHT
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    #[test]
    fn claims_round_robin_and_reports_in_flight() {
        let ring = Ring::new(2);
        let a = ring.claim();
        let b = ring.claim();
        assert_eq!((a.index, b.index), (0, 1));
        assert!(!a.was_in_flight && !b.was_in_flight);
        ring.release(0, true);
        ring.release(1, false);
        let c = ring.claim();
        assert_eq!(
            c,
            Claim {
                index: 0,
                was_in_flight: true
            }
        );
        let d = ring.claim();
        assert_eq!(
            d,
            Claim {
                index: 1,
                was_in_flight: false
            }
        );
    }

    #[test]
    fn skips_a_slot_being_written() {
        let ring = Ring::new(3);
        let a = ring.claim(); // slot 0 held
        ring.release(ring.claim().index, false); // 1
        ring.release(ring.claim().index, false); // 2
        // next ticket maps to 0, which is WRITING: it must be skipped
        let b = ring.claim();
        assert_ne!(b.index, a.index);
    }

    #[test]
    fn many_threads_never_share_a_slot() {
        use std::sync::Arc;
        use std::sync::atomic::AtomicBool;
        let ring = Arc::new(Ring::new(2));
        let owned: Arc<Vec<AtomicBool>> =
            Arc::new((0..2).map(|_| AtomicBool::new(false)).collect());
        let threads: Vec<_> = (0..4)
            .map(|_| {
                let (ring, owned) = (ring.clone(), owned.clone());
                std::thread::spawn(move || {
                    for _ in 0..if cfg!(miri) { 50 } else { 20_000 } {
                        let c = ring.claim();
                        assert!(!owned[c.index].swap(true, std::sync::atomic::Ordering::AcqRel));
                        owned[c.index].store(false, std::sync::atomic::Ordering::Release);
                        ring.release(c.index, true);
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
    }
}

/// Loom model of the slot protocol with a simulated copy engine.
///
/// Each slot has a buffer (`UnsafeCell<Vec<u32>>`) and an "event" (`pending`: 1 while a copy from
/// the buffer is in flight, with the value it must read in `expect`). Writer threads claim a
/// slot; when it was `IN_FLIGHT` they first complete its copy as the copy engine would (read the
/// whole buffer and check it still holds the value written for that copy), then optionally grow
/// the buffer, write their value, "issue the copy" (`pending = 1`, Release) and release the slot
/// `IN_FLIGHT`. Copies still pending at the end are completed by the main thread ("drop").
/// Loom reports any unsynchronised buffer access (a torn copy), and the checks catch stale data.
/// The copy engine is folded into the waiter because a free-running engine thread spins, and
/// spinning explodes loom's state space; what is checked is the same: no buffer is written
/// between its copy's issue and completion, and two threads never own one slot.
#[cfg(all(test, loom))]
mod loom_tests {
    use super::*;
    use crate::sync::UnsafeCell;
    use loom::sync::Arc;
    use loom::sync::atomic::AtomicU32 as LAtomicU32;

    struct Model {
        ring: Ring,
        bufs: Vec<UnsafeCell<Vec<u32>>>,
        pending: Vec<LAtomicU32>,
        expect: Vec<LAtomicU32>,
        completed: LAtomicU32,
    }

    // SAFETY: buffers are only touched by the slot owner (WRITING); loom checks exactly this.
    unsafe impl Sync for Model {}
    // SAFETY: see Sync.
    unsafe impl Send for Model {}

    /// The copy engine's read of slot `i`: the buffer must still hold the value of its copy.
    fn complete(m: &Model, i: usize) {
        if m.pending[i].load(Ordering::Acquire) == 1 {
            let want = m.expect[i].load(Ordering::Relaxed);
            // SAFETY: called by the slot's owner (or after all threads joined).
            unsafe {
                m.bufs[i].with_mut(|b| assert!((*b).iter().all(|&x| x == want), "torn copy"))
            };
            m.pending[i].store(0, Ordering::Release);
            m.completed.fetch_add(1, Ordering::Relaxed);
        }
    }

    fn writer(m: &Model, value: u32, grow: bool) {
        let c = m.ring.claim();
        if c.was_in_flight {
            complete(m, c.index); // "wait for the event"
        }
        assert_eq!(
            m.pending[c.index].load(Ordering::Acquire),
            0,
            "slot reused while in flight"
        );
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
        m.expect[c.index].store(value, Ordering::Relaxed);
        m.pending[c.index].store(1, Ordering::Release); // issue + record
        m.ring.release(c.index, true);
    }

    fn run(depth: usize, threads: u32, copies_each: u32, grow: bool) {
        let mut builder = loom::model::Builder::new();
        if builder.preemption_bound.is_none() {
            builder.preemption_bound = Some(2);
        }
        builder.check(move || {
            let m = Arc::new(Model {
                ring: Ring::new(depth),
                bufs: (0..depth).map(|_| UnsafeCell::new(vec![0u32; 2])).collect(),
                pending: (0..depth).map(|_| LAtomicU32::new(0)).collect(),
                expect: (0..depth).map(|_| LAtomicU32::new(0)).collect(),
                completed: LAtomicU32::new(0),
            });
            let hs: Vec<_> = (0..threads)
                .map(|t| {
                    let m = m.clone();
                    loom::thread::spawn(move || {
                        for k in 0..copies_each {
                            writer(&m, 100 * (t + 1) + k, grow && k == 0);
                        }
                    })
                })
                .collect();
            for h in hs {
                h.join().unwrap();
            }
            // "Drop": complete whatever is still in flight; every copy read what was written.
            for i in 0..depth {
                complete(&m, i);
            }
            assert_eq!(m.completed.load(Ordering::Relaxed), threads * copies_each);
        });
    }

    #[test]
    fn two_threads_depth_one() {
        run(1, 2, 1, false);
    }

    #[test]
    fn two_threads_depth_one_reuse_and_growth() {
        run(1, 2, 2, true);
    }

    #[test]
    fn two_threads_depth_two_reuse() {
        run(2, 2, 2, false);
    }

    #[test]
    fn three_threads_depth_two_growth() {
        run(2, 3, 1, true);
    }
}
