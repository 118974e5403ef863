//! One slot of the pinned stager: its buffer, how values and padding are written into it, and
//! the one copy issued from it (the ring's [`SlotIo`]).

use crate::cuda::{Current, StreamHandle};
use crate::driver;
use crate::error::Result;
use crate::host::{PinnedBuffer, PinnedFlags};
use crate::ring::slots::{Counter, SlotIo, SlotRing};
use crate::ring::write::{
    Layout, PARALLEL_WRITE_MIN, store_fence, write_padded, write_padded_parallel,
};

/// The stager's counters a slot's growth adds to.
#[derive(Clone, Copy)]
pub(super) struct Grew<'a> {
    pub(super) growths: &'a Counter,
    pub(super) pinned_bytes: &'a Counter,
}

pub(super) struct SlotBuf {
    /// The slot's bytes: its slice of the stager's arena, or `grown` once it outgrew that.
    ptr: *mut u8,
    cap: usize,
    /// The slot's own buffer after a copy exceeded its arena slice.
    grown: Option<PinnedBuffer>,
    /// What the buffer holds after its last write, so the next write can skip padding that is
    /// already there.
    layout: Option<Layout>,
    /// Buffers outgrown by `grown`. They are freed with the stager, not at growth time:
    /// `cuMemFreeHost` may synchronize the whole device, which would stall a live graph.
    retired: Vec<PinnedBuffer>,
}

impl SlotBuf {
    /// A slot of `cap` bytes at `ptr` (its slice of the stager's arena).
    pub(super) fn new(ptr: *mut u8, cap: usize) -> Self {
        Self {
            ptr,
            cap,
            grown: None,
            layout: None,
            retired: Vec::new(),
        }
    }

    /// A slot without memory (no driver: host destinations never use the slots).
    pub(super) fn empty() -> Self {
        Self {
            ptr: std::ptr::null_mut(),
            cap: 0,
            grown: None,
            layout: None,
            retired: Vec::new(),
        }
    }

    /// Writes values and padding into the slot's buffer (growing it first if needed); returns
    /// where the copy reads from.
    #[inline]
    pub(super) fn fill(
        &mut self,
        cur: &Current<'_>,
        job: &Job<'_>,
        grew: Grew<'_>,
    ) -> Result<*const u8> {
        if self.cap < job.total {
            self.grow(cur, job.total, grew)?;
        }
        // Padding already in the buffer from the last write (same pad, same total) need not be
        // written again: only [values.len(), old values_len) is.
        let new_layout = Layout::new(job.values.len(), job.total, job.pad);
        let fresh_pad_end = match (self.layout.as_ref(), job.pad) {
            (Some(old), Some(_)) if old.same_padding(&new_layout) => {
                old.values_len.max(job.values.len())
            }
            _ => job.total,
        };
        // SAFETY: `self.ptr` is valid for `self.cap >= total` bytes (arena slice or own buffer) and
        // owned by this slot; `values` is the caller's memory, not ours.
        unsafe {
            if fresh_pad_end >= PARALLEL_WRITE_MIN {
                write_padded_parallel(self.ptr, job.values, job.pad, fresh_pad_end);
            } else {
                write_padded(self.ptr, job.values, job.pad, fresh_pad_end, false);
            }
        }
        self.layout = Some(new_layout);
        Ok(self.ptr)
    }

    /// Gives a slot its own, larger buffer.
    #[cold]
    fn grow(&mut self, cur: &Current<'_>, total: usize, grew: Grew<'_>) -> Result<()> {
        let cap = total.max(self.cap.saturating_mul(2));
        let mut new = PinnedBuffer::new(cur.device(), cap, PinnedFlags::WRITE_COMBINED)?;
        self.ptr = new.as_mut_ptr();
        self.cap = cap;
        if let Some(old) = self.grown.replace(new) {
            self.retired.push(old);
        }
        self.layout = None;
        grew.pinned_bytes.add(cap as u64);
        grew.growths.add(1);
        Ok(())
    }
}

