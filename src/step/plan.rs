//! Which bytes a commit sends: the written fields' used rows, merged into as few spans as the
//! gaps allow. Pure, so every case is tested on the CPU.

use super::layout::Field;

/// The largest gap one copy spans when the spans could go as one `cuMemcpyBatchAsync`. In the
/// crossover of `benches/gpu_step.rs` (benches/RESULTS.md, "plan's crossover") a batch of two
/// beats one copy over the gap from about 16 KiB in a loop; from Python the engine step of
/// `benches/bench_step.py`, whose gaps reach 62 KiB, cost less as one copy than as a batch of four
/// (`bench_step.py --probe`). 64 KiB keeps that step one copy.
pub const AUTO_GAP_BATCH: usize = 64 << 10;
/// The largest gap one copy spans when each span would be a copy of its own (no batch: the
/// legacy default stream, or a driver older than CUDA 12.8). In the same crossover a second copy
/// costs about 2.2 µs more host time than one; one copy over a 64 KiB gap beats two copies, one
/// over 256 KiB no longer does in a loop (the copy engine's time shows). This is that upper
/// bound.
pub const AUTO_GAP_COPIES: usize = 256 << 10;

/// Fills `segs` with `(offset, bytes)` spans covering the used rows of every field with
/// `rows[i] > 0`, in offset order. Two consecutive written fields share a span when the bytes
/// between them (the first's unused capacity and alignment padding) number at most `max_gap`.
/// A field that is not written (rows 0) is never covered: its device bytes keep their values,
/// so it always splits the span.
pub fn plan(fields: &[Field], rows: &[usize], max_gap: usize, segs: &mut Vec<(usize, usize)>) {
    segs.clear();
    let mut cur: Option<(usize, usize)> = None;
    let mut adjacent = false;
    for (f, &r) in fields.iter().zip(rows) {
        if r == 0 {
            adjacent = false;
            continue;
        }
        let (start, end) = (f.offset(), f.offset() + r * f.row_bytes());
        cur = match cur {
            Some((s, e)) if adjacent && start - e <= max_gap => Some((s, end)),
            Some((s, e)) => {
                segs.push((s, e - s));
                Some((start, end))
            }
            None => Some((start, end)),
        };
        adjacent = true;
    }
    if let Some((s, e)) = cur {
        segs.push((s, e - s));
    }
}
