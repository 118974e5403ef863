//! What a move is and returns: [`Direction`], [`Strategy`], [`MovePlan`] and [`BlockCopy`].

use std::marker::PhantomData;
use std::time::Duration;

use crate::cuda::Event;
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
    /// across every tensor).
    pub copies: usize,
    /// Driver calls that carry them.
    pub calls: usize,
    /// Bytes moved in all.
    pub bytes: usize,
    /// Why this strategy.
    pub reason: &'static str,
}

/// A move in flight: [`BlockCopy::wait`] for it, or let a stream wait on
/// [`BlockCopy::event`]. Dropped before the move completed, it waits for it (the tensors are
/// borrowed until then).
#[must_use = "dropping a BlockCopy waits for the move"]
pub struct BlockCopy<'m> {
    pub(super) event: Option<Event>,
    pub(super) expected: Duration,
    pub(super) _mover: PhantomData<&'m ()>,
}

impl std::fmt::Debug for BlockCopy<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BlockCopy")
            .field("pending", &self.event.is_some())
            .finish()
    }
}

impl BlockCopy<'_> {
    /// A move with nothing in flight (nothing to move, or moved already).
    pub(super) fn done() -> Self {
        Self {
            event: None,
            expected: Duration::ZERO,
            _mover: PhantomData,
        }
    }

    /// Whether the move completed (never blocks; an error counts as done: `wait` reports it).
    pub fn is_done(&self) -> bool {
        self.event
            .as_ref()
            .is_none_or(|e| e.query().unwrap_or(true))
    }

    /// The event recorded after the move (`None`: nothing was moved).
    pub fn event(&self) -> Option<&Event> {
        self.event.as_ref()
    }

    /// Waits for the move.
    ///
    /// # Errors
    /// [`Error::Driver`]: the move or its stream failed.
    pub fn wait(mut self) -> Result<()> {
        match self.event.take() {
            Some(ev) => ev.wait_expecting(self.expected),
            None => Ok(()),
        }
    }

    /// The event, for a caller that keeps the tensors alive itself until it completed.
    #[cfg(feature = "python")]
    pub(crate) fn into_event(mut self) -> Option<Event> {
        self.event.take()
    }
}

impl Drop for BlockCopy<'_> {
    fn drop(&mut self) {
        if let Some(ev) = self.event.take()
            && let Err(Error::Driver(e)) = ev.synchronize()
        {
            crate::error::on_drop::<()>(Err(e));
        }
    }
}
