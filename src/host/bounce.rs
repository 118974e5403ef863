//! Pinned bounce slots shared by both directions' pageable paths (a per-device cache, so a
//! pageable copy does not pay `cuMemHostAlloc`), pinstage's copy workers, and the
//! multi-threaded host copy that drains D2H slots.

use parking_lot::Mutex;

use super::{PinnedBuffer, PinnedFlags};
use crate::cuda::{Current, Device, Event};
use crate::error::Result;

/// Bytes per D2H bounce chunk.
pub const BOUNCE_CHUNK: usize = 8 << 20;
/// D2H bounce chunks in flight.
pub const BOUNCE_DEPTH: usize = 3;

/// A pinned bounce buffer and the event recorded after the last copy that used it: nobody
/// touches the buffer before that event completed.
pub(crate) struct BounceSlot {
    pub(crate) buf: PinnedBuffer,
    pub(crate) busy: Event,
}

impl BounceSlot {
    fn len(&self) -> usize {
        self.buf.len()
    }
}

/// Cached slots: (device ordinal, slot). A slot's copy may still be in flight (its event says).
static CACHE: Mutex<Vec<(i32, BounceSlot)>> = Mutex::new(Vec::new());

/// `count` slots of `size` bytes for the current device, from the cache or new; owned by the
/// caller until [`give_back`]. Cached slots may still be busy: wait for `busy` before use.
pub(crate) fn take(cur: &Current<'_>, count: usize, size: usize) -> Result<Vec<BounceSlot>> {
    let device = cur.device();
    let mut slots: Vec<BounceSlot> = {
        let mut cache = CACHE.lock();
        let mut mine = Vec::with_capacity(count);
        let mut i = 0;
        while i < cache.len() && mine.len() < count {
            if cache[i].0 == device.ordinal() && cache[i].1.len() == size {
                mine.push(cache.swap_remove(i).1);
            } else {
                i += 1;
            }
        }
        mine
    };
    while slots.len() < count {
        let slot = PinnedBuffer::alloc(device, size, PinnedFlags::PORTABLE).and_then(|buf| {
            Ok(BounceSlot {
                buf,
                busy: Event::new_in(cur)?,
            })
        });
        match slot {
            Ok(s) => slots.push(s),
            Err(e) => {
                give_back(device, slots);
                return Err(e);
            }
        }
    }
    Ok(slots)
}

/// Bounce slots taken from the cache, given back when dropped (also by a panic unwinding their
/// user): each slot's event guards its copy in flight, and whoever takes a slot next waits for
/// it (a slot freed past the cache's size is freed only after its copy).
pub(crate) struct Lent<'d> {
    device: &'d Device,
    pub(crate) slots: Vec<BounceSlot>,
}

impl<'d> Lent<'d> {
    /// `count` slots of `size` bytes from the cache alone (no allocation, nothing waited for),
    /// or `None` (the cache keeps what it had) where it holds fewer.
    pub(crate) fn take_cached(cur: &Current<'d>, count: usize, size: usize) -> Option<Self> {
        let device = cur.device();
        let mut cache = CACHE.lock();
        let fits = |e: &(i32, BounceSlot)| e.0 == device.ordinal() && e.1.len() == size;
        if cache.iter().filter(|e| fits(e)).count() < count {
            return None;
        }
        let mut slots = Vec::with_capacity(count);
        let mut i = 0;
        while slots.len() < count {
            if fits(&cache[i]) {
                slots.push(cache.swap_remove(i).1);
            } else {
                i += 1;
            }
        }
        Some(Self { device, slots })
    }

    /// [`take`]s `count` slots of `size` bytes, lent until dropped.
    pub(crate) fn take(cur: &Current<'d>, count: usize, size: usize) -> Result<Self> {
        Ok(Self {
            device: cur.device(),
            slots: take(cur, count, size)?,
        })
    }
}

impl Drop for Lent<'_> {
    fn drop(&mut self) {
        give_back(self.device, std::mem::take(&mut self.slots));
    }
}

/// Slots the cache keeps per device (12 for one pageable H2D, 3 for a D2H, and room for a few
/// concurrent copies); more are freed as they come back.
const CACHE_PER_DEVICE: usize = 32;

