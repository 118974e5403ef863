//! [`DeviceMem`]: a device allocation freed on pinstage's reaper once the device drained (the
//! step stager's arenas and fresh blocks, a block mover's staging).

use crate::cuda::{Current, Device};
use crate::driver::{self, CUdeviceptr};
use crate::error::{Error, Result};

/// A device allocation (`cuMemAlloc`), freed when dropped, on the reaper thread once the device
/// drained (`cuMemFree` waits for all the device's work and holds up other threads' calls).
pub(crate) struct DeviceMem {
    ptr: CUdeviceptr,
    device: Device,
}

impl DeviceMem {
    /// `len` bytes (at least one) of the current device's memory; `what` names the allocation
    /// in an out-of-memory error. Refused for memory while frees are pending, it waits for them
    /// and tries once more.
    pub(crate) fn new(cur: &Current<'_>, len: usize, what: &'static str) -> Result<Self> {
        let ptr = super::retry_after_frees(|| {
            // SAFETY: a context is current (`cur`).
            unsafe { driver::mem::mem_alloc(len.max(1)) }
                .map_err(|e| Error::allocation(e, what, len))
        })?;
        Ok(Self {
            ptr,
            device: cur.device().clone(),
        })
    }

    pub(crate) fn ptr(&self) -> u64 {
        self.ptr
    }
}

impl Drop for DeviceMem {
    fn drop(&mut self) {
        // SAFETY: allocated in `new` in the device's primary context, freed once. Its owners
        // drop it only once no copy of theirs uses it any more (the stager waits for its copies,
        // exports drop theirs when their consumer is done with the memory, the block pool drops
        // a block once its copy completed and nobody holds it, a mover's staging ring waits for
        // its copies), and `cuMemFree` waits for any work still queued.
        unsafe { super::reaper::free_device_memory(self.device.clone(), self.ptr) };
    }
}
