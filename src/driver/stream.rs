//! Streams, graph capture and host functions.

use cudarc::driver::sys;

use super::{CUevent, CUstream, DResult, check};

/// [cuStreamCreate](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__STREAM.html) with
/// `CU_STREAM_NON_BLOCKING`.
///
/// # Safety
/// 1. A context must be current on this thread.
pub(crate) unsafe fn stream_create() -> DResult<CUstream> {
    let mut s = std::ptr::null_mut();
    // SAFETY: valid out-pointer; a context is current (caller).
    check("cuStreamCreate", unsafe {
        sys::cuStreamCreate(&mut s, sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32)
    })?;
    Ok(s)
}

/// [cuStreamDestroy](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__STREAM.html)
///
/// # Safety
/// 1. `s` is live and destroyed once.
pub(crate) unsafe fn stream_destroy(s: CUstream) -> DResult<()> {
    // SAFETY: caller's contract.
    check("cuStreamDestroy", unsafe { sys::cuStreamDestroy_v2(s) })
}

/// [cuStreamSynchronize](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__STREAM.html)
///
/// # Safety
/// 1. `s` is a live stream of the current context (or null).
pub(crate) unsafe fn stream_synchronize(s: CUstream) -> DResult<()> {
    // Relaxed (`capture_relaxed`): a wait that guards memory must not be refused.
    super::capture_relaxed(|| {
        // SAFETY: caller's contract.
        check("cuStreamSynchronize", unsafe {
            sys::cuStreamSynchronize(s)
        })
    })
}

/// [cuStreamQuery](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__STREAM.html):
/// `Ok(true)` once all work queued on `s` completed.
///
/// # Safety
/// 1. `s` is a live stream of the current context (or a special handle).
pub(crate) unsafe fn stream_query(s: CUstream) -> DResult<bool> {
    #[cfg(feature = "testing")]
    if let Some(f) = super::fault::take(super::fault::Call::StreamQuery) {
        return f.error("cuStreamQuery").map_or(Ok(false), Err);
    }
    // SAFETY: caller's contract. Relaxed, as `event_query`.
    super::capture_relaxed(|| match unsafe { sys::cuStreamQuery(s) } {
        sys::CUresult::CUDA_SUCCESS => Ok(true),
        sys::CUresult::CUDA_ERROR_NOT_READY => Ok(false),
        code => Err(super::DriverError {
            call: "cuStreamQuery",
            code,
        }),
    })
}

/// [cuStreamIsCapturing](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__STREAM.html):
/// `true` while `s` is capturing a CUDA graph (active or invalidated capture).
///
/// # Safety
/// 1. `s` is a live stream of the current context (or null).
pub(crate) unsafe fn stream_is_capturing(s: CUstream) -> DResult<bool> {
    let mut status = sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
    // SAFETY: caller's contract; valid out-pointer.
    check("cuStreamIsCapturing", unsafe {
        sys::cuStreamIsCapturing(s, &mut status)
    })?;
    Ok(status != sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE)
}

/// [cuStreamBeginCapture](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__STREAM.html)
/// in relaxed mode.
///
/// # Safety
/// 1. `s` is a live, non-default stream of the current context.
#[cfg(feature = "testing")]
pub(crate) unsafe fn stream_begin_capture(s: CUstream) -> DResult<()> {
    // SAFETY: caller's contract.
    check("cuStreamBeginCapture", unsafe {
        sys::cuStreamBeginCapture_v2(s, sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED)
    })
}

/// [cuStreamEndCapture](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__STREAM.html)
/// followed by `cuGraphDestroy` of whatever graph was captured.
///
/// # Safety
/// 1. `s` is a live stream of the current context that is capturing.
#[cfg(feature = "testing")]
pub(crate) unsafe fn stream_end_capture_discard(s: CUstream) -> DResult<()> {
    let mut graph = std::ptr::null_mut();
    // SAFETY: caller's contract; valid out-pointer.
    let r = check("cuStreamEndCapture", unsafe {
        sys::cuStreamEndCapture(s, &mut graph)
    });
    if !graph.is_null() {
        // SAFETY: a graph returned by cuStreamEndCapture is ours to destroy, once.
        check("cuGraphDestroy", unsafe { sys::cuGraphDestroy(graph) })?;
    }
    r
}

