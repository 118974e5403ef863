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

use std::ffi::{CStr, c_void};
use std::fmt;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicBool, Ordering};

use cudarc::driver::sys;

pub(crate) use sys::{CUcontext, CUdevice, CUdeviceptr, CUevent, CUstream};

/// A failed CUDA driver call: the call's name and the `CUresult` it returned.
///
/// `Display` names the error through `cuGetErrorName` / `cuGetErrorString`, e.g.
/// `cuMemcpyHtoDAsync_v2: CUDA_ERROR_INVALID_VALUE (invalid argument)`.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct DriverError {
    call: &'static str,
    code: sys::CUresult,
}

impl DriverError {
    /// The driver function that failed.
    pub fn call(&self) -> &'static str {
        self.call
    }

    /// The raw `CUresult` value.
    pub fn code(&self) -> u32 {
        self.code as u32
    }

    /// The symbolic name of the error, e.g. `CUDA_ERROR_INVALID_VALUE`.
    pub fn name(&self) -> String {
        let mut ptr: *const std::ffi::c_char = std::ptr::null();
        // SAFETY: a DriverError only exists after the library was loaded by `probe`; the
        // out-pointer is valid; on success it points to a static NUL-terminated string.
        let ok = unsafe { sys::cuGetErrorName(self.code, &mut ptr) } == sys::CUresult::CUDA_SUCCESS;
        if ok && !ptr.is_null() {
            // SAFETY: see above: static C string owned by the driver.
            unsafe { CStr::from_ptr(ptr) }
                .to_string_lossy()
                .into_owned()
        } else {
            format!("CUresult({})", self.code as u32)
        }
    }

    /// The driver's description of the error.
    pub fn description(&self) -> String {
        let mut ptr: *const std::ffi::c_char = std::ptr::null();
        // SAFETY: as in `name`.
        let ok =
            unsafe { sys::cuGetErrorString(self.code, &mut ptr) } == sys::CUresult::CUDA_SUCCESS;
        if ok && !ptr.is_null() {
            // SAFETY: static C string owned by the driver.
            unsafe { CStr::from_ptr(ptr) }
                .to_string_lossy()
                .into_owned()
        } else {
            "unknown error".to_owned()
        }
    }
}

impl fmt::Display for DriverError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {} ({})", self.call, self.name(), self.description())
    }
}

impl fmt::Debug for DriverError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

impl std::error::Error for DriverError {}

/// Result of one driver call.
pub(crate) type DResult<T> = Result<T, DriverError>;

#[inline]
fn check(call: &'static str, code: sys::CUresult) -> DResult<()> {
    if code == sys::CUresult::CUDA_SUCCESS {
        Ok(())
    } else {
        Err(DriverError { call, code })
    }
}

/// What the one-time probe found.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Probe {
    /// Number of CUDA devices the driver reports.
    pub device_count: i32,
    /// Driver version as `major * 1000 + minor * 10` (e.g. 13000 for 13.0).
    pub driver_version: i32,
}

static PROBE: OnceLock<Result<Probe, String>> = OnceLock::new();
static FORKED: AtomicBool = AtomicBool::new(false);

extern "C" fn mark_forked_child() {
    FORKED.store(true, Ordering::Relaxed);
}

/// Environment variable that, when set to `1`, makes pinstage behave as if no driver existed.
pub const DISABLE_ENV: &str = "PINSTAGE_DISABLE_CUDA";

/// Loads libcuda and initialises the driver, once per process.
///
/// `Err` carries a human-readable reason: library missing, `cuInit` failed, disabled by
/// [`DISABLE_ENV`], or this is a forked child of a process that had initialised CUDA (CUDA is not
/// fork-safe).
pub fn probe() -> Result<Probe, String> {
    if FORKED.load(Ordering::Relaxed) {
        return Err(
            "CUDA cannot be used in a forked child of a process that initialised it \
                    (CUDA is not fork-safe); use the 'spawn' start method"
                .to_owned(),
        );
    }
    PROBE.get_or_init(probe_uncached).clone()
}

