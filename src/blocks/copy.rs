//! What a move is and returns: [`Direction`], [`Strategy`], [`MovePlan`] and [`BlockCopy`].

use std::marker::PhantomData;
use std::sync::Arc;
use std::sync::atomic::{AtomicU8, Ordering};
use std::time::Duration;

use parking_lot::Mutex;

use crate::cuda::wait::{Backoff, wait_until};
use crate::cuda::{Event, StreamHandle};
use crate::driver::DriverError;
use crate::error::{Error, Result};

/// Which way a move goes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Direction {
    /// Device blocks to host blocks.
    Offload,
    /// Host blocks to device blocks.
    Load,
}

impl Direction {
    /// `"offload"` or `"load"`.
    pub fn name(self) -> &'static str {
        match self {
            Direction::Offload => "offload",
            Direction::Load => "load",
        }
    }
}

/// How a move is issued.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Strategy {
    /// Every copy in `cuMemcpyBatchAsync` calls of at most [`MAX_BATCH`] entries.
    Batched,
    /// One `cuMemcpy2DAsync` per run and part, across every tensor at once (the tensors of each
    /// side sit at one address stride: slices of one allocation).
    Strided,
    /// A move in the background through staging buffers
    /// ([`Staging`](super::Staging)): 2D copies gather (offload) or scatter (load) the blocks
    /// inside device memory, one copy per chunk crosses the link, and pinstage's copy threads
    /// scatter or gather the host blocks.
    Staged,
    /// One `cuMemcpyAsync` per copy (a driver older than CUDA 12.8).
    PerCopy,
    /// Nothing to move.
    Empty,
}

/// The most copies one `cuMemcpyBatchAsync` call carries; a longer move takes several calls.
pub const MAX_BATCH: usize = 1 << 16;

/// What a move would issue: [`BlockMover::plan`](super::BlockMover::plan).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MovePlan {
    /// The direction.
    pub direction: Direction,
    /// How it is issued.
    pub strategy: Strategy,
    /// Blocks moved per tensor.
    pub blocks: usize,
    /// Runs of adjacent blocks (on both sides) they merge into.
    pub runs: usize,
    /// Copies issued (runs x parts x tensors; runs x parts for [`Strategy::Strided`], each
    /// across every tensor; for [`Strategy::Staged`] the 2D copies inside device memory, each
    /// across every tensor).
    pub copies: usize,
    /// Driver calls that carry them.
    pub calls: usize,
    /// Threads (each with its own stream) the calls are issued from at once ([`Strategy::Staged`]:
    /// the copy threads that move the host blocks).
    pub threads: usize,
    /// Bytes moved in all.
    pub bytes: usize,
    /// Why this strategy.
    pub reason: &'static str,
    /// What chose between 2D copies and a batch, where the tensors allow both.
    pub choice: Choice,
}

/// What chose between 2D copies across the tensors and a batch for a move between tensors at one
/// stride ([`MovePlan::choice`]): a mover times its first moves of 8 MiB or more of each
/// direction and copy size every way on the GPU, and takes the faster from then on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Choice {
    /// One way only, or the table measured on an H200 (moves under 8 MiB, or moves of a size
    /// this mover has yet to time every way).
    Table,
    /// This move is timed on the GPU (one of the first moves of its direction and copy size).
    Timing,
    /// Every way timed on this device: the mean rate of each, bytes per second.
    Measured {
        /// 2D copies across the tensors.
        strided: u64,
        /// Batched copies (issued from several threads where [`MovePlan::threads`] would be
        /// more than one for a batch).
        batched: u64,
        /// The same batch issued from one thread, timed where the batch is split over threads.
        batched_one_thread: Option<u64>,
    },
}

/// A move in flight: [`BlockCopy::wait`] for it, or let a stream wait for it
/// ([`BlockCopy::stream_wait`]). Dropped before the move completed, it waits for it (the tensors
/// are borrowed until then).
#[must_use = "dropping a BlockCopy waits for the move"]
pub struct BlockCopy<'m> {
    pub(super) inflight: Option<InFlight>,
    pub(super) expected: Duration,
    pub(super) _mover: PhantomData<&'m ()>,
}

/// What a move in flight completes with.
pub(crate) enum InFlight {
    /// Issued on the caller's thread: its event, recorded after the copies.
    Event(Event),
    /// Handed to a thread of the mover (a move in the background).
    Background(Arc<Ticket>),
}

impl InFlight {
    fn query(&self) -> Result<bool> {
        match self {
            InFlight::Event(e) => e.query(),
            InFlight::Background(t) => t.query(),
        }
    }
}

impl std::fmt::Debug for BlockCopy<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BlockCopy")
            .field("pending", &self.inflight.is_some())
            .finish()
    }
}

