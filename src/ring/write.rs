//! Host-side writes into slot buffers: values, then padding, never reading the destination
//! (slot buffers are write-combined), and the store fence that drains write-combining buffers
//! before the copy engine may read.

/// The content of a slot buffer after a write.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) struct Layout {
    pub(crate) values_len: usize,
    total: usize,
    pad: [u8; 16],
    pad_len: usize,
}

impl Layout {
    pub(crate) fn new(values_len: usize, total: usize, pad: Option<&[u8]>) -> Self {
        let mut p = [0u8; 16];
        let pad_len = pad.map_or(0, |x| {
            p[..x.len()].copy_from_slice(x);
            x.len()
        });
        Self {
            values_len,
            total,
            pad: p,
            pad_len,
        }
    }

    pub(crate) fn same_padding(&self, other: &Layout) -> bool {
        self.pad_len > 0
            && self.total == other.total
            && self.pad == other.pad
            && self.pad_len == other.pad_len
    }
}

#[inline]
pub(crate) fn store_fence() {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: sfence has no preconditions on x86_64.
    unsafe {
        std::arch::x86_64::_mm_sfence()
    };
    #[cfg(not(target_arch = "x86_64"))]
    std::sync::atomic::fence(std::sync::atomic::Ordering::SeqCst);
}

/// Writes `values` then the `pad` element repeated up to `total` bytes at `dst`, never reading
/// `dst` (it may be write-combined).
///
/// # Safety
/// 1. `dst` is valid for writes of `total` bytes, and `values.len() <= total`.
/// 2. `pad` is `Some` when `values.len() < total`; `total - values.len()` is a multiple of its
///    length, which divides 512.
/// 3. Without `may_overlap`, `values` does not overlap `dst..dst+total`.
#[inline]
pub(crate) unsafe fn write_padded(
    dst: *mut u8,
    values: &[u8],
    pad: Option<&[u8]>,
    total: usize,
    may_overlap: bool,
) {
    // SAFETY: contract 1 and 3 (memmove when overlap is possible).
    unsafe {
        if may_overlap {
            std::ptr::copy(values.as_ptr(), dst, values.len());
        } else {
            std::ptr::copy_nonoverlapping(values.as_ptr(), dst, values.len());
        }
    }
    let rest = total - values.len();
    if rest == 0 {
        return;
    }
    let Some(p) = pad else { return };
    let mut chunk = [0u8; 512];
    for (i, b) in chunk.iter_mut().enumerate() {
        *b = p[i % p.len()];
    }
    // SAFETY: contract 1: we write exactly `rest` bytes after the values.
    unsafe {
        let mut out = dst.add(values.len());
        let mut left = rest;
        while left >= chunk.len() {
            std::ptr::copy_nonoverlapping(chunk.as_ptr(), out, chunk.len());
            out = out.add(chunk.len());
            left -= chunk.len();
        }
        std::ptr::copy_nonoverlapping(chunk.as_ptr(), out, left);
    }
}

/// From this many bytes on, a slot write is split over the rayon pool: one core cannot write
/// write-combined memory as fast as the copy engine reads it, several can (benches/RESULTS.md).
pub const PARALLEL_WRITE_MIN: usize = 1 << 20;

/// [`write_padded`] (no overlap) by several threads, in pieces of 256 KiB.
///
/// # Safety
/// As [`write_padded`] with `may_overlap = false`.
pub(crate) unsafe fn write_padded_parallel(
    dst: *mut u8,
    values: &[u8],
    pad: Option<&[u8]>,
    total: usize,
) {
    use rayon::prelude::*;
    // A multiple of 512, so every pad piece starts on an element boundary.
    const PIECE: usize = 256 << 10;
    // SAFETY: contract 1: `dst` is valid for writes of `total` bytes and nothing else uses them;
    // the slice is only written, never read (the memory may be write-combined).
    let out = unsafe { std::slice::from_raw_parts_mut(dst, total) };
    let (head, tail) = out.split_at_mut(values.len());
    head.par_chunks_mut(PIECE)
        .zip(values.par_chunks(PIECE))
        .for_each(|(d, s)| d.copy_from_slice(s));
    if let Some(p) = pad
        && !tail.is_empty()
    {
        tail.par_chunks_mut(PIECE).for_each(|d| {
            // SAFETY: `d` is ours, `d.len()` bytes, a whole number of pad elements (contract 2:
            // the pad length divides 512, so it divides PIECE and the whole tail).
            unsafe { write_padded(d.as_mut_ptr(), &[], Some(p), d.len(), false) }
        });
    }
}
