//! Host and device memory, and the copies between them.

use std::ffi::c_void;

use cudarc::driver::sys;

use super::{CUdeviceptr, CUstream, DResult, check};

/// The base page size: the unit the driver locks, and that pinstage rounds pinned blocks to.
pub(crate) const PAGE: usize = 4096;

/// `CU_MEMHOSTALLOC_PORTABLE`: pinned memory usable from every context.
pub(crate) const HOSTALLOC_PORTABLE: u32 = sys::CU_MEMHOSTALLOC_PORTABLE;
/// `CU_MEMHOSTALLOC_WRITECOMBINED`: fast for the device to read, very slow for the CPU to read.
pub(crate) const HOSTALLOC_WRITECOMBINED: u32 = sys::CU_MEMHOSTALLOC_WRITECOMBINED;

/// `CU_MEMHOSTALLOC_DEVICEMAP`: mapped into the device's address space (kernels may read it).
pub(crate) const HOSTALLOC_DEVICEMAP: u32 = sys::CU_MEMHOSTALLOC_DEVICEMAP;

/// [cuMemHostRegister](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__MEM.html)
/// (`PORTABLE`, plus `READ_ONLY` when asked): page-locks existing host memory in place.
///
/// # Safety
/// 1. A context is current; `ptr..ptr+bytes` is host memory that stays mapped until
///    [`mem_host_unregister`].
pub(crate) unsafe fn mem_host_register(
    ptr: *mut c_void,
    bytes: usize,
    read_only: bool,
    mapped: bool,
) -> DResult<()> {
    let flags = sys::CU_MEMHOSTREGISTER_PORTABLE
        | if read_only {
            sys::CU_MEMHOSTREGISTER_READ_ONLY
        } else {
            0
        }
        | if mapped {
            sys::CU_MEMHOSTREGISTER_DEVICEMAP
        } else {
            0
        };
    // Relaxed: see `capture_relaxed` (a page-locking call on this thread must not invalidate
    // another thread's global-mode capture).
    super::capture_relaxed(|| {
        // SAFETY: caller's contract.
        check("cuMemHostRegister", unsafe {
            sys::cuMemHostRegister_v2(ptr, bytes, flags)
        })
    })
}

/// [cuMemHostUnregister](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__MEM.html)
///
/// # Safety
/// 1. A context is current; `ptr` was registered by [`mem_host_register`] and no copy in flight
///    uses it.
pub(crate) unsafe fn mem_host_unregister(ptr: *mut c_void) -> DResult<()> {
    // Relaxed, as `mem_host_register`.
    super::capture_relaxed(|| {
        // SAFETY: caller's contract.
        check("cuMemHostUnregister", unsafe {
            sys::cuMemHostUnregister(ptr)
        })
    })
}

/// [cuMemHostGetDevicePointer](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__MEM.html):
/// the device address of mapped pinned memory (equal to the host address under unified
/// addressing).
///
/// # Safety
/// 1. A context must be current on this thread; `ptr` lies in memory from [`mem_host_alloc`]
///    with [`HOSTALLOC_DEVICEMAP`].
pub(crate) unsafe fn mem_host_get_device_pointer(ptr: *mut c_void) -> DResult<CUdeviceptr> {
    let mut d = 0;
    // SAFETY: valid out-pointer; caller's contract.
    check("cuMemHostGetDevicePointer", unsafe {
        sys::cuMemHostGetDevicePointer_v2(&mut d, ptr, 0)
    })?;
    Ok(d)
}

/// [cuMemcpyDtoH](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__MEM.html), the
/// synchronous copy (ordered on the legacy default stream).
///
/// # Safety
/// 1. A context is current; `src..src+bytes` is device memory of its device, `dst..dst+bytes`
///    writable host memory.
pub(crate) unsafe fn memcpy_dtoh(dst: *mut c_void, src: CUdeviceptr, bytes: usize) -> DResult<()> {
    // SAFETY: caller's contract.
    check("cuMemcpyDtoH", unsafe {
        sys::cuMemcpyDtoH_v2(dst, src, bytes)
    })
}

/// The driver version from which `cuMemcpyBatchAsync` exists (CUDA 12.8).
pub(crate) const BATCH_MIN_DRIVER: i32 = 12080;

