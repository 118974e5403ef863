//! Host to device: the slot ring's protocol ([`ring`]), the host writes into slots, the
//! [`Stager`] that issues one copy per call from a pinned slot, and [`H2DMirror`], which lets a
//! copy of unchanged values be skipped.

mod copy;
mod fresh;
pub(crate) mod mirror;
pub(crate) mod stager;
#[cfg(feature = "lab")]
pub(crate) mod trace;
pub(crate) mod tuning;
mod upload;

pub use copy::{Copy, PinnedStager, PinnedStagerBuilder, RawCopy, WaitFn};
pub use fresh::{
    DevicePoolStats, FreshMem, device_pool_stats, start_to_device, to_device, trim_device_pools,
};
pub use mirror::H2DMirror;
pub use stager::{
    CopyOutcome, DEFAULT_DEPTH, DEFAULT_NUMEL, MAX_DEPTH, Stager, StagerBuilder, StagerStats,
};
pub use upload::{H2DPath, copy_h2d, start_h2d};
