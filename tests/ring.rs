//! The slot ring's protocol (`src/ring/protocol.rs`) against a simulated driver: claims, the state
//! word, the stream table, and the completion watermark that lets one query serve many claims.
#![cfg(not(loom))]

mod common;

use std::sync::Arc;
use std::sync::atomic::AtomicU64 as StdU64;

use common::sim::Sim;
use pinstage::testing::ring::*;

fn in_flight(ring: &Ring, index: usize) {
    ring.release(
        index,
        Release::InFlight {
            mark: NO_MARK,
            begin: ring.begin(NO_MARK),
            done: ring.done(NO_MARK),
        },
    );
}

#[test]
fn claims_round_robin_and_reports_in_flight() {
    let ring = Ring::new(2);
    let a = ring.claim();
    let b = ring.claim();
    assert_eq!((a.index, b.index), (0, 1));
    assert!(!a.was_in_flight() && !b.was_in_flight());
    in_flight(&ring, 0);
    ring.release(1, Release::Idle);
    let c = ring.claim();
    assert_eq!(c.index, 0);
    assert!(c.was_in_flight());
    let d = ring.claim();
    assert_eq!(d.index, 1);
    assert!(!d.was_in_flight());
}

#[test]
fn skips_a_slot_being_written() {
    let ring = Ring::new(3);
    let a = ring.claim(); // slot 0 held
    ring.release(ring.claim().index, Release::Idle); // 1
    ring.release(ring.claim().index, Release::Idle); // 2
    // next ticket maps to 0, which is WRITING: it must be skipped
    let b = ring.claim();
    assert_ne!(b.index, a.index);
}

#[test]
fn state_words_round_trip() {
    let s = SlotState::recorded(3, 1000, 1005);
    assert!(s.in_flight());
    assert_eq!((s.mark(), s.done(), s.begin()), (3, 1005, Some(1000)));
    let far = SlotState::recorded(3, 0, 5000);
    assert_eq!(
        far.begin(),
        None,
        "a gap too large to store is unknown, never guessed"
    );
    let big = SlotState::recorded(14, (1 << 47) - 2, (1 << 47) + 1);
    assert_eq!(
        (big.mark(), big.done(), big.begin()),
        (14, (1 << 47) + 1, Some((1 << 47) - 2))
    );
    assert_eq!(s.with_kind(IDLE).kind(), IDLE);
    assert_eq!(s.with_kind(IDLE).done(), 1005);
}

#[test]
fn stream_table_assigns_once_and_fills_up() {
    let ring = Ring::new(4);
    assert_eq!(ring.mark(None), NO_MARK);
    assert_eq!(ring.mark(Some(u64::MAX)), NO_MARK);
    let marks: Vec<u8> = (0..MARKS as u64)
        .map(|id| ring.mark(Some(id * 7)))
        .collect();
    assert_eq!(marks, (0..MARKS as u8).collect::<Vec<_>>());
    assert_eq!(ring.mark(Some(3 * 7)), 3, "an ID keeps its entry");
    assert_eq!(
        ring.mark(Some(999)),
        NO_MARK,
        "a full table tracks no new stream"
    );
}

/// One stream, depth 8, one thread: after the first turn of the ring, claims query about
/// twice per turn, never a slot whose copy is still pending.
#[test]
fn watermark_checks_query_less_and_stay_correct() {
    let depth = 8;
    let ring = Ring::new(depth);
    let sim = Sim::new(1, depth, true);
    let bufs: Vec<StdU64> = (0..depth).map(|_| StdU64::new(0)).collect();
    let read = |s: usize| bufs[s].load(std::sync::atomic::Ordering::Relaxed);
    let mark = ring.mark(Some(42));
    let mut queries = 0usize;
    let copies = 800u64;
    for v in 1..=copies {
        let c = ring.claim();
        if c.was_in_flight() {
            let ok = ring
                .check(&c, &mut |j| {
                    queries += 1;
                    Ok::<_, ()>(sim.query(j, &read))
                })
                .unwrap();
            if !ok {
                while !sim.query(c.index, &read) {}
            }
        }
        bufs[c.index].store(v, std::sync::atomic::Ordering::Relaxed);
        let begin = ring.begin(mark);
        sim.copy(0, c.index, v);
        sim.record(0, c.index);
        let done = ring.done(mark);
        ring.release(c.index, Release::InFlight { mark, begin, done });
    }
    assert_eq!(sim.drain(&read), copies as usize);
    // A query per claim would ask 792 times after the first turn of the ring.
    assert!(
        queries <= 792 / 3,
        "amortized: {queries} queries for 792 checks (a GPU that keeps up)"
    );
}