/// [cuMemcpyBatchAsync](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__MEM.html)
/// (CUDA 12.8): `dsts.len()` copies in one call, in any direction (unified addresses), sources
/// read in stream order.
///
/// # Safety
/// 1. For each entry, `srcs[i]..+sizes[i]` is readable and `dsts[i]..+sizes[i]` writable memory
///    (device memory of the current context's device, or pinned host memory) that stays valid
///    until the copy completed on `stream`; the three slices have one length.
/// 2. The driver is at least [`BATCH_MIN_DRIVER`] (the symbol exists); `stream` is not the
///    legacy default stream (the call refuses it).
pub(crate) unsafe fn memcpy_batch_async(
    dsts: &mut [CUdeviceptr],
    srcs: &mut [CUdeviceptr],
    sizes: &mut [usize],
    stream: CUstream,
) -> DResult<()> {
    debug_assert!(dsts.len() == srcs.len() && srcs.len() == sizes.len());
    // SAFETY: a plain C struct of enums and integers; all-zero is a valid value for each field
    // (location type INVALID: no hint).
    let mut attr: sys::CUmemcpyAttributes = unsafe { std::mem::zeroed() };
    attr.srcAccessOrder = sys::CUmemcpySrcAccessOrder::CU_MEMCPY_SRC_ACCESS_ORDER_STREAM;
    let mut idx = [0usize];
    let mut fail = usize::MAX;
    // SAFETY: caller's contract; every array holds `count` entries (one attribute applies to all
    // from index 0) and outlives the call.
    check("cuMemcpyBatchAsync", unsafe {
        sys::cuMemcpyBatchAsync(
            dsts.as_mut_ptr(),
            srcs.as_mut_ptr(),
            sizes.as_mut_ptr(),
            dsts.len(),
            &mut attr,
            idx.as_mut_ptr(),
            1,
            &mut fail,
            stream,
        )
    })
}

/// [cuMemHostAlloc](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__MEM.html)
///
/// # Safety
/// 1. A context must be current on this thread.
pub(crate) unsafe fn mem_host_alloc(bytes: usize, flags: u32) -> DResult<*mut c_void> {
    let mut ptr = std::ptr::null_mut();
    // Relaxed, as `mem_host_register`.
    super::capture_relaxed(|| {
        // SAFETY: valid out-pointer; a context is current (caller).
        check("cuMemHostAlloc", unsafe {
            sys::cuMemHostAlloc(&mut ptr, bytes, flags)
        })
    })?;
    Ok(ptr)
}

/// [cuMemFreeHost](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__MEM.html)
///
/// # Safety
/// 1. `ptr` came from [`mem_host_alloc`] and is freed once.
/// 2. No copy in flight still reads or writes it.
pub(crate) unsafe fn mem_free_host(ptr: *mut c_void) -> DResult<()> {
    // Relaxed, as `mem_host_register`.
    // SAFETY: caller's contract.
    super::capture_relaxed(|| check("cuMemFreeHost", unsafe { sys::cuMemFreeHost(ptr) }))
}

/// [cuMemAlloc](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__MEM.html)
///
/// # Safety
/// 1. A context must be current on this thread.
pub(crate) unsafe fn mem_alloc(bytes: usize) -> DResult<CUdeviceptr> {
    let mut ptr = 0;
    // Relaxed, as `mem_host_register`.
    // SAFETY: valid out-pointer; a context is current (caller).
    super::capture_relaxed(|| check("cuMemAlloc", unsafe { sys::cuMemAlloc_v2(&mut ptr, bytes) }))?;
    Ok(ptr)
}

/// [cuMemGetInfo](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__MEM.html): the free
/// and total bytes of the current context's device (tests of frees).
///
/// # Safety
/// 1. A context must be current on this thread.
#[cfg(feature = "testing")]
pub(crate) unsafe fn mem_get_info() -> DResult<(usize, usize)> {
    let (mut free, mut total) = (0, 0);
    // SAFETY: valid out-pointers; a context is current (caller).
    check("cuMemGetInfo", unsafe {
        sys::cuMemGetInfo_v2(&mut free, &mut total)
    })?;
    Ok((free, total))
}

/// [cuMemFree](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__MEM.html)
///
/// # Safety
/// 1. `ptr` came from [`mem_alloc`], is freed once, and no work in flight uses it.
pub(crate) unsafe fn mem_free(ptr: CUdeviceptr) -> DResult<()> {
    // Relaxed, as `mem_host_register`.
    // SAFETY: caller's contract.
    super::capture_relaxed(|| check("cuMemFree", unsafe { sys::cuMemFree_v2(ptr) }))
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
    #[cfg(feature = "testing")]
    if let Some(f) = super::fault::take(super::fault::Call::MemcpyHtoDAsync) {
        return f.error("cuMemcpyHtoDAsync").map_or(Ok(()), Err);
    }
    // SAFETY: caller's contract.
    check("cuMemcpyHtoDAsync", unsafe {
        sys::cuMemcpyHtoDAsync_v2(dst, src, bytes, stream)
    })
}

