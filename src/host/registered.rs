//! Existing host memory page-locked in place (`cuMemHostRegister`): pinned without a copy, at
//! the exact size, for as long as a [`Registered`] lives.

use crate::cuda::Device;
use crate::driver;
use crate::error::{Error, Result, on_drop};

/// Page ranges (start, end) whose unregistration went to the reaper and has not run yet.
static UNREGISTERING: parking_lot::Mutex<Vec<(usize, usize)>> = parking_lot::Mutex::new(Vec::new());

/// The 4 KiB pages `ptr..ptr+len` touches.
fn pages(ptr: usize, len: usize) -> (usize, usize) {
    let end = ptr.saturating_add(len);
    (
        ptr & !4095,
        end.checked_next_multiple_of(4096).unwrap_or(end),
    )
}

/// Whether pages of `ptr..ptr+len` wait for their unregistration on the reaper.
fn unregistering(ptr: usize, len: usize) -> bool {
    let (a, b) = pages(ptr, len);
    UNREGISTERING.lock().iter().any(|&(c, d)| a < d && c < b)
}

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
        // A registration of these pages the reaper has yet to undo (a collected pin of the same
        // array): waited for.
        if unregistering(ptr as usize, len) {
            super::reaper::wait_for_frees_a_while();
        }
        if driver::mem::is_pinned_host(ptr.cast()) {
            return Err(Error::arg(
                "array",
                format!("memory at {ptr:p}"),
                "memory that is not page-locked already",
            ));
        }
        // Refused for memory while the reaper has frees pending: tried again after them.
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

    /// Unregisters on pinstage's reaper thread once the device's queued work is done (the caller
    /// never waits; `host::reaper`), then runs `then` there. Until then, [`Registered::new`] of
    /// any of these pages waits for it rather than refusing them as page-locked.
    #[cfg_attr(not(feature = "python"), allow(dead_code))] // Python's collected regions
    pub(crate) fn unregister_in_background(self, then: impl FnOnce() + Send + 'static) {
        let range = pages(self.ptr as usize, self.len);
        UNREGISTERING.lock().push(range);
        super::reaper::defer(move || {
            let device = self.device.clone();
            super::reaper::free_when_idle(&device, || drop(self));
            let mut u = UNREGISTERING.lock();
            if let Some(i) = u.iter().position(|&r| r == range) {
                u.swap_remove(i);
            }
            drop(u);
            then();
        });
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_range_waits_only_for_an_unregistration_sharing_a_page() {
        let base = 0x7000_0000_0000usize;
        let range = pages(base + 100, 8192); // pages base .. base + 12288
        assert_eq!(range, (base, base + 12288));
        UNREGISTERING.lock().push(range);
        assert!(unregistering(base, 1));
        assert!(unregistering(base + 12287, 1));
        assert!(unregistering(base - 10, 11));
        assert!(!unregistering(base + 12288, 4096));
        assert!(!unregistering(base - 4096, 4096));
        UNREGISTERING.lock().retain(|&r| r != range);
    }
}
