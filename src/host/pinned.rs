//! Page-locked host memory: from a host memory pool (freed without waiting for the device:
//! [`super::host_pool`]), from `cuMemHostAlloc`, or pages pinstage maps itself and registers
//! with `cuMemHostRegister` (several times cheaper to get than `cuMemHostAlloc`, at the
//! page-rounded size).

use std::ptr::NonNull;

use crate::cuda::Device;
use crate::driver;
use crate::error::{Error, Result, on_drop};

static LIVE_BYTES: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// Pinned bytes currently allocated by pinstage in this process (every [`PinnedBuffer`]:
/// stager slots, pool blocks, pinned arrays, bounce buffers). For leak checks and reports.
pub fn live_pinned_bytes() -> usize {
    LIVE_BYTES.load(std::sync::atomic::Ordering::Relaxed)
}

/// Whether [`PinnedBuffer::alloc`] registers pages (the default) or calls `cuMemHostAlloc`.
static PIN_BY_REGISTER: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(true);

/// Chooses how [`PinnedBuffer::alloc`] gets pinned memory (the laboratory's comparisons).
#[cfg_attr(not(all(feature = "lab", feature = "python")), allow(dead_code))]
pub(crate) fn set_pin_by_register(on: bool) -> bool {
    PIN_BY_REGISTER.swap(on, std::sync::atomic::Ordering::Relaxed)
}

pub(crate) fn count_pinned(bytes: usize) {
    LIVE_BYTES.fetch_add(bytes, std::sync::atomic::Ordering::Relaxed);
}

pub(crate) fn uncount_pinned(bytes: usize) {
    LIVE_BYTES.fetch_sub(bytes, std::sync::atomic::Ordering::Relaxed);
}

/// Allocation flags for [`PinnedBuffer`]. `PORTABLE` is always set: the memory is pinned for
/// every context, so buffers work with any framework's context on the device.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PinnedFlags {
    write_combined: bool,
    mapped: bool,
}

impl PinnedFlags {
    /// `CU_MEMHOSTALLOC_PORTABLE`: for buffers the CPU reads (D2H destinations, pools).
    pub const PORTABLE: Self = Self {
        write_combined: false,
        mapped: false,
    };
    /// `PORTABLE | CU_MEMHOSTALLOC_DEVICEMAP`: also mapped for kernels to read in place (step
    /// slots in zero-copy mode).
    pub const MAPPED: Self = Self {
        write_combined: false,
        mapped: true,
    };
    /// `PORTABLE | CU_MEMHOSTALLOC_WRITECOMBINED`: only for H2D staging buffers the CPU writes
    /// and never reads (CPU reads of write-combined memory are very slow).
    pub const WRITE_COMBINED: Self = Self {
        write_combined: true,
        mapped: false,
    };

    /// Whether the memory is write-combined.
    pub fn is_write_combined(self) -> bool {
        self.write_combined
    }

    fn raw(self) -> u32 {
        driver::mem::HOSTALLOC_PORTABLE
            | if self.write_combined {
                driver::mem::HOSTALLOC_WRITECOMBINED
            } else {
                0
            }
            | if self.mapped {
                driver::mem::HOSTALLOC_DEVICEMAP
            } else {
                0
            }
    }
}

/// An owned block of pinned host memory. Dropping it hands the block back (`cuMemFreeAsync` to
/// its host pool, `cuMemHostUnregister` or `cuMemFreeHost`) off the caller's thread; the owner
/// must make sure no copy still reads or writes it (the stager, the pool and pending copies do,
/// by waiting on their events first).
///
/// `Send + Sync`: it owns plain memory; `&PinnedBuffer` only reads, writes need `&mut`.
pub struct PinnedBuffer {
    ptr: NonNull<u8>,
    len: usize,
    flags: PinnedFlags,
    /// Keeps the primary context (which owns the pinned mapping) alive.
    device: Device,
    backing: Backing,
}

