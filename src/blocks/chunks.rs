//! How a staged move ([`staged`](super::staged)) cuts its 2D copies into chunks of staging:
//! pure, tested without a GPU.

use std::sync::atomic::AtomicUsize;

use super::plan::Segment;

/// The fewest bytes one row of a chunk may hold: a chunk must fit every tensor's row of a
/// piece at least this long.
const MIN_ROW: usize = 512;

/// The layout of a staged move: the 2D segments' rows and the strides of both sides.
#[derive(Clone, Copy, Debug)]
pub(super) struct Shape {
    /// Rows of every segment: one per tensor.
    pub(super) rows: usize,
    /// Bytes between consecutive tensors on the device side and on the host side.
    pub(super) device_pitch: usize,
    pub(super) host_pitch: usize,
}

/// One piece of a chunk: a row of `len` bytes in each of `rows` tensors, from `src` and into
/// `dst` (each side stepping by its tensors' stride), staged packed at `off` (row `i` at
/// `off + i * len`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Piece {
    pub(super) src: u64,
    pub(super) dst: u64,
    pub(super) len: usize,
    pub(super) off: usize,
}

/// Whether a chunk of `chunk` bytes can hold `rows` rows of a piece.
pub(super) fn fits(rows: usize, chunk: usize) -> bool {
    rows > 0 && chunk / rows >= MIN_ROW
}

/// Packs the 2D `segments` (each `rows` rows) into chunks of at most `chunk` bytes: `pieces` in
/// order, and per chunk the end of its pieces and the bytes it uses. A segment longer than a
/// chunk's room is split (at a row length of at least [`MIN_ROW`] where it continues a chunk).
pub(super) fn pack(
    segments: &[Segment],
    rows: usize,
    chunk: usize,
    pieces: &mut Vec<Piece>,
    ends: &mut Vec<(usize, usize)>,
) {
    debug_assert!(fits(rows, chunk));
    pieces.clear();
    ends.clear();
    let mut used = 0;
    for s in segments {
        let mut at = 0;
        while at < s.len {
            let room = (chunk - used) / rows;
            let mut len = s.len - at;
            if len > room {
                if room < MIN_ROW {
                    ends.push((pieces.len(), used));
                    used = 0;
                    continue;
                }
                len = room;
            }
            pieces.push(Piece {
                src: s.src + at as u64,
                dst: s.dst + at as u64,
                len,
                off: used,
            });
            used += len * rows;
            at += len;
        }
    }
    if used > 0 {
        ends.push((pieces.len(), used));
    }
}

/// Host rows for one task of the copy threads: rows `start..end` of chunk `chunk` (row `t` of a
/// chunk is row `t % rows` of its piece `t / rows`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Task {
    pub(super) chunk: usize,
    pub(super) start: usize,
    pub(super) end: usize,
}

/// Cuts every chunk's host rows (`pieces`, `ends` as [`pack`] made them, `rows` rows a piece)
/// into `tasks` of about `task_bytes` bytes each, in chunk order, never across chunks.
pub(super) fn cut(
    pieces: &[Piece],
    ends: &[(usize, usize)],
    rows: usize,
    task_bytes: usize,
    tasks: &mut Vec<Task>,
) {
    tasks.clear();
    let mut first = 0;
    for (chunk, &(end, _)) in ends.iter().enumerate() {
        let (mut start, mut bytes) = (0, 0);
        for (i, p) in pieces[first..end].iter().enumerate() {
            let mut r = 0;
            while r < rows {
                let take = (task_bytes - bytes)
                    .div_ceil(p.len.max(1))
                    .clamp(1, rows - r);
                (r, bytes) = (r + take, bytes + take * p.len);
                if bytes >= task_bytes {
                    let end = i * rows + r;
                    tasks.push(Task { chunk, start, end });
                    (start, bytes) = (end, 0);
                }
            }
        }
        let total = (end - first) * rows;
        if start < total {
            tasks.push(Task {
                chunk,
                start,
                end: total,
            });
        }
        first = end;
    }
}

/// A staged move's chunks: the pieces packed into them, and the host rows cut into tasks.
#[derive(Default)]
pub(super) struct Work {
    pub(super) pieces: Vec<Piece>,
    /// Per chunk: the end of its pieces and the bytes it uses.
    pub(super) ends: Vec<(usize, usize)>,
    pub(super) tasks: Vec<Task>,
    /// Per chunk: its tasks not yet done.
    pub(super) left: Vec<AtomicUsize>,
}

