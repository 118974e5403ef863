//! Paged KV-cache blocks between device tensors and pinned host tensors (the block mover): how
//! a tensor lays out its blocks, and the copies that move a list of block ids with runs of
//! adjacent ids merged ([`plan`]). The mover that issues these copies on the copy engines
//! builds on this module; until it lands, only the tests use it.
#![cfg_attr(not(test), allow(dead_code, unused_imports))]

mod plan;
#[cfg(test)]
mod tests;

pub(crate) use plan::{BlockLayout, Segment, plan};
