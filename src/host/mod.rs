//! Host memory: page-locked blocks ([`PinnedBuffer`]) and a pool of them ([`PinnedPool`]).

pub(crate) mod bounce;
mod pinned;
mod pool;

pub use bounce::{BOUNCE_CHUNK, BOUNCE_DEPTH, release_bounce_buffers};

pub use pinned::{PinnedBuffer, PinnedFlags, is_pinned, live_pinned_bytes};
pub use pool::{DEFAULT_BUDGET, PinnedPool, PoolBlock, PoolStats, size_class};

/// `vec![0u8; len]`, refused with [`crate::Error::OutOfMemory`] instead of aborting the process
/// when the memory cannot be had.
pub(crate) fn zeroed_vec(len: usize, what: &'static str) -> crate::Result<Vec<u8>> {
    let mut v = Vec::new();
    v.try_reserve_exact(len)
        .map_err(|_| crate::Error::OutOfMemory { what, bytes: len })?;
    v.resize(len, 0);
    Ok(v)
}
