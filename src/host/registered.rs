//! Existing host memory page-locked in place (`cuMemHostRegister`): pinned without a copy, at
//! the exact size, for as long as a [`Registered`] lives.

use crate::cuda::Device;
use crate::driver;
use crate::error::{Error, Result, on_drop};

/// A range of host memory registered with the driver (page-locked, usable for DMA from every
/// context); unregistered when dropped.
pub struct Registered {
    ptr: *mut u8,
    len: usize,
    device: Device,
}

// SAFETY: a registration is a driver handle on memory the caller keeps valid (contract of
// `new`); the driver allows unregistering from any thread.
unsafe impl Send for Registered {}
// SAFETY: `&Registered` only reads the address and length.
unsafe impl Sync for Registered {}

impl std::fmt::Debug for Registered {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Registered")
            .field("ptr", &self.ptr)
            .field("len", &self.len)
            .finish()
    }
}

impl Registered {
    /// Page-locks `ptr..ptr+len` in place (`read_only`: the device only reads it).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for 0 bytes or memory that is page-locked already (pinned by
    /// pinstage, a framework, or an earlier registration overlapping it), [`Error::Driver`] when
    /// the driver refuses (memory it cannot lock).
    ///
    /// # Safety
    /// `ptr..ptr+len` is host memory that stays mapped until the value is dropped, and no copy
    /// uses it as pinned memory after that.
    pub unsafe fn new(device: &Device, ptr: *mut u8, len: usize, read_only: bool) -> Result<Self> {
        if len == 0 {
            return Err(Error::arg("nbytes", 0, "at least one byte to pin"));
        }
        let _cur = device.enter()?;
        // Pinned, unless by a registration the reaper has yet to undo (a collected pin of the
        // same pages): waited for once.
        let pinned = || driver::mem::is_pinned_host(ptr.cast());
        if pinned() && (!super::reaper::settle_pending_frees() || pinned()) {
            return Err(Error::arg(
                "array",
                format!("memory at {ptr:p}"),
                "memory that is not page-locked already",
            ));
        }
        // The same for pages sharing a page with such a registration, and for the pinned memory
        // the reaper has yet to free (`retry_after_frees`).
        let registered = super::reaper::retry_after_frees(|| {
            // SAFETY: the context is current; the caller keeps the memory mapped until drop.
            Ok(unsafe { driver::mem::mem_host_register(ptr.cast(), len, read_only, false) }?)
        });
        match registered {
            Ok(()) => {}
            Err(Error::Driver(e)) if e.is_already_registered() => {
                return Err(Error::arg(
                    "array",
                    format!("memory at {ptr:p}"),
                    "memory whose pages are not page-locked already (another registration \
                     shares a page with it)",
                ));
            }
            Err(e) => return Err(e),
        }
        super::pinned::count_pinned(len);
        Ok(Self {
            ptr,
            len,
            device: device.clone(),
        })
    }

    /// Start of the range.
    pub fn as_ptr(&self) -> *const u8 {
        self.ptr
    }

    /// The device whose context registered it.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// Bytes registered.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the range is empty (never: 0 bytes are refused).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

impl Drop for Registered {
    fn drop(&mut self) {
        super::pinned::uncount_pinned(self.len);
        match self.device.enter() {
            // SAFETY: registered in `new`; the owner's contract: no copy uses it any more.
            Ok(_cur) => on_drop(unsafe { driver::mem::mem_host_unregister(self.ptr.cast()) }),
            Err(Error::Driver(e)) => on_drop::<()>(Err(e)),
            Err(_) => {}
        }
    }
}