/// Where a [`PinnedBuffer`]'s memory comes from, which says how it is given back.
enum Backing {
    /// `cuMemHostAlloc` (or nothing, for 0 bytes).
    HostAlloc,
    /// Pages pinstage mapped and registered.
    Registered(super::mapped::MappedPages),
    /// A block of the device's host pool, `len` rounded up to whole pages.
    Pool(&'static super::host_pool::HostPool, usize),
}

impl Backing {
    /// The bytes pinned for a buffer of `len` bytes.
    fn pinned_len(&self, len: usize) -> usize {
        match self {
            Backing::HostAlloc => len,
            Backing::Registered(p) => p.len(),
            Backing::Pool(_, n) => *n,
        }
    }
}

// SAFETY: the buffer is uniquely owned host memory; the driver lets it be freed from any thread.
unsafe impl Send for PinnedBuffer {}
// SAFETY: shared references only allow reads of the bytes.
unsafe impl Sync for PinnedBuffer {}

impl PinnedBuffer {
    /// Allocates `len` bytes of pinned memory (`cuMemHostAlloc`). A 0-byte buffer allocates
    /// nothing. Refused for memory while pinstage's background thread has frees pending (memory
    /// let go is back with the driver only once they ran), it waits for them, up to 5 s, and
    /// tries once more.
    pub fn new(device: &Device, len: usize, flags: PinnedFlags) -> Result<Self> {
        super::reaper::retry_after_frees(|| Self::new_now(device, len, flags))
    }

    /// [`PinnedBuffer::new`] without the wait for pending frees.
    fn new_now(device: &Device, len: usize, flags: PinnedFlags) -> Result<Self> {
        if len == 0 {
            return Ok(Self::empty(device, flags));
        }
        let _cur = device.enter()?;
        // SAFETY: the device's context is current (guard).
        let raw = unsafe { driver::mem::mem_host_alloc(len, flags.raw()) }?;
        let ptr = NonNull::new(raw.cast::<u8>()).ok_or(Error::OutOfMemory {
            what: "pinned host memory",
            bytes: len,
        })?;
        LIVE_BYTES.fetch_add(len, std::sync::atomic::Ordering::Relaxed);
        Ok(Self {
            ptr,
            len,
            flags,
            device: device.clone(),
            backing: Backing::HostAlloc,
        })
    }

    fn empty(device: &Device, flags: PinnedFlags) -> Self {
        Self {
            ptr: NonNull::dangling(),
            len: 0,
            flags,
            device: device.clone(),
            backing: Backing::HostAlloc,
        }
    }

    /// `len` bytes of pinned memory from pages pinstage maps (transparent huge pages where the
    /// system offers them), populates with several threads and registers with
    /// `cuMemHostRegister`: the memory pinned is `len` rounded up to whole 4 KiB pages.
    /// Write-combined memory cannot be registered: those flags get [`PinnedBuffer::new`]. Waits
    /// for pending frees as [`PinnedBuffer::new`] does.
    ///
    /// # Errors
    /// [`Error::OutOfMemory`] without pages, [`Error::Driver`] when the driver refuses them.
    pub fn new_registered(device: &Device, len: usize, flags: PinnedFlags) -> Result<Self> {
        super::reaper::retry_after_frees(|| Self::new_registered_now(device, len, flags))
    }

    /// [`PinnedBuffer::new_registered`] without the wait for pending frees.
    fn new_registered_now(device: &Device, len: usize, flags: PinnedFlags) -> Result<Self> {
        if len == 0 {
            return Ok(Self::empty(device, flags));
        }
        if flags.write_combined {
            return Self::new_now(device, len, flags);
        }
        // On a host with several NUMA nodes, the pages come from the device's node.
        let node = (super::numa::online_nodes() > 1)
            .then(|| device.numa_node())
            .flatten();
        let pages = super::mapped::MappedPages::new_on(len, node)?;
        let _cur = device.enter()?;
        // SAFETY: our own fresh mapping, unregistered (in drop) before it is unmapped; the
        // context is current.
        unsafe {
            driver::mem::mem_host_register(pages.as_ptr().cast(), pages.len(), false, flags.mapped)
        }?;
        LIVE_BYTES.fetch_add(pages.len(), std::sync::atomic::Ordering::Relaxed);
        Ok(Self {
            ptr: NonNull::new(pages.as_ptr()).expect("a mapping is never at address 0"),
            len,
            flags,
            device: device.clone(),
            backing: Backing::Registered(pages),
        })
    }

    /// `len` bytes of pinned memory the way pinstage gets it for its pools, bounce slots and
    /// pinned arrays: a block of the device's host memory pool, whose free never waits for the
    /// device (plain [`PinnedFlags::PORTABLE`] memory, where the driver makes such pools: 12.6
    /// and later); else registered pages ([`PinnedBuffer::new_registered`]), or
    /// `cuMemHostAlloc` when pages cannot be registered (or registration is switched off).
    ///
    /// Waits for pending frees as [`PinnedBuffer::new`] does (once, whichever way it pins).
    ///
    /// # Errors
    /// As [`PinnedBuffer::new`].
    pub fn alloc(device: &Device, len: usize, flags: PinnedFlags) -> Result<Self> {
        super::reaper::retry_after_frees(|| Self::alloc_now(device, len, flags))
    }

