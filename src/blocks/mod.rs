//! Paged KV-cache blocks between device tensors and pinned host tensors: [`BlockMover`] moves
//! lists of block ids with the copy engines (runs of adjacent ids merged, one batched driver call
//! per move); the planning behind it is pure and tested without a GPU.

mod mover;
mod plan;
#[cfg(test)]
mod tests;

pub use mover::{BlockCopy, BlockMover, Direction, MAX_BATCH, MovePlan, Strategy};
#[cfg(test)]
pub(crate) use plan::{BlockLayout, Segment, plan};
