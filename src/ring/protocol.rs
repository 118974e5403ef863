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

use crate::sync::{AtomicU64, AtomicUsize, Ordering, yield_now};

// The seeded-bug harness (`scripts/test`): each `pinstage_seeded_bug` value puts back one known
// protocol bug, and the loom models must fail on it. Never set in a build anyone uses.
#[cfg(not(pinstage_seeded_bug = "claim_relaxed"))]
const CLAIM_ORDER: Ordering = Ordering::Acquire;
#[cfg(pinstage_seeded_bug = "claim_relaxed")]
const CLAIM_ORDER: Ordering = Ordering::Relaxed;
#[cfg(not(pinstage_seeded_bug = "release_relaxed"))]
const RELEASE_ORDER: Ordering = Ordering::Release;
#[cfg(pinstage_seeded_bug = "release_relaxed")]
const RELEASE_ORDER: Ordering = Ordering::Relaxed;

/// The watermark a complete record on another slot proves: its `begin` ticket (see the module
/// docs); the seeded bug takes its `done`, which also covers copies recorded during it.
#[inline]
fn evidence(begin: u64, _other: SlotState) -> u64 {
    #[cfg(pinstage_seeded_bug = "watermark_done")]
    return _other.done();
    #[cfg(not(pinstage_seeded_bug = "watermark_done"))]
    begin
}

/// The deepest ring a stager accepts.
pub const MAX_DEPTH: usize = 1 << 16;

/// No copy pending from the slot's buffer.
pub const IDLE: u64 = 0;
/// Owned by one thread.
pub const WRITING: u64 = 1;
/// A copy was issued from the buffer and the slot's event recorded after it.
pub const IN_FLIGHT: u64 = 2;
const KIND_MASK: u64 = 0b11;
const MARK_SHIFT: u32 = 2;
const GAP_SHIFT: u32 = 6;
const DONE_SHIFT: u32 = 16;
/// Entries in the stream table; `NO_MARK` is the "untracked" mark.
pub const MARKS: usize = 15;
/// The stream is not tracked: claims query the slot's own event.
pub const NO_MARK: u8 = 15;
const NO_GAP: u64 = 1023;

/// A decoded state word.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SlotState(u64);

impl SlotState {
    /// The state: [`IDLE`], [`WRITING`] or [`IN_FLIGHT`].
    pub fn kind(self) -> u64 {
        self.0 & KIND_MASK
    }

    /// The slot's last copy may still be running.
    pub fn in_flight(self) -> bool {
        self.kind() == IN_FLIGHT
    }

    /// The stream table entry of the slot's last record ([`NO_MARK`]: untracked).
    pub fn mark(self) -> u8 {
        ((self.0 >> MARK_SHIFT) & 0xF) as u8
    }

    /// The completion ticket of the slot's last record.
    pub fn done(self) -> u64 {
        self.0 >> DONE_SHIFT
    }

    /// The ticket read before the copy was issued, when known.
    pub fn begin(self) -> Option<u64> {
        let gap = (self.0 >> GAP_SHIFT) & NO_GAP;
        (gap != NO_GAP).then(|| self.done() - gap)
    }

    /// The word of a slot released in flight with these tickets.
    pub fn recorded(mark: u8, begin: u64, done: u64) -> Self {
        let gap = (done - begin).min(NO_GAP);
        Self(
            IN_FLIGHT | (u64::from(mark) << MARK_SHIFT) | (gap << GAP_SHIFT) | (done << DONE_SHIFT),
        )
    }

    /// The same word with another state.
    pub fn with_kind(self, kind: u64) -> Self {
        Self((self.0 & !KIND_MASK) | kind)
    }
}

/// What the owner of a slot reports when it gives the slot back.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Release {
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
pub struct Ring {
    ticket: CachePadded<AtomicUsize>,
    states: Box<[CachePadded<AtomicU64>]>,
    /// Stream IDs + 1 of the table's entries (0: free); read on every copy, written once each.
    ids: [AtomicU64; MARKS],
    /// Each entry's tickets, watermark and reach, on its own cache line: threads on different
    /// streams share none of them.
    marks: [CachePadded<MarkState>; MARKS],
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
pub struct Claim {
    /// Index of the slot.
    pub index: usize,
    /// The slot's word when it was claimed.
    pub prev: SlotState,
}

impl Claim {
    /// The slot was `IN_FLIGHT`: its copy must be known complete before its buffer is touched.
    pub fn was_in_flight(&self) -> bool {
        self.prev.in_flight()
    }
}

impl Ring {
    /// A ring of `depth >= 1` idle slots.
    pub fn new(depth: usize) -> Self {
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
        }
    }

    /// Number of slots.
    pub fn depth(&self) -> usize {
        self.states.len()
    }

