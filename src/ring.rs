//! The slot-claim protocol of the stager ring, and how a claimer learns that a slot's last copy
//! completed; free of CUDA so loom can model-check it.
//!
//! # State word (one `AtomicU64` per slot)
//!
//! `kind` (bits 0-1) | `mark` (bits 2-5) | `gap` (bits 6-15) | `done` (bits 16-63).
//!
//! | kind        | meaning                                                      | who may change it |
//! |-------------|--------------------------------------------------------------|-------------------|
//! | `IDLE`      | no copy was issued from the slot's buffer, or its last copy is known complete | any thread: CAS to `WRITING` |
//! | `WRITING`   | exactly one thread owns the slot: it may wait on the slot's event, grow and write the buffer, issue the copy and record the event | only the owner: store `IN_FLIGHT` or `IDLE` |
//! | `IN_FLIGHT` | a copy reading the buffer was issued and the slot's event recorded after it; the copy may still run | any thread: CAS to `WRITING` (then it must learn the copy completed before touching the buffer), or CAS to `IDLE` with the same other bits once it knows the copy completed |
//!
//! The other fields describe the slot's last record: `done` is its completion ticket, `mark`
//! the stream's entry in the ring's stream table (`NO_MARK`: untracked), `gap` = `done - begin`
//! (`NO_GAP`: too large). A ticket is unique within its stream and the word carries the mark, so
//! the word of a tracked record never repeats (no ABA); untracked records carry ticket 0 and are
//! never used as evidence.
//!
//! # Completion tickets and watermarks: one query serves many slots
//!
//! Each copy reads `begin = tickets` (its stream's counter, on the stream's own cache line)
//! before it issues its copy and, once its event is recorded, takes `done = ++tickets`. If
//! `done_x <= begin_y` for two records on one stream, x's record call returned before y's copy
//! was issued (y's Acquire load saw x's AcqRel increment), so x's
//! copy and event come before y's in the stream's order: y's event complete implies x's copy
//! complete. A stream's watermark `wm` is the largest `begin` of an event on it known complete;
//! a slot with `done <= wm` on that stream needs no query. A claimer whose slot is not covered
//! queries the event of a slot `reach` slots ahead (issued that many copies later, so it covers
//! this slot and the ones claimed next; `reach` adapts to the copy engine's lag, starting at
//! half the ring), then, if that copy is not complete yet, its own.
//!
//! Streams are told apart by the driver's stream ID (unique for the context's life, unlike a
//! handle, which a new stream may reuse): the table assigns an entry per ID, for good; streams
//! beyond its size, and the per-thread default stream, are untracked (each claim queries its own
//! event, as it always may).
//!
//! An event queried through another slot proves something only about the record the slot's word
//! described when it was read: the claimer reads the word, queries, and reads the word again; an
//! unchanged word (the `done` ticket is unique) means no new record started in between (a new
//! owner's claim CAS precedes its record, and the driver orders our query after any record it
//! observed).
//!
//! # Orderings
//! - `ticket.fetch_add(Relaxed)`: the ticket only spreads threads over slots; it publishes no
//!   data, ownership is decided by the CAS on the slot's state.
//! - `state.load(Relaxed)` before the claim CAS: a hint; the CAS decides.
//! - Claim CAS `Acquire` on success: pairs with the previous owner's `Release` store, so the new
//!   owner sees that owner's buffer pointer (after growth), its recorded event and its stats.
//!   `Relaxed` on failure: nothing is read after a failed CAS.
//! - Release `store(Release)`: publishes everything the owner did to the slot to the next owner.
//! - `tickets`: `load(Acquire)` for `begin`, `fetch_add(AcqRel)` for `done` (the argument above).
//! - Watermarks: `fetch_max(Release)` after a query saw the event complete, `load(Acquire)` before
//!   the buffer is reused: the reuse happens after the query that observed the copy complete.
//!
//! A waiting owner holds no lock: it owns one slot in `WRITING`, other threads skip that slot
//! and claim others. Two threads never own one slot: only a successful CAS from a non-`WRITING`
//! state enters `WRITING`, and only the owner leaves it.

