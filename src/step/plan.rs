//! Which bytes a commit sends: the written fields' used rows, merged into as few spans as the
//! gaps allow. Pure, so every case is tested on the CPU.

use super::layout::Field;

/// The largest gap one copy spans when the spans could go as one `cuMemcpyBatchAsync`: 64 KiB
/// cost the copy engine about 1.2 µs at 55 GB/s, less than a batch entry costs the host when the
/// GPU is idle as the step arrives (about 1.5 µs paced); with this allowance the engine step of
/// benches/bench_step.py is one copy (benches/RESULTS.md, "step plan").
pub const AUTO_GAP_BATCH: usize = 64 << 10;
/// The largest gap one copy spans when each span would be a copy of its own (no batch: the
/// legacy default stream, or a driver older than CUDA 12.8): one more copy costs about 2.6 µs
/// of host time and as much of the copy engine's, more than copying 256 KiB more does.
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
