//! The memory of step staging: host bytes for slots (pinned, or plain without a driver), the
//! device arena, and the pool of fresh device blocks.

use std::ptr::NonNull;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use crate::cuda::{Current, Device, Event, StreamHandle};
use crate::driver;
use crate::error::{Error, Result};
use crate::host::{DeviceMem, PinnedBuffer, PinnedFlags};

use super::layout::FIELD_ALIGN;

/// Zeroed host bytes aligned to [`FIELD_ALIGN`], from the global allocator (slots and arenas
/// without a driver, blocks of the host fallback).
pub(crate) struct AlignedBytes {
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: uniquely owned plain memory.
unsafe impl Send for AlignedBytes {}
// SAFETY: `&AlignedBytes` hands out only the address; writers own the slot protocol.
unsafe impl Sync for AlignedBytes {}

impl AlignedBytes {
    pub(crate) fn new(len: usize, what: &'static str) -> Result<Self> {
        if len == 0 {
            return Ok(Self {
                ptr: NonNull::dangling(),
                len,
            });
        }
        let layout = std::alloc::Layout::from_size_align(len, FIELD_ALIGN)
            .map_err(|_| Error::OutOfMemory { what, bytes: len })?;
        // SAFETY: a non-zero size.
        let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
        NonNull::new(ptr)
            .map(|ptr| Self { ptr, len })
            .ok_or(Error::OutOfMemory { what, bytes: len })
    }

    pub(crate) fn ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }
}

impl Drop for AlignedBytes {
    fn drop(&mut self) {
        if self.len > 0 {
            // SAFETY: allocated in `new` with this layout.
            unsafe {
                std::alloc::dealloc(
                    self.ptr.as_ptr(),
                    std::alloc::Layout::from_size_align_unchecked(self.len, FIELD_ALIGN),
                )
            }
        }
    }
}

/// Host memory holding every slot: pinned (and mapped, for zero-copy) with a driver, plain
/// without one.
pub(crate) enum HostMem {
    Pinned(PinnedBuffer),
    Plain(AlignedBytes),
}

impl HostMem {
    pub(crate) fn ptr(&self) -> *mut u8 {
        match self {
            // The pinned buffer's bytes are only written by the slot's owner (ring protocol).
            HostMem::Pinned(b) => b.as_ptr() as *mut u8,
            HostMem::Plain(b) => b.ptr(),
        }
    }
}

/// One fresh block: device memory (or host bytes without a driver), which it owns, and the
/// event recorded after the copy that last filled it.
pub(crate) struct BlockMem {
    ptr: u64,
    _device: Option<DeviceMem>,
    _host: Option<AlignedBytes>,
    pub(crate) event: Option<Event>,
}

/// Fresh blocks: handed out one per committed step, back in the pool when the last owner of the
/// [`StepBlock`] (a consumer's DLPack deleter) drops it, reused once its copy completed.
pub(crate) struct BlockPool {
    free: parking_lot::Mutex<Vec<BlockMem>>,
    device: Option<Device>,
    bytes: usize,
    pub(crate) allocated: AtomicU64,
}

impl BlockPool {
    pub(crate) fn new(device: Option<Device>, bytes: usize) -> Self {
        Self {
            free: parking_lot::Mutex::new(Vec::new()),
            device,
            bytes,
            allocated: AtomicU64::new(0),
        }
    }

    /// A block whose last copy completed: a free one, else a new allocation.
    pub(crate) fn take(self: &Arc<Self>, cur: Option<&Current<'_>>) -> Result<StepBlock> {
        {
            let mut free = self.free.lock();
            for i in 0..free.len() {
                let ready = match &free[i].event {
                    Some(e) => e.query()?,
                    None => true,
                };
                if ready {
                    let mem = free.swap_remove(i);
                    return Ok(self.wrap(mem));
                }
            }
        }
        self.grow(cur)
    }

