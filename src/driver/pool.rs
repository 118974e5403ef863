//! Stream-ordered device memory: a memory pool of pinstage's own, allocations and frees ordered
//! on a stream.

use cudarc::driver::sys;

use super::{CUdeviceptr, CUstream, DResult, check};

pub(crate) use sys::CUmemoryPool;

/// [cuMemPoolCreate](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__MALLOC__ASYNC.html)
/// of device memory on `ordinal`, then its release threshold set to keep every byte it holds
/// (freed memory stays in the pool for the next allocation until [`pool_trim`]).
///
/// # Safety
/// 1. A context must be current on this thread.
pub(crate) unsafe fn pool_create(ordinal: i32) -> DResult<CUmemoryPool> {
    // SAFETY: `create_with` gives the pool just made.
    let setup = |pool| unsafe { keep_all(pool) };
    // SAFETY: a context is current (caller).
    unsafe {
        create_with(
            sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
            ordinal,
            setup,
        )
    }
}

/// [cuMemPoolCreate](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__MALLOC__ASYNC.html)
/// of page-locked HOST memory on NUMA node `numa` (drivers 12.6+), mapped for devices
/// `0..count` (`cuMemPoolSetAccess`), keeping the memory it holds until [`pool_trim`] as
/// [`pool_create`] does. Its blocks are freed with [`free_async`], which unlike
/// `cuMemFreeHost` does not wait for the device's work (`lab/c/host_pool.c`).
///
/// # Safety
/// 1. A context must be current on this thread.
pub(crate) unsafe fn host_pool_create(numa: i32, count: i32) -> DResult<CUmemoryPool> {
    let descs: Vec<sys::CUmemAccessDesc> = (0..count)
        .map(|d| {
            // SAFETY: plain C data, every field set below.
            let mut a: sys::CUmemAccessDesc = unsafe { std::mem::zeroed() };
            a.location.type_ = sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE;
            a.location.id = d;
            a.flags = sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
            a
        })
        .collect();
    let setup = |pool| {
        // SAFETY: our live pool, `descs.len()` descriptors.
        check("cuMemPoolSetAccess", unsafe {
            sys::cuMemPoolSetAccess(pool, descs.as_ptr(), descs.len())
        })
        // SAFETY: as above.
        .and_then(|()| unsafe { keep_all(pool) })
    };
    // SAFETY: a context is current (caller); the setup is given the pool just made.
    unsafe {
        create_with(
            sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_HOST_NUMA,
            numa,
            setup,
        )
    }
}

/// A pinned memory pool at (`location`, `id`), then `setup` run on it; destroyed again if the
/// setup fails.
///
/// # Safety
/// 1. A context must be current on this thread.
unsafe fn create_with(
    location: sys::CUmemLocationType,
    id: i32,
    setup: impl FnOnce(CUmemoryPool) -> DResult<()>,
) -> DResult<CUmemoryPool> {
    // SAFETY: plain C data; all-zero is "no handle types, no flags" for every other field.
    let mut props: sys::CUmemPoolProps = unsafe { std::mem::zeroed() };
    props.allocType = sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
    props.handleTypes = sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_NONE;
    props.location.type_ = location;
    props.location.id = id;
    let mut pool = std::ptr::null_mut();
    // SAFETY: valid out-pointer and properties; a context is current (caller).
    check("cuMemPoolCreate", unsafe {
        sys::cuMemPoolCreate(&mut pool, &props)
    })?;
    if let Err(e) = setup(pool) {
        // SAFETY: nothing was allocated from the pool.
        let _ = unsafe { sys::cuMemPoolDestroy(pool) };
        return Err(e);
    }
    Ok(pool)
}

/// Sets `pool`'s release threshold to keep every byte it holds (freed memory stays in the pool
/// for the next allocation until [`pool_trim`]).
///
/// # Safety
/// 1. `pool` must be a live pool.
unsafe fn keep_all(pool: CUmemoryPool) -> DResult<()> {
    let mut keep: u64 = u64::MAX;
    // SAFETY: a live pool (caller); the attribute takes a cuuint64_t.
    check("cuMemPoolSetAttribute", unsafe {
        sys::cuMemPoolSetAttribute(
            pool,
            sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
            (&raw mut keep).cast(),
        )
    })
}