#[test]
fn evidence_from_another_stream_or_a_changed_word_is_not_used() {
    let ring = Ring::new(4);
    let (m0, m1) = (ring.mark(Some(1)), ring.mark(Some(2)));
    // slot 0 on stream 0, slot 2 (half a ring ahead) on stream 1, recorded later.
    for (i, m) in [(0usize, m0), (1, m0), (2, m1), (3, m1)] {
        let c = ring.claim();
        assert_eq!(c.index, i);
        let begin = ring.begin(m);
        let done = ring.done(m);
        ring.release(
            i,
            Release::InFlight {
                mark: m,
                begin,
                done,
            },
        );
    }
    let c = ring.claim();
    assert_eq!(c.index, 0);
    let mut asked = Vec::new();
    let ok = ring
        .check(&c, &mut |j| {
            asked.push(j);
            Ok::<_, ()>(false)
        })
        .unwrap();
    assert!(!ok);
    assert_eq!(
        asked,
        vec![0],
        "slot 2 is on another stream: only the own event is asked"
    );
    // Now slot 2 on the same stream, but re-recorded while its event is queried.
    ring.release(0, Release::Idle);
    let mut ring = Ring::new(4);
    let m = ring.mark(Some(1));
    for i in 0..4 {
        let c = ring.claim();
        let begin = ring.begin(m);
        let done = ring.done(m);
        ring.release(
            c.index,
            Release::InFlight {
                mark: m,
                begin,
                done,
            },
        );
        assert_eq!(c.index, i);
    }
    let c = ring.claim(); // slot 0
    let r = &ring;
    let ok = r
        .check(&c, &mut |j| {
            if j == 2 {
                // Another thread claims slot 2 and records it again meanwhile.
                let word = r.word(2);
                r.set_word(2, word.with_kind(WRITING));
                let (begin, done) = (r.begin(m), r.done(m));
                r.set_word(2, SlotState::recorded(m, begin, done));
                Ok::<_, ()>(true)
            } else {
                Ok(false)
            }
        })
        .unwrap();
    assert!(
        !ok,
        "a query of a re-recorded event proves nothing about the old record"
    );
    assert!(!ring.covered(c.prev));
    assert!(ring.is_in_flight(2));
}

/// The watermark is the evidence's `begin`, not its `done`: a copy whose record returned
/// between another's `begin` and `done` may follow it in the stream and still be pending.
#[test]
fn watermark_never_covers_a_copy_recorded_during_the_evidence() {
    let ring = Ring::new(4);
    let m = ring.mark(Some(5));
    let issue = |i: usize| {
        let c = ring.claim();
        assert_eq!(c.index, i);
        let (begin, done) = (ring.begin(m), ring.done(m));
        ring.release(
            i,
            Release::InFlight {
                mark: m,
                begin,
                done,
            },
        );
    };
    issue(0);
    issue(1);
    // Thread A issues j = slot 2 and records it; before A takes its done ticket, thread B
    // issues y = slot 3 whole: stream order x0, x1, j, y.
    let j = ring.claim();
    let begin_j = ring.begin(m);
    let y = ring.claim();
    let (begin_y, done_y) = (ring.begin(m), ring.done(m));
    ring.release(
        y.index,
        Release::InFlight {
            mark: m,
            begin: begin_y,
            done: done_y,
        },
    );
    let done_j = ring.done(m);
    ring.release(
        j.index,
        Release::InFlight {
            mark: m,
            begin: begin_j,
            done: done_j,
        },
    );
    // The engine completed x0, x1 and j; y is still pending.
    let complete = |slot: usize| slot != 3;
    let mut asked = Vec::new();
    for expect in [0usize, 1, 2] {
        let c = ring.claim();
        assert_eq!(c.index, expect);
        if c.was_in_flight() {
            assert!(
                ring.check(&c, &mut |s| {
                    asked.push(s);
                    Ok::<_, ()>(complete(s))
                })
                .unwrap()
            );
        }
        ring.release(c.index, Release::Idle);
    }
    assert_eq!(
        asked,
        vec![2],
        "x0 asked j once; x1 was covered; j was marked idle"
    );
    let c = ring.claim();
    assert_eq!(c.index, 3);
    let known = ring.check(&c, &mut |s| Ok::<_, ()>(complete(s))).unwrap();
    assert!(!known, "y is pending: no watermark may cover it");
}

