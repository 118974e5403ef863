//! Devices and primary contexts.

use cudarc::driver::sys;

use super::{CUcontext, CUdevice, DResult, check};

/// [cuDeviceGet](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__DEVICE.html)
pub(crate) fn device_get(ordinal: i32) -> DResult<CUdevice> {
    let mut dev = 0;
    // SAFETY: valid out-pointer; the driver validates the ordinal.
    check("cuDeviceGet", unsafe {
        sys::cuDeviceGet(&mut dev, ordinal)
    })?;
    Ok(dev)
}

/// [cuDeviceGetPCIBusId](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__DEVICE.html):
/// the device's PCI address, e.g. `0000:3B:00.0`.
pub(crate) fn device_pci_bus_id(dev: CUdevice) -> DResult<String> {
    let mut buf = [0 as std::ffi::c_char; 64];
    // SAFETY: a writable buffer of the length given; the driver writes a NUL-terminated string.
    check("cuDeviceGetPCIBusId", unsafe {
        sys::cuDeviceGetPCIBusId(buf.as_mut_ptr(), buf.len() as i32, dev)
    })?;
    // SAFETY: NUL-terminated within `buf` (the driver's contract; the last byte stays 0).
    Ok(unsafe { std::ffi::CStr::from_ptr(buf.as_ptr()) }
        .to_string_lossy()
        .into_owned())
}

/// [cuDevicePrimaryCtxRetain](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__PRIMARY__CTX.html)
pub(crate) fn primary_ctx_retain(dev: CUdevice) -> DResult<CUcontext> {
    let mut ctx = std::ptr::null_mut();
    // SAFETY: valid out-pointer; `dev` came from cuDeviceGet.
    check("cuDevicePrimaryCtxRetain", unsafe {
        sys::cuDevicePrimaryCtxRetain(&mut ctx, dev)
    })?;
    Ok(ctx)
}

/// [cuDevicePrimaryCtxRelease](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__PRIMARY__CTX.html)
///
/// # Safety
/// 1. Must balance exactly one earlier [`primary_ctx_retain`] of `dev`.
pub(crate) unsafe fn primary_ctx_release(dev: CUdevice) -> DResult<()> {
    // SAFETY: the caller balances a retain.
    check("cuDevicePrimaryCtxRelease", unsafe {
        sys::cuDevicePrimaryCtxRelease_v2(dev)
    })
}

/// [cuCtxGetCurrent](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__CTX.html)
pub(crate) fn ctx_get_current() -> DResult<CUcontext> {
    let mut ctx = std::ptr::null_mut();
    // SAFETY: valid out-pointer.
    check("cuCtxGetCurrent", unsafe { sys::cuCtxGetCurrent(&mut ctx) })?;
    Ok(ctx)
}

/// [cuCtxGetDevice](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__CTX.html): the
/// device of the current context (an error without one).
pub(crate) fn ctx_get_device() -> DResult<CUdevice> {
    let mut dev = 0;
    // SAFETY: valid out-pointer; with no current context the driver returns an error.
    check("cuCtxGetDevice", unsafe { sys::cuCtxGetDevice(&mut dev) })?;
    Ok(dev)
}

/// [cuCtxSynchronize](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__CTX.html):
/// blocks until all work queued in the current context, on every stream, completed.
pub(crate) fn ctx_synchronize() -> DResult<()> {
    // SAFETY: no arguments; with no current context the driver returns an error. Relaxed
    // (`capture_relaxed`): a wait that guards memory must not be refused.
    super::capture_relaxed(|| check("cuCtxSynchronize", unsafe { sys::cuCtxSynchronize() }))
}

/// [cuCtxPushCurrent](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__CTX.html)
///
/// # Safety
/// 1. `ctx` must be a live context (ours is kept alive by a retain).
pub(crate) unsafe fn ctx_push(ctx: CUcontext) -> DResult<()> {
    // SAFETY: the caller guarantees `ctx` is live.
    check("cuCtxPushCurrent", unsafe { sys::cuCtxPushCurrent_v2(ctx) })
}

/// [cuCtxPopCurrent](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__CTX.html)
pub(crate) fn ctx_pop() -> DResult<()> {
    let mut ctx = std::ptr::null_mut();
    // SAFETY: valid out-pointer; popping with an empty stack returns an error, not UB.
    check("cuCtxPopCurrent", unsafe {
        sys::cuCtxPopCurrent_v2(&mut ctx)
    })
}
