//! Python bindings (feature `python`): a thin skin over the core, one file per family of
//! Python-visible names; this file only declares them.
//!
//! - `module`: the module `pinstage._native` and what it finds of the driver;
//! - `device`: per-device state (the device and its pinned pools);
//! - `errors`: the one place mapping [`crate::Error`] to Python exceptions;
//! - `args`, `import`, `values`: arguments, DLPack import and streams, value conversion;
//! - `arrays`, `pool`, `linger`, `wait`: numpy arrays over pinned memory, pools, what outlives a
//!   dropped handle, waits with the GIL released;
//! - `stager`, `mirror`, `step`: small H2D copies and steps; `h2d`, `fresh`: whole arrays;
//!   `d2h`: device to host; `blocks`: KV-cache blocks (`BlockMover`).
//!
//! No panic crosses into Python: pyo3 turns a panic into an exception at the boundary, and the
//! code here returns typed errors for every bad input instead of panicking.

pub(crate) mod args;
pub(crate) mod arrays;
mod blocks;
pub(crate) mod d2h;
pub(crate) mod device;
pub(crate) mod dtype;
pub(crate) mod errors;
pub(crate) mod export;
mod fresh;
mod h2d;
pub(crate) mod helpers;
mod host;
pub(crate) mod import;
mod linger;
mod mirror;
mod module;
mod nvtx;
pub(crate) mod pending;
mod pool;
#[cfg(test)]
mod pytest;
mod stager;
mod step;
pub(crate) mod stream;
pub(crate) mod values;
pub(crate) mod wait;