use crossbeam_utils::CachePadded;

use crate::sync::{AtomicBool, AtomicU64, AtomicUsize, Ordering, yield_now};

/// No copy pending from the slot's buffer.
pub(crate) const IDLE: u64 = 0;
/// Owned by one thread.
pub(crate) const WRITING: u64 = 1;
/// A copy was issued from the buffer and the slot's event recorded after it.
pub(crate) const IN_FLIGHT: u64 = 2;
const KIND_MASK: u64 = 0b11;
const MARK_SHIFT: u32 = 2;
const GAP_SHIFT: u32 = 6;
const DONE_SHIFT: u32 = 16;
/// Entries in the stream table; `NO_MARK` is the "untracked" mark.
pub(crate) const MARKS: usize = 15;
/// The stream is not tracked: claims query the slot's own event.
pub(crate) const NO_MARK: u8 = 15;
const NO_GAP: u64 = 1023;

/// A decoded state word.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct SlotState(u64);

impl SlotState {
    fn kind(self) -> u64 {
        self.0 & KIND_MASK
    }

    /// The slot's last copy may still be running.
    pub(crate) fn in_flight(self) -> bool {
        self.kind() == IN_FLIGHT
    }

    fn mark(self) -> u8 {
        ((self.0 >> MARK_SHIFT) & 0xF) as u8
    }

    fn done(self) -> u64 {
        self.0 >> DONE_SHIFT
    }

    /// The ticket read before the copy was issued, when known.
    fn begin(self) -> Option<u64> {
        let gap = (self.0 >> GAP_SHIFT) & NO_GAP;
        (gap != NO_GAP).then(|| self.done() - gap)
    }

    fn recorded(mark: u8, begin: u64, done: u64) -> Self {
        let gap = (done - begin).min(NO_GAP);
        Self(
            IN_FLIGHT | (u64::from(mark) << MARK_SHIFT) | (gap << GAP_SHIFT) | (done << DONE_SHIFT),
        )
    }

    fn with_kind(self, kind: u64) -> Self {
        Self((self.0 & !KIND_MASK) | kind)
    }
}

/// What the owner of a slot reports when it gives the slot back.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Release {
    /// Nothing from the buffer is pending.
    Idle,
    /// A copy was issued and the slot's event recorded: on stream table entry `mark`, tickets
    /// `begin` (read before the copy) and `done` (taken after the record).
    InFlight {
        /// The stream's table entry ([`NO_MARK`]: untracked).
        mark: u8,
        /// [`Ring::begin`] before the copy.
        begin: u64,
        /// [`Ring::done`] after the record.
        done: u64,
    },
    /// Nothing changed since the claim (an error ended the copy before anything was issued):
    /// the word read at the claim goes back.
    Restore(SlotState),
}

/// The atomics of a ring of `depth` slots, with the stream table and the completion tickets.
pub(crate) struct Ring {
    ticket: CachePadded<AtomicUsize>,
    states: Box<[CachePadded<AtomicU64>]>,
    /// Stream IDs + 1 of the table's entries (0: free); read on every copy, written once each.
    ids: [AtomicU64; MARKS],
    /// Each entry's tickets, watermark and reach, on its own cache line: threads on different
    /// streams share none of them.
    marks: [CachePadded<MarkState>; MARKS],
    /// Whether claims use the watermarks and a query of a slot ahead (the default), or query
    /// their own slot's event every time (for comparison in the benches).
    amortize: AtomicBool,
}

/// What the ring knows of one tracked stream.
struct MarkState {
    /// Completion tickets of the records on this stream (only compared within one stream).
    tickets: AtomicU64,
    /// Records on this stream with `done <= wm` completed.
    wm: AtomicU64,
    /// How many slots ahead of its own a claimer asks about: the newest copy likely complete.
    /// Grows by one after a complete answer, halves after an incomplete one, so it settles just
    /// behind the copy engine's lag (a ring deeper than that lag lets one query serve several
    /// claims).
    reach: AtomicUsize,
}