/// [cuStreamWaitEvent](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__STREAM.html):
/// later work on `s` waits for `ev` on the device (no host wait, no SM work).
///
/// # Safety
/// 1. `s` and `ev` are live and belong to the current context's device.
pub(crate) unsafe fn stream_wait_event(s: CUstream, ev: CUevent) -> DResult<()> {
    // SAFETY: caller's contract.
    check("cuStreamWaitEvent", unsafe {
        sys::cuStreamWaitEvent(s, ev, 0)
    })
}

/// A host function for [`launch_host_func`].
#[cfg(feature = "testing")]
pub(crate) type HostFn = unsafe extern "C" fn(*mut std::ffi::c_void);

/// [cuLaunchHostFunc](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__EXEC.html):
/// runs `f(data)` on a driver thread once prior work on `s` completed; later work on `s` waits
/// for it to return.
///
/// # Safety
/// 1. `s` is a live stream of the current context; `f` must not call CUDA and must not unwind.
/// 2. `data` stays valid until `f` ran.
#[cfg(feature = "testing")]
pub(crate) unsafe fn launch_host_func(
    s: CUstream,
    f: HostFn,
    data: *mut std::ffi::c_void,
) -> DResult<()> {
    // SAFETY: caller's contract.
    check("cuLaunchHostFunc", unsafe {
        sys::cuLaunchHostFunc(s, Some(f), data)
    })
}

/// [cuStreamGetId](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__STREAM.html):
/// the stream's ID, unique for the life of its context (a destroyed stream's handle may be
/// reused by a new stream; its ID is not). For the legacy and per-thread default streams it is
/// the ID of the stream the handle means for the calling thread.
///
/// # Safety
/// 1. `stream` is a live stream of the current context, or null, or a default-stream handle.
pub(crate) unsafe fn stream_get_id(stream: CUstream) -> DResult<u64> {
    let mut id: std::ffi::c_ulonglong = 0;
    // SAFETY: caller's contract; `id` outlives the call.
    check("cuStreamGetId", unsafe {
        sys::cuStreamGetId(stream, &mut id)
    })?;
    Ok(id as u64)
}

/// [cuStreamWriteValue32](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__MEMOP.html):
/// once the work before it on `stream` completed (default flags: a memory barrier first), the
/// GPU's front end writes `value` at `addr`. No SM work.
///
/// # Safety
/// 1. `addr` is a device address of 4 writable bytes that stay allocated until the write ran.
/// 2. `stream` is live; a context is current.
pub(crate) unsafe fn stream_write_value32(
    stream: CUstream,
    addr: super::CUdeviceptr,
    value: u32,
) -> DResult<()> {
    #[cfg(feature = "testing")]
    if let Some(f) = super::fault::take(super::fault::Call::StreamWriteValue32) {
        return f.error("cuStreamWriteValue32").map_or(Ok(()), Err);
    }
    // SAFETY: caller's contract.
    check("cuStreamWriteValue32", unsafe {
        sys::cuStreamWriteValue32_v2(
            stream,
            addr,
            value,
            sys::CUstreamWriteValue_flags::CU_STREAM_WRITE_VALUE_DEFAULT as u32,
        )
    })
}

/// [cuStreamGetCtx](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__STREAM.html): the
/// context a stream belongs to.
///
/// # Safety
/// 1. `stream` is a live stream (a handle checked live), not a default-stream handle.
#[cfg(feature = "python")]
pub(crate) unsafe fn stream_get_ctx(stream: CUstream) -> DResult<super::CUcontext> {
    let mut ctx = std::ptr::null_mut();
    // SAFETY: caller's contract; `ctx` outlives the call.
    check("cuStreamGetCtx", unsafe {
        sys::cuStreamGetCtx(stream, &mut ctx)
    })?;
    Ok(ctx)
}
