//! # pinstage
//!
//! Moves data between host memory and CUDA device memory as fast as the PCIe link allows, through
//! the CUDA driver API alone (no kernels, fills or device-to-device copies: no SM work).
//!
//! - [`PinnedBuffer`] and [`PinnedPool`]: page-locked host memory, pooled.
//! - [`PinnedStager`] / [`Stager`]: a ring of pinned buffers for small host-to-device copies
//!   issued beside a live CUDA graph: one non-blocking copy per call, slots guarded by their own
//!   events, claimed with atomics. [`H2DMirror`] skips a copy whose values the destination holds.
//! - [`copy_d2h`] / [`copy_d2h_async`]: device-to-host into pinned memory at line rate, or into
//!   pageable memory through a pinned bounce ring.
//! - [`DeviceView`]: a validated DLPack tensor ([`dlpack::validate`]).
//!
//! libcuda is loaded at run time: the crate builds without a CUDA toolkit and, without a driver,
//! every CUDA entry returns [`Error::CudaUnavailable`].
#![warn(missing_docs)]
#![deny(unsafe_op_in_unsafe_fn)]
#![warn(clippy::undocumented_unsafe_blocks)]

mod d2h;
mod device;
pub mod dlpack;
mod driver;
mod dtype;
mod error;
mod mirror;
mod pinned;
mod pool;
mod ring;
mod stager;
mod sync;

#[cfg(feature = "python")]
mod python;

pub use d2h::{
    BOUNCE_CHUNK, BOUNCE_DEPTH, D2HPath, HostRegion, PendingCopy, copy_d2h, copy_d2h_async,
    release_bounce_buffers,
};
pub use device::{
    ContextGuard, Device, DeviceBuffer, Event, Stream, StreamHandle, cuda_available,
    current_context, device_count,
};
pub use dlpack::{DeviceView, DlpackError, MemoryKind};
pub use driver::{DISABLE_ENV, DriverError, Probe, probe};
pub use dtype::{Bool8, DType, Element};
pub use error::{Error, Result};
pub use mirror::H2DMirror;
pub use pinned::{PinnedBuffer, PinnedFlags, is_pinned, live_pinned_bytes};
pub use pool::{DEFAULT_BUDGET, PinnedPool, PoolBlock, PoolStats, size_class};
pub use stager::{CopyOutcome, DEFAULT_DEPTH, DEFAULT_NUMEL, PinnedStager, Stager, StagerStats};

/// Internals exposed for the benches only; not a stable API.
#[doc(hidden)]
pub mod bench_internals;
#[doc(hidden)]
pub use bench_internals::driver_costs;
