//! Page-locked memory from a stream-ordered memory pool of host memory (`cuMemPoolCreate` with a
//! `HOST_NUMA` location, drivers 12.6+), which [`super::PinnedBuffer::alloc`] prefers where the
//! driver makes one.
//!
//! Why: `cuMemFreeHost` and `cuMemHostUnregister` wait inside the driver for all the work queued
//! on the device, and while they wait they hold up every other thread's driver calls. pinstage's
//! reaper synchronizes the device before such a free, but work queued between its synchronize
//! and the free still holds everyone up, and in a busy engine work is always being queued. A
//! pool block is freed with `cuMemFreeAsync` on a stream of pinstage's own where nothing else
//! runs, and the pool then hands the memory back with `cuMemPoolTrimTo` (beyond [`KEEP`] bytes it
//! keeps for the next allocations): neither waits for the
//! device (`lab/c/host_pool.c`, an H100, a stream held 300 ms: the free and trim took 0.02-2.6
//! ms and another thread's copy + record 0.02-0.03 ms, against 304 ms and 254 ms for
//! `cuMemFreeHost`). The memory is host memory to the driver and copies at the rate of
//! `cuMemHostAlloc` memory.
//!
//! One pool per device, made at the first allocation for it, mapped for every device, kept for
//! the life of the process (as the driver keeps its default pools). Where the driver refuses a
//! pool, or an allocation from it, the caller pins memory the older ways.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

use crate::cuda::Device;
use crate::driver::pool::CUmemoryPool;
use crate::driver::{self, CUstream};
use crate::error::Result;

/// Whether [`HostPool::of`] hands out pools (the laboratory switches it off to compare).
static ENABLED: AtomicBool = AtomicBool::new(true);

/// Chooses whether pinned memory comes from host pools where the driver makes them (the
/// laboratory's comparisons); returns the previous setting.
#[cfg_attr(not(all(feature = "lab", feature = "python")), allow(dead_code))]
pub(crate) fn set_pin_from_pool(on: bool) -> bool {
    ENABLED.swap(on, Ordering::Relaxed)
}

/// A device's host pool and the stream that orders its allocations and frees.
pub(crate) struct HostPool {
    pool: CUmemoryPool,
    /// pinstage's own stream in the device's primary context: nothing else runs on it, so its
    /// synchronize returns at once.
    stream: CUstream,
    /// Bytes of the pool's blocks in use: a trim counts them as held, so a free trims to these
    /// plus [`KEEP`].
    live: AtomicUsize,
    /// Keeps that context, and with it the stream, alive as long as the pool (the process): the
    /// last `Device` dropped releases the primary context, which destroys its streams (run
    /// 2026-12-06-h100-f: a probe whose only `Device` had made the pool, then dropped, crashed
    /// at its next pooled allocation). `None` only in the seeded `pool_drops_context` build.
    device: Option<Device>,
}

// SAFETY: driver handles, usable from any thread with the device's context current (every use
// enters it).
unsafe impl Send for HostPool {}
// SAFETY: as Send; the driver serializes calls on one pool and stream.
unsafe impl Sync for HostPool {}

/// Freed memory each pool keeps for the next allocations (beyond the blocks in use, which a trim
/// counts too); a free gives the rest back to the system at once, [`super::wait_for_frees`] all
/// of it, and an allocation refused for memory all of it before its second try. A fresh pool block costs 3-14x
/// registered pages (4 MiB 5.0 ms against 0.36, 1 GiB 173 ms against 32; run
/// 2026-12-06-h100-f), a block from memory the pool kept should cost far less (not measured yet).
const KEEP: usize = 64 << 20;

/// Every live pool block, start to length (page-rounded): the driver's range attributes do not
/// answer for a pool block as for other allocations (run 2026-12-06-h100-f: the block mover
/// never found its host tensors in one allocation), so pinstage answers for its own.
static BLOCKS: parking_lot::Mutex<std::collections::BTreeMap<usize, usize>> =
    parking_lot::Mutex::new(std::collections::BTreeMap::new());

/// The pool block holding `addr` (start, length), if one of pinstage's host pools handed it out
/// and it is alive.
pub(crate) fn block_holding(addr: u64) -> Option<(u64, usize)> {
    let addr = usize::try_from(addr).ok()?;
    let blocks = BLOCKS.lock();
    let (&start, &len) = blocks.range(..=addr).next_back()?;
    (addr < start + len).then_some((start as u64, len))
}

