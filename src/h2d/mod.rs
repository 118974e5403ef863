//! Host to device: [`PinnedStager`] for small copies issued beside a live CUDA graph (one
//! non-blocking copy per call from a ring of pinned slots, [`H2DMirror`] to skip unchanged
//! values), [`copy_h2d`] for whole arrays at the link's rate (pinned: one DMA; pageable:
//! pinstage's copy threads and bounce slots), and [`to_device`] for fresh device memory.

mod fresh;
pub(crate) mod mirror;
pub(crate) mod slot;
pub(crate) mod stager;
#[cfg(feature = "lab")]
pub(crate) mod trace;
pub(crate) mod tuning;
mod typed;
pub(crate) mod upload;

pub use crate::host::{CopyPath, HostRegion, PendingCopy};
#[cfg(feature = "python")]
pub(crate) use fresh::start_to_device;
pub use fresh::{DevicePoolStats, FreshMem, device_pool_stats, to_device, trim_device_pools};
pub use mirror::H2DMirror;
pub use stager::{CopyOutcome, DEFAULT_DEPTH, DEFAULT_NUMEL, MAX_DEPTH, PinnedStagerStats, WaitFn};
#[cfg(feature = "testing")]
pub use stager::{RawStager, RawStagerBuilder};
pub use typed::{PinnedStager, PinnedStagerBuilder, StagedCopy};
#[cfg(feature = "python")]
pub(crate) use upload::meanwhile::start_h2d_made_meanwhile;
#[cfg(feature = "python")]
pub(crate) use upload::start_h2d;
pub use upload::{copy_h2d, copy_h2d_async};