fn probe_uncached() -> Result<Probe, String> {
    if std::env::var(DISABLE_ENV).is_ok_and(|v| v == "1") {
        return Err(format!("disabled by {DISABLE_ENV}=1"));
    }
    // SAFETY: only tries to dlopen candidate library names; no driver call is made.
    if !unsafe { sys::is_culib_present() } {
        return Err("the CUDA driver library (libcuda.so) was not found".to_owned());
    }
    // SAFETY: the library is present (checked above), so cudarc's loader does not panic.
    let code = unsafe { sys::cuInit(0) };
    check("cuInit", code).map_err(|e| format!("cuInit failed: {e}"))?;
    let mut count = 0;
    // SAFETY: driver initialised; valid out-pointer.
    check("cuDeviceGetCount", unsafe {
        sys::cuDeviceGetCount(&mut count)
    })
    .map_err(|e| e.to_string())?;
    let mut version = 0;
    // SAFETY: valid out-pointer.
    check("cuDriverGetVersion", unsafe {
        sys::cuDriverGetVersion(&mut version)
    })
    .map_err(|e| e.to_string())?;
    // SAFETY: registers a plain extern "C" fn that only stores to a static atomic.
    unsafe { libc::pthread_atfork(None, None, Some(mark_forked_child)) };
    Ok(Probe {
        device_count: count,
        driver_version: version,
    })
}

/// Whether the process was forked after CUDA was initialised in its parent.
pub(crate) fn forked() -> bool {
    FORKED.load(Ordering::Relaxed)
}

// ---------------------------------------------------------------------------------------------
// Devices and contexts
// ---------------------------------------------------------------------------------------------

