//! Host-to-device copies of whole arrays at line rate: a pinned source goes as one DMA; a
//! pageable one through the pinned bounce ring, several threads filling one buffer while the
//! copy engine drains another.

use crate::cuda::{Current, Device, Event, StreamHandle};
use crate::driver;
use crate::error::{Error, Result};
use crate::host::bounce::{self, BOUNCE_CHUNK, BOUNCE_DEPTH, parallel_copy};
use crate::view::{DeviceView, MemoryKind};

/// How a host-to-device copy was carried out.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum H2DPath {
    /// One DMA straight from pinned memory; the source may change only once it completed.
    Pinned,
    /// Through the pinned bounce ring; the source was read before the call returned.
    Bounced,
    /// The destination was host memory: a plain memcpy.
    Host,
    /// Nothing to copy.
    Empty,
}

/// Starts copying `src` into `dst` (all of it: the sizes must be equal). A pinned source gets
/// one truly asynchronous DMA and the event that says when the source may change; a pageable
/// one is copied through the bounce ring, read completely before this returns (`None`), as is a
/// host destination.
///
/// # Errors
/// [`Error::ReadOnly`], [`Error::DestinationTooSmall`] (sizes differ), [`Error::WrongDevice`],
/// [`Error::CudaUnavailable`], [`Error::StreamCapturing`], [`Error::Driver`].
///
/// # Safety
/// 1. `src..src+len` is readable host memory that nothing writes until the returned event
///    completed (or until return when `None`).
pub unsafe fn start_h2d(
    device: Option<&Device>,
    dst: &DeviceView<'_>,
    src: *const u8,
    len: usize,
    stream: StreamHandle,
) -> Result<(H2DPath, Option<Event>)> {
    let _range = crate::nvtx::NvtxRange::new(c"pinstage.copy_h2d");
    if dst.is_read_only() {
        return Err(Error::ReadOnly);
    }
    if dst.nbytes() != len {
        return Err(Error::DestinationTooSmall {
            needed: len,
            got: dst.nbytes(),
        });
    }
    let device = match dst.memory() {
        MemoryKind::Host => {
            if len > 0 {
                // SAFETY: the view's contract: `dst` is writable host memory of `len` bytes;
                // the caller's source holds `len` readable bytes (memmove tolerates overlap).
                unsafe { std::ptr::copy(src, dst.ptr() as *mut u8, len) };
            }
            return Ok((H2DPath::Host, None));
        }
        MemoryKind::Cuda(id) => {
            let device = device.ok_or_else(|| Error::unavailable("no device was given"))?;
            if id != device.ordinal() {
                return Err(Error::WrongDevice {
                    what: "copy",
                    expected: device.ordinal(),
                    got: id,
                });
            }
            device
        }
    };
    if len == 0 {
        return Ok((H2DPath::Empty, None));
    }
    let cur = device.enter_for_copy(stream)?;
    if driver::mem::is_pinned_host(src.cast()) {
        let ev = Event::new_in(&cur)?;
        // SAFETY: the source is pinned and unchanged until the event completed (caller); `dst`
        // is device memory of this device of `len` bytes (view contract, device checked).
        unsafe { issue(&cur, &ev, dst.ptr(), src, len, stream) }?;
        return Ok((H2DPath::Pinned, Some(ev)));
    }
    // SAFETY: caller's contract: `len` readable bytes, unchanged until we return.
    let src = unsafe { std::slice::from_raw_parts(src, len) };
    upload_bounced(&cur, src, dst.ptr(), stream)?;
    Ok((H2DPath::Bounced, None))
}

/// Issues one H2D copy and records `ev` after it.
///
/// # Safety
/// 1. `src..src+n` pinned host memory unchanged until `ev` completed; `dst` device memory of the
///    current device of `n` bytes.
unsafe fn issue(
    cur: &Current<'_>,
    ev: &Event,
    dst: u64,
    src: *const u8,
    n: usize,
    stream: StreamHandle,
) -> Result<()> {
    // SAFETY: caller's contract; context current (`cur`); the stream is a special handle, ours,
    // or vouched for by its maker.
    unsafe { driver::mem::memcpy_htod_async(dst, src.cast(), n, stream.raw()) }?;
    if let Err(e) = ev.record_in(cur, stream) {
        // The copy cannot be tracked: wait for the stream so the source is free when we return.
        let _ = stream.synchronize(cur);
        return Err(e);
    }
    Ok(())
}

/// Chunk `i` goes through bounce buffer `i % BOUNCE_DEPTH`: the CPU fills it (several threads)
/// once that buffer's previous copy completed, then issues its copy, so the copy engine drains
/// one buffer while the CPU fills the next. Returns once every copy completed (the buffers go
/// back to the cache).
fn upload_bounced(cur: &Current<'_>, src: &[u8], dst: u64, stream: StreamHandle) -> Result<()> {
    let device = cur.device();
    let mut bufs = bounce::take(device)?;
    let events = (0..BOUNCE_DEPTH)
        .map(|_| Event::new_in(cur))
        .collect::<Result<Vec<_>>>();
    let events = match events {
        Ok(e) => e,
        Err(e) => {
            bounce::give_back(device, bufs);
            return Err(e);
        }
    };
    let mut result = Ok(());
    for (i, (piece, off)) in src
        .chunks(BOUNCE_CHUNK)
        .zip((0..src.len()).step_by(BOUNCE_CHUNK))
        .enumerate()
    {
        let k = i % BOUNCE_DEPTH;
        result = (if i >= BOUNCE_DEPTH {
            events[k].synchronize()
        } else {
            Ok(())
        })
        .and_then(|()| {
            parallel_copy(&mut bufs[k].as_mut_slice()[..piece.len()], piece);
            // SAFETY: buffer k holds `piece` and is not touched again until its event
            // completed; dst + off..+len lies within the destination (sizes checked).
            unsafe {
                issue(
                    cur,
                    &events[k],
                    dst + off as u64,
                    bufs[k].as_ptr(),
                    piece.len(),
                    stream,
                )
            }
        });
        if result.is_err() {
            break;
        }
    }
    // Whatever happened, no copy may still read a buffer that goes back to the cache.
    for ev in &events {
        if let Err(Error::Driver(e)) = ev.synchronize() {
            crate::error::record_drop_error(e);
        }
    }
    bounce::give_back(device, bufs);
    result
}

/// Copies `src` into `dst` (equal sizes) and waits until the source may change: a pinned source
/// as one DMA (waited for), a pageable one through the bounce ring, a host destination by memcpy.
///
/// # Errors
/// As [`start_h2d`].
pub fn copy_h2d(
    device: Option<&Device>,
    dst: &DeviceView<'_>,
    src: &[u8],
    stream: StreamHandle,
) -> Result<H2DPath> {
    // SAFETY: `src` is borrowed until we return, and we wait for the copy first.
    let (path, event) = unsafe { start_h2d(device, dst, src.as_ptr(), src.len(), stream) }?;
    if let Some(ev) = event {
        ev.synchronize()?;
    }
    Ok(path)
}
