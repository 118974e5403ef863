//! # pinstage
//!
//! Moves data between host memory and CUDA device memory as fast as the PCIe link allows,
//! through the CUDA driver API alone: copies only, no kernels, fills or device-to-device copies.
//!
//! The modules, by job:
//! - [`h2d`]: host to device. [`PinnedStager`] for small copies issued beside a live CUDA graph
//!   (one non-blocking copy per call from a ring of pinned slots; [`H2DMirror`] skips unchanged
//!   values); [`copy_h2d`] for whole arrays at the link's rate; [`h2d::to_device`] for fresh
//!   device memory.
//! - [`step`]: all of an engine step's small inputs (named fields of a [`StepLayout`]) in one
//!   driver call per step ([`StepStager`]).
//! - [`d2h`]: device to host, into pinned memory at line rate or pageable memory through a
//!   pinned bounce ring ([`copy_d2h`], [`d2h::copy_d2h_async`]).
//! - [`blocks`]: paged KV-cache blocks between device tensors and pinned host tensors
//!   ([`BlockMover`]: lists of block ids moved by the copy engines: batched calls, or 2D copies
//!   across tensors that share one allocation).
//! - [`host`]: page-locked memory ([`PinnedBuffer`], [`host::PinnedPool`]), memory pinned in
//!   place, and what a copy in flight holds ([`host::PendingCopy`]).
//! - [`cuda`]: devices, streams and events over the driver.
//! - [`dlpack`]: the tensors copies read and write ([`DeviceView`]), from DLPack metadata.
//!
//! libcuda is loaded at run time: the crate builds without a CUDA toolkit and, without a driver,
//! every CUDA entry returns [`Error::CudaUnavailable`] while host destinations keep working.
//!
//! ```
//! use pinstage::{DeviceView, H2DMirror, PinnedStager};
//!
//! # fn main() -> pinstage::Result<()> {
//! // Four slots of 8 int32; without a GPU the stager serves host destinations only.
//! let stager = PinnedStager::<i32>::builder().numel(8).depth(4).build()?;
//! let mut dst = [0i32; 8];
//! // SAFETY: one copy at a time uses the view (this thread's).
//! let view = unsafe { DeviceView::host_mut(&mut dst) };
//! let mut mirror = H2DMirror::new();
//! // dst[..3] = [1, 2, 3], the rest = -1.
//! stager.to(&view).pad(-1).mirror(&mut mirror).copy(&[1, 2, 3])?;
//! // The same values again: the mirror shows dst holds them, nothing is written.
//! let again = stager.to(&view).pad(-1).mirror(&mut mirror).copy(&[1, 2, 3])?;
//! assert_eq!(again, pinstage::h2d::CopyOutcome::Skipped);
//! drop(view);
//! assert_eq!(dst, [1, 2, 3, -1, -1, -1, -1, -1]);
//! # Ok(())
//! # }
//! ```
//!
#![warn(missing_docs)]
#![deny(unsafe_op_in_unsafe_fn)]
#![warn(clippy::undocumented_unsafe_blocks)]

pub mod blocks;
pub mod cuda;
pub mod d2h;
pub mod dlpack;
mod driver;
mod error;
pub mod h2d;
pub mod host;
mod nvtx;
mod ring;
mod stamps;
pub mod step;
mod sync;

// The laboratory lives outside the product tree (lab/): experiments and probes only.
#[cfg(feature = "lab")]
#[doc(hidden)]
#[path = "../lab/src/mod.rs"]
pub mod lab;
#[cfg(feature = "python")]
mod python;
#[cfg(feature = "testing")]
pub mod testing;

pub use blocks::BlockMover;
pub use cuda::{Device, Stream, StreamHandle};
pub use d2h::copy_d2h;
pub use dlpack::{DType, DeviceView};
pub use error::{Error, Result};
pub use h2d::{H2DMirror, PinnedStager, copy_h2d};
pub use host::PinnedBuffer;
pub use step::{StepLayout, StepStager};