#[test]
fn many_threads_never_share_a_slot() {
    use std::sync::atomic::AtomicBool;
    let ring = Arc::new(Ring::new(2));
    let owned: Arc<Vec<AtomicBool>> = Arc::new((0..2).map(|_| AtomicBool::new(false)).collect());
    let threads: Vec<_> = (0..4)
        .map(|_| {
            let (ring, owned) = (ring.clone(), owned.clone());
            std::thread::spawn(move || {
                for _ in 0..if cfg!(miri) { 50 } else { 20_000 } {
                    let c = ring.claim();
                    assert!(!owned[c.index].swap(true, std::sync::atomic::Ordering::AcqRel));
                    owned[c.index].store(false, std::sync::atomic::Ordering::Release);
                    in_flight(&ring, c.index);
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
}

/// Threads on two streams share one ring of 8 and the simulated driver; the engine checks
/// every copy read what was written for it.
#[rstest::rstest]
fn threads_on_two_streams_never_rewrite_a_pending_slot(#[values(false, true)] eager: bool) {
    let depth = 8;
    let ring = Arc::new(Ring::new(depth));
    let sim = Arc::new(Sim::new(2, depth, eager));
    let bufs: Arc<Vec<StdU64>> = Arc::new((0..depth).map(|_| StdU64::new(0)).collect());
    let per = if cfg!(miri) { 30u64 } else { 20_000 };
    let hs: Vec<_> = (0..4u64)
        .map(|t| {
            let (ring, sim, bufs) = (ring.clone(), sim.clone(), bufs.clone());
            std::thread::spawn(move || {
                let stream = (t % 2) as usize;
                for k in 0..per {
                    let v = (t + 1) << 40 | k;
                    // The stager's own protocol code, with the simulated driver's steps.
                    ring.drive(&mut StdOwner {
                        sim: &sim,
                        bufs: &bufs,
                        stream,
                        value: v,
                        queries: None,
                    })
                    .unwrap();
                }
            })
        })
        .collect();
    for h in hs {
        h.join().unwrap();
    }
    let read = |s: usize| bufs[s].load(std::sync::atomic::Ordering::Relaxed);
    assert_eq!(sim.drain(&read), 4 * per as usize);
}

#[test]
fn depth_is_the_number_of_slots() {
    for d in [1usize, 2, 7, 16] {
        assert_eq!(Ring::new(d).depth(), d);
    }
}

/// Streams racing for the table's free entries each get their own: a claim CAS lost to
/// another stream's ID must not be taken as this stream's entry.
#[test]
fn racing_streams_get_distinct_table_entries() {
    for round in 0..if cfg!(miri) { 3 } else { 2000 } {
        let ring = Arc::new(Ring::new(4));
        let barrier = Arc::new(std::sync::Barrier::new(4));
        let hs: Vec<_> = (0..4u64)
            .map(|t| {
                let (ring, barrier) = (ring.clone(), barrier.clone());
                std::thread::spawn(move || {
                    barrier.wait();
                    ring.mark(Some(1000 * round + t))
                })
            })
            .collect();
        let mut marks: Vec<u8> = hs.into_iter().map(|h| h.join().unwrap()).collect();
        marks.sort_unstable();
        marks.dedup();
        assert_eq!(marks.len(), 4, "round {round}: two streams share an entry");
    }
}

/// Threads of one stream racing to enter it in the table all get the same entry.
#[test]
fn racing_threads_of_one_stream_share_its_entry() {
    for round in 0..if cfg!(miri) { 3 } else { 2000 } {
        let ring = Arc::new(Ring::new(4));
        let barrier = Arc::new(std::sync::Barrier::new(4));
        let hs: Vec<_> = (0..4)
            .map(|_| {
                let (ring, barrier) = (ring.clone(), barrier.clone());
                std::thread::spawn(move || {
                    barrier.wait();
                    ring.mark(Some(77 + round))
                })
            })
            .collect();
        let marks: Vec<u8> = hs.into_iter().map(|h| h.join().unwrap()).collect();
        assert!(
            marks.iter().all(|&m| m == marks[0]),
            "round {round}: {marks:?}"
        );
        assert_eq!(
            ring.mark(Some(78 + round)),
            1,
            "one entry used by the stream, the next free"
        );
    }
}

/// The stager's side of `Ring::drive` against the simulated driver (std atomics as buffers).
struct StdOwner<'a> {
    sim: &'a Sim,
    bufs: &'a [StdU64],
    stream: usize,
    value: u64,
    queries: Option<&'a mut usize>,
}

impl SlotOwner for StdOwner<'_> {
    type Error = ();

    fn query(&mut self, slot: usize) -> Result<bool, ()> {
        if let Some(q) = self.queries.as_deref_mut() {
            *q += 1;
        }
        let bufs = self.bufs;
        Ok(self.sim.query(slot, &|s| {
            bufs[s].load(std::sync::atomic::Ordering::Relaxed)
        }))
    }

    fn wait(&mut self, slot: usize) -> Result<(), ()> {
        let bufs = self.bufs;
        while !self.sim.query(slot, &|s| {
            bufs[s].load(std::sync::atomic::Ordering::Relaxed)
        }) {}
        Ok(())
    }

    fn fill(&mut self, slot: usize) -> Result<(), ()> {
        self.bufs[slot].store(self.value, std::sync::atomic::Ordering::Relaxed);
        Ok(())
    }

    fn stream_id(&mut self) -> Option<u64> {
        Some(100 + self.stream as u64)
    }

    fn send(&mut self, slot: usize) -> Result<(), ()> {
        self.sim.copy(self.stream, slot, self.value);
        Ok(())
    }

    fn record(&mut self, slot: usize) -> Result<(), ()> {
        self.sim.record(self.stream, slot);
        Ok(())
    }

    fn settle(&mut self) -> bool {
        true
    }
}

/// A `SlotOwner` whose step `at` fails.
struct Failing {
    at: &'static str,
    settles: bool,
    complete: bool,
}

impl Failing {
    fn step(&self, name: &'static str) -> Result<(), &'static str> {
        if self.at == name { Err(name) } else { Ok(()) }
    }
}

impl SlotOwner for Failing {
    type Error = &'static str;

    fn query(&mut self, _: usize) -> Result<bool, &'static str> {
        self.step("query").map(|()| self.complete)
    }

    fn wait(&mut self, _: usize) -> Result<(), &'static str> {
        self.step("wait")
    }

    fn fill(&mut self, _: usize) -> Result<(), &'static str> {
        self.step("fill")
    }

    fn stream_id(&mut self) -> Option<u64> {
        Some(9)
    }

    fn send(&mut self, _: usize) -> Result<(), &'static str> {
        self.step("send")
    }

    fn record(&mut self, _: usize) -> Result<(), &'static str> {
        self.step("record")
    }

    fn settle(&mut self) -> bool {
        self.settles
    }
}