// SAFETY: a slot's buffer pointer leads into the stager's own pinned memory, touched only by the
// slot's owner in the ring protocol (see `SlotRing`); the rest is owned and may move between
// threads.
unsafe impl Send for SlotBuf {}

/// What one copy does with its claimed slot: write the values and padding, copy them.
pub(super) struct CopyIo<'s, 'c, 'd, 'j> {
    pub(super) core: &'s SlotRing<SlotBuf>,
    pub(super) grew: Grew<'s>,
    pub(super) cur: &'c Current<'d>,
    pub(super) job: &'j Job<'j>,
    /// Where the copy reads from, once `fill` wrote the slot.
    pub(super) src: *const u8,
}

impl SlotIo for CopyIo<'_, '_, '_, '_> {
    #[inline]
    fn fill(&mut self, slot: usize) -> Result<()> {
        // SAFETY: we own the slot (state WRITING) and its last copy completed (`drive`), so
        // nobody else reads or writes the buffer until we release it.
        let b = unsafe { &mut *self.core.data(slot) };
        self.src = b.fill(self.cur, self.job, self.grew)?;
        // The buffer is write-combined: drain the CPU's write-combining buffers before the copy
        // engine may read it.
        store_fence();
        Ok(())
    }

    #[inline]
    fn send(&mut self, _slot: usize) -> Result<()> {
        let (job, src) = (self.job, self.src);
        let stream = job.stream;
        // SAFETY: `src` holds `total` bytes and stays untouched until the event recorded next
        // completed (ring protocol); `dst` is device memory of this device of at least `total`
        // bytes (the view's contract, size and device checked); the stream is a special handle,
        // ours, or vouched for by its maker; the context is current (`cur`).
        #[cfg(not(pinstage_seeded_bug = "skip_copy"))]
        let sent = unsafe {
            match row_shape(job.total).filter(|_| job.dst % ROW_DST_ALIGN == 0) {
                Some((width, height)) => driver::mem::memcpy_2d_htod_async(
                    job.dst,
                    src.cast(),
                    width,
                    height,
                    stream.raw(),
                ),
                None => {
                    driver::mem::memcpy_htod_async(job.dst, src.cast(), job.total, stream.raw())
                }
            }
        };
        // The seeded-bug harness's "the stager skips the copy" (`skip_copy` in scripts/seeded.tsv): the
        // slot is written and its event recorded, but nothing reaches the device.
        #[cfg(pinstage_seeded_bug = "skip_copy")]
        let sent: std::result::Result<(), crate::cuda::DriverError> = {
            let _ = (src, stream);
            Ok(())
        };
        Ok(sent?)
    }
}

/// Destinations whose address is a multiple of this take the 2-D path ([`row_shape`]).
pub(crate) const ROW_DST_ALIGN: u64 = 256;

/// Copies from 2 KiB up to 32 KiB go as one 2-D copy of packed 1 KiB rows (or 512- or 256-byte
/// rows when the size is not a multiple of 1 KiB): `Some((row bytes, rows))`. The driver stages a
/// small `cuMemcpyHtoDAsync` through its own command buffer, copying the bytes on the host; a 2-D
/// copy of several rows is handed to the copy engine as is (benches/RESULTS.md has the costs).
/// Either way it is ONE copy of the same contiguous bytes. Only for destinations aligned to
/// 256 bytes.
pub fn row_shape(total: usize) -> Option<(usize, usize)> {
    if !(2048..=32768).contains(&total) {
        return None;
    }
    [1024usize, 512, 256]
        .into_iter()
        .find(|w| total % w == 0)
        .map(|w| (w, total / w))
}

/// One device copy: destination address, values, pad, bytes in all, stream.
pub(super) struct Job<'a> {
    pub(super) dst: u64,
    pub(super) values: &'a [u8],
    pub(super) pad: Option<&'a [u8]>,
    pub(super) total: usize,
    pub(super) stream: StreamHandle<'a>,
}
