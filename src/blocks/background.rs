//! Moves issued in the background: the caller's call checks the move's ids, records a fork event
//! on its stream and hands the ids to a thread of the mover, which merges them into runs, builds
//! the copies and issues them on its own stream after the fork, then records the move's event.
//! The caller returns once the move is handed over, however long the driver holds the issuing
//! thread (which polls for the next move for 50 us after each, so that a move handed over soon
//! after the one before costs the caller no system call); with the ids it spends only what
//! reading them twice and marking one bit per destination block costs (plus, from Rust,
//! copying them; see `Tensors::check_unmerged`).
//!
//! Order, all of it through events recorded before anything waits on them (no wait on a value
//! the host writes later: streams share hardware queues, and such a wait can hold up the very
//! copies it waits for):
//! - the copies run after the work queued on the caller's stream before the call;
//! - work queued on the caller's stream after the call does NOT wait for them: the caller joins
//!   the move with [`Ticket::issued`] then the event (`BlockCopy::wait`, `stream_wait`);
//! - one thread and one stream per direction: moves of one direction run in call order.

use std::sync::{Arc, OnceLock, mpsc};
use std::time::{Duration, Instant};

use super::copy::{Direction, Ticket};
use super::issue::{Issue, Lists, helper_streams, issue_on};
use super::plan::{Segment, segments_of};
use super::staged::{self, Stage};
use super::tensors::Tensors;
use crate::cuda::{Current, Device, Event, Stream, StreamHandle};
use crate::driver::DriverError;
use crate::error::{Error, Result};
use crate::stamps::stamp;
use cudarc::driver::sys::CUresult::{
    CUDA_ERROR_INVALID_CONTEXT as INVALID_CONTEXT, CUDA_ERROR_INVALID_VALUE as INVALID_VALUE,
    CUDA_ERROR_UNKNOWN as UNKNOWN,
};

struct Job {
    direction: Direction,
    src_ids: Vec<usize>,
    dst_ids: Vec<usize>,
    fork: Event,
    ticket: Arc<Ticket>,
}

impl Drop for Job {
    fn drop(&mut self) {
        // A move never issued (its thread gone) must not leave its waiters waiting.
        self.ticket.abandon();
    }
}

/// One direction's issuing thread and its stream. Dropped, the thread ends once it issued every
/// move sent (their `BlockCopy`s borrow the mover, so none is left by then).
pub(super) struct Issuer {
    tx: mpsc::Sender<Job>,
}

impl Issuer {
    /// A thread for `device` that issues moves between `tensors`.
    ///
    /// # Errors
    /// [`Error::Driver`]: no stream; [`Error::CudaUnavailable`]: no thread.
    pub(super) fn start(device: &Device, tensors: Arc<Tensors>) -> Result<Self> {
        let side = Stream::new(device)?;
        let (tx, rx) = mpsc::channel::<Job>();
        let device = device.clone();
        std::thread::Builder::new()
            .name("pinstage-blocks".into())
            .spawn(move || {
                let cur = device.enter();
                let helpers = OnceLock::new();
                let mut stage = Stage::default();
                // Polling pays where the caller has a CPU of its own, not on a single CPU.
                // (The lab's variant `no_poll` is the control that never polls.)
                let poll = std::thread::available_parallelism().is_ok_and(|n| n.get() >= 2)
                    && !cfg!(pinstage_lab_variant = "no_poll");
                let poll = if poll { POLL } else { Duration::ZERO };
                while let Some(job) = next_job(&rx, poll) {
                    let outcome = match &cur {
                        // Relaxed capture mode: a graph captured on another thread in global
                        // mode neither fails these calls nor is invalidated by them. A panic
                        // (a bug) is caught: the stream drained, the move reported failed.
                        Ok(cur) => crate::driver::capture_relaxed(|| {
                            std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                                // SAFETY: the sender's contract (`Issuer::send`).
                                unsafe { run(cur, &side, &helpers, &mut stage, &tensors, &job) }
                            }))
                            .unwrap_or_else(|_| {
                                let _ = side.handle().synchronize(cur);
                                Err(DriverError::new("pinstage: block move (a bug)", UNKNOWN))
                            })
                        }),
                        Err(Error::Driver(e)) => Err(*e),
                        Err(_) => Err(DriverError::new("cuCtxSetCurrent", INVALID_CONTEXT)),
                    };
                    job.ticket.settle(outcome);
                }
                // The ring goes with `stage`: with the mover, no one reads `staging_held`.
            })
            .map_err(|e| Error::unavailable(format!("no thread to issue moves: {e}")))?;
        Ok(Self { tx })
    }

    /// Hands a move of `src_ids[i]` into `dst_ids[i]` in `direction` to the thread: its copies
    /// run after the work queued on `stream` so far.
    ///
    /// # Errors
    /// [`Error::Driver`]: the fork event refused; [`Error::CudaUnavailable`]: the thread is gone.
    /// Either way nothing was handed over.
    ///
    /// # Safety
    /// 1. The ids are a checked, non-empty move (`check_ids`) between the thread's tensors; the
    ///    tensors' memory stays valid until the returned ticket completed.
    /// 2. `stream` is a live stream of the thread's device, not capturing.
    pub(super) unsafe fn send(
        &self,
        cur: &Current<'_>,
        direction: Direction,
        src_ids: Vec<usize>,
        dst_ids: Vec<usize>,
        stream: StreamHandle,
    ) -> Result<Arc<Ticket>> {
        // Events come from the device's spares once warm (`Event::new_in`): no driver call.
        let fork = Event::new_in(cur)?;
        stamp!("fork event");
        fork.record_in(cur, stream)?;
        stamp!("fork recorded");
        let ticket = Arc::new(Ticket::pending(Event::new_in(cur)?));
        stamp!("ticket");
        let job = Job {
            direction,
            src_ids,
            dst_ids,
            fork,
            ticket: Arc::clone(&ticket),
        };
        self.tx
            .send(job)
            .map_err(|_| Error::unavailable("the block mover's issuing thread is gone"))?;
        stamp!("sent");
        Ok(ticket)
    }
}

