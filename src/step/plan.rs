//! Which bytes a commit sends: the written fields' used rows, merged into as few spans as the
//! gaps allow. Pure, so every case is tested on the CPU.

use super::layout::Field;

/// Default largest gap one copy may span: 64 KiB costs the copy engine about 1.2 µs at
/// 55 GB/s, about what one more batch entry costs the host (benches/RESULTS.md, step plan).
pub const DEFAULT_MAX_GAP: usize = 64 << 10;

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
