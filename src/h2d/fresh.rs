//! Fresh device memory filled from host memory (`to_device`): allocated from a stream-ordered
//! memory pool of pinstage's own per device, filled by [`start_h2d`] on pinstage's stream of that
//! device, handed to consumers (JAX, any DLPack importer) that order their work after its event.
//!
//! A consumer releases the memory by dropping its [`FreshMem`] (a DLPack deleter). That drop makes
//! no driver call (deleters may run on a driver callback thread, where the driver must not be
//! called): the address goes onto the device's list of released memory, which the next
//! allocation (or [`trim_device_pools`]) gives back to the pool with `cuMemFreeAsync` on
//! pinstage's stream, so the pool reuses it for later copies in stream order.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use parking_lot::Mutex;

use super::upload::start_h2d;
use crate::cuda::{Current, Device, Event, Stream};
use crate::dlpack::{DType, DeviceView, TensorMeta};
use crate::driver::{self, pool::CUmemoryPool};
use crate::error::{Error, Result};
use crate::host::CopyPath;

/// Pool allocations are rounded up to this many bytes (and come at least this aligned).
const FRESH_ALIGN: usize = 512;

/// One device's pool, stream and released memory.
struct DevicePool {
    device: Device,
    stream: Stream,
    pool: CUmemoryPool,
    released: Mutex<Vec<u64>>,
    in_use_arrays: AtomicU64,
    in_use_bytes: AtomicU64,
}

// SAFETY: the pool handle is a driver object usable from any thread (the driver API is thread
// safe); everything else is Send + Sync.
unsafe impl Send for DevicePool {}
// SAFETY: as above.
unsafe impl Sync for DevicePool {}

static POOLS: Mutex<Vec<Arc<DevicePool>>> = Mutex::new(Vec::new());

fn pool_of(cur: &Current<'_>) -> Result<Arc<DevicePool>> {
    let device = cur.device();
    let mut pools = POOLS.lock();
    if let Some(p) = pools.iter().find(|p| p.device == *device) {
        return Ok(Arc::clone(p));
    }
    let stream = Stream::new(device)?;
    // SAFETY: the device's context is current (`cur`).
    let pool = unsafe { driver::pool::pool_create(device.ordinal()) }?;
    if let Ok(count) = crate::cuda::device_count() {
        // Best effort: without peer access a result is still usable on its own device.
        // SAFETY: the pool just made, of this device; its context is current.
        let _ = unsafe { driver::pool::pool_grant_peers(pool, device.ordinal(), count) };
    }
    let p = Arc::new(DevicePool {
        device: device.clone(),
        stream,
        pool,
        released: Mutex::new(Vec::new()),
        in_use_arrays: AtomicU64::new(0),
        in_use_bytes: AtomicU64::new(0),
    });
    pools.push(Arc::clone(&p));
    Ok(p)
}

impl DevicePool {
    /// Gives released memory back to the pool, ordered on pinstage's stream. What the driver
    /// refuses stays released for the next attempt (the error is returned).
    fn reap(&self, _cur: &Current<'_>) -> Result<()> {
        let released = std::mem::take(&mut *self.released.lock());
        for (i, &ptr) in released.iter().enumerate() {
            // SAFETY: `ptr` came from this pool and was released by its last owner (no work
            // outside our stream's order uses it: the consumer's deleter said so); once each.
            if let Err(e) = unsafe { driver::pool::free_async(ptr, self.stream.handle().raw()) } {
                self.released.lock().extend_from_slice(&released[i..]);
                return Err(e.into());
            }
        }
        Ok(())
    }

    fn alloc(&self, cur: &Current<'_>, len: usize) -> Result<u64> {
        if let Err(Error::Driver(e)) = self.reap(cur) {
            // Not this allocation's failure: it is recorded, the memory stays for a later reap.
            crate::error::record_drop_error(e);
        }
        let bytes = len.max(1).next_multiple_of(FRESH_ALIGN);
        // SAFETY: our live pool and stream, the device's context current.
        let ptr =
            unsafe { driver::pool::alloc_async(bytes, self.pool, self.stream.handle().raw()) }
                .map_err(|e| Error::allocation(e, "device array", len))?;
        debug_assert_eq!(ptr % FRESH_ALIGN as u64, 0);
        Ok(ptr)
    }
}

/// Device memory pinstage allocated and filled for a consumer: `len` bytes at `ptr` on
/// `device`, valid after [`FreshMem::ready`] completed. Dropping it releases the memory (see the
/// module notes: no driver call in the drop).
pub struct FreshMem {
    ptr: u64,
    len: usize,
    pool: Arc<DevicePool>,
    ready: Event,
}

impl std::fmt::Debug for FreshMem {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FreshMem")
            .field("ptr", &format_args!("{:#x}", self.ptr))
            .field("len", &self.len)
            .field("device", &self.pool.device.ordinal())
            .finish()
    }
}

impl FreshMem {
    /// The device address.
    pub fn ptr(&self) -> u64 {
        self.ptr
    }

