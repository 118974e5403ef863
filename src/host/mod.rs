//! Host memory: page-locked blocks ([`PinnedBuffer`]) and a pool of them ([`PinnedPool`]).

pub(crate) mod bounce;
pub(crate) mod mapped;
pub(crate) mod numa;
mod pinned;
mod pool;
pub(crate) mod reaper;
mod region;
mod registered;
pub(crate) mod workers;

pub use bounce::{BOUNCE_CHUNK, BOUNCE_DEPTH, release_bounce_buffers};

#[cfg(all(feature = "lab", feature = "python"))]
pub(crate) use pinned::set_pin_by_register;
pub use pinned::{PinnedBuffer, PinnedFlags, is_pinned, live_pinned_bytes};
pub use pool::{DEFAULT_BUDGET, PinnedPool, PoolBlock, PoolStats, size_class};
pub use region::HostRegion;
pub use registered::Registered;

/// Waits until the pinned memory pinstage let go so far is back with the OS. Freeing page-locked
/// memory waits for all the work queued on its device, so pinstage frees it on a background
/// thread (a dropped buffer, stager or pool block never stalls the caller); this waits for that
/// thread, for tests and for callers that want the memory back now.
pub fn wait_for_frees() {
    reaper::flush();
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
