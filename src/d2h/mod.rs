//! Device-to-host copies at PCIe line rate.
//!
//! Into pinned memory: one `cuMemcpyDtoHAsync` and a wait on a recycled event. Into pageable
//! memory: a ring of pinned bounce buffers, the copy engine filling one while the CPU drains
//! another, which beats the driver's own pageable path.

mod bounce;
mod pending;

pub use pending::{HostRegion, PendingCopy, copy_d2h_async};

use crate::cuda::{Current, Device, Event, StreamHandle};
use crate::driver;
use crate::error::{Error, Result};
use crate::view::{DeviceView, MemoryKind};

/// How a D2H copy was carried out.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum D2HPath {
    /// One DMA straight into pinned memory.
    Pinned,
    /// Through the pinned bounce ring into pageable memory.
    Bounced,
    /// The source was host memory: a plain memcpy.
    Host,
    /// Nothing to copy.
    Empty,
}

fn check_src(device: &Device, src: &DeviceView<'_>, dst_len: usize) -> Result<()> {
    if let MemoryKind::Cuda(id) = src.memory()
        && id != device.ordinal()
    {
        return Err(Error::WrongDevice {
            what: "copy",
            expected: device.ordinal(),
            got: id,
        });
    }
    if dst_len < src.nbytes() {
        return Err(Error::DestinationTooSmall {
            needed: src.nbytes(),
            got: dst_len,
        });
    }
    Ok(())
}

/// Copies `src` into `dst[..src.nbytes()]` and waits. `dst` may be pinned (one DMA) or pageable
/// (bounce ring); a host `src` is a plain memcpy. `stream` orders the copy after the producer's
/// work.
///
/// # Errors
/// [`Error::WrongDevice`] (src on another device than `device`), [`Error::DestinationTooSmall`],
/// [`Error::StreamCapturing`], [`Error::Driver`].
pub fn copy_d2h(
    device: &Device,
    src: &DeviceView<'_>,
    dst: &mut [u8],
    stream: StreamHandle,
) -> Result<D2HPath> {
    // SAFETY: `dst` is exclusively borrowed until we return, and we wait for the copy first.
    let (path, event) = unsafe { start_d2h(device, src, dst.as_mut_ptr(), dst.len(), stream) }?;
    if let Some(ev) = event {
        ev.synchronize()?;
    }
    Ok(path)
}

/// Issues one D2H copy and records `ev` after it.
///
/// # Safety
/// 1. `dst..dst+n` host memory untouched until `ev` completed; `src` valid device memory of the
///    current device of `n` bytes.
unsafe fn issue_d2h(
    cur: &Current<'_>,
    ev: &Event,
    src: u64,
    dst: *mut u8,
    n: usize,
    stream: StreamHandle,
) -> Result<()> {
    // SAFETY: caller's contract; context current (`cur`); the stream is a special handle, ours,
    // or vouched for by its maker.
    unsafe { driver::mem::memcpy_dtoh_async(dst.cast(), src, n, stream.raw()) }?;
    if let Err(e) = ev.record_in(cur, stream) {
        // The copy cannot be tracked: wait for the stream so `dst` is free when we return. Its
        // own error, if any, is the same failing context: `e` says it.
        let _ = stream.synchronize(cur);
        return Err(e);
    }
    Ok(())
}

/// Starts copying `src` into `dst_ptr..dst_ptr+len`. A pinned destination gets one truly
/// asynchronous DMA and the event to wait on; a pageable one is filled through the bounce ring
/// before this returns (`None`: already done), as is a host source.
///
/// # Safety
/// 1. `dst_ptr..dst_ptr+len` is writable host memory that nothing else touches, and that stays
///    valid, until the returned event completed (or until return when `None`).
pub(crate) unsafe fn start_d2h(
    device: &Device,
    src: &DeviceView<'_>,
    dst_ptr: *mut u8,
    len: usize,
    stream: StreamHandle,
) -> Result<(D2HPath, Option<Event>)> {
    let _range = crate::nvtx::NvtxRange::new(c"pinstage.copy_d2h");
    check_src(device, src, len)?;
    let n = src.nbytes();
    if n == 0 {
        return Ok((D2HPath::Empty, None));
    }
    if src.memory() == MemoryKind::Host {
        // SAFETY: the view's contract: `src` is readable host memory of n bytes; the caller's
        // destination holds `len >= n` bytes (memmove tolerates overlap).
        unsafe { std::ptr::copy(src.ptr() as *const u8, dst_ptr, n) };
        return Ok((D2HPath::Host, None));
    }
    let cur = device.enter_for_copy(stream)?;
    if driver::mem::is_pinned_host(dst_ptr.cast()) {
        let ev = Event::new_in(&cur)?;
        // SAFETY: the destination is pinned and reserved for this copy until the event
        // completed (caller); src is device memory of this device of n bytes (view contract,
        // device checked).
        unsafe { issue_d2h(&cur, &ev, src.ptr(), dst_ptr, n, stream) }?;
        return Ok((D2HPath::Pinned, Some(ev)));
    }
    // SAFETY: caller's contract: `len >= n` writable bytes, exclusively ours until return.
    let dst = unsafe { std::slice::from_raw_parts_mut(dst_ptr, n) };
    bounce::bounce(&cur, src.ptr(), dst, stream)?;
    Ok((D2HPath::Bounced, None))
}