/// A slot owned by the calling thread (state `WRITING`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Claim {
    /// Index of the slot.
    pub index: usize,
    /// The slot's word when it was claimed.
    pub prev: SlotState,
}

impl Claim {
    /// The slot was `IN_FLIGHT`: its copy must be known complete before its buffer is touched.
    pub(crate) fn was_in_flight(&self) -> bool {
        self.prev.in_flight()
    }
}

impl Ring {
    /// A ring of `depth >= 1` idle slots.
    pub(crate) fn new(depth: usize) -> Self {
        assert!(depth >= 1, "depth must be at least 1");
        Self {
            ticket: CachePadded::new(AtomicUsize::new(0)),
            states: (0..depth)
                .map(|_| CachePadded::new(AtomicU64::new(IDLE)))
                .collect(),
            ids: std::array::from_fn(|_| AtomicU64::new(0)),
            marks: std::array::from_fn(|_| {
                CachePadded::new(MarkState {
                    tickets: AtomicU64::new(0),
                    wm: AtomicU64::new(0),
                    reach: AtomicUsize::new(depth / 2),
                })
            }),
            amortize: AtomicBool::new(true),
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
            if cur & KIND_MASK != WRITING
                && state
                    // Acquire on success: see the previous owner's writes. Relaxed on failure.
                    .compare_exchange(
                        cur,
                        SlotState(cur).with_kind(WRITING).0,
                        Ordering::Acquire,
                        Ordering::Relaxed,
                    )
                    .is_ok()
            {
                return Claim {
                    index,
                    prev: SlotState(cur),
                };
            }
            misses += 1;
            if misses >= depth {
                misses = 0;
                yield_now();
            }
        }
    }

    /// Gives an owned slot back.
    pub(crate) fn release(&self, index: usize, how: Release) {
        let next = match how {
            Release::Idle => IDLE,
            Release::InFlight { mark, begin, done } => SlotState::recorded(mark, begin, done).0,
            Release::Restore(prev) => prev.0,
        };
        debug_assert_eq!(
            self.states[index].load(Ordering::Relaxed) & KIND_MASK,
            WRITING
        );
        // Release: publish the owner's writes to the next owner (pairs with the claim CAS).
        self.states[index].store(next, Ordering::Release);
    }

    /// The stream table entry of the stream with driver ID `id` (`None`: untracked), assigned
    /// on first use; [`NO_MARK`] once the table is full.
    pub(crate) fn mark(&self, id: Option<u64>) -> u8 {
        let Some(key) = id.and_then(|id| id.checked_add(1)) else {
            return NO_MARK;
        };
        for (e, slot) in self.ids.iter().enumerate() {
            // Acquire/AcqRel: an entry's key is only ever written once (0 -> key).
            let cur = slot.load(Ordering::Acquire);
            if cur == key {
                return e as u8;
            }
            if cur == 0 {
                match slot.compare_exchange(0, key, Ordering::AcqRel, Ordering::Acquire) {
                    Ok(_) => return e as u8,
                    Err(now) if now == key => return e as u8,
                    Err(_) => {}
                }
            }
        }
        NO_MARK
    }

    /// The completion ticket to read before issuing a copy on the stream of `mark` (0 when
    /// untracked).
    pub(crate) fn begin(&self, mark: u8) -> u64 {
        self.marks.get(usize::from(mark)).map_or(0, |m| {
            // Acquire: pairs with the AcqRel increments of records that returned before (module
            // docs).
            m.tickets.load(Ordering::Acquire)
        })
    }

    /// The completion ticket of a record that just returned on the stream of `mark` (0 when
    /// untracked).
    pub(crate) fn done(&self, mark: u8) -> u64 {
        self.marks.get(usize::from(mark)).map_or(0, |m| {
            // AcqRel: publishes this record's return to every later `begin` that sees it.
            m.tickets.fetch_add(1, Ordering::AcqRel) + 1
        })
    }

    /// Chooses between amortized checks (default) and a query of the own event on every claim.
    pub(crate) fn set_amortize(&self, on: bool) {
        // Relaxed: a mode switch for benches; either mode is correct.
        self.amortize.store(on, Ordering::Relaxed);
    }

