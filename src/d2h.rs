//! Device-to-host copies at PCIe line rate.
//!
//! Into pinned memory: one `cuMemcpyDtoHAsync` and a wait on a recycled event. Into pageable
//! memory: a ring of pinned bounce buffers, the copy engine filling one while the CPU drains
//! another, which beats the driver's own pageable path.

use parking_lot::Mutex;

use crate::device::{Device, PooledEvent, StreamHandle};
use crate::dlpack::{DeviceView, MemoryKind};
use crate::driver;
use crate::error::{Error, Result};
use crate::pinned::{PinnedBuffer, PinnedFlags};

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

/// Bytes per bounce chunk.
pub const BOUNCE_CHUNK: usize = 8 << 20;
/// Bounce buffers in flight.
pub const BOUNCE_DEPTH: usize = 3;

/// Per-device cache of bounce buffers, so pageable copies do not pay `cuMemHostAlloc`.
static BOUNCE: Mutex<Vec<(i32, PinnedBuffer)>> = Mutex::new(Vec::new());

fn check_src(device: &Device, src: &DeviceView, dst_len: usize) -> Result<()> {
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
pub fn copy_d2h(
    device: &Device,
    src: &DeviceView,
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
/// 1. Context current; `dst..dst+n` host memory untouched until `ev` completed; `src` valid
///    device memory of `n` bytes.
unsafe fn issue_d2h(
    ev: &PooledEvent,
    src: u64,
    dst: *mut u8,
    n: usize,
    stream: StreamHandle,
) -> Result<()> {
    // SAFETY: caller's contract.
    unsafe { driver::memcpy_dtoh_async(dst.cast(), src, n, stream.raw()) }?;
    if let Err(e) = ev.record_entered(stream) {
        // The copy cannot be tracked: wait for the stream so `dst` is free when we return.
        // SAFETY: the caller's stream, context current.
        let _ = unsafe { driver::stream_synchronize(stream.raw()) };
        return Err(e);
    }
    Ok(())
}

fn bounce(device: &Device, src: u64, dst: &mut [u8], stream: StreamHandle) -> Result<()> {
    let mut bufs: Vec<PinnedBuffer> = {
        let mut cache = BOUNCE.lock();
        let mut mine = Vec::with_capacity(BOUNCE_DEPTH);
        let mut i = 0;
        while i < cache.len() && mine.len() < BOUNCE_DEPTH {
            if cache[i].0 == device.ordinal() {
                mine.push(cache.swap_remove(i).1);
            } else {
                i += 1;
            }
        }
        mine
    };
    while bufs.len() < BOUNCE_DEPTH {
        bufs.push(PinnedBuffer::new(
            device,
            BOUNCE_CHUNK,
            PinnedFlags::PORTABLE,
        )?);
    }
    let events = (0..BOUNCE_DEPTH)
        .map(|_| device.pooled_event())
        .collect::<Result<Vec<_>>>()?;
    let chunks: Vec<(usize, usize)> = (0..dst.len())
        .step_by(BOUNCE_CHUNK)
        .map(|off| (off, BOUNCE_CHUNK.min(dst.len() - off)))
        .collect();
    // Chunk i goes through bounce buffer i % BOUNCE_DEPTH. Chunk i + BOUNCE_DEPTH is issued as
    // soon as chunk i was drained, so the copy engine fills buffers while the CPU drains others.
    let issue = |i: usize, bufs: &mut [PinnedBuffer]| -> Result<()> {
        let (off, len) = chunks[i];
        let k = i % BOUNCE_DEPTH;
        // SAFETY: buffer k is idle (never used, or chunk i - BOUNCE_DEPTH was drained after its
        // event completed); src + off..+len lies within the source.
        unsafe {
            issue_d2h(
                &events[k],
                src + off as u64,
                bufs[k].as_mut_ptr(),
                len,
                stream,
            )
        }
    };
    let mut result = (0..chunks.len().min(BOUNCE_DEPTH)).try_for_each(|i| issue(i, &mut bufs));
    for (i, &(off, len)) in chunks.iter().enumerate() {
        if result.is_err() {
            break;
        }
        let k = i % BOUNCE_DEPTH;
        result = events[k].synchronize().and_then(|()| {
            parallel_copy(&mut dst[off..off + len], &bufs[k].as_slice()[..len]);
            match i + BOUNCE_DEPTH {
                next if next < chunks.len() => issue(next, &mut bufs),
                _ => Ok(()),
            }
        });
    }
    // Whatever happened, no copy may still write a buffer that goes back to the cache.
    for ev in &events {
        let _ = ev.synchronize();
    }
    BOUNCE
        .lock()
        .extend(bufs.into_iter().map(|b| (device.ordinal(), b)));
    result
}

/// Copies `src` into `dst` with several threads: one core cannot keep up with the copy engine
/// (about 55 GB/s on PCIe Gen5), several can.
fn parallel_copy(dst: &mut [u8], src: &[u8]) {
    use rayon::prelude::*;
    const PIECE: usize = 512 << 10;
    if dst.len() <= PIECE {
        dst.copy_from_slice(src);
        return;
    }
    dst.par_chunks_mut(PIECE)
        .zip(src.par_chunks(PIECE))
        .for_each(|(d, s)| d.copy_from_slice(s));
}

/// Frees the cached bounce buffers.
pub fn release_bounce_buffers() {
    BOUNCE.lock().clear();
}

/// Host memory a [`PendingCopy`] writes into and hands back when done.
///
/// # Safety
/// Implementors return the same stable region from every call to `region`: its address must not
/// change while the value is alive (it may be moved, the bytes may not).
pub unsafe trait HostRegion: Send {
    /// Start and length of the writable region.
    fn region(&mut self) -> (*mut u8, usize);
}

// SAFETY: the heap block of a PinnedBuffer does not move with the value.
unsafe impl HostRegion for PinnedBuffer {
    fn region(&mut self) -> (*mut u8, usize) {
        (self.as_mut_ptr(), self.len())
    }
}

// SAFETY: a Vec's heap block does not move with the value (we never push to it).
unsafe impl HostRegion for Vec<u8> {
    fn region(&mut self) -> (*mut u8, usize) {
        (self.as_mut_ptr(), self.len())
    }
}

/// An asynchronous D2H copy into an owned host region. The region is handed back by
/// [`PendingCopy::wait`]; dropping a pending copy waits for it first, so the region is never
/// freed while the copy writes it.
pub struct PendingCopy<B: HostRegion> {
    buf: Option<B>,
    event: Option<PooledEvent>,
}

impl<B: HostRegion> PendingCopy<B> {
    /// Whether the copy completed (errors count as done: `wait` reports them).
    pub fn is_done(&self) -> bool {
        self.event
            .as_ref()
            .is_none_or(|e| e.query().unwrap_or(true))
    }

    /// Waits for the copy and returns the region.
    pub fn wait(mut self) -> Result<B> {
        let r = match self.event.take() {
            Some(e) => e.synchronize(),
            None => Ok(()),
        };
        let buf = self.buf.take().expect("buffer present until wait");
        r.map(|()| buf)
    }
}

impl<B: HostRegion> Drop for PendingCopy<B> {
    fn drop(&mut self) {
        if let Some(e) = self.event.take() {
            let _ = e.synchronize();
        }
    }
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
    src: &DeviceView,
    dst_ptr: *mut u8,
    len: usize,
    stream: StreamHandle,
) -> Result<(D2HPath, Option<PooledEvent>)> {
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
    let _g = device.enter_for_copy(stream)?;
    if driver::is_pinned_host(dst_ptr.cast()) {
        let ev = device.pooled_event()?;
        // SAFETY: the destination is pinned and reserved for this copy until the event
        // completed (caller); src is device memory of this device of n bytes (view contract,
        // device checked).
        unsafe { issue_d2h(&ev, src.ptr(), dst_ptr, n, stream) }?;
        return Ok((D2HPath::Pinned, Some(ev)));
    }
    // SAFETY: caller's contract: `len >= n` writable bytes, exclusively ours until return.
    let dst = unsafe { std::slice::from_raw_parts_mut(dst_ptr, n) };
    bounce(device, src.ptr(), dst, stream)?;
    Ok((D2HPath::Bounced, None))
}

/// Starts copying `src` into `dst` and returns at once. A pinned `dst` gets a truly
/// asynchronous DMA; a pageable one is filled through the bounce ring before this returns
/// (still correct, not overlapped).
pub fn copy_d2h_async<B: HostRegion>(
    device: &Device,
    src: &DeviceView,
    mut dst: B,
    stream: StreamHandle,
) -> Result<PendingCopy<B>> {
    let (ptr, len) = dst.region();
    // SAFETY: the region is owned by `dst`, which the PendingCopy keeps (and waits for before
    // handing back or dropping); HostRegion guarantees the address is stable.
    let (_, event) = unsafe { start_d2h(device, src, ptr, len, stream) }?;
    Ok(PendingCopy {
        buf: Some(dst),
        event,
    })
}