/// How long the issuing thread polls for the next move after one, before it parks: a move
/// handed to a polling thread costs the caller a store (no system call to wake it; FUTEX_WAKE
/// costs about 1 us on the GPU machines, `lab/c/bg_floor.c`). Engines that move blocks every
/// step (ms apart) pay at most this much of one core per move; a machine with one CPU does not
/// poll.
const POLL: Duration = Duration::from_micros(50);

/// The next move sent, polled for `poll` then waited for parked; `None` once the mover is gone
/// and every move sent was taken.
fn next_job(rx: &mpsc::Receiver<Job>, poll: Duration) -> Option<Job> {
    let since = Instant::now();
    loop {
        match rx.try_recv() {
            Ok(job) => return Some(job),
            Err(mpsc::TryRecvError::Disconnected) => return None,
            Err(mpsc::TryRecvError::Empty) if since.elapsed() >= poll => return rx.recv().ok(),
            Err(mpsc::TryRecvError::Empty) => {
                for _ in 0..32 {
                    std::hint::spin_loop();
                }
            }
        }
    }
}

thread_local! {
    /// The thread's copy lists, reused from move to move.
    static SCRATCH: std::cell::RefCell<(Vec<Segment>, Lists)> = Default::default();
}

/// Merges `job`'s ids into runs, issues them on `side` after its fork and records its event
/// (a staged move: moves it through `stage`'s ring, returning once it completed or, for a
/// load, once every copy is queued); on a failure the stream is drained first, so nothing of
/// the move runs when its waiters hear of it.
///
/// # Safety
/// As [`Issuer::send`].
unsafe fn run(
    cur: &Current<'_>,
    side: &Stream,
    helpers: &OnceLock<Vec<Stream>>,
    stage: &mut Stage,
    tensors: &Tensors,
    job: &Job,
) -> std::result::Result<(), DriverError> {
    let stream = side.handle();
    let mut forked = false;
    let issued = SCRATCH.with_borrow_mut(|(segments, lists)| {
        segments.clear();
        // Checked when the move was sent: a failure here is a bug, reported, not issued.
        let bug = |_| DriverError::new("pinstage: block move", INVALID_VALUE);
        let runs = tensors
            .runs(job.direction, &job.src_ids, &job.dst_ids)
            .map_err(bug)?;
        let (blocks, n_runs) = (job.src_ids.len(), runs.len());
        if let Some((shape, chunk)) = tensors.staged(job.direction, blocks, n_runs)
            && let Some(turn) =
                tensors.take_staging(job.direction, tensors.copy_bytes(blocks, n_runs))
            && (stage.ring(cur, chunk, &tensors.staging_held).is_some() || {
                // No memory for the ring: this move and the next of this chunk size go
                // unstaged (and plans say so).
                tensors.refuse_staging(job.direction, chunk);
                false
            })
        {
            segments_of(&tensors.pairs, job.direction, &runs, true, segments).map_err(bug)?;
            let Stage { ring, work } = stage;
            work.pack(segments, shape.rows, chunk);
            let ring = ring.as_mut().expect("made above");
            forked = true;
            // SAFETY: the sender's contract 1 (the pieces lie within the tensors, at the strides
            // `staged` gives); `stream` is our side stream.
            return unsafe {
                staged::run(
                    cur,
                    ring,
                    job.direction,
                    work,
                    shape,
                    stream,
                    &job.fork,
                    job.ticket.event(),
                    &|| turn.hand_over(),
                )
            }
            .map_err(staged_error);
        }
        let (how, pick) = tensors.how(job.direction, blocks, n_runs, Some(cur));
        let strided = matches!(how, Issue::Strided { .. });
        segments_of(&tensors.pairs, job.direction, &runs, strided, segments).map_err(bug)?;
        #[cfg(not(pinstage_seeded_bug = "background_no_fork"))]
        job.fork.wait_on_in(cur, stream).map_err(driver_error)?;
        forked = true;
        if let Issue::Batched { threads: 2.. } = how {
            helper_streams(cur, helpers).map_err(driver_error)?;
        }
        tensors
            .issue_timed(cur, stream, job.direction, (blocks, n_runs), pick, || {
                // SAFETY: the sender's contract 1; `stream` is our side stream (not the legacy
                // one).
                unsafe { issue_on(cur, segments, how, stream, helpers, lists) }
            })
            .map_err(driver_error)?;
        job.ticket
            .event()
            .record_in(cur, stream)
            .map_err(driver_error)
    });
    if issued.is_err() && forked {
        // Copies may be queued behind the fork: drained before the waiters hear of it.
        let _ = stream.synchronize(cur);
    }
    issued
}

fn driver_error(e: Error) -> DriverError {
    match e {
        Error::Driver(e) => e,
        _ => DriverError::new("pinstage: block move", INVALID_VALUE),
    }
}

/// The driver error of a staged move's failure (a refused allocation never gets here).
fn staged_error(e: Error) -> DriverError {
    match e {
        Error::Driver(e) => e,
        _ => DriverError::new("pinstage: staged block move", UNKNOWN),
    }
}