    /// Whether claims use the watermarks.
    pub(crate) fn amortizes(&self) -> bool {
        self.amortize.load(Ordering::Relaxed)
    }

    fn advance(&self, mark: u8, begin: u64) {
        if let Some(m) = self.marks.get(usize::from(mark)) {
            // Release: pairs with the Acquire load in `covered` (module docs).
            m.wm.fetch_max(begin, Ordering::Release);
        }
    }

    fn covered(&self, s: SlotState) -> bool {
        self.marks
            .get(usize::from(s.mark()))
            // Acquire: see `advance`.
            .is_some_and(|m| m.wm.load(Ordering::Acquire) >= s.done())
    }

    /// For the owner of `claim` (a slot that was `IN_FLIGHT`): whether its last copy is known
    /// complete, asking `query(slot)` (the slot's event: `Ok(true)` once complete) as little as
    /// possible: not at all when the stream's watermark covers it, else once for the slot half a
    /// ring ahead, else once for its own. `Ok(false)`: the caller must wait for its own event.
    pub(crate) fn check<E>(
        &self,
        claim: &Claim,
        query: &mut dyn FnMut(usize) -> Result<bool, E>,
    ) -> Result<bool, E> {
        let me = claim.prev;
        debug_assert!(me.in_flight());
        let depth = self.states.len();
        let tracked = me.mark() != NO_MARK && self.amortizes();
        if tracked {
            if self.covered(me) {
                return Ok(true);
            }
            if depth >= 4 {
                let hint = &self.marks[usize::from(me.mark())].reach;
                // Relaxed: a hint; any slot is a correct choice (the word decides).
                let reach = hint.load(Ordering::Relaxed).clamp(1, depth - 1);
                let j = (claim.index + reach) % depth;
                // Acquire: the word's record happened before this read (its owner's Release).
                let word = self.states[j].load(Ordering::Acquire);
                let other = SlotState(word);
                if other.in_flight()
                    && other.mark() == me.mark()
                    && let Some(begin) = other.begin()
                    && begin >= me.done()
                {
                    let complete = query(j)?;
                    // Reach further after a hit, back off by half after a miss.
                    let next = (if complete { reach + 1 } else { reach / 2 }).clamp(1, depth - 1);
                    if next != reach {
                        // Relaxed: see above. Written only when it changes: the line stays
                        // shared among the stream's claimers while the lag is steady.
                        hint.store(next, Ordering::Relaxed);
                    }
                    // Unchanged: the query saw this record, not a newer one (module docs).
                    if !complete || self.states[j].load(Ordering::Acquire) != word {
                        return self.check_own(claim, query, true);
                    }
                    self.advance(me.mark(), begin);
                    // Its own copy completed too: spare its next claimer the check. Failure
                    // (claimed meanwhile) is fine.
                    let _ = self.states[j].compare_exchange(
                        word,
                        other.with_kind(IDLE).0,
                        Ordering::AcqRel,
                        Ordering::Relaxed,
                    );
                    return Ok(true);
                }
            }
        }
        self.check_own(claim, query, tracked)
    }

    /// The last step of [`Ring::check`]: the claimed slot's own event.
    fn check_own<E>(
        &self,
        claim: &Claim,
        query: &mut dyn FnMut(usize) -> Result<bool, E>,
        tracked: bool,
    ) -> Result<bool, E> {
        let me = claim.prev;
        let complete = query(claim.index)?;
        if complete
            && tracked
            && let Some(begin) = me.begin()
        {
            self.advance(me.mark(), begin);
        }
        Ok(complete)
    }

    /// Whether slot `index` is `IN_FLIGHT`; for `Drop`, which has exclusive access.
    pub(crate) fn is_in_flight(&mut self, index: usize) -> bool {
        // Acquire: pairs with the last owner's Release store.
        self.states[index].load(Ordering::Acquire) & KIND_MASK == IN_FLIGHT
    }
}

