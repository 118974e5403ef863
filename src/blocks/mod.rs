//! Paged KV-cache blocks between device tensors and pinned host tensors: [`BlockMover`] moves
//! lists of block ids with the copy engines (runs of adjacent ids merged; one batched driver call
//! per move, or one 2D copy per run across tensors that sit at one stride; moves in the
//! background of small blocks through staging buffers, [`Staging`]); the planning behind it is
//! pure and tested without a GPU.

mod background;
mod chunks;
mod copy;
mod flow;
mod issue;
mod mover;
mod plan;
mod staged;
mod strides;
mod tensors;
#[cfg(test)]
mod tests;
mod tuning;

#[cfg(feature = "python")]
pub(crate) use copy::InFlight;
#[cfg(feature = "python")]
pub(crate) use copy::Ticket;
pub use copy::{BlockCopy, Choice, Direction, MAX_BATCH, MovePlan, Strategy};
#[cfg(feature = "testing")]
pub use flow::panic_in_staged_task;
pub use mover::BlockMover;
#[cfg(test)]
pub(crate) use plan::{BlockLayout, Segment, plan};
#[cfg(feature = "testing")]
#[doc(hidden)]
pub use staged::staged_handovers;
pub use staged::{CHUNK_RANGE, DEFAULT_CHUNK, Staging};
