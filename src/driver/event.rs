//! Events.

use cudarc::driver::sys;

use super::{CUevent, CUstream, DResult, DriverError, check};

/// [cuEventCreate](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__EVENT.html) with
/// `CU_EVENT_DISABLE_TIMING`.
///
/// # Safety
/// 1. A context must be current on this thread.
pub(crate) unsafe fn event_create() -> DResult<CUevent> {
    let mut ev = std::ptr::null_mut();
    // SAFETY: valid out-pointer; a context is current (caller).
    check("cuEventCreate", unsafe {
        sys::cuEventCreate(&mut ev, sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32)
    })?;
    Ok(ev)
}

/// [cuEventDestroy](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__EVENT.html)
///
/// # Safety
/// 1. `ev` is live and destroyed once.
pub(crate) unsafe fn event_destroy(ev: CUevent) -> DResult<()> {
    // SAFETY: caller's contract.
    check("cuEventDestroy", unsafe { sys::cuEventDestroy_v2(ev) })
}

/// [cuEventRecord](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__EVENT.html)
///
/// # Safety
/// 1. `ev` is live; `stream` is a live stream of the event's context (or null).
pub(crate) unsafe fn event_record(ev: CUevent, stream: CUstream) -> DResult<()> {
    #[cfg(feature = "testing")]
    if let Some(f) = super::fault::take(super::fault::Call::EventRecord) {
        return f.error("cuEventRecord").map_or(Ok(()), Err);
    }
    // SAFETY: caller's contract.
    check("cuEventRecord", unsafe { sys::cuEventRecord(ev, stream) })
}

/// [cuEventQuery](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__EVENT.html):
/// `Ok(true)` once all work captured by the last record completed.
///
/// # Safety
/// 1. `ev` is live.
pub(crate) unsafe fn event_query(ev: CUevent) -> DResult<bool> {
    // SAFETY: caller's contract. Relaxed (`capture_relaxed`): a refused query would
    // invalidate another thread's global-mode capture.
    super::capture_relaxed(|| match unsafe { sys::cuEventQuery(ev) } {
        sys::CUresult::CUDA_SUCCESS => Ok(true),
        sys::CUresult::CUDA_ERROR_NOT_READY => Ok(false),
        code => Err(DriverError {
            call: "cuEventQuery",
            code,
        }),
    })
}

/// [cuEventCreate](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__EVENT.html) with
/// timing: for [`event_elapsed`].
///
/// # Safety
/// 1. A context must be current on this thread.
pub(crate) unsafe fn event_create_timed() -> DResult<CUevent> {
    let mut ev = std::ptr::null_mut();
    // SAFETY: valid out-pointer; a context is current (caller).
    check("cuEventCreate", unsafe {
        sys::cuEventCreate(&mut ev, sys::CUevent_flags::CU_EVENT_DEFAULT as u32)
    })?;
    Ok(ev)
}

/// [cuEventElapsedTime](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__EVENT.html):
/// the GPU time from `start` to `end` in milliseconds, `Ok(None)` while either is yet to
/// complete.
///
/// # Safety
/// 1. `start` and `end` are live events made by [`event_create_timed`], both recorded, of the
///    context current on this thread.
pub(crate) unsafe fn event_elapsed(start: CUevent, end: CUevent) -> DResult<Option<f32>> {
    let mut ms = 0f32;
    // SAFETY: caller's contract; a valid out-pointer. Relaxed, as `event_query`: a refused call
    // would invalidate another thread's global-mode capture.
    super::capture_relaxed(
        || match unsafe { sys::cuEventElapsedTime(&mut ms, start, end) } {
            sys::CUresult::CUDA_SUCCESS => Ok(Some(ms)),
            sys::CUresult::CUDA_ERROR_NOT_READY => Ok(None),
            code => Err(DriverError {
                call: "cuEventElapsedTime",
                code,
            }),
        },
    )
}