/// [cuDeviceGet](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__DEVICE.html)
pub(crate) fn device_get(ordinal: i32) -> DResult<CUdevice> {
    let mut dev = 0;
    // SAFETY: valid out-pointer; the driver validates the ordinal.
    check("cuDeviceGet", unsafe {
        sys::cuDeviceGet(&mut dev, ordinal)
    })?;
    Ok(dev)
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

// ---------------------------------------------------------------------------------------------
// Memory
// ---------------------------------------------------------------------------------------------

/// `CU_MEMHOSTALLOC_PORTABLE`: pinned memory usable from every context.
pub(crate) const HOSTALLOC_PORTABLE: u32 = sys::CU_MEMHOSTALLOC_PORTABLE;
/// `CU_MEMHOSTALLOC_WRITECOMBINED`: fast for the device to read, very slow for the CPU to read.
pub(crate) const HOSTALLOC_WRITECOMBINED: u32 = sys::CU_MEMHOSTALLOC_WRITECOMBINED;

/// [cuMemHostAlloc](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__MEM.html)
///
/// # Safety
/// 1. A context must be current on this thread.
pub(crate) unsafe fn mem_host_alloc(bytes: usize, flags: u32) -> DResult<*mut c_void> {
    let mut ptr = std::ptr::null_mut();
    // SAFETY: valid out-pointer; a context is current (caller).
    check("cuMemHostAlloc", unsafe {
        sys::cuMemHostAlloc(&mut ptr, bytes, flags)
    })?;
    Ok(ptr)
}

/// [cuMemFreeHost](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__MEM.html)
///
/// # Safety
/// 1. `ptr` came from [`mem_host_alloc`] and is freed once.
/// 2. No copy in flight still reads or writes it.
pub(crate) unsafe fn mem_free_host(ptr: *mut c_void) -> DResult<()> {
    // SAFETY: caller's contract.
    check("cuMemFreeHost", unsafe { sys::cuMemFreeHost(ptr) })
}

/// [cuMemAlloc](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__MEM.html)
///
/// # Safety
/// 1. A context must be current on this thread.
pub(crate) unsafe fn mem_alloc(bytes: usize) -> DResult<CUdeviceptr> {
    let mut ptr = 0;
    // SAFETY: valid out-pointer; a context is current (caller).
    check("cuMemAlloc", unsafe { sys::cuMemAlloc_v2(&mut ptr, bytes) })?;
    Ok(ptr)
}

/// [cuMemFree](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__MEM.html)
///
/// # Safety
/// 1. `ptr` came from [`mem_alloc`], is freed once, and no work in flight uses it.
pub(crate) unsafe fn mem_free(ptr: CUdeviceptr) -> DResult<()> {
    // SAFETY: caller's contract.
    check("cuMemFree", unsafe { sys::cuMemFree_v2(ptr) })
}

/// [cuMemcpyHtoDAsync](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__MEM.html)
///
/// # Safety
/// 1. `src..src+bytes` is host memory that stays valid and unchanged until the copy completed
///    on `stream` (for pinned memory the copy is truly asynchronous).
/// 2. `dst..dst+bytes` is device memory of the current context's device.
/// 3. `stream` is a live stream of the current context (or null: the legacy default stream).
pub(crate) unsafe fn memcpy_htod_async(
    dst: CUdeviceptr,
    src: *const c_void,
    bytes: usize,
    stream: CUstream,
) -> DResult<()> {
    // SAFETY: caller's contract.
    check("cuMemcpyHtoDAsync", unsafe {
        sys::cuMemcpyHtoDAsync_v2(dst, src, bytes, stream)
    })
}

/// [cuMemcpyAsync](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__MEM.html): the
/// unified-addressing copy (direction inferred from the pointers). For the benches' comparison of
/// copy entry points.
///
/// # Safety
/// As [`memcpy_htod_async`], with `src` given as its unified address.
pub(crate) unsafe fn memcpy_async(
    dst: CUdeviceptr,
    src: CUdeviceptr,
    bytes: usize,
    stream: CUstream,
) -> DResult<()> {
    // SAFETY: caller's contract.
    check("cuMemcpyAsync", unsafe {
        sys::cuMemcpyAsync(dst, src, bytes, stream)
    })
}

/// [cuMemcpyBatchAsync](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__MEM.html)
/// (CUDA 12.8) with one copy, source read in stream order. For the benches' comparison of copy
/// entry points.
///
/// # Safety
/// As [`memcpy_htod_async`]; `stream` must not be the legacy default stream (the call refuses
/// it).
pub(crate) unsafe fn memcpy_batch_async_one(
    dst: CUdeviceptr,
    src: *const c_void,
    bytes: usize,
    stream: CUstream,
) -> DResult<()> {
    let mut dsts = [dst];
    let mut srcs = [src as CUdeviceptr];
    let mut sizes = [bytes];
    // SAFETY: a plain C struct of enums and integers; all-zero is a valid value for each field
    // (location type INVALID: no hint).
    let mut attr: sys::CUmemcpyAttributes = unsafe { std::mem::zeroed() };
    attr.srcAccessOrder = sys::CUmemcpySrcAccessOrder::CU_MEMCPY_SRC_ACCESS_ORDER_STREAM;
    let mut idx = [0usize];
    let mut fail = usize::MAX;
    // SAFETY: caller's contract; every array holds `count` = 1 entries and outlives the call.
    check("cuMemcpyBatchAsync", unsafe {
        sys::cuMemcpyBatchAsync(
            dsts.as_mut_ptr(),
            srcs.as_mut_ptr(),
            sizes.as_mut_ptr(),
            1,
            &mut attr,
            idx.as_mut_ptr(),
            1,
            &mut fail,
            stream,
        )
    })
}

/// [cuMemcpy2DAsync](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__MEM.html) from
/// host to device, `height` rows of `width` bytes, both packed. For the benches' comparison of
/// copy entry points.
///
/// # Safety
/// As [`memcpy_htod_async`] for `width * height` bytes.
pub(crate) unsafe fn memcpy_2d_htod_async(
    dst: CUdeviceptr,
    src: *const c_void,
    width: usize,
    height: usize,
    stream: CUstream,
) -> DResult<()> {
    let c = sys::CUDA_MEMCPY2D {
        srcXInBytes: 0,
        srcY: 0,
        srcMemoryType: sys::CUmemorytype::CU_MEMORYTYPE_HOST,
        srcHost: src,
        srcDevice: 0,
        srcArray: std::ptr::null_mut(),
        srcPitch: width,
        dstXInBytes: 0,
        dstY: 0,
        dstMemoryType: sys::CUmemorytype::CU_MEMORYTYPE_DEVICE,
        dstHost: std::ptr::null_mut(),
        dstDevice: dst,
        dstArray: std::ptr::null_mut(),
        dstPitch: width,
        WidthInBytes: width,
        Height: height,
    };
    // SAFETY: caller's contract; `c` outlives the call (the driver reads it during the call).
    check("cuMemcpy2DAsync", unsafe {
        sys::cuMemcpy2DAsync_v2(&c, stream)
    })
}

/// [cuMemcpyDtoHAsync](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__MEM.html)
///
/// # Safety
/// 1. `dst..dst+bytes` is host memory nothing else touches until the copy completed.
/// 2. `src..src+bytes` is device memory that stays valid until then.
/// 3. `stream` is a live stream of the current context (or null).
pub(crate) unsafe fn memcpy_dtoh_async(
    dst: *mut c_void,
    src: CUdeviceptr,
    bytes: usize,
    stream: CUstream,
) -> DResult<()> {
    // SAFETY: caller's contract.
    check("cuMemcpyDtoHAsync", unsafe {
        sys::cuMemcpyDtoHAsync_v2(dst, src, bytes, stream)
    })
}

/// [cuPointerGetAttributes](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__UNIFIED.html)
/// with `CU_POINTER_ATTRIBUTE_MEMORY_TYPE`: `true` when `ptr` lies in page-locked host memory
/// known to the driver (pinned by any framework), `false` for pageable memory. Unlike the
/// singular `cuPointerGetAttribute`, this call succeeds (memory type 0) for memory the driver
/// does not know, so probing pageable memory raises no API error (compute-sanitizer stays quiet).
pub(crate) fn is_pinned_host(ptr: *const c_void) -> bool {
    let mut mem_type: u32 = 0;
    let mut attr = sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_MEMORY_TYPE;
    let mut data: [*mut c_void; 1] = [(&mut mem_type as *mut u32).cast()];
    // SAFETY: one attribute, one out-pointer to a u32 (the size of CUmemorytype); the driver only
    // inspects the address value of `ptr`.
    let code =
        unsafe { sys::cuPointerGetAttributes(1, &mut attr, data.as_mut_ptr(), ptr as CUdeviceptr) };
    code == sys::CUresult::CUDA_SUCCESS && mem_type == sys::CUmemorytype::CU_MEMORYTYPE_HOST as u32
}

// ---------------------------------------------------------------------------------------------
// Events
// ---------------------------------------------------------------------------------------------

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
    // SAFETY: caller's contract.
    check("cuEventRecord", unsafe { sys::cuEventRecord(ev, stream) })
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
    addr: CUdeviceptr,
    value: u32,
) -> DResult<()> {
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

/// [cuEventQuery](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__EVENT.html):
/// `Ok(true)` once all work captured by the last record completed.
///
/// # Safety
/// 1. `ev` is live.
pub(crate) unsafe fn event_query(ev: CUevent) -> DResult<bool> {
    // SAFETY: caller's contract.
    match unsafe { sys::cuEventQuery(ev) } {
        sys::CUresult::CUDA_SUCCESS => Ok(true),
        sys::CUresult::CUDA_ERROR_NOT_READY => Ok(false),
        code => Err(DriverError {
            call: "cuEventQuery",
            code,
        }),
    }
}

/// [cuEventSynchronize](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__EVENT.html)
///
/// # Safety
/// 1. `ev` is live.
pub(crate) unsafe fn event_synchronize(ev: CUevent) -> DResult<()> {
    // SAFETY: caller's contract.
    check("cuEventSynchronize", unsafe { sys::cuEventSynchronize(ev) })
}

// ---------------------------------------------------------------------------------------------
// Streams
// ---------------------------------------------------------------------------------------------

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
    // SAFETY: caller's contract.
    check("cuStreamSynchronize", unsafe {
        sys::cuStreamSynchronize(s)
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
pub(crate) type HostFn = unsafe extern "C" fn(*mut c_void);

/// [cuLaunchHostFunc](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__EXEC.html):
/// runs `f(data)` on a driver thread once prior work on `s` completed; later work on `s` waits
/// for it to return.
///
/// # Safety
/// 1. `s` is a live stream of the current context; `f` must not call CUDA and must not unwind.
/// 2. `data` stays valid until `f` ran.
pub(crate) unsafe fn launch_host_func(s: CUstream, f: HostFn, data: *mut c_void) -> DResult<()> {
    // SAFETY: caller's contract.
    check("cuLaunchHostFunc", unsafe {
        sys::cuLaunchHostFunc(s, Some(f), data)
    })
}
