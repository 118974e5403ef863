//! How the pageable host-to-device path cuts a copy into pieces and units (one setting per
//! process; the laboratory's experiments change it).

use parking_lot::Mutex;

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
    /// Copies of at least two `min_piece`s and at most this many bytes (and two `max_piece`s)
    /// are cut in two halves, no ramp, each filled in up to four units (an eighth of the copy,
    /// at least 64 KiB): two copies, the first issued while the second half fills. Below a few
    /// MiB the ramp's several small copies buy little overlap for what each copy costs.
    pub(crate) halves_upto: usize,
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
        halves_upto: 8 << 20,
    };

    /// Workers for a copy of `len` bytes: one per 2 MiB, at least 4 (waking more costs more
    /// than they bring to a small copy), at most `workers`.
    pub(crate) fn workers_for(&self, len: usize) -> usize {
        (len >> 21).clamp(4, 64).min(self.workers)
    }

    /// The pieces (offset, bytes) of a copy of `len > 0` bytes: of `max_piece` bytes (or, with
    /// `per_worker`, about that many per worker, between `min_piece` and `max_piece`),
    /// multiples of 64 KiB (the last one excepted); with `ramp`, the first ones smaller.
    /// With `halves_upto`, two halves (the first a multiple of 64 KiB).
    pub(crate) fn cut(&self, len: usize, workers: usize) -> Vec<(usize, usize)> {
        if self.halved(len) {
            let half = len.div_ceil(2).next_multiple_of(64 << 10);
            return vec![(0, half), (half, len - half)];
        }
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

    /// Whether a copy of `len` bytes is cut in two halves.
    fn halved(&self, len: usize) -> bool {
        len >= 2 * self.min_piece && len <= self.halves_upto.min(2 * self.max_piece)
    }

    /// The fill unit of a copy of `len` bytes: `unit`, or for a halved copy an eighth of it
    /// (a multiple of 64 KiB).
    pub(crate) fn unit_for(&self, len: usize) -> usize {
        if self.halved(len) {
            len.div_ceil(8).next_multiple_of(64 << 10)
        } else {
            self.unit.max(1)
        }
    }

    /// The fill units (piece index, offset, bytes) of `pieces` (a copy's [`cut`](Self::cut)),
    /// in address order: each piece cut into units of [`unit_for`](Self::unit_for) bytes (the
    /// last one shorter), so every unit starts 64 KiB-aligned within its slot.
    pub(crate) fn units(&self, pieces: &[(usize, usize)]) -> Vec<(usize, usize, usize)> {
        let unit = self.unit_for(pieces.last().map_or(0, |&(o, n)| o + n));
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
        halves_upto: t.halves_upto.min(2 * max_piece),
        per_worker: t.per_worker.min(64),
        ..t
    };
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
            halves_upto: 0,
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
        let no_halves = H2DTuning {
            halves_upto: 0,
            ..t
        };
        assert_eq!(
            no_halves.cut(1 << 20, 4).len(),
            4,
            "128 + 256 + 512 + 128 KiB"
        );
    }

    #[test]
    fn copies_up_to_8_mib_are_cut_in_halves_of_four_units() {
        let t = H2DTuning::DEFAULT;
        assert_eq!(t.cut(1 << 20, 4), [(0, 512 << 10), (512 << 10, 512 << 10)]);
        assert_eq!(t.cut(8 << 20, 4), [(0, 4 << 20), (4 << 20, 4 << 20)]);
        let units = t.units(&t.cut(1 << 20, 4));
        assert_eq!(units.len(), 8);
        assert!(units.iter().all(|u| u.2 == 128 << 10));
        assert_eq!((units[3].0, units[4].0), (0, 1), "four units per half");
        // An odd size: the first half a multiple of 64 KiB, every piece within a slot.
        for len in [
            (2 << 20) + 1,
            3_000_001,
            (256 << 10) + 1,
            256 << 10,
            (8 << 20) - 1,
        ] {
            let p = t.cut(len, 4);
            check(&p, len);
            assert_eq!(p.len(), 2);
            assert_eq!(p[0].1 % (64 << 10), 0);
            assert!(p.iter().all(|&(_, n)| n <= t.max_piece));
            assert!(t.units(&p).len() <= 8);
        }
        // Outside the range: the ramp (below two smallest pieces, above `halves_upto`), and
        // never halves larger than a slot.
        assert_eq!(t.cut((256 << 10) - 1, 4).len(), 2, "128 KiB + the rest");
        assert_eq!(t.cut((8 << 20) + 1, 4)[0].1, 128 << 10);
        let small_slots = H2DTuning {
            max_piece: 1 << 20,
            ..t
        };
        assert_eq!(small_slots.cut(4 << 20, 4)[0].1, 128 << 10);
        assert_eq!(t.unit_for(64 << 20), t.unit);
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
                assert!(n > 0 && n <= t.unit_for(len));
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
            halves_upto: 1 << 40,
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
                halves_upto: 128 << 20,
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
}
