//! # pinstage
//!
//! Moves data between host memory and CUDA device memory as fast as the PCIe link allows,
//! through the CUDA driver API alone: copies only, no kernels, fills or device-to-device copies.
//!
//! - [`PinnedStager`] / [`Stager`]: a ring of pinned buffers for small host-to-device copies
//!   issued beside a live CUDA graph: one non-blocking copy per call, each slot guarded by its
//!   own event, claimed with atomics. [`H2DMirror`] skips a copy whose values the destination
//!   already holds.
//! - [`copy_d2h`] / [`copy_d2h_async`]: device-to-host into pinned memory at line rate, or into
//!   pageable memory through a pinned bounce ring.
//! - [`PinnedBuffer`] and [`PinnedPool`]: page-locked host memory, pooled.
//! - [`StepStager`]: all of an engine step's small inputs (named fields of a [`StepLayout`]) in
//!   one driver call per step, into a persistent device arena, a fresh block per step, or read
//!   in place by kernels (zero-copy).
//! - [`DeviceView`]: a tensor the copies read or write, from DLPack metadata ([`validate`]) or
//!   from a Rust slice.
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
//! assert_eq!(again, pinstage::CopyOutcome::Skipped);
//! drop(view);
//! assert_eq!(dst, [1, 2, 3, -1, -1, -1, -1, -1]);
//! # Ok(())
//! # }
//! ```
//!
//! Where things are: `driver` (the only module that calls the CUDA driver), `cuda` (device,
//! context guard, streams, events), `host` (pinned memory, pool), `view` (DLPack metadata,
//! dtypes), `h2d` (ring protocol, stager, mirror), `d2h`, and `python` (the pyo3 skin, feature
//! `python`).
#![warn(missing_docs)]
#![deny(unsafe_op_in_unsafe_fn)]
#![warn(clippy::undocumented_unsafe_blocks)]

mod cuda;
mod d2h;
mod driver;
mod error;
mod h2d;
mod host;
mod nvtx;
mod ring;
mod step;
mod sync;
mod view;

// The laboratory lives outside the product tree (lab/): experiments and probes only.
#[cfg(feature = "lab")]
#[doc(hidden)]
#[path = "../lab/src/mod.rs"]
pub mod lab;
#[cfg(feature = "python")]
mod python;
#[cfg(feature = "testing")]
pub mod testing;

pub use cuda::{
    Current, Device, Event, SlotEvent, Stream, StreamHandle, cuda_available, current_device,
    device_count,
};
pub use d2h::{D2HPath, PendingCopy, copy_d2h, copy_d2h_async};
pub use driver::{DISABLE_ENV, DriverError, Probe, probe};
pub use error::{DropErrors, Error, Result, drop_errors};
pub use h2d::{
    Copy, CopyOutcome, DEFAULT_DEPTH, DEFAULT_NUMEL, DevicePoolStats, FreshMem, H2DMirror, H2DPath,
    MAX_DEPTH, PinnedStager, PinnedStagerBuilder, RawCopy, Stager, StagerBuilder, StagerStats,
    WaitFn, copy_h2d, device_pool_stats, start_h2d, start_to_device, to_device, trim_device_pools,
};
pub use host::{
    BOUNCE_CHUNK, BOUNCE_DEPTH, DEFAULT_BUDGET, HostRegion, PinnedBuffer, PinnedFlags, PinnedPool,
    PoolBlock, PoolStats, Registered, is_pinned, live_pinned_bytes, release_bounce_buffers,
    size_class, wait_for_frees,
};
pub use nvtx::{NvtxRange, nvtx_available};
pub use step::{
    AUTO_GAP_BATCH, AUTO_GAP_COPIES, Committed, DEFAULT_STEP_DEPTH, FIELD_ALIGN, Field, FieldId,
    FieldKey, MAX_FIELDS, Step, StepBlock, StepLayout, StepLayoutBuilder, StepMode, StepStager,
    StepStagerBuilder, StepStats,
};
pub use view::{
    Bool8, DType, DeviceView, DlpackError, Element, MAX_NDIM, MemoryKind, TensorDesc, TensorMeta,
    meta_of_dltensor, validate,
};

/// DLPack device type codes, for [`TensorDesc::device_type`].
pub mod dlpack {
    pub use crate::view::{DL_CPU, DL_CUDA, DL_CUDA_HOST, DL_CUDA_MANAGED};
}
