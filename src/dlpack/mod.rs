//! DLPack metadata and views of tensors.
//!
//! [`validate`] turns raw DLPack fields ([`TensorDesc`]) into [`TensorMeta`]: pure and safe (no
//! driver, no Python, nothing read behind the data pointer), so it runs on the CPU in tests and
//! under the fuzzer. A [`DeviceView`] is what the copies read or write: it is made from metadata
//! only through an `unsafe` constructor whose contract says the memory is there, or safely from
//! a Rust slice, whose borrow it carries.
//!
//! DLPack's device and dtype codes come from dlpark ([`dlpark::ffi::DLDeviceType`],
//! [`dlpark::ffi::DLDataTypeCode`]); this module keeps only what dlpark does not do: the
//! contiguity and size checks, and the mapping to pinstage's [`DType`].

mod device_view;
mod dtype;
mod meta;

pub use device_view::DeviceView;
pub use dtype::{Bool8, DType, Element};
pub use meta::{
    DL_CPU, DL_CUDA, DL_CUDA_HOST, DL_CUDA_MANAGED, DlpackError, MAX_NDIM, MemoryKind, TensorDesc,
    TensorMeta, meta_of_dltensor, validate,
};