    #[cold]
    fn grow(self: &Arc<Self>, cur: Option<&Current<'_>>) -> Result<StepBlock> {
        let mem = match cur {
            Some(cur) => {
                let d = DeviceMem::new(cur, self.bytes, "device arena")?;
                BlockMem {
                    ptr: d.ptr(),
                    _device: Some(d),
                    _host: None,
                    event: Some(Event::new_in(cur)?),
                }
            }
            None => {
                let host = AlignedBytes::new(self.bytes, "step block")?;
                BlockMem {
                    ptr: host.ptr() as u64,
                    _device: None,
                    _host: Some(host),
                    event: None,
                }
            }
        };
        // Relaxed: a statistic.
        self.allocated.fetch_add(1, Ordering::Relaxed);
        Ok(self.wrap(mem))
    }

    fn wrap(self: &Arc<Self>, mem: BlockMem) -> StepBlock {
        StepBlock {
            mem: Some(mem),
            pool: Arc::clone(self),
        }
    }
}

impl Drop for BlockPool {
    /// Free blocks whose last copy may still write them are freed by the reaper thread once it
    /// completed (a failed wait leaks them).
    fn drop(&mut self) {
        for mut b in std::mem::take(self.free.get_mut()) {
            match b.event.take() {
                Some(e) => crate::host::reaper::free_after(vec![e], b),
                // Its copy completed, nobody holds it: freed as it drops.
                None => drop(b),
            }
        }
    }
}

/// A fresh block holding one committed step (fresh-block mode): its bytes are the layout's
/// arena, never rewritten while this value (or a clone of the `Arc` a DLPack export holds)
/// lives. Consumers must order their reads after [`StepBlock::wait_on`] (the Python export
/// does it for the consumer's stream).
pub struct StepBlock {
    mem: Option<BlockMem>,
    pool: Arc<BlockPool>,
}

impl std::fmt::Debug for StepBlock {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StepBlock")
            .field("ptr", &format_args!("{:#x}", self.ptr()))
            .field("len", &self.len())
            .finish()
    }
}

impl StepBlock {
    fn mem(&self) -> &BlockMem {
        self.mem.as_ref().expect("present until drop")
    }

    /// Address of the block: a device address, or a host address without a driver.
    pub fn ptr(&self) -> u64 {
        self.mem().ptr
    }

    /// Bytes: the layout's arena size.
    pub fn len(&self) -> usize {
        self.pool.bytes
    }

    /// Whether the block has no bytes (never: layouts hold at least one field).
    pub fn is_empty(&self) -> bool {
        self.pool.bytes == 0
    }

    /// The device the block lives on (`None`: host memory, no driver).
    pub fn device(&self) -> Option<&Device> {
        self.pool.device.as_ref()
    }

    /// Makes `stream` wait (on the device, the host does not block) for the copy that filled
    /// the block.
    ///
    /// # Errors
    /// [`Error::Driver`] when the driver refuses.
    pub fn wait_on(&self, stream: StreamHandle<'_>) -> Result<()> {
        match &self.mem().event {
            Some(e) => e.wait_on(stream),
            None => Ok(()),
        }
    }

    /// Whether the copy that filled the block completed (never blocks).
    ///
    /// # Errors
    /// [`Error::Driver`] when the driver reports a failure.
    pub fn is_ready(&self) -> Result<bool> {
        match &self.mem().event {
            Some(e) => e.query(),
            None => Ok(true),
        }
    }

    /// Blocks until the copy that filled the block completed.
    ///
    /// # Errors
    /// [`Error::Driver`] when the driver reports a failure.
    pub fn synchronize(&self) -> Result<()> {
        match &self.mem().event {
            Some(e) => e.synchronize(),
            None => Ok(()),
        }
    }

    pub(crate) fn event(&self) -> Option<&Event> {
        self.mem().event.as_ref()
    }
}

impl Drop for StepBlock {
    fn drop(&mut self) {
        if let Some(mem) = self.mem.take() {
            self.pool.free.lock().push(mem);
        }
    }
}

/// Pinned, mapped slot memory (`depth * bytes`), and its device address for zero-copy reads.
pub(crate) fn pinned_slots(device: &Device, len: usize) -> Result<(HostMem, u64)> {
    let buf = PinnedBuffer::new(device, len, PinnedFlags::MAPPED)?;
    let dev = if len == 0 {
        0
    } else {
        let _cur = device.enter()?;
        // SAFETY: the context is current; the buffer is mapped pinned memory.
        unsafe { driver::mem::mem_host_get_device_pointer(buf.as_ptr() as *mut _) }?
    };
    Ok((HostMem::Pinned(buf), dev))
}
