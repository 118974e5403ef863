//! Device-to-host copies at PCIe line rate.
//!
//! Into pinned memory: one `cuMemcpyDtoHAsync` and a wait on a recycled event. Into pageable
//! memory: a ring of pinned bounce buffers, the copy engine filling one while the CPU drains
//! another, which beats the driver's own pageable path.

mod bounce;
mod copy;
mod issue;
mod landing;

pub use crate::host::{CopyPath, HostRegion, PendingCopy};
#[cfg(all(feature = "lab", feature = "python"))]
pub(crate) use copy::set_landing;
#[cfg(feature = "python")]
pub(crate) use copy::start_d2h;
pub use copy::{copy_d2h, copy_d2h_async};
#[cfg(feature = "testing")]
pub use copy::{
    landing_after_spin, landing_counts, landing_free_words, landing_from_stream, landing_reset,
};
