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
    /// The last pieces halve from the piece size down to `min_piece`, so the copy left after
    /// the last fill is a small one (a copy with room for the ramp, one whole piece and the
    /// taper).
    pub(crate) taper: bool,
    /// A piece shorter than four units is filled in quarters (at least 64 KiB each), so the
    /// ramp's and the taper's small pieces are filled by several workers at once.
    pub(crate) fine_units: bool,
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
    /// of at least `max_piece` gives each piece to one worker (without `fine_units`).
    pub(crate) unit: usize,
    /// Copies of at least two `min_piece`s and at most this many bytes (and two `max_piece`s)
    /// are cut in two halves, no ramp, each filled in up to four units (an eighth of the copy,
    /// at least 64 KiB): two copies, the first issued while the second half fills. Below a few
    /// MiB the ramp's several small copies buy little overlap for what each copy costs.
    pub(crate) halves_upto: usize,
    /// With cached stores (above `nt_upto`), each filled unit's lines are demoted from the
    /// filling core's private caches to the shared L3 (`cldemote`, x86-64; a no-op where the
    /// CPU lacks it), where the copy engine's reads find them without a snoop of that core.
    pub(crate) demote: bool,
}

impl H2DTuning {
    /// The defaults.
    pub(crate) const DEFAULT: Self = Self {
        workers: 12,
        max_piece: 4 << 20,
        min_piece: 128 << 10,
        slots: 12,
        ramp: true,
        taper: true,
        fine_units: true,
        per_worker: 0,
        nt_upto: 128 << 20,
        driver_below: 0,
        unit: 256 << 10,
        halves_upto: 8 << 20,
        demote: false,
    };

    /// Workers for a copy of `len` bytes: one per 2 MiB, at least 4 (waking more costs more
    /// than they bring to a small copy), at most `workers`.
    pub(crate) fn workers_for(&self, len: usize) -> usize {
        (len >> 21).clamp(4, 64).min(self.workers)
    }