/// A simulated driver for the tests and the loom model: streams that complete their copies in
/// order, events that remember their last record, and a copy engine that, when a copy
/// completes, checks that the slot's buffer still holds what was written for that copy.
/// Everything is behind one lock, as the driver serialises its calls; a query completes at most
/// one more copy of the queried event's stream (the engine "progresses" as the host asks).
#[cfg(test)]
mod sim {
    #[cfg(loom)]
    use loom::sync::Mutex;
    #[cfg(not(loom))]
    use std::sync::Mutex;

    pub(super) struct Sim {
        inner: Mutex<Inner>,
        /// A query completes every copy issued so far on the stream (a GPU that keeps up),
        /// instead of one more.
        eager: bool,
    }

    struct Inner {
        /// Per stream: (slot, value the copy must read) in issue order, and how many completed.
        logs: Vec<(Vec<(usize, u64)>, usize)>,
        /// Per slot event: (stream, log length at its last record).
        events: Vec<Option<(usize, usize)>>,
        completed: usize,
    }

    impl Sim {
        pub(super) fn new(streams: usize, slots: usize, eager: bool) -> Self {
            Self {
                eager,
                inner: Mutex::new(Inner {
                    logs: (0..streams).map(|_| (Vec::new(), 0)).collect(),
                    events: vec![None; slots],
                    completed: 0,
                }),
            }
        }

        pub(super) fn copy(&self, stream: usize, slot: usize, value: u64) {
            self.inner.lock().unwrap().logs[stream]
                .0
                .push((slot, value));
        }

        pub(super) fn record(&self, stream: usize, slot: usize) {
            let mut g = self.inner.lock().unwrap();
            let pos = g.logs[stream].0.len();
            g.events[slot] = Some((stream, pos));
        }

        /// `read(slot)` gives the slot buffer's content as the copy engine reads it.
        pub(super) fn query(&self, slot: usize, read: &dyn Fn(usize) -> u64) -> bool {
            let mut g = self.inner.lock().unwrap();
            let Some((stream, pos)) = g.events[slot] else {
                return true;
            };
            let g = &mut *g;
            let (log, done) = &mut g.logs[stream];
            let until = if self.eager {
                log.len()
            } else {
                log.len().min(*done + 1)
            };
            while *done < until {
                let (s, want) = log[*done];
                assert_eq!(
                    read(s),
                    want,
                    "torn copy: slot {s} rewritten before its copy ran"
                );
                *done += 1;
                g.completed += 1;
            }
            g.logs[stream].1 >= pos
        }