/// [cuMemcpyAsync](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__MEM.html): the
/// unified-addressing copy (direction inferred from the pointers).
///
/// # Safety
/// As one entry of [`memcpy_batch_async`] (any stream, the legacy one included).
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
#[cfg(feature = "lab")]
pub(crate) unsafe fn memcpy_batch_async_one(
    dst: CUdeviceptr,
    src: *const c_void,
    bytes: usize,
    stream: CUstream,
) -> DResult<()> {
    // SAFETY: caller's contract, for the one entry.
    unsafe { memcpy_batch_async(&mut [dst], &mut [src as CUdeviceptr], &mut [bytes], stream) }
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
    let packed = |addr, host| Pitched {
        addr,
        pitch: width,
        host,
    };
    // SAFETY: caller's contract: packed rows (pitch = width) of host source, device destination.
    unsafe {
        memcpy_2d_async(
            packed(dst, false),
            packed(src as u64, true),
            width,
            height,
            stream,
        )
    }
}

/// One side of a pitched copy: where row 0 starts, the distance between rows, and whether it
/// is host memory (else device memory).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Pitched {
    pub(crate) addr: u64,
    pub(crate) pitch: usize,
    pub(crate) host: bool,
}

/// [cuMemcpy2DAsync](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__MEM.html):
/// `height` rows of `width` bytes from `src` to `dst`, each side stepping by its pitch.
///
/// # Safety
/// 1. Every row lies in memory of its side's kind that stays valid until the copy completed;
///    nothing else writes a destination row (or a source row) until then.
/// 2. `width <= pitch` on both sides, a pitch within the device's maximum pitch.
/// 3. `stream` is a live stream of the current context (or a special handle).
pub(crate) unsafe fn memcpy_2d_async(
    dst: Pitched,
    src: Pitched,
    width: usize,
    height: usize,
    stream: CUstream,
) -> DResult<()> {
    let kind = |host| {
        if host {
            sys::CUmemorytype::CU_MEMORYTYPE_HOST
        } else {
            sys::CUmemorytype::CU_MEMORYTYPE_DEVICE
        }
    };
    let c = sys::CUDA_MEMCPY2D {
        srcXInBytes: 0,
        srcY: 0,
        srcMemoryType: kind(src.host),
        srcHost: if src.host {
            src.addr as *const c_void
        } else {
            std::ptr::null()
        },
        srcDevice: if src.host { 0 } else { src.addr },
        srcArray: std::ptr::null_mut(),
        srcPitch: src.pitch,
        dstXInBytes: 0,
        dstY: 0,
        dstMemoryType: kind(dst.host),
        dstHost: if dst.host {
            dst.addr as *mut c_void
        } else {
            std::ptr::null_mut()
        },
        dstDevice: if dst.host { 0 } else { dst.addr },
        dstArray: std::ptr::null_mut(),
        dstPitch: dst.pitch,
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

/// [cuPointerGetAttributes](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__UNIFIED.html)
/// with `CU_POINTER_ATTRIBUTE_RANGE_START_ADDR` and `_RANGE_SIZE`: the start and length of the
/// driver allocation (device or pinned host memory) holding `ptr`; `None` for memory the driver
/// does not know.
pub(crate) fn allocation_range(ptr: u64) -> Option<(u64, usize)> {
    let mut start: CUdeviceptr = 0;
    let mut size: usize = 0;
    let mut attrs = [
        sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_RANGE_START_ADDR,
        sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_RANGE_SIZE,
    ];
    let mut data: [*mut c_void; 2] = [
        (&mut start as *mut CUdeviceptr).cast(),
        (&mut size as *mut usize).cast(),
    ];
    // SAFETY: two attributes, each with an out-pointer of its type's size (a CUdeviceptr, a
    // size_t); the driver only inspects the address value of `ptr`.
    let code = unsafe {
        sys::cuPointerGetAttributes(2, attrs.as_mut_ptr(), data.as_mut_ptr(), ptr as CUdeviceptr)
    };
    (code == sys::CUresult::CUDA_SUCCESS && start != 0 && size != 0).then_some((start, size))
}

/// Whether all of `ptr..ptr+len` is page-locked host memory known to the driver, as far as its
/// first and last bytes tell: a copy that treats the range as pinned must not run over into
/// pageable memory past a pinned start (an array partly pinned by `pin` of a slice). Memory is
/// locked in whole pages, so a range within the first byte's page needs one query (a small
/// `copy_d2h` round trip asks once, as before).
pub(crate) fn is_pinned_range(ptr: *const c_void, len: usize) -> bool {
    let first = ptr as usize;
    let last = first.wrapping_add(len.saturating_sub(1));
    is_pinned_host(ptr) && (first / PAGE == last / PAGE || is_pinned_host(last as *const c_void))
}