/// Returns slots to the cache; their last copies may still be in flight (each slot's event).
/// Past [`CACHE_PER_DEVICE`] the extra slots are freed once their copies completed.
pub(crate) fn give_back(device: &Device, slots: Vec<BounceSlot>) {
    let extra: Vec<BounceSlot> = {
        let mut cache = CACHE.lock();
        let mut have = cache.iter().filter(|(o, _)| *o == device.ordinal()).count();
        let mut extra = Vec::new();
        for s in slots {
            if have < CACHE_PER_DEVICE {
                cache.push((device.ordinal(), s));
                have += 1;
            } else {
                extra.push(s);
            }
        }
        extra
    };
    free_after_copies(extra.into_iter());
}

/// Frees slots once their last copies completed, on the reaper thread (never under a copy: a
/// failed wait leaks the buffer and records the error).
fn free_after_copies(slots: impl Iterator<Item = BounceSlot>) {
    for slot in slots {
        super::reaper::free_after(vec![slot.busy], slot.buf);
    }
}

/// Frees the cached bounce slots once their last copies completed.
pub fn release_bounce_buffers() {
    let slots = std::mem::take(&mut *CACHE.lock());
    free_after_copies(slots.into_iter().map(|(_, s)| s));
}

/// Copies `src` into `dst` with several threads: one core cannot keep up with the copy engine
/// on a fast link, several can.
pub(crate) fn parallel_copy(dst: &mut [u8], src: &[u8]) {
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

/// Copies `n` bytes from `src` to `dst`; with `nt` (x86-64), by non-temporal stores, which
/// skip reading the destination's cache lines first and leave the caches to the source, then
/// a store fence so a DMA issued next reads every byte.
///
/// # Safety
/// 1. `src..src+n` readable, `dst..dst+n` writable, not overlapping; with `nt`, `dst` is
///    16-byte aligned.
pub(crate) unsafe fn fill(dst: *mut u8, src: *const u8, n: usize, nt: bool) {
    #[cfg(target_arch = "x86_64")]
    if nt {
        use std::arch::x86_64::{__m128i, _mm_loadu_si128, _mm_sfence, _mm_stream_si128};
        debug_assert_eq!(dst as usize % 16, 0);
        let mut i = 0;
        // SAFETY: the caller's ranges; every access lies below `n`; `dst + i` stays 16-byte
        // aligned (i is a multiple of 64); SSE2 is part of x86-64.
        unsafe {
            while i + 64 <= n {
                let s = src.add(i).cast::<__m128i>();
                let d = dst.add(i).cast::<__m128i>();
                let (a, b) = (_mm_loadu_si128(s), _mm_loadu_si128(s.add(1)));
                let (c, e) = (_mm_loadu_si128(s.add(2)), _mm_loadu_si128(s.add(3)));
                _mm_stream_si128(d, a);
                _mm_stream_si128(d.add(1), b);
                _mm_stream_si128(d.add(2), c);
                _mm_stream_si128(d.add(3), e);
                i += 64;
            }
            std::ptr::copy_nonoverlapping(src.add(i), dst.add(i), n - i);
            _mm_sfence();
        }
        return;
    }
    let _ = nt;
    // SAFETY: the caller's ranges.
    unsafe { std::ptr::copy_nonoverlapping(src, dst, n) };
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fill_copies_every_byte_both_ways() {
        let src: Vec<u8> = (0..5000u32).map(|i| (i * 7 + 3) as u8).collect();
        for nt in [false, true] {
            for n in [0, 1, 63, 64, 65, 4999, 5000] {
                let mut dst = vec![0xEEu8; 5008 + 16];
                let off = dst.as_ptr().align_offset(16);
                // SAFETY: both ranges hold n bytes; the destination is 16-byte aligned.
                unsafe { fill(dst.as_mut_ptr().add(off), src.as_ptr(), n, nt) };
                assert_eq!(&dst[off..off + n], &src[..n], "nt={nt} n={n}");
                assert!(dst[off + n..].iter().all(|&b| b == 0xEE), "nt={nt} n={n}");
            }
        }
    }
}