/// Bytes of host rows in one task of the copy threads: about 128 KiB (a 16 MiB chunk is 128;
/// each claim is an atomic operation on one cache line that every thread shares).
const TASK_BYTES: usize = 128 << 10;

impl Work {
    /// Packs `segments` (of `rows` rows each) into chunks of `chunk` bytes and cuts their host
    /// rows into tasks.
    pub(super) fn pack(&mut self, segments: &[Segment], rows: usize, chunk: usize) {
        pack(segments, rows, chunk, &mut self.pieces, &mut self.ends);
        cut(&self.pieces, &self.ends, rows, TASK_BYTES, &mut self.tasks);
        self.left.clear();
        self.left.resize_with(self.ends.len(), AtomicUsize::default);
        for t in &self.tasks {
            *self.left[t.chunk].get_mut() += 1;
        }
    }

    /// Chunk `j`'s pieces and the bytes it uses.
    pub(super) fn chunk(&self, j: usize) -> (&[Piece], usize) {
        let start = if j == 0 { 0 } else { self.ends[j - 1].0 };
        (&self.pieces[start..self.ends[j].0], self.ends[j].1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn seg(src: u64, dst: u64, len: usize) -> Segment {
        Segment { src, dst, len }
    }

    /// Every byte of every row of `segments` is staged exactly once, within its chunk, and the
    /// pieces of a chunk do not overlap.
    fn covers(segments: &[Segment], rows: usize, chunk: usize) {
        let (mut pieces, mut ends) = (Vec::new(), Vec::new());
        pack(segments, rows, chunk, &mut pieces, &mut ends);
        let mut start = 0;
        for &(end, used) in &ends {
            assert!(used <= chunk && used > 0 && end > start, "{ends:?}");
            let mut at = 0;
            for p in &pieces[start..end] {
                assert_eq!(p.off, at, "pieces packed in order");
                assert!(p.len > 0);
                at += p.len * rows;
            }
            assert_eq!(at, used);
            start = end;
        }
        assert_eq!(start, pieces.len());
        // The pieces, in order, cut the segments into consecutive spans.
        let mut it = pieces.iter();
        for s in segments {
            let mut at = 0;
            while at < s.len {
                let p = it.next().expect("a piece for every span");
                assert_eq!((p.src, p.dst), (s.src + at as u64, s.dst + at as u64));
                at += p.len;
            }
            assert_eq!(at, s.len);
        }
        assert!(it.next().is_none());
    }

    #[test]
    fn pack_stages_every_row_once_within_its_chunk() {
        let small: Vec<_> = (0..100)
            .map(|i| seg(i * 100_000, 7 + i * 90_000, 4096 + 17 * i as usize))
            .collect();
        for (rows, chunk) in [(1, 1 << 20), (3, 64 << 10), (64, 16 << 20), (7, 40_000)] {
            covers(&small, rows, chunk);
        }
        // A run longer than a chunk, between short ones.
        let long = [
            seg(0, 0, 5000),
            seg(1 << 30, 1 << 31, 3 << 20),
            seg(9, 9, 1),
        ];
        covers(&long, 4, 1 << 20);
        covers(&long, 1, 1 << 20);
        covers(&[], 4, 1 << 20);
    }

    #[test]
    fn pack_fills_chunks_and_splits_only_at_their_ends() {
        let (mut pieces, mut ends) = (Vec::new(), Vec::new());
        // 10 segments of 1000 bytes x 4 rows = 4000 bytes each into 10_000-byte chunks: two per
        // chunk, then the room left (2000 bytes: 500 a row) is under MIN_ROW: no split.
        let segs: Vec<_> = (0..10).map(|i| seg(i * 5000, i * 5000, 1000)).collect();
        pack(&segs, 4, 10_000, &mut pieces, &mut ends);
        assert_eq!(pieces.len(), 10);
        assert_eq!(
            ends,
            [(2, 8000), (4, 8000), (6, 8000), (8, 8000), (10, 8000)]
        );
        // A long segment continues a chunk with what room is left (600 a row), then fills
        // whole chunks.
        pack(
            &[seg(0, 0, 100), seg(0, 0, 6000)],
            4,
            3200,
            &mut pieces,
            &mut ends,
        );
        assert_eq!(
            pieces.iter().map(|p| p.len).collect::<Vec<_>>(),
            [100, 700, 800, 800, 800, 800, 800, 800, 500]
        );
        assert_eq!(ends.len(), 8);
        // A segment's end that fits the room exactly stays in the chunk, however short.
        pack(
            &[seg(0, 0, 700), seg(0, 0, 300)],
            1,
            1000,
            &mut pieces,
            &mut ends,
        );
        assert_eq!(ends, [(2, 1000)]);
        // A room of exactly MIN_ROW still takes a piece of a longer segment.
        pack(
            &[seg(0, 0, 512), seg(0, 0, 1000)],
            1,
            1024,
            &mut pieces,
            &mut ends,
        );
        assert_eq!(
            pieces.iter().map(|p| p.len).collect::<Vec<_>>(),
            [512, 512, 488]
        );
        assert_eq!(ends, [(2, 1024), (3, 488)]);
        assert!(fits(4, 2048) && !fits(4, 2047) && !fits(0, 1 << 20));
    }

    #[test]
    fn work_counts_each_chunks_tasks_and_hands_out_its_pieces() {
        // 64 rows of 16 KiB pieces: 1 MiB a block, 16 blocks a 16 MiB chunk, 128 tasks of about
        // 128 KiB each (8 rows).
        let segs: Vec<_> = (0..40).map(|i| seg(i << 20, i << 21, 16 << 10)).collect();
        let mut w = Work::default();
        w.pack(&segs, 64, 16 << 20);
        assert_eq!(w.ends.len(), 3);
        for j in 0..w.ends.len() {
            let (pieces, bytes) = w.chunk(j);
            let first = if j == 0 { 0 } else { w.ends[j - 1].0 };
            assert_eq!(pieces, &w.pieces[first..w.ends[j].0]);
            assert_eq!(bytes, pieces.len() * 64 * (16 << 10));
            let tasks = w.tasks.iter().filter(|t| t.chunk == j).count();
            assert_eq!(w.left[j].load(std::sync::atomic::Ordering::Relaxed), tasks);
        }
        assert_eq!(w.chunk(0).0.len(), 16);
        assert_eq!(w.chunk(2).0.len(), 8);
        assert_eq!(w.tasks.iter().filter(|t| t.chunk == 0).count(), 128);
        // Packed again, nothing of the first move is left.
        w.pack(&segs[..1], 64, 16 << 20);
        assert_eq!((w.ends.len(), w.left.len(), w.tasks.len()), (1, 1, 8));
        assert_eq!(w.left[0].load(std::sync::atomic::Ordering::Relaxed), 8);
    }

    #[test]
    fn cut_covers_every_row_of_every_chunk_once_in_order() {
        let segs: Vec<_> = (0..300)
            .map(|i| seg(i * 100_000, 7 + i * 90_000, 512 + 97 * (i as usize % 50)))
            .collect();
        for (rows, chunk, task) in [
            (1, 1 << 20, 32 << 10),
            (3, 64 << 10, 1000),
            (64, 1 << 20, 32 << 10),
            (7, 40_000, 1),
        ] {
            let (mut pieces, mut ends, mut tasks) = (Vec::new(), Vec::new(), Vec::new());
            pack(&segs, rows, chunk, &mut pieces, &mut ends);
            cut(&pieces, &ends, rows, task, &mut tasks);
            let mut first = 0;
            let mut it = tasks.iter().peekable();
            for (j, &(end, _)) in ends.iter().enumerate() {
                // This chunk's tasks: consecutive, from row 0 to its last row.
                let mut at = 0;
                while let Some(t) = it.next_if(|t| t.chunk == j) {
                    assert_eq!(t.start, at, "{t:?}");
                    assert!(t.end > t.start);
                    let bytes: usize = (t.start..t.end).map(|r| pieces[first + r / rows].len).sum();
                    // No task holds a whole row more than it needs.
                    let last = pieces[first + (t.end - 1) / rows].len;
                    assert!(bytes < task + last || t.end - t.start == 1, "{t:?} {bytes}");
                    at = t.end;
                }
                assert_eq!(at, (end - first) * rows, "chunk {j}");
                first = end;
            }
            assert!(it.next().is_none());
        }
        let mut tasks = vec![Task {
            chunk: 9,
            start: 0,
            end: 1,
        }];
        cut(&[], &[], 4, 1 << 10, &mut tasks);
        assert!(tasks.is_empty());
    }
}
