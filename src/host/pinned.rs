//! Page-locked host memory from `cuMemHostAlloc`.

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

/// An owned block of pinned host memory. Dropping it frees the block with `cuMemFreeHost`; the
/// owner must make sure no copy still reads or writes it (the stager, the pool and pending
/// copies do, by waiting on their events first).
///
/// `Send + Sync`: it owns plain memory; `&PinnedBuffer` only reads, writes need `&mut`.
pub struct PinnedBuffer {
    ptr: NonNull<u8>,
    len: usize,
    flags: PinnedFlags,
    /// Keeps the primary context (which owns the pinned mapping) alive.
    device: Device,
}

// SAFETY: the buffer is uniquely owned host memory; the driver lets it be freed from any thread.
unsafe impl Send for PinnedBuffer {}
// SAFETY: shared references only allow reads of the bytes.
unsafe impl Sync for PinnedBuffer {}

impl PinnedBuffer {
    /// Allocates `len` bytes of pinned memory. A 0-byte buffer allocates nothing.
    pub fn new(device: &Device, len: usize, flags: PinnedFlags) -> Result<Self> {
        if len == 0 {
            return Ok(Self {
                ptr: NonNull::dangling(),
                len: 0,
                flags,
                device: device.clone(),
            });
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
        })
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
    fn drop(&mut self) {
        if self.len == 0 {
            return;
        }
        LIVE_BYTES.fetch_sub(self.len, std::sync::atomic::Ordering::Relaxed);
        // cuMemFreeHost needs no particular current context for PORTABLE memory, but enter ours
        // so the call works from any thread. Drop never panics: errors are recorded.
        match self.device.enter() {
            // SAFETY: allocated by cuMemHostAlloc in `new`, freed once; owners guarantee no copy
            // is in flight.
            Ok(_cur) => on_drop(unsafe { driver::mem::mem_free_host(self.ptr.as_ptr().cast()) }),
            Err(Error::Driver(e)) => on_drop::<()>(Err(e)),
            Err(_) => {}
        }
    }
}

impl std::fmt::Debug for PinnedBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PinnedBuffer")
            .field("len", &self.len)
            .field("flags", &self.flags)
            .field("device", &self.device)
            .finish()
    }
}

/// Whether `ptr` lies in page-locked host memory known to the CUDA driver (allocated or
/// registered by pinstage, PyTorch, CuPy, JAX...). `false` without a driver.
pub fn is_pinned(ptr: *const u8) -> bool {
    let Ok(device) = Device::new(0) else {
        return false;
    };
    let Ok(_cur) = device.enter() else {
        return false;
    };
    driver::mem::is_pinned_host(ptr.cast())
}