    /// Claims the next slot that nobody is writing. Never blocks on a lock; spins (yielding after
    /// every full turn of the ring) only while every slot is owned by another thread.
    pub fn claim(&self) -> Claim {
        let depth = self.states.len();
        let mut misses = 0usize;
        loop {
            if let Some(c) = self.claim_next() {
                return c;
            }
            misses += 1;
            if misses >= depth {
                misses = 0;
                yield_now();
            }
        }
    }

    /// One claim attempt: the slot the next ticket names, unless another thread is writing it.
    #[inline]
    fn claim_next(&self) -> Option<Claim> {
        // Relaxed: see the module docs; the ticket publishes nothing.
        let t = self.ticket.fetch_add(1, Ordering::Relaxed);
        let index = t % self.states.len();
        let state = &self.states[index];
        // Relaxed: a hint only, the CAS below decides.
        let cur = state.load(Ordering::Relaxed);
        (cur & KIND_MASK != WRITING
            && state
                // Acquire on success: see the previous owner's writes. Relaxed on failure.
                .compare_exchange(
                    cur,
                    SlotState(cur).with_kind(WRITING).0,
                    CLAIM_ORDER,
                    Ordering::Relaxed,
                )
                .is_ok())
        .then_some(Claim {
            index,
            prev: SlotState(cur),
        })
    }

    /// Gives an owned slot back.
    pub fn release(&self, index: usize, how: Release) {
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
        self.states[index].store(next, RELEASE_ORDER);
    }