        /// Completes every copy (the stager's drop); returns how many completed in all.
        pub(super) fn drain(&self, read: &dyn Fn(usize) -> u64) -> usize {
            let mut g = self.inner.lock().unwrap();
            let g = &mut *g;
            for (log, done) in g.logs.iter_mut() {
                while *done < log.len() {
                    let (s, want) = log[*done];
                    assert_eq!(read(s), want, "torn copy at drop");
                    *done += 1;
                    g.completed += 1;
                }
            }
            g.completed
        }
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::sync::atomic::AtomicU64 as StdU64;

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
    fn amortized_checks_query_less_and_stay_correct() {
        let depth = 8;
        let ring = Ring::new(depth);
        let sim = sim::Sim::new(1, depth, true);
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
        // Without amortization every claim after the first turn queries: 792 queries.
        assert!(
            queries <= 792 / 3,
            "amortized: {queries} queries for 792 checks (a GPU that keeps up)"
        );
        ring.set_amortize(false);
        let (mut own, mut checks) = (0usize, 0usize);
        for _ in 0..2 * depth {
            let c = ring.claim();
            if c.was_in_flight() {
                checks += 1;
                ring.check(&c, &mut |j| {
                    assert_eq!(j, c.index, "without amortization only the own event");
                    own += 1;
                    Ok::<_, ()>(true)
                })
                .unwrap();
            }
            let (begin, done) = (ring.begin(mark), ring.done(mark));
            ring.release(c.index, Release::InFlight { mark, begin, done });
        }
        assert!(checks >= depth);
        assert_eq!(
            own, checks,
            "every in-flight slot asked its own event, once"
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
                    let word = r.states[2].load(Ordering::Relaxed);
                    r.states[2].store(SlotState(word).with_kind(WRITING).0, Ordering::Relaxed);
                    let (begin, done) = (r.begin(m), r.done(m));
                    r.states[2].store(SlotState::recorded(m, begin, done).0, Ordering::Relaxed);
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
        let sim = Arc::new(sim::Sim::new(2, depth, eager));
        let bufs: Arc<Vec<StdU64>> = Arc::new((0..depth).map(|_| StdU64::new(0)).collect());
        let per = if cfg!(miri) { 30u64 } else { 20_000 };
        let hs: Vec<_> = (0..4u64)
            .map(|t| {
                let (ring, sim, bufs) = (ring.clone(), sim.clone(), bufs.clone());
                std::thread::spawn(move || {
                    let read = |s: usize| bufs[s].load(std::sync::atomic::Ordering::Relaxed);
                    let stream = (t % 2) as usize;
                    let mark = ring.mark(Some(100 + stream as u64));
                    for k in 0..per {
                        let v = (t + 1) << 40 | k;
                        let c = ring.claim();
                        if c.was_in_flight()
                            && !ring
                                .check(&c, &mut |j| Ok::<_, ()>(sim.query(j, &read)))
                                .unwrap()
                        {
                            while !sim.query(c.index, &read) {}
                        }
                        bufs[c.index].store(v, std::sync::atomic::Ordering::Relaxed);
                        let begin = ring.begin(mark);
                        sim.copy(stream, c.index, v);
                        sim.record(stream, c.index);
                        let done = ring.done(mark);
                        ring.release(c.index, Release::InFlight { mark, begin, done });
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
}

/// Loom model of the slot protocol with the simulated driver (`sim`): writer threads claim a
/// slot; when it was `IN_FLIGHT` they learn its copy completed (watermark, a query half a ring
/// ahead, or their own event, as the stager does; waiting = querying until complete), then
/// optionally grow the buffer, write their value, issue the copy, record the event and release.
/// The buffers are loom cells: any write to a buffer that is not ordered after the completion
/// of its last copy (where the simulated engine reads it) is a data race loom reports; the
/// engine also checks the value it reads. Copies left at the end are completed by "drop".
#[cfg(all(test, loom))]
mod loom_tests {
    use super::*;
    use crate::sync::UnsafeCell;
    use loom::sync::Arc;

    struct Model {
        ring: Ring,
        bufs: Vec<UnsafeCell<Vec<u64>>>,
        sim: sim::Sim,
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

    fn writer(m: &Model, stream: usize, value: u64, grow: bool) {
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
        let mark = m.ring.mark(Some(7 + stream as u64));
        let begin = m.ring.begin(mark);
        m.sim.copy(stream, c.index, value);
        m.sim.record(stream, c.index);
        let done = m.ring.done(mark);
        m.ring
            .release(c.index, Release::InFlight { mark, begin, done });
    }

    fn run(depth: usize, threads: u64, copies_each: u64, grow: bool, streams: usize) {
        let mut builder = loom::model::Builder::new();
        if builder.preemption_bound.is_none() {
            builder.preemption_bound = Some(2);
        }
        builder.check(move || {
            let m = Arc::new(Model {
                ring: Ring::new(depth),
                bufs: (0..depth).map(|_| UnsafeCell::new(vec![0u64; 2])).collect(),
                sim: sim::Sim::new(streams, depth, false),
            });
            let hs: Vec<_> = (0..threads)
                .map(|t| {
                    let m = m.clone();
                    loom::thread::spawn(move || {
                        for k in 0..copies_each {
                            writer(&m, t as usize % streams, 100 * (t + 1) + k, grow && k == 0);
                        }
                    })
                })
                .collect();
            for h in hs {
                h.join().unwrap();
            }
            let read = |s: usize| m.read(s);
            assert_eq!(m.sim.drain(&read), (threads * copies_each) as usize);
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
}
