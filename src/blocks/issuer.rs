//! The mover's issuing threads: a move's copies are issued on a thread of the mover, on its
//! side stream, so the caller returns before the driver has taken them (the driver holds a
//! thread that issues thousands of copies for about as long as they take).
//!
//! Order is kept on the device; the host never waits:
//! - the caller records a fork event on its stream: the copies run after the work queued there;
//! - the caller's stream waits (`cuStreamWaitValue32`) until the side stream has written the
//!   move's number into a device word after the copies, and the move's event is recorded after
//!   that wait: later work on the caller's stream, and whatever waits on the event, runs after
//!   the copies;
//! - the thread takes moves in the order of their numbers and writes each move's number even
//!   when issuing failed (after draining what it issued), so no stream waits forever; the error
//!   goes into the move's [`Outcome`] before the number is written, so a wait that saw the
//!   move's event complete sees it.

use std::sync::Arc;
use std::sync::mpsc;

use parking_lot::Mutex;

use super::copy::{MAX_BATCH, Outcome};
use super::plan::Segment;
use crate::cuda::{Current, Device, Event, Stream, StreamHandle};
use crate::driver::{self, CUdeviceptr, DriverError};
use crate::error::{Error, Result};

/// How a move's segments are issued.
#[derive(Clone, Copy, Debug)]
pub(super) enum Issue {
    /// One 2D copy per segment: `rows` rows, sources `src_pitch` and destinations `dst_pitch`
    /// bytes apart; `to_host`: device to host.
    Strided {
        src_pitch: usize,
        dst_pitch: usize,
        rows: usize,
        to_host: bool,
    },
    /// `cuMemcpyBatchAsync`, [`MAX_BATCH`] copies per call (not on the legacy stream).
    Batched,
    /// One `cuMemcpyAsync` per segment (drivers before CUDA 12.8).
    PerCopy,
}

struct Job {
    segments: Vec<Segment>,
    issue: Issue,
    fork: Event,
    number: u32,
    outcome: Arc<Outcome>,
}

struct Queue {
    tx: mpsc::Sender<Job>,
    /// The number of the last move sent (the word's value once it completed).
    number: u32,
}

/// One issuing thread with its side stream and device word. Dropped, it lets the thread end
/// once it issued every move sent; the thread then frees the word and the stream.
pub(super) struct Issuer {
    queue: Mutex<Queue>,
    word: CUdeviceptr,
    /// Copy lists handed back by the thread, for the next moves.
    spares: Arc<Mutex<Vec<Vec<Segment>>>>,
}

impl std::fmt::Debug for Issuer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Issuer").field("word", &self.word).finish()
    }
}

impl Issuer {
    /// An issuing thread for `device`; `None` when it cannot have one (stream memory operations
    /// refused, no thread, no context on it): moves are then issued on the caller's thread.
    pub(super) fn start(device: &Device) -> Option<Self> {
        let cur = device.enter().ok()?;
        let side = Stream::new(device).ok()?;
        // SAFETY: a context is current (`cur`).
        let word = unsafe { driver::mem::mem_alloc(4) }.ok()?;
        let word = Word {
            device: device.clone(),
            ptr: word,
        };
        // The word starts at 0 (numbers start at 1), and a wait for 0 is met at once: the
        // driver must take one here, or the caller's thread issues.
        // SAFETY: the word's 4 bytes, synchronous.
        unsafe { driver::mem::memset_d32(word.ptr, 0, 1) }.ok()?;
        // SAFETY: our stream and word; the wait is met at once.
        unsafe { driver::stream::stream_wait_value32(side.handle().raw(), word.ptr, 0) }.ok()?;
        drop(cur);
        let (tx, rx) = mpsc::channel::<Job>();
        let spares = Arc::default();
        let ptr = word.ptr;
        let (ready_tx, ready_rx) = mpsc::sync_channel::<bool>(1);
        let thread_spares = Arc::clone(&spares);
        let device = device.clone();
        std::thread::Builder::new()
            .name("pinstage-blocks".into())
            .spawn(move || {
                let Ok(cur) = device.enter() else {
                    let _ = ready_tx.send(false);
                    return;
                };
                let _ = ready_tx.send(true);
                run(&cur, &side, &word, &rx, &thread_spares);
            })
            .ok()?;
        ready_rx.recv().ok().filter(|&ok| ok)?;
        Some(Self {
            queue: Mutex::new(Queue { tx, number: 0 }),
            word: ptr,
            spares,
        })
    }

    /// An empty copy list to fill (reused from earlier moves).
    pub(super) fn segments(&self) -> Vec<Segment> {
        self.spares.lock().pop().unwrap_or_default()
    }