    /// [`PinnedBuffer::alloc`] without the wait for pending frees: for callers that serve the
    /// request with pageable memory when it cannot be pinned at once.
    pub(crate) fn alloc_now(device: &Device, len: usize, flags: PinnedFlags) -> Result<Self> {
        if len > 0 && flags == PinnedFlags::PORTABLE {
            if let Some(b) = Self::new_pooled_now(device, len) {
                return Ok(b);
            }
        }
        if PIN_BY_REGISTER.load(std::sync::atomic::Ordering::Relaxed) && !flags.write_combined {
            match Self::new_registered_now(device, len, flags) {
                Ok(b) => return Ok(b),
                // More than the system can give: the driver would not do better.
                Err(e @ Error::OutOfMemory { .. }) => return Err(e),
                Err(_) => {}
            }
        }
        Self::new_now(device, len, flags)
    }

    /// A block of the device's host pool; `None` where there is no pool or it refused (the
    /// caller pins memory another way).
    fn new_pooled_now(device: &Device, len: usize) -> Option<Self> {
        let pool = super::host_pool::HostPool::of(device)?;
        let (ptr, pinned) = pool.alloc(device, len).ok()?;
        let ptr = NonNull::new(ptr)?;
        LIVE_BYTES.fetch_add(pinned, std::sync::atomic::Ordering::Relaxed);
        Some(Self {
            ptr,
            len,
            flags: PinnedFlags::PORTABLE,
            device: device.clone(),
            backing: Backing::Pool(pool, pinned),
        })
    }

    /// Whether the memory is registered pages.
    pub fn is_registered(&self) -> bool {
        matches!(self.backing, Backing::Registered(_))
    }

    /// Whether the memory is a block of a host memory pool (freed without waiting for the
    /// device).
    pub fn is_pooled(&self) -> bool {
        matches!(self.backing, Backing::Pool(..))
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the buffer is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The flags it was allocated with.
    pub fn flags(&self) -> PinnedFlags {
        self.flags
    }

    /// The device whose context allocated it.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// Start of the block.
    pub fn as_ptr(&self) -> *const u8 {
        self.ptr.as_ptr()
    }

    /// Start of the block, for writing.
    pub fn as_mut_ptr(&mut self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    /// Start of the block, for writing through a shared reference: for owners whose own
    /// protocol gives one writer at a time exclusive use of the bytes (the bounce slots' claims).
    /// No `&[u8]` of those bytes may be alive while they are written.
    pub(crate) fn shared_mut_ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    /// The bytes. Reading write-combined memory is correct but very slow.
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: ptr is valid for len bytes (or dangling with len 0) for our lifetime.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }

    /// The bytes, mutably.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as in as_slice, and `&mut self` is exclusive.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }

    /// A typed view (the block is page-aligned, so any Pod type's alignment holds).
    ///
    /// # Errors
    /// [`Error::BadCast`] when the length is not a multiple of `size_of::<T>()`.
    pub fn typed<T: bytemuck::Pod>(&self) -> Result<&[T]> {
        bytemuck::try_cast_slice(self.as_slice()).map_err(|_| self.bad_cast::<T>())
    }

    /// A typed mutable view.
    ///
    /// # Errors
    /// [`Error::BadCast`] when the length is not a multiple of `size_of::<T>()`.
    pub fn typed_mut<T: bytemuck::Pod>(&mut self) -> Result<&mut [T]> {
        let e = self.bad_cast::<T>();
        bytemuck::try_cast_slice_mut(self.as_mut_slice()).map_err(|_| e)
    }

    fn bad_cast<T>(&self) -> Error {
        Error::BadCast {
            addr: self.ptr.as_ptr() as usize,
            bytes: self.len,
            type_name: std::any::type_name::<T>(),
        }
    }
}

impl Drop for PinnedBuffer {
    /// Counts the bytes as let go at once, and hands the free to pinstage's reaper thread
    /// ([`super::wait_for_frees`]): freeing page-locked memory waits for all the device's queued work.
    fn drop(&mut self) {
        if self.len == 0 {
            return;
        }
        LIVE_BYTES.fetch_sub(
            self.backing.pinned_len(self.len),
            std::sync::atomic::Ordering::Relaxed,
        );
        let backing = std::mem::replace(&mut self.backing, Backing::HostAlloc);
        if let Backing::Pool(pool, _) = backing {
            // The pool's free waits for nothing: no device synchronize first.
            let (ptr, device) = (self.ptr.as_ptr() as usize, self.device.clone());
            // The seeded bug (`pool_free_waits`, scripts/seeded.tsv): the device drained first,
            // as for the other frees.
            if cfg!(pinstage_seeded_bug = "pool_free_waits") {
                super::reaper::defer(move || {
                    super::reaper::free_when_idle(&device, || pool.free(&device, ptr as *mut u8))
                });
            } else {
                super::reaper::defer(move || pool.free(&device, ptr as *mut u8));
            }
            return;
        }
        let pages = match backing {
            Backing::Registered(p) => Some(p),
            _ => None,
        };
        let doomed = Doomed {
            ptr: self.ptr.as_ptr() as usize,
            device: self.device.clone(),
            pages,
        };
        super::reaper::defer(move || doomed.free());
    }
}

/// A dropped buffer's memory on its way to the reaper.
struct Doomed {
    /// The `cuMemHostAlloc` block (unused for registered pages).
    ptr: usize,
    device: Device,
    /// Registered pages (`None`: `cuMemHostAlloc` memory).
    pages: Option<super::mapped::MappedPages>,
}

impl Doomed {
    fn free(mut self) {
        let device = self.device.clone();
        super::reaper::free_when_idle(&device, || self.free_now());
    }