    /// The pieces (offset, bytes) of a copy of `len > 0` bytes: of `max_piece` bytes (or, with
    /// `per_worker`, about that many per worker, between `min_piece` and `max_piece`),
    /// multiples of 64 KiB (the last one excepted); with `ramp`, the first ones smaller; with
    /// `taper`, the last ones too. With `halves_upto`, two halves (the first a multiple of 64
    /// KiB).
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
        let first = if self.ramp {
            self.min_piece.min(piece)
        } else {
            piece
        };
        let ramp: usize = std::iter::successors(Some(first), |s| Some(s * 2))
            .take_while(|&s| s < piece)
            .sum();
        // The taper: half a piece, a quarter, ... down to `min_piece`, each a multiple of 64
        // KiB; the bytes past the last 64 KiB boundary go into its last piece.
        let odd = len % (64 << 10);
        let mut taper: Vec<usize> = std::iter::successors(Some(piece / 2), |s| Some(s / 2))
            .take_while(|&s| self.taper && s >= self.min_piece.max(64 << 10) && s % (64 << 10) == 0)
            .collect();
        let tapered: usize = taper.iter().sum();
        if taper.is_empty() || len - odd < ramp + piece + tapered {
            taper.clear();
        }
        let body = if taper.is_empty() {
            len
        } else {
            len - odd - tapered
        };
        let mut out = Vec::with_capacity(body.div_ceil(piece) + taper.len() + 8);
        let (mut off, mut size) = (0, first);
        while off < body {
            let n = size.min(body - off);
            out.push((off, n));
            off += n;
            size = (size * 2).min(piece);
        }
        let last = taper.len().wrapping_sub(1);
        for (i, n) in taper.into_iter().enumerate() {
            let n = if i == last { n + odd } else { n };
            out.push((off, n));
            off += n;
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
    /// in address order: each piece cut into units of [`unit_for`](Self::unit_for) bytes (with
    /// `fine_units`, a quarter of a shorter piece, at least 64 KiB; the last one shorter), so
    /// every unit starts 64 KiB-aligned within its slot.
    pub(crate) fn units(&self, pieces: &[(usize, usize)]) -> Vec<(usize, usize, usize)> {
        let len = pieces.last().map_or(0, |&(o, n)| o + n);
        let unit = self.unit_for(len);
        let fine = self.fine_units && !self.halved(len);
        let unit_of = |n: usize| {
            if fine {
                (n / 4)
                    .next_multiple_of(64 << 10)
                    .clamp(64 << 10, unit.max(64 << 10))
            } else {
                unit
            }
        };
        let mut out = Vec::with_capacity(pieces.iter().map(|p| p.1.div_ceil(unit_of(p.1))).sum());
        for (i, &(off, n)) in pieces.iter().enumerate() {
            let unit = unit_of(n);
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
            taper: false,
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
        for (len, w) in [(64 << 20, 12), (64 << 20, 4), (16 << 20, 8), (1 << 30, 12)] {
            let p = t.cut(len, w);
            check(&p, len);
            let sizes: Vec<usize> = p.iter().map(|&(_, n)| n >> 10).collect();
            // The ramp (128 KiB doubling to 2 MiB: 3968 KiB), whole 4 MiB slots, the rest of
            // the body, then the taper (2 MiB halving to 128 KiB: 3968 KiB again).
            assert_eq!(sizes[..5], [128, 256, 512, 1024, 2048]);
            assert_eq!(sizes[sizes.len() - 5..], [2048, 1024, 512, 256, 128]);
            let body = len - 2 * (3968 << 10);
            let whole = body / (4 << 20);
            assert!(sizes[5..5 + whole].iter().all(|&k| k == 4096), "{sizes:?}");
            let rest = usize::from(body % (4 << 20) != 0);
            assert_eq!(sizes.len(), 5 + whole + rest + 5, "{sizes:?}");
        }
        let no_halves = H2DTuning {
            halves_upto: 0,
            ..t
        };
        assert_eq!(
            no_halves.cut(1 << 20, 4).len(),
            4,
            "128 + 256 + 512 + 128 KiB: no room for a taper"
        );
    }

    #[test]
    fn the_taper_ends_on_a_small_piece_and_keeps_the_odd_bytes() {
        let t = H2DTuning::DEFAULT;
        // 64 MiB + 1000 bytes: every piece but the last a multiple of 64 KiB, the last the
        // smallest piece plus the odd bytes, every piece within a slot.
        let len = (64 << 20) + 1000;
        let p = t.cut(len, 12);
        check(&p, len);
        assert!(p[..p.len() - 1].iter().all(|&(_, n)| n % (64 << 10) == 0));
        assert_eq!(p.last().unwrap().1, (128 << 10) + 1000);
        assert!(p.iter().all(|&(_, n)| n <= t.max_piece));
        // Room for the ramp, one whole piece and the taper (11.75 MiB) or no taper at all.
        let edge = 2 * (3968 << 10) + (4 << 20);
        assert_eq!(t.cut(edge, 12).last().unwrap().1, 128 << 10);
        assert_eq!(t.cut(edge, 12).len(), 11);
        let short = t.cut(edge - (64 << 10), 12);
        check(&short, edge - (64 << 10));
        assert_eq!(
            short[short.len() - 2..],
            [(3968 << 10, 4 << 20), ((8064 << 10), 3904 << 10)]
        );
        // Off: the rest after whole pieces ends the copy, as before the taper.
        let off = H2DTuning { taper: false, ..t };
        let p = off.cut(64 << 20, 12);
        assert_eq!(p.len(), 5 + 15 + 1);
        assert_eq!(p[19].1, 4 << 20);
        // Slots of the smallest piece: nothing to taper.
        let flat = H2DTuning {
            max_piece: 128 << 10,
            ..t
        };
        let p = flat.cut(1 << 30, 12);
        assert!(p.iter().all(|&(_, n)| n == 128 << 10));
    }

    #[test]
    fn fine_units_split_short_pieces_in_quarters() {
        let t = H2DTuning::DEFAULT;
        let pieces = t.cut(64 << 20, 12);
        let units = t.units(&pieces);
        let of = |i: usize| -> Vec<usize> {
            units
                .iter()
                .filter(|u| u.0 == i)
                .map(|u| u.2 >> 10)
                .collect()
        };
        assert_eq!(of(0), [64, 64], "128 KiB: two units of 64 KiB");
        assert_eq!(of(1), [64; 4]);
        assert_eq!(of(2), [128; 4]);
        assert_eq!(of(3), [256; 4]);
        assert_eq!(of(4), [256; 8]);
        assert_eq!(of(5), [256; 16]);
        assert_eq!(of(pieces.len() - 1), [64, 64]);
        let coarse = H2DTuning {
            fine_units: false,
            ..t
        };
        let units = coarse.units(&pieces);
        assert_eq!(units.iter().filter(|u| u.0 == 0).count(), 1);
        // The odd bytes: a last unit shorter than 64 KiB, every unit 64 KiB-aligned in its slot.
        let len = (64 << 20) + 1000;
        let pieces = t.cut(len, 12);
        let units = t.units(&pieces);
        assert!(
            units
                .iter()
                .all(|&(p, o, _)| (o - pieces[p].0) % (64 << 10) == 0)
        );
        assert_eq!(units.last().unwrap().2, 1000);
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
        assert_eq!(p.last().unwrap().1, 128 << 10, "the taper's last piece");
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
        // A unit as large as the pieces, no fine units: one unit per piece (each piece filled
        // by one worker).
        let whole = H2DTuning {
            unit: 4 << 20,
            fine_units: false,
            ..t
        };
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
            demote: true,
            taper: false,
            fine_units: false,
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