    /// Hands `segments` to the thread: they run on its side stream after the work queued on
    /// `stream` so far, and work queued on `stream` from now on, and `done` (recorded here),
    /// run after them. On an error nothing was handed over and nothing waits.
    ///
    /// # Safety
    /// 1. Every segment is a copy that may be issued as `issue` (the mover's checked plan), in
    ///    memory that stays valid until `done` completed.
    /// 2. `stream` is a live stream of the issuer's device (or a special handle), not capturing.
    pub(super) unsafe fn send(
        &self,
        cur: &Current<'_>,
        segments: Vec<Segment>,
        issue: Issue,
        stream: StreamHandle,
        done: &Event,
    ) -> Result<Arc<Outcome>> {
        let fork = Event::new_in(cur)?;
        fork.record_in(cur, stream)?;
        let outcome = Arc::new(Outcome::default());
        let mut q = self.queue.lock();
        let number = q.number.wrapping_add(1);
        // The wait before the hand-over: refused, nothing was sent and nothing waits.
        // The seeded-bug harness: later work on `stream` no longer waits for the copies.
        #[cfg(not(pinstage_seeded_bug = "blocks_no_stream_wait"))]
        // SAFETY: the word lives until the thread ends, which is after it wrote every number
        // sent; `stream` is live (the caller's contract).
        unsafe { driver::stream::stream_wait_value32(stream.raw(), self.word, number) }?;
        let job = Job {
            segments,
            issue,
            fork,
            number,
            outcome: Arc::clone(&outcome),
        };
        if let Err(mpsc::SendError(job)) = q.tx.send(job) {
            // The thread is gone (it never ends before the issuer): write the number here so
            // the stream that now waits for it goes on.
            // SAFETY: the word, not freed (the thread frees it when it ends normally).
            let _ = unsafe { driver::mem::memset_d32(self.word, job.number, 1) };
            return Err(Error::unavailable(
                "the block mover's issuing thread is gone",
            ));
        }
        q.number = number;
        drop(q);
        // Recorded after the wait: it completes once the copies did. Refused, the move is
        // still under way: the stream is drained so the error returns with nothing in flight.
        let recorded = done.record_in(cur, stream);
        stream.drained_on_err(cur, recorded)?;
        Ok(outcome)
    }
}

/// The device word, freed when the thread ends (on the reaper: `cuMemFree` waits for the
/// device's work and holds up other threads' calls meanwhile).
struct Word {
    device: Device,
    ptr: CUdeviceptr,
}

impl Drop for Word {
    fn drop(&mut self) {
        // SAFETY: allocated in `Issuer::start`, freed once; every wait on it was met (the
        // thread wrote every number sent before it ended).
        unsafe { crate::host::reaper::free_device_memory(self.device.clone(), self.ptr) };
    }
}

/// The thread's loop: each move's copies after its fork, then its number.
fn run(
    cur: &Current<'_>,
    side: &Stream,
    word: &Word,
    rx: &mpsc::Receiver<Job>,
    spares: &Mutex<Vec<Vec<Segment>>>,
) {
    let stream = side.handle();
    let mut lists = Lists::default();
    for mut job in rx {
        let issued = job.fork.wait_on_in(cur, stream).and_then(|()| {
            // SAFETY: the sender's contract 1; `stream` is our side stream (not the legacy one).
            unsafe { issue(&job.segments, job.issue, stream, &mut lists) }
        });
        drop(job.fork);
        if let Err(e) = issued {
            // What was issued before the failure cannot be followed: drained first, so nothing
            // runs any more when the waiters go on.
            let _ = stream.synchronize(cur);
            job.outcome.fail(e);
        }
        // SAFETY: our word and stream.
        if unsafe { driver::stream::stream_write_value32(stream.raw(), word.ptr, job.number) }
            .is_err()
        {
            let _ = stream.synchronize(cur);
            // SAFETY: our word; synchronous, after the stream drained.
            let _ = unsafe { driver::mem::memset_d32(word.ptr, job.number, 1) };
        }
        job.segments.clear();
        spares.lock().push(job.segments);
    }
    // The issuer dropped: every number sent was written; wait for the last writes before the
    // word goes (the stream's own work only).
    let _ = stream.synchronize(cur);
}

/// The address lists of one batched call, reused.
#[derive(Default)]
pub(super) struct Lists {
    dsts: Vec<u64>,
    srcs: Vec<u64>,
    sizes: Vec<usize>,
}

/// Issues `segments` on `stream` as `how` says.
///
/// # Safety
/// 1. Every segment is a copy valid for `how` whose memory stays valid until it completed.
/// 2. `stream` is a live stream of the current context (not the legacy default stream for
///    [`Issue::Batched`]).
pub(super) unsafe fn issue(
    segments: &[Segment],
    how: Issue,
    stream: StreamHandle,
    lists: &mut Lists,
) -> std::result::Result<(), DriverError> {
    match how {
        Issue::Strided {
            src_pitch,
            dst_pitch,
            rows,
            to_host,
        } => {
            for s in segments {
                let src = driver::mem::Pitched {
                    addr: s.src,
                    pitch: src_pitch,
                    host: !to_host,
                };
                let dst = driver::mem::Pitched {
                    addr: s.dst,
                    pitch: dst_pitch,
                    host: to_host,
                };
                // SAFETY: the caller's contract; rows of `s.len <= pitch` bytes.
                unsafe { driver::mem::memcpy_2d_async(dst, src, s.len, rows, stream.raw()) }?;
            }
        }
        Issue::Batched => {
            for chunk in segments.chunks(MAX_BATCH) {
                lists.dsts.clear();
                lists.srcs.clear();
                lists.sizes.clear();
                for s in chunk {
                    lists.dsts.push(s.dst);
                    lists.srcs.push(s.src);
                    lists.sizes.push(s.len);
                }
                // SAFETY: the caller's contract, per entry; three lists of one length.
                unsafe {
                    driver::mem::memcpy_batch_async(
                        &mut lists.dsts,
                        &mut lists.srcs,
                        &mut lists.sizes,
                        stream.raw(),
                    )
                }?;
            }
        }
        Issue::PerCopy => {
            for s in segments {
                // SAFETY: the caller's contract, per segment.
                unsafe { driver::mem::memcpy_async(s.dst, s.src, s.len, stream.raw()) }?;
            }
        }
    }
    Ok(())
}