    fn free_now(&mut self) {
        // Neither call needs a particular current context for PORTABLE memory, but enter ours
        // so they work from any thread. Never panics: errors are recorded.
        let cur = self.device.enter();
        let freed = match (&cur, &self.pages) {
            // SAFETY: registered in `new_registered`, unregistered once; owners guarantee no
            // copy is in flight. The pages are unmapped after this (field drop).
            (Ok(_), Some(p)) => unsafe { driver::mem::mem_host_unregister(p.as_ptr().cast()) },
            // SAFETY: allocated by cuMemHostAlloc in `new`, freed once; owners guarantee no copy
            // is in flight.
            (Ok(_), None) => unsafe { driver::mem::mem_free_host(self.ptr as *mut _) },
            (Err(Error::Driver(e)), _) => Err(*e),
            (Err(_), _) => Ok(()),
        };
        if let Err(e) = freed {
            on_drop::<()>(Err(e));
            // Still registered (or the driver is gone): never hand the pages back to the
            // kernel under a registration.
            if let Some(p) = self.pages.take() {
                std::mem::forget(p);
            }
        }
    }
}

impl std::fmt::Debug for PinnedBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PinnedBuffer")
            .field("len", &self.len)
            .field("flags", &self.flags)
            .field("registered", &self.is_registered())
            .field("pooled", &self.is_pooled())
            .field("device", &self.device)
            .finish()
    }
}

/// Whether `ptr` lies in page-locked host memory known to the CUDA driver (allocated or
/// registered by pinstage, PyTorch, CuPy, JAX...). `false` without a driver.
pub fn is_pinned(ptr: *const u8) -> bool {
    if crate::driver::probe().is_err() || crate::driver::forked() {
        return false;
    }
    // Asked in the thread's current context when there is one (no context retained for it);
    // else in device 0's.
    if crate::driver::ctx::ctx_get_current().is_ok_and(|c| !c.is_null()) {
        return crate::driver::mem::is_pinned_host(ptr.cast());
    }
    Device::new(0)
        .and_then(|d| d.is_pinned_host(ptr))
        .unwrap_or(false)
}

/// `vec![0u8; len]`, refused with [`crate::Error::OutOfMemory`] instead of aborting the process
/// when the memory cannot be had.
///
/// The zeros come from `alloc_zeroed` (calloc: fresh pages from the OS are zero already), so a
/// large block costs nothing until it is written.
pub(crate) fn zeroed_vec(len: usize, what: &'static str) -> crate::Result<Vec<u8>> {
    if len == 0 {
        return Ok(Vec::new());
    }
    let oom = || crate::Error::OutOfMemory { what, bytes: len };
    let layout = std::alloc::Layout::array::<u8>(len).map_err(|_| oom())?;
    // SAFETY: a non-zero size.
    let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
    if ptr.is_null() {
        return Err(oom());
    }
    // SAFETY: `ptr` comes from the global allocator with the layout of `[u8; len]`, all `len`
    // bytes initialised (zero); the Vec takes ownership with capacity `len`.
    Ok(unsafe { Vec::from_raw_parts(ptr, len, len) })
}
