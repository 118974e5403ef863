//! Pinned bounce slots shared by both directions' pageable paths (a per-device cache, so a
//! pageable copy does not pay `cuMemHostAlloc`), pinstage's copy workers, and the
//! multi-threaded host copy that drains D2H slots.

use std::sync::OnceLock;

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

/// Most threads pinstage's copy workers run on, per device.
const MAX_WORKER_THREADS: usize = 12;

/// pinstage's own copy threads (not the global rayon pool, which the caller's code may keep
/// busy). `None` when no thread could be started: the bounced paths then run on the caller's
/// thread alone.
pub(crate) fn workers() -> Option<&'static rayon::ThreadPool> {
    static POOL: OnceLock<Option<rayon::ThreadPool>> = OnceLock::new();
    POOL.get_or_init(|| {
        // Up to 12 per device (copies to several GPUs at once each want their workers), at
        // most one per core.
        let devices = crate::driver::probe().map_or(1, |p| p.device_count.clamp(1, 8) as usize);
        let n = std::thread::available_parallelism()
            .map_or(4, |n| n.get())
            .clamp(1, MAX_WORKER_THREADS * devices);
        rayon::ThreadPoolBuilder::new()
            .num_threads(n)
            .thread_name(|i| format!("pinstage-copy-{i}"))
            .build()
            .ok()
    })
    .as_ref()
}

/// How the pageable H2D path cuts a copy: at most `workers` threads (the caller's included),
/// pieces of at most `max_piece` bytes, `slots` bounce slots of `max_piece` bytes each.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct H2DTuning {
    /// Threads filling slots (the calling thread is one of them).
    pub(crate) workers: usize,
    /// Largest piece (and the size of every slot).
    pub(crate) max_piece: usize,
    /// Smallest piece a copy is cut into (a copy smaller than this is one piece).
    pub(crate) min_piece: usize,
    /// Slots: the copies in flight plus the slots being filled.
    pub(crate) slots: usize,
    /// The first pieces start at `min_piece` and double up to the piece size, so the copy
    /// engine starts early.
    pub(crate) ramp: bool,
    /// Pieces per worker (0: every piece `max_piece` bytes, the ramp and the end excepted).
    /// Several pieces per worker served the fill of one piece by one worker; the workers now
    /// fill each piece together, and fewer, larger copies keep the copy engine busier.
    pub(crate) per_worker: usize,
    /// Copies of at most this many bytes fill slots with non-temporal stores (x86-64): faster
    /// while the source sits in the caches, slower for sources far larger than them.
    pub(crate) nt_upto: usize,
    /// Copies below this many bytes go to the driver's own pageable path.
    pub(crate) driver_below: usize,
    /// Bytes one worker fills at a time: the workers fill each piece together, unit by unit
    /// in address order, so pieces become ready one after the other (the copy engine starts
    /// on the first while the rest fill) instead of all at once at the end of a wave. A unit
    /// of at least `max_piece` gives each piece to one worker.
    pub(crate) unit: usize,
}

impl H2DTuning {
    /// The defaults.
    pub(crate) const DEFAULT: Self = Self {
        workers: 12,
        max_piece: 4 << 20,
        min_piece: 128 << 10,
        slots: 12,
        ramp: true,
        per_worker: 0,
        nt_upto: 128 << 20,
        driver_below: 0,
        unit: 256 << 10,
    };

    /// Workers for a copy of `len` bytes: one per 2 MiB, at least 4 (waking more costs more
    /// than they bring to a small copy), at most `workers`.
    pub(crate) fn workers_for(&self, len: usize) -> usize {
        (len >> 21).clamp(4, 64).min(self.workers)
    }

    /// The pieces (offset, bytes) of a copy of `len > 0` bytes: of `max_piece` bytes (or, with
    /// `per_worker`, about that many per worker, between `min_piece` and `max_piece`),
    /// multiples of 64 KiB (the last one excepted); with `ramp`, the first ones smaller.
    pub(crate) fn cut(&self, len: usize, workers: usize) -> Vec<(usize, usize)> {
        let want = match self.per_worker {
            0 => self.max_piece,
            k => len.div_ceil(k * workers.max(1)),
        };
        let piece = want
            .clamp(self.min_piece, self.max_piece)
            .next_multiple_of(64 << 10)
            .min(self.max_piece);
        let mut out = Vec::with_capacity(len.div_ceil(piece) + 8);
        let (mut off, mut size) = (
            0,
            if self.ramp {
                self.min_piece.min(piece)
            } else {
                piece
            },
        );
        while off < len {
            let n = size.min(len - off);
            out.push((off, n));
            off += n;
            size = (size * 2).min(piece);
        }
        out
    }