impl BlockCopy<'_> {
    /// A move with nothing in flight (nothing to move, or moved already).
    pub(super) fn done() -> Self {
        Self {
            inflight: None,
            expected: Duration::ZERO,
            _mover: PhantomData,
        }
    }

    /// Whether the move completed (never blocks; an error counts as done: `wait` reports it).
    pub fn is_done(&self) -> bool {
        self.query().unwrap_or(true)
    }

    /// Whether the move completed (never blocks).
    ///
    /// # Errors
    /// [`Error::Driver`]: the move (or, as the driver reports it, earlier work) failed.
    pub fn query(&self) -> Result<bool> {
        self.inflight.as_ref().map_or(Ok(true), InFlight::query)
    }

    /// Makes work queued on `stream` from now on wait for the move, on the device. For a move
    /// in the background the host first waits until the mover's thread issued it (and the
    /// moves of its direction sent before it): `stream` must not wait for anything the caller
    /// does after this call returns. A staged move ([`Strategy::Staged`]) is issued only once
    /// an offload completed (the host blocks hold the data), or once a load's copies are all
    /// queued, after the work queued before the move on its stream completed.
    ///
    /// # Errors
    /// [`Error::Driver`]: issuing the move failed, or the driver refused the wait.
    pub fn stream_wait(&self, stream: StreamHandle) -> Result<()> {
        match &self.inflight {
            None => Ok(()),
            Some(InFlight::Event(e)) => e.wait_on(stream),
            Some(InFlight::Background(t)) => {
                wait_until(&Backoff::new(self.expected), None, || t.issued())?;
                t.event().wait_on(stream)
            }
        }
    }

    /// Waits for the move.
    ///
    /// # Errors
    /// [`Error::Driver`]: the move or its stream failed.
    pub fn wait(mut self) -> Result<()> {
        match self.inflight.take() {
            Some(f) => crate::driver::relaxed(|| {
                wait_until(&Backoff::new(self.expected), None, || f.query())
            })
            .map(|_| ()),
            None => Ok(()),
        }
    }

    /// What the move completes with, for a caller that keeps the tensors alive itself until
    /// it completed.
    #[cfg(feature = "python")]
    pub(crate) fn into_inflight(mut self) -> Option<InFlight> {
        self.inflight.take()
    }
}

impl Drop for BlockCopy<'_> {
    fn drop(&mut self) {
        if let Some(f) = self.inflight.take()
            && let Err(Error::Driver(e)) = crate::driver::relaxed(|| {
                wait_until(&Backoff::new(self.expected), None, || f.query())
            })
        {
            crate::error::on_drop::<()>(Err(e));
        }
    }
}

const PENDING: u8 = 0;
const ISSUED: u8 = 1;
const FAILED: u8 = 2;

/// A move handed to a thread of the mover: pending until the thread issued it (or failed to,
/// having drained what it issued), then complete once its event is.
pub(crate) struct Ticket {
    state: AtomicU8,
    error: Mutex<Option<DriverError>>,
    event: Arc<Event>,
}

impl std::fmt::Debug for Ticket {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Ticket")
            .field("state", &self.state.load(Ordering::Relaxed))
            .finish()
    }
}

impl Ticket {
    /// A move handed over, not yet issued, that completes with `event`.
    pub(super) fn pending(event: Event) -> Self {
        Self {
            state: AtomicU8::new(PENDING),
            error: Mutex::new(None),
            event: Arc::new(event),
        }
    }

    /// Whether the thread issued the move (its event is then recorded after the copies).
    ///
    /// # Errors
    /// [`Error::Driver`]: issuing failed (nothing of the move is in flight any more).
    pub(crate) fn issued(&self) -> Result<bool> {
        match self.state.load(Ordering::Acquire) {
            PENDING => Ok(false),
            ISSUED => Ok(true),
            _ => Err(Error::Driver(
                self.error
                    .lock()
                    .expect("a failed move stores its error before its state"),
            )),
        }
    }

    /// Whether the move completed (issued, and its event complete).
    ///
    /// # Errors
    /// [`Error::Driver`]: issuing or the copies failed.
    pub(crate) fn query(&self) -> Result<bool> {
        Ok(self.issued()? && self.event.query()?)
    }

    /// The event recorded after the copies once [`Ticket::issued`] says so (before that it
    /// captures nothing: never wait on it then).
    pub(crate) fn event(&self) -> &Arc<Event> {
        &self.event
    }

    /// Settles a move that was never issued as failed (no-op once settled).
    pub(super) fn abandon(&self) {
        if self.state.load(Ordering::Acquire) == PENDING {
            self.settle(Err(DriverError::new(
                "pinstage: block move (its issuing thread is gone)",
                cudarc::driver::sys::CUresult::CUDA_ERROR_UNKNOWN,
            )));
        }
    }

    pub(super) fn settle(&self, outcome: std::result::Result<(), DriverError>) {
        match outcome {
            Ok(()) => self.state.store(ISSUED, Ordering::Release),
            Err(e) => {
                *self.error.lock() = Some(e);
                self.state.store(FAILED, Ordering::Release);
            }
        }
    }
}