/// Each device's pool once asked for (`None`: the driver made none), by ordinal.
static POOLS: parking_lot::Mutex<Vec<(i32, Option<&'static HostPool>)>> =
    parking_lot::Mutex::new(Vec::new());

impl HostPool {
    /// The host pool for `device`, made at the first call; `None` where the driver makes none
    /// (before 12.6, or refused) or pools are switched off.
    pub(crate) fn of(device: &Device) -> Option<&'static HostPool> {
        // A forked child: no CUDA, and a lock a parent's thread held at the fork stays held.
        if !ENABLED.load(Ordering::Relaxed) || driver::forked() {
            return None;
        }
        let ordinal = device.ordinal();
        let mut pools = POOLS.lock();
        if let Some((_, p)) = pools.iter().find(|(o, _)| *o == ordinal) {
            return *p;
        }
        // Relaxed: a capture on another thread must not refuse the pool for good.
        match driver::relaxed(|| Self::create(device)) {
            Ok(p) => {
                pools.push((ordinal, Some(p)));
                Some(p)
            }
            // The driver makes no such pool (before 12.6): asked once.
            Err(crate::Error::Driver(e)) if e.is_not_supported() || e.is_invalid_value() => {
                pools.push((ordinal, None));
                None
            }
            // Anything else may pass: asked again at the next allocation.
            Err(_) => None,
        }
    }

    fn create(device: &Device) -> Result<&'static HostPool> {
        let _cur = device.enter()?;
        let numa = device.numa_node().map_or(0, |n| n as i32);
        let count = crate::cuda::device_count()?;
        // SAFETY: the device's context is current (guard).
        let pool = unsafe { driver::pool::host_pool_create(numa, count) }?;
        // SAFETY: as above.
        let stream = match unsafe { driver::stream::stream_create() } {
            Ok(s) => s,
            Err(e) => {
                // SAFETY: our pool, nothing allocated from it.
                let _ = unsafe { driver::pool::pool_destroy(pool) };
                return Err(e.into());
            }
        };
        Ok(Box::leak(Box::new(HostPool {
            pool,
            stream,
            live: AtomicUsize::new(0),
            device: (!cfg!(pinstage_seeded_bug = "pool_drops_context")).then(|| device.clone()),
        })))
    }

    /// `len` bytes (rounded up to whole pages), usable by the host once this returns.
    /// Refused unless the block is page-aligned (what [`super::PinnedBuffer`] promises).
    pub(crate) fn alloc(&self, device: &Device, len: usize) -> Result<(*mut u8, usize)> {
        let len = len.next_multiple_of(driver::mem::PAGE);
        let _cur = device.enter()?;
        let ptr = driver::capture_relaxed(|| {
            // SAFETY: our live pool and stream, the device's context current (guard).
            let p = unsafe { driver::pool::alloc_async(len, self.pool, self.stream) }?;
            // The block is the host's once the stream got past its allocation.
            // SAFETY: our live stream.
            match unsafe { driver::stream::stream_synchronize(self.stream) } {
                Ok(()) => Ok(p),
                Err(e) => {
                    // SAFETY: just allocated on this stream, used by nothing.
                    let _ = unsafe { driver::pool::free_async(p, self.stream) };
                    Err(e)
                }
            }
        })?;
        if ptr as usize % driver::mem::PAGE != 0 {
            self.release(device, ptr as *mut u8);
            return Err(crate::Error::OutOfMemory {
                what: "page-aligned memory from the host pool",
                bytes: len,
            });
        }
        BLOCKS.lock().insert(ptr as usize, len);
        self.live.fetch_add(len, Ordering::Relaxed);
        Ok((ptr as *mut u8, len))
    }

    /// Frees a block of [`HostPool::alloc`] and gives the pool's unused memory beyond [`KEEP`]
    /// back to the system, without waiting for the device's work. Never panics: errors are
    /// recorded ([`crate::drop_errors`]).
    ///
    /// The caller makes sure no copy still reads or writes the block.
    pub(crate) fn free(&self, device: &Device, ptr: *mut u8) {
        if driver::forked() {
            return; // no CUDA in a forked child; the registry's lock may be a parent thread's
        }
        if let Some(len) = BLOCKS.lock().remove(&(ptr as usize)) {
            self.live.fetch_sub(len, Ordering::Relaxed);
        }
        self.release(device, ptr);
    }

    /// [`HostPool::free`] of a block not in [`BLOCKS`].
    fn release(&self, device: &Device, ptr: *mut u8) {
        let Ok(_cur) = device.enter() else {
            // A forked child or a driver gone: nothing to free.
            return;
        };
        let freed = driver::capture_relaxed(|| {
            // SAFETY: a block of this pool (caller), freed once, on the stream that allocated it;
            // no copy uses it any more (caller).
            unsafe { driver::pool::free_async(ptr as u64, self.stream) }?;
            // A free the pool has not seen complete is not trimmed.
            // SAFETY: our live stream.
            unsafe { driver::stream::stream_synchronize(self.stream) }?;
            let keep = self.live.load(Ordering::Relaxed) + KEEP;
            // SAFETY: our live pool.
            unsafe { driver::pool::pool_trim(self.pool, keep) }
        });
        crate::error::on_drop(freed);
    }

    /// Gives all the pool's unused memory back to the system. Never panics: errors are recorded.
    pub(crate) fn trim(&self) {
        // (`None`: the seeded build, whose pool cannot enter its context on its own.)
        let Some(Ok(_cur)) = self.device.as_ref().map(Device::enter) else {
            return;
        };
        crate::error::on_drop(driver::capture_relaxed(|| {
            // SAFETY: our live pool.
            unsafe { driver::pool::pool_trim(self.pool, 0) }
        }));
    }
}

/// [`HostPool::trim`] of every pool made so far ([`super::wait_for_frees`]: the memory
/// pinstage let go is back with the system).
pub(crate) fn trim_all() {
    if driver::forked() {
        return;
    }
    let pools: Vec<&'static HostPool> = POOLS.lock().iter().filter_map(|(_, p)| *p).collect();
    for p in pools {
        p.trim();
    }
}