    /// The fill units (piece index, offset, bytes) of `pieces`, in address order: each piece
    /// cut into `unit`-byte units (the last one shorter), so every unit starts 64 KiB-aligned
    /// within its slot.
    pub(crate) fn units(&self, pieces: &[(usize, usize)]) -> Vec<(usize, usize, usize)> {
        let unit = self.unit.max(1);
        let mut out = Vec::with_capacity(pieces.iter().map(|p| p.1.div_ceil(unit)).sum());
        for (i, &(off, n)) in pieces.iter().enumerate() {
            let mut at = 0;
            while at < n {
                let k = unit.min(n - at);
                out.push((i, off + at, k));
                at += k;
            }
        }
        out
    }
}

static TUNING: Mutex<H2DTuning> = Mutex::new(H2DTuning::DEFAULT);

/// The pageable H2D path's current tuning.
pub(crate) fn h2d_tuning() -> H2DTuning {
    *TUNING.lock()
}

/// Sets the pageable H2D path's tuning (the laboratory's experiments; values are clamped to
/// sane ranges: 1..=64 workers, pieces and units of 64 KiB..=64 MiB, 2..=64 slots, at most
/// 64 pieces per worker).
#[cfg_attr(not(all(feature = "lab", feature = "python")), allow(dead_code))]
pub(crate) fn set_h2d_tuning(t: H2DTuning) {
    let max_piece = t
        .max_piece
        .clamp(64 << 10, 64 << 20)
        .next_multiple_of(64 << 10);
    *TUNING.lock() = H2DTuning {
        workers: t.workers.clamp(1, 64),
        max_piece,
        min_piece: t
            .min_piece
            .clamp(64 << 10, max_piece)
            .next_multiple_of(64 << 10),
        slots: t.slots.clamp(2, 64),
        unit: t.unit.clamp(64 << 10, 64 << 20).next_multiple_of(64 << 10),
        per_worker: t.per_worker.min(64),
        ..t
    };
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

    fn check(pieces: &[(usize, usize)], len: usize) {
        let mut off = 0;
        for &(o, n) in pieces {
            assert_eq!(o, off);
            assert!(n > 0);
            off += n;
        }
        assert_eq!(off, len);
    }

    #[test]
    fn cut_gives_two_pieces_per_worker_within_bounds() {
        let t = H2DTuning {
            ramp: false,
            per_worker: 2,
            ..H2DTuning::DEFAULT
        };
        let sizes = |len, w| {
            let p = t.cut(len, w);
            check(&p, len);
            (p[0].1, p.len())
        };
        assert_eq!(sizes(1, 8), (1, 1));
        assert_eq!(sizes(1 << 20, 8), (128 << 10, 8));
        assert_eq!(sizes(16 << 20, 8), (1 << 20, 16));
        assert_eq!(sizes(64 << 20, 8), (4 << 20, 16));
        assert_eq!(sizes(1 << 30, 8), (4 << 20, 256));
        assert_eq!(sizes((1 << 30) + 1, 8), (4 << 20, 257));
        for (len, w) in [(3_000_001, 3), (12345, 1), (7 << 20, 5)] {
            let p = t.cut(len, w);
            check(&p, len);
            assert!(p[..p.len() - 1].iter().all(|&(_, n)| n % (64 << 10) == 0));
        }
    }

    #[test]
    fn pieces_are_whole_slots_by_default() {
        let t = H2DTuning::DEFAULT;
        for (len, w) in [(64 << 20, 12), (64 << 20, 4), (16 << 20, 8)] {
            let p = t.cut(len, w);
            check(&p, len);
            let sizes: Vec<usize> = p.iter().map(|&(_, n)| n >> 10).collect();
            // The ramp (128 KiB doubling to 2 MiB: 3968 KiB), then whole 4 MiB slots, the rest.
            assert_eq!(sizes[..5], [128, 256, 512, 1024, 2048]);
            let whole = (len - (3968 << 10)) / (4 << 20);
            assert!(sizes[5..5 + whole].iter().all(|&k| k == 4096), "{sizes:?}");
            assert_eq!(sizes.len(), 5 + whole + 1);
        }
        assert_eq!(t.cut(1 << 20, 4).len(), 4, "128 + 256 + 512 + 128 KiB");
    }

    #[test]
    fn ramp_starts_small_and_doubles() {
        let t = H2DTuning {
            ramp: true,
            ..H2DTuning::DEFAULT
        };
        let p = t.cut(64 << 20, 8);
        check(&p, 64 << 20);
        let sizes: Vec<usize> = p.iter().take(7).map(|&(_, n)| n >> 10).collect();
        assert_eq!(sizes, [128, 256, 512, 1024, 2048, 4096, 4096]);
        assert_eq!(
            p.last().unwrap().1,
            128 << 10,
            "the rest after whole pieces"
        );
        // A copy smaller than the smallest piece is one piece.
        assert_eq!(t.cut(1000, 8), [(0, 1000)]);
    }

    #[test]
    fn units_cover_each_piece_in_order() {
        let t = H2DTuning::DEFAULT;
        for (len, w) in [
            (1, 8),
            (64 << 20, 8),
            (16 << 20, 4),
            (3_000_001, 3),
            (1 << 30, 8),
        ] {
            let pieces = t.cut(len, w);
            let units = t.units(&pieces);
            let mut off = 0;
            let mut sums = vec![0; pieces.len()];
            for (k, &(p, o, n)) in units.iter().enumerate() {
                assert_eq!(o, off, "units in address order");
                assert!(n > 0 && n <= t.unit);
                assert_eq!(
                    (o - pieces[p].0) % (64 << 10),
                    0,
                    "unit aligned in its slot"
                );
                if k > 0 {
                    assert!(units[k - 1].0 <= p, "pieces in order");
                }
                sums[p] += n;
                off += n;
            }
            assert_eq!(off, len);
            assert!(sums.iter().zip(&pieces).all(|(s, p)| *s == p.1));
        }
        // A unit as large as the pieces: one unit per piece (each piece filled by one worker).
        let whole = H2DTuning { unit: 4 << 20, ..t };
        let pieces = whole.cut(64 << 20, 8);
        assert_eq!(whole.units(&pieces).len(), pieces.len());
        // 64 MiB: 4 MiB pieces of 16 units each once the ramp is over.
        let units = t.units(&t.cut(64 << 20, 8));
        assert_eq!(units.iter().filter(|u| u.0 == 6).count(), 16);
    }

    #[test]
    fn set_h2d_tuning_clamps_to_sane_ranges() {
        // The only test touching the global tuning (the pageable path reads it on a GPU only).
        let clamped = |t: H2DTuning| {
            set_h2d_tuning(t);
            let got = h2d_tuning();
            set_h2d_tuning(H2DTuning::DEFAULT);
            got
        };
        let wild = H2DTuning {
            workers: 0,
            max_piece: 1 << 40,
            min_piece: 1,
            slots: 1000,
            ramp: false,
            per_worker: 1 << 40,
            nt_upto: 7,
            driver_below: 9,
            unit: 100_000,
        };
        assert_eq!(
            clamped(wild),
            H2DTuning {
                workers: 1,
                max_piece: 64 << 20,
                min_piece: 64 << 10,
                slots: 64,
                per_worker: 64,
                unit: 128 << 10,
                ..wild
            }
        );
        let got = clamped(H2DTuning {
            workers: 1000,
            max_piece: 100_000,
            min_piece: 1 << 30,
            slots: 0,
            unit: 1,
            ..H2DTuning::DEFAULT
        });
        assert_eq!(
            (
                got.workers,
                got.max_piece,
                got.min_piece,
                got.slots,
                got.unit
            ),
            (64, 128 << 10, 128 << 10, 2, 64 << 10)
        );
        // Zero sizes round up to the smallest piece and unit.
        let got = clamped(H2DTuning {
            max_piece: 0,
            min_piece: 0,
            unit: 0,
            ..H2DTuning::DEFAULT
        });
        assert_eq!(
            (got.max_piece, got.min_piece, got.unit),
            (64 << 10, 64 << 10, 64 << 10)
        );
        assert_eq!(h2d_tuning(), H2DTuning::DEFAULT);
    }

    #[test]
    fn workers_grow_with_the_copy() {
        let t = H2DTuning::DEFAULT;
        assert_eq!(t.workers_for(1), 4);
        assert_eq!(t.workers_for(4 << 20), 4);
        assert_eq!(t.workers_for(12 << 20), 6);
        assert_eq!(t.workers_for(1 << 30), t.workers);
    }

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