/// `drive` gives the slot back in the state each failing step leaves it in.
#[test]
fn drive_releases_the_slot_on_every_error() {
    let ok = |ring: &Ring| {
        ring.drive(&mut Failing {
            at: "",
            settles: true,
            complete: true,
        })
        .unwrap()
    };
    // A fresh ring of 1: fill, send and record fail.
    for (at, settles, in_flight) in [
        ("fill", true, false),
        ("send", true, false),
        ("record", true, false),
        ("record", false, true),
    ] {
        let ring = Ring::new(1);
        let e = ring
            .drive(&mut Failing {
                at,
                settles,
                complete: true,
            })
            .unwrap_err();
        assert_eq!(e, at);
        assert_eq!(
            ring.word(0).kind() == IN_FLIGHT,
            in_flight,
            "{at}, settles {settles}"
        );
        assert_ne!(
            ring.word(0).kind(),
            WRITING,
            "{at}: the slot was given back"
        );
        assert_eq!(ok(&ring), 0, "the slot is usable again");
    }
    // A slot whose copy may still run: a failed query or wait restores its word.
    for (at, complete) in [("query", true), ("wait", false)] {
        let ring = Ring::new(1);
        ok(&ring);
        let before = ring.word(0);
        assert!(before.in_flight());
        let e = ring
            .drive(&mut Failing {
                at,
                settles: true,
                complete,
            })
            .unwrap_err();
        assert_eq!(e, at);
        assert_eq!(
            ring.word(0),
            before,
            "{at}: the previous copy's word is back"
        );
    }
}