    /// Bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether it holds no bytes.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The device.
    pub fn device(&self) -> &Device {
        &self.pool.device
    }

    /// The event that completes once the memory holds the source's bytes.
    pub fn ready(&self) -> &Event {
        &self.ready
    }
}

impl Drop for FreshMem {
    fn drop(&mut self) {
        // Relaxed: statistics.
        self.pool.in_use_arrays.fetch_sub(1, Ordering::Relaxed);
        self.pool
            .in_use_bytes
            .fetch_sub(self.len as u64, Ordering::Relaxed);
        self.pool.released.lock().push(self.ptr);
    }
}

/// Starts filling fresh device memory of `device` with `len` bytes from `src`, on pinstage's
/// stream of that device; the result's [`FreshMem::ready`] completes after the copy.
///
/// # Errors
/// [`Error::OutOfMemory`], [`Error::CudaUnavailable`], [`Error::Driver`].
///
/// # Safety
/// 1. `src..src+len` is readable host memory that nothing writes until this returned and, for
///    [`CopyPath::Pinned`], until the result's event completed.
pub(crate) unsafe fn start_to_device(
    device: &Device,
    src: *const u8,
    len: usize,
) -> Result<(FreshMem, CopyPath)> {
    let cur = device.enter()?;
    let pool = pool_of(&cur)?;
    let ready = Event::new_in(&cur)?;
    let ptr = pool.alloc(&cur, len)?;
    // Relaxed: statistics (`FreshMem`'s drop takes them back).
    pool.in_use_arrays.fetch_add(1, Ordering::Relaxed);
    pool.in_use_bytes.fetch_add(len as u64, Ordering::Relaxed);
    // From here on, dropping `mem` releases the memory (on an error too).
    let mut mem = FreshMem {
        ptr,
        len,
        pool: Arc::clone(&pool),
        ready,
    };
    // SAFETY: `ptr` holds `len` writable bytes of this device, ours alone until `mem` drops.
    let view = unsafe {
        DeviceView::from_meta(TensorMeta::cuda_1d(device.ordinal(), ptr, DType::U8, len))
    };
    let stream = pool.stream.handle();
    // SAFETY: the caller's contract on `src`.
    let (path, event) = unsafe { start_h2d(Some(device), &view, src, len, stream) }?;
    match event {
        Some(ev) => mem.ready = ev,
        None => mem.ready.record_in(&cur, stream)?,
    }
    Ok((mem, path))
}

/// Fresh device memory of `device` holding `src`'s bytes; returns once `src` may change (a pinned
/// source's copy completed); the result's [`FreshMem::ready`] says when the device copy did.
///
/// # Errors
/// [`Error::OutOfMemory`], [`Error::CudaUnavailable`], [`Error::Driver`].
pub fn to_device(src: &[u8], device: &Device) -> Result<FreshMem> {
    // SAFETY: `src` is borrowed until we return; a pinned source's copy is waited for.
    let (mem, path) = unsafe { start_to_device(device, src.as_ptr(), src.len()) }?;
    if path == CopyPath::Pinned {
        mem.ready
            .wait_expecting(crate::cuda::wait::copy_time(src.len()))?;
    }
    Ok(mem)
}

/// What `to_device` holds on one device.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DevicePoolStats {
    /// Results not yet released by their consumers.
    pub in_use_arrays: u64,
    /// Their bytes.
    pub in_use_bytes: u64,
    /// Device memory the pool holds (live results and memory kept for reuse).
    pub outstanding_bytes: u64,
}

/// `to_device`'s memory on `device` (zeros before its first use there).
///
/// # Errors
/// [`Error::Driver`] if the pool cannot be asked.
pub fn device_pool_stats(device: &Device) -> Result<DevicePoolStats> {
    let pool = POOLS.lock().iter().find(|p| p.device == *device).cloned();
    let Some(pool) = pool else {
        return Ok(DevicePoolStats::default());
    };
    // SAFETY: our live pool.
    let reserved = unsafe { driver::pool::pool_reserved(pool.pool) }?;
    Ok(DevicePoolStats {
        in_use_arrays: pool.in_use_arrays.load(Ordering::Relaxed),
        in_use_bytes: pool.in_use_bytes.load(Ordering::Relaxed),
        outstanding_bytes: reserved,
    })
}

/// Gives released `to_device` memory back to its pools and the pools' unused memory back to
/// the devices (after pinstage's streams drained).
///
/// # Errors
/// The first driver error met (every pool is still visited).
pub fn trim_device_pools() -> Result<()> {
    let pools: Vec<Arc<DevicePool>> = POOLS.lock().clone();
    let mut result = Ok(());
    for p in pools {
        let r = p.device.enter().and_then(|cur| {
            p.reap(&cur)?;
            p.stream.synchronize()?;
            // SAFETY: our live pool.
            unsafe { driver::pool::pool_trim(p.pool, 0) }?;
            Ok(())
        });
        if result.is_ok() {
            result = r;
        }
    }
    result
}
