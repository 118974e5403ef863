//! Host memory: page-locked blocks ([`PinnedBuffer`]), a pool of them ([`PinnedPool`]), memory
//! pinned in place ([`Registered`]), and what a copy between host and device hands back
//! ([`CopyPath`], [`PendingCopy`]). Pinned memory pinstage lets go is freed on a background
//! thread: blocks of a host memory pool at once, other pinned memory once the device drained
//! ([`wait_for_frees`]).

pub(crate) mod bounce;
mod device_mem;
pub(crate) mod host_pool;
pub(crate) mod mapped;
pub(crate) mod numa;
mod pinned;
mod pool;
pub(crate) mod reaper;
mod registered;
mod transfer;
pub(crate) mod workers;

pub use bounce::{BOUNCE_CHUNK, BOUNCE_DEPTH, release_bounce_buffers};

pub(crate) use device_mem::DeviceMem;
#[cfg(all(feature = "lab", feature = "python"))]
pub(crate) use pinned::set_pin_by_register;
pub(crate) use pinned::zeroed_vec;
pub use pinned::{PinnedBuffer, PinnedFlags, is_pinned, live_pinned_bytes};
pub use pool::{DEFAULT_BUDGET, PinnedPool, PinnedPoolStats, PoolBlock, size_class};
pub(crate) use reaper::retry_after_frees;
pub use reaper::wait_for_frees;
pub use registered::Registered;
pub use transfer::{CopyPath, HostRegion, PendingCopy};
