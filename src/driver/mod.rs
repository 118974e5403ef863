//! The only module that touches `cudarc::driver::sys`.
//!
//! One thin, `Result`-returning function per CUDA driver call, in the style of cudarc's
//! `driver/result.rs`. libcuda is loaded at run time by cudarc's `dynamic-loading` feature:
//! [`probe`] checks `is_culib_present()` before the first driver call (cudarc's loader panics
//! otherwise), runs `cuInit(0)` once and counts devices. Every other function here must only be
//! called after [`probe`] succeeded; the safe layers above guarantee it by holding a
//! [`crate::Device`], which can only be made through [`probe`].
//!
//! Driver API reference: <https://docs.nvidia.com/cuda/cuda-driver-api/>.

use cudarc::driver::sys;

pub(crate) use sys::{CUcontext, CUdevice, CUdeviceptr, CUevent, CUstream};

pub(crate) mod ctx;
mod error;
pub(crate) mod event;
#[cfg(feature = "testing")]
pub mod fault;
pub(crate) mod mem;
pub(crate) mod pool;
mod probe;
pub(crate) mod stream;

pub use error::DriverError;
pub(crate) use error::{DResult, capture_relaxed, check, relaxed};
pub(crate) use probe::forked;
pub use probe::{DISABLE_ENV, Probe, probe};