    /// The stream table entry of the stream with driver ID `id` (`None`: untracked), assigned
    /// on first use; [`NO_MARK`] once the table is full.
    pub fn mark(&self, id: Option<u64>) -> u8 {
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
    pub fn begin(&self, mark: u8) -> u64 {
        self.marks.get(usize::from(mark)).map_or(0, |m| {
            // Acquire: pairs with the AcqRel increments of records that returned before (module
            // docs).
            m.tickets.load(Ordering::Acquire)
        })
    }

    /// The completion ticket of a record that just returned on the stream of `mark` (0 when
    /// untracked).
    pub fn done(&self, mark: u8) -> u64 {
        self.marks.get(usize::from(mark)).map_or(0, |m| {
            // AcqRel: publishes this record's return to every later `begin` that sees it.
            m.tickets.fetch_add(1, Ordering::AcqRel) + 1
        })
    }

    fn advance(&self, mark: u8, begin: u64) {
        if let Some(m) = self.marks.get(usize::from(mark)) {
            // Release: pairs with the Acquire load in `covered` (module docs).
            m.wm.fetch_max(begin, Ordering::Release);
        }
    }

    /// Whether the watermark of `s`'s stream shows `s`'s record complete.
    pub fn covered(&self, s: SlotState) -> bool {
        self.marks
            .get(usize::from(s.mark()))
            // Acquire: see `advance`.
            .is_some_and(|m| m.wm.load(Ordering::Acquire) >= s.done())
    }

    /// For the owner of `claim` (a slot that was `IN_FLIGHT`): whether its last copy is known
    /// complete, asking `query(slot)` (the slot's event: `Ok(true)` once complete) as little as
    /// possible: not at all when the stream's watermark covers it, else once for the slot half a
    /// ring ahead, else once for its own. `Ok(false)`: the caller must wait for its own event.
    pub fn check<E>(
        &self,
        claim: &Claim,
        query: &mut dyn FnMut(usize) -> Result<bool, E>,
    ) -> Result<bool, E> {
        let me = claim.prev;
        debug_assert!(me.in_flight());
        let depth = self.states.len();
        let tracked = me.mark() != NO_MARK;
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
                    self.advance(me.mark(), evidence(begin, other));
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
    pub fn is_in_flight(&mut self, index: usize) -> bool {
        // Acquire: pairs with the last owner's Release store.
        self.states[index].load(Ordering::Acquire) & KIND_MASK == IN_FLIGHT
    }
}

/// What the owner of a claimed slot does with the device, for [`Ring::drive`]: the stager's
/// CUDA calls, or a simulated driver in the tests and the loom models, which so drive the
/// stager's own protocol code.
pub trait SlotOwner {
    /// The error of a step.
    type Error;
    /// `Ok(true)` once the copy last recorded on slot `slot`'s event completed (never blocks).
    fn query(&mut self, slot: usize) -> Result<bool, Self::Error>;
    /// Blocks until slot `slot`'s last copy completed.
    fn wait(&mut self, slot: usize) -> Result<(), Self::Error>;
    /// Writes slot `slot`'s buffer: its last copy completed and nobody else touches it.
    fn fill(&mut self, slot: usize) -> Result<(), Self::Error>;
    /// The driver's ID of the stream the copy goes on (`None`: untracked).
    fn stream_id(&mut self) -> Option<u64>;
    /// Issues the copy from slot `slot`'s buffer.
    fn send(&mut self, slot: usize) -> Result<(), Self::Error>;
    /// Records slot `slot`'s event after the copy.
    fn record(&mut self, slot: usize) -> Result<(), Self::Error>;
    /// After a failed record: waits for the stream; `false` if even that failed.
    fn settle(&mut self) -> bool;
}

impl Ring {
    /// One copy through the ring: claims a slot, learns that its last copy completed (the
    /// stream's watermark, one query, or waiting), has `owner` write the slot, send the copy and
    /// record the slot's event, and releases the slot, on every error too, in the state that
    /// error leaves it in. Returns the slot used.
    ///
    /// # Errors
    /// The first error of `owner`'s steps; the slot is released: restored (its previous copy
    /// may still run) when learning failed, idle when the copy was not issued, in flight and
    /// untracked when even waiting for the stream failed after a failed record.
    pub fn drive<O: SlotOwner>(&self, owner: &mut O) -> Result<usize, O::Error> {
        let claim = self.claim();
        self.ready(&claim, owner)?;
        self.finish(&claim, owner)?;
        Ok(claim.index)
    }

    /// Claims the next free slot without spinning: `None` after one full turn of the ring found
    /// every slot owned (the caller may then block in [`Ring::claim`], e.g. without the GIL).
    #[cfg(any(feature = "python", feature = "testing"))]
    pub fn try_claim(&self) -> Option<Claim> {
        (0..self.states.len()).find_map(|_| self.claim_next())
    }

    /// For a fresh `claim`: learns that the slot's last copy completed (the stream's watermark,
    /// one query, or `owner.wait`). On error the slot is released as it was (its previous copy
    /// may still run) and the claim is spent.
    pub fn ready<O: SlotOwner>(&self, claim: &Claim, owner: &mut O) -> Result<(), O::Error> {
        if claim.was_in_flight() {
            // A panicking owner (a caller's wait function) leaves the slot as it was: its
            // previous copy may still run, and whoever drops the ring must wait for it.
            let guard = RestoreOnUnwind {
                ring: self,
                index: claim.index,
                prev: claim.prev,
            };
            let learned = match self.check(claim, &mut |j| owner.query(j)) {
                Ok(true) => Ok(()),
                Ok(false) => owner.wait(claim.index),
                Err(e) => Err(e),
            };
            std::mem::forget(guard);
            if let Err(e) = learned {
                // Nothing changed: the slot's previous copy may still run, its word says so.
                self.release(claim.index, Release::Restore(claim.prev));
                return Err(e);
            }
        }
        Ok(())
    }

    /// For a claim made [`Ring::ready`]: has `owner` write the slot, send the copy and record the
    /// slot's event, then releases the slot in the state that the outcome leaves it in.
    pub fn finish<O: SlotOwner>(&self, claim: &Claim, owner: &mut O) -> Result<(), O::Error> {
        let (result, how) = self.own(claim, owner);
        self.release(claim.index, how);
        result
    }

    #[inline]
    fn own<O: SlotOwner>(&self, claim: &Claim, owner: &mut O) -> (Result<(), O::Error>, Release) {
        if let Err(e) = owner.fill(claim.index) {
            return (Err(e), Release::Idle);
        }
        let mark = self.mark(owner.stream_id());
        let begin = self.begin(mark);
        if let Err(e) = owner.send(claim.index) {
            return (Err(e), Release::Idle);
        }
        if let Err(e) = owner.record(claim.index) {
            // The copy cannot be tracked by its event: idle once the stream was waited for;
            // else in flight and unmarked, so a claimer asks the driver (the context is failing).
            let how = if owner.settle() {
                Release::Idle
            } else {
                Release::InFlight {
                    mark: NO_MARK,
                    begin: 0,
                    done: 0,
                }
            };
            return (Err(e), how);
        }
        let done = self.done(mark);
        (Ok(()), Release::InFlight { mark, begin, done })
    }
}

/// Direct access to the words, for tests that play another thread's part at a chosen moment.
#[cfg(any(feature = "testing", loom))]
impl Ring {
    /// Slot `index`'s word.
    pub fn word(&self, index: usize) -> SlotState {
        SlotState(self.states[index].load(Ordering::Acquire))
    }

    /// Overwrites slot `index`'s word (breaks the protocol unless the test plays it).
    pub fn set_word(&self, index: usize, word: SlotState) {
        self.states[index].store(word.0, Ordering::Release);
    }
}

/// Releases a claimed slot in its previous state when dropped (by a panic unwinding
/// [`Ring::ready`]; forgotten otherwise).
struct RestoreOnUnwind<'r> {
    ring: &'r Ring,
    index: usize,
    prev: SlotState,
}

impl Drop for RestoreOnUnwind<'_> {
    fn drop(&mut self) {
        self.ring.release(self.index, Release::Restore(self.prev));
    }
}