/// [cuMemPoolSetAccess](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__MALLOC__ASYNC.html)
/// for every other device that can access `ordinal`'s memory (`cuDeviceCanAccessPeer`): a
/// pool's memory is mapped for its own device only, so without this a framework copying an
/// array of it to another GPU peer to peer (XLA, torch `.to("cuda:1")`) could not read it, as
/// it can the memory of its own pools. Returns how many devices were granted access.
///
/// # Safety
/// 1. `pool` is a live pool of device `ordinal`; a context is current.
pub(crate) unsafe fn pool_grant_peers(
    pool: CUmemoryPool,
    ordinal: i32,
    count: i32,
) -> DResult<usize> {
    let own = super::ctx::device_get(ordinal)?;
    let mut descs = Vec::new();
    for p in (0..count).filter(|&p| p != ordinal) {
        let peer = super::ctx::device_get(p)?;
        let mut can = 0;
        // SAFETY: valid out-pointer, devices from cuDeviceGet.
        check("cuDeviceCanAccessPeer", unsafe {
            sys::cuDeviceCanAccessPeer(&mut can, peer, own)
        })?;
        if can != 0 {
            // SAFETY: plain C data, every field set below.
            let mut d: sys::CUmemAccessDesc = unsafe { std::mem::zeroed() };
            d.location.type_ = sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE;
            d.location.id = p;
            d.flags = sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
            descs.push(d);
        }
    }
    if !descs.is_empty() {
        // SAFETY: our live pool (caller) and `descs.len()` descriptors.
        check("cuMemPoolSetAccess", unsafe {
            sys::cuMemPoolSetAccess(pool, descs.as_ptr(), descs.len())
        })?;
    }
    Ok(descs.len())
}

/// [cuMemAllocFromPoolAsync](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__MALLOC__ASYNC.html)
///
/// # Safety
/// 1. `pool` is live; `stream` a live stream of the pool's device's current context.
pub(crate) unsafe fn alloc_async(
    bytes: usize,
    pool: CUmemoryPool,
    stream: CUstream,
) -> DResult<CUdeviceptr> {
    let mut ptr = 0;
    // SAFETY: valid out-pointer; caller's contract.
    check("cuMemAllocFromPoolAsync", unsafe {
        sys::cuMemAllocFromPoolAsync(&mut ptr, bytes, pool, stream)
    })?;
    Ok(ptr)
}

/// [cuMemFreeAsync](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__MALLOC__ASYNC.html)
///
/// # Safety
/// 1. `ptr` came from [`alloc_async`], is freed once, and no work outside `stream`'s order
///    uses it any more.
pub(crate) unsafe fn free_async(ptr: CUdeviceptr, stream: CUstream) -> DResult<()> {
    // SAFETY: caller's contract.
    check("cuMemFreeAsync", unsafe {
        sys::cuMemFreeAsync(ptr, stream)
    })
}

/// [cuMemPoolDestroy](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__MALLOC__ASYNC.html)
///
/// # Safety
/// 1. `pool` is live, destroyed once, and nothing allocated from it is in use.
pub(crate) unsafe fn pool_destroy(pool: CUmemoryPool) -> DResult<()> {
    // SAFETY: caller's contract.
    check("cuMemPoolDestroy", unsafe { sys::cuMemPoolDestroy(pool) })
}

/// [cuMemPoolTrimTo](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__MALLOC__ASYNC.html):
/// gives the pool's unused memory back to the device, keeping `keep` bytes.
///
/// # Safety
/// 1. `pool` is live.
pub(crate) unsafe fn pool_trim(pool: CUmemoryPool, keep: usize) -> DResult<()> {
    // SAFETY: caller's contract.
    check("cuMemPoolTrimTo", unsafe {
        sys::cuMemPoolTrimTo(pool, keep)
    })
}

/// Bytes of device memory the pool holds (`CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT`).
///
/// # Safety
/// 1. `pool` is live.
pub(crate) unsafe fn pool_reserved(pool: CUmemoryPool) -> DResult<u64> {
    let mut v: u64 = 0;
    // SAFETY: our live pool; the attribute writes a cuuint64_t.
    check("cuMemPoolGetAttribute", unsafe {
        sys::cuMemPoolGetAttribute(
            pool,
            sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT,
            (&raw mut v).cast(),
        )
    })?;
    Ok(v)
}
