use super::*;
use crate::dlpack::{DType, TensorMeta};
use crate::error::Error;
use rstest::rstest;

fn meta(base: u64, dtype: DType, shape: &[i64]) -> TensorMeta {
    TensorMeta::host_nd(base, dtype, shape, false).expect("a valid shape")
}

#[rstest]
#[case::per_layer_k_v_first(&[2, 8, 16, 4], 1, (8, 128, 2))]
#[case::per_layer_blocks_first(&[8, 2, 16, 4], 0, (8, 256, 1))]
#[case::cross_layer(&[8, 32, 2, 16, 4], 0, (8, 8192, 1))]
#[case::innermost(&[3, 5], 1, (5, 2, 3))]
fn layouts_come_from_the_shape_and_the_block_dimension(
    #[case] shape: &[i64],
    #[case] block_dim: usize,
    #[case] want: (usize, usize, usize),
) {
    let l = BlockLayout::of(&meta(0x1000, DType::F16, shape), block_dim).unwrap();
    assert_eq!((l.num_blocks, l.bytes, l.outer), want);
    assert_eq!(l.base, 0x1000);
}

#[rstest]
#[case::no_such_dimension(&[2, 8, 16], 3)]
#[case::no_block(&[2, 0, 16], 1)]
#[case::empty_block(&[2, 8, 0], 1)]
#[case::no_part(&[0, 8, 16], 1)]
fn layouts_refuse_what_holds_no_block(#[case] shape: &[i64], #[case] block_dim: usize) {
    let e = BlockLayout::of(&meta(0x1000, DType::F32, shape), block_dim).unwrap_err();
    assert!(matches!(e, Error::InvalidArgument { .. }), "{e:?}");
}

fn layout(base: u64, num_blocks: usize, bytes: usize, outer: usize) -> BlockLayout {
    BlockLayout {
        base,
        num_blocks,
        bytes,
        outer,
    }
}

/// Runs the segments over byte arrays standing for the two tensors' memory.
fn apply(segs: &[Segment], src: &BlockLayout, s: &[u8], dst: &BlockLayout, d: &mut [u8]) {
    for g in segs {
        let (a, b) = ((g.src - src.base) as usize, (g.dst - dst.base) as usize);
        d[b..b + g.len].copy_from_slice(&s[a..a + g.len]);
    }
}

/// Distinct, never-zero bytes per tensor, part, block and offset.
fn pattern(l: &BlockLayout, tag: u8) -> Vec<u8> {
    (0..l.outer * l.num_blocks * l.bytes)
        .map(|i| (i.wrapping_mul(31) ^ usize::from(tag)).wrapping_add(i / 251) as u8 | 1)
        .collect()
}

/// Even, so never one of the pattern's (odd) bytes.
const POISON: u8 = 0xEE;

/// What moving block by block writes.
fn expected(src: &BlockLayout, s: &[u8], dst: &BlockLayout, ids: &[(usize, usize)]) -> Vec<u8> {
    let mut d = vec![POISON; dst.outer * dst.num_blocks * dst.bytes];
    for part in 0..src.outer {
        for &(a, b) in ids {
            let from = (part * src.num_blocks + a) * src.bytes;
            let to = (part * dst.num_blocks + b) * dst.bytes;
            d[to..to + dst.bytes].copy_from_slice(&s[from..from + src.bytes]);
        }
    }
    d
}

#[rstest]
#[case::one_run(&[3, 4, 5], &[7, 8, 9], 1)]
#[case::unsorted_run(&[5, 3, 4], &[9, 7, 8], 1)]
#[case::broken_on_the_source(&[3, 5], &[7, 8], 2)]
#[case::broken_on_the_destination(&[3, 4], &[7, 9], 2)]
#[case::reversed(&[3, 4, 5], &[9, 8, 7], 3)]
#[case::repeated_source(&[3, 3, 4], &[7, 1, 8], 2)]
#[case::repeated_source_after_its_run(&[3, 3, 4], &[7, 9, 8], 2)]
#[case::empty(&[], &[], 0)]
fn adjacent_ids_merge_into_one_copy_per_part(
    #[case] src_ids: &[usize],
    #[case] dst_ids: &[usize],
    #[case] runs: usize,
) {
    let (src, dst) = (layout(0x10_0000, 10, 48, 2), layout(0x90_0000, 12, 48, 2));
    let mut segs = Vec::new();
    plan(&src, &dst, src_ids, dst_ids, &mut segs).unwrap();
    assert_eq!(segs.len(), 2 * runs);
    let s = pattern(&src, 1);
    let mut d = vec![POISON; 2 * 12 * 48];
    apply(&segs, &src, &s, &dst, &mut d);
    let ids: Vec<_> = src_ids
        .iter()
        .copied()
        .zip(dst_ids.iter().copied())
        .collect();
    assert!(d == expected(&src, &s, &dst, &ids));
}

/// A small deterministic generator (xorshift), so every failure names its seed.
struct Rng(u64);

impl Rng {
    fn below(&mut self, n: usize) -> usize {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        (self.0 % n as u64) as usize
    }
}

#[test]
fn random_moves_write_every_block_and_nothing_else_in_the_fewest_copies() {
    for seed in 1..400u64 {
        let mut r = Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15));
        let (outer, bytes) = (1 + r.below(3), 1 + r.below(40));
        let (ns, nd) = (1 + r.below(40), 1 + r.below(40));
        let src = layout(0x1000, ns, bytes, outer);
        let dst = layout(0x80_0000, nd, bytes, outer);
        // Distinct destinations: a shuffled prefix, kept in runs now and then.
        let mut dsts: Vec<usize> = (0..nd).collect();
        if r.below(2) == 0 {
            for i in (1..nd).rev() {
                dsts.swap(i, r.below(i + 1));
            }
        }
        dsts.truncate(r.below(nd + 1));
        let start = r.below(ns);
        let srcs: Vec<usize> = (0..dsts.len())
            .map(|i| {
                if r.below(3) == 0 {
                    r.below(ns)
                } else {
                    (start + i) % ns
                }
            })
            .collect();
        let mut segs = Vec::new();
        plan(&src, &dst, &srcs, &dsts, &mut segs).unwrap();
        let s = pattern(&src, seed as u8);
        let mut d = vec![POISON; outer * nd * bytes];
        apply(&segs, &src, &s, &dst, &mut d);
        let ids: Vec<_> = srcs.iter().copied().zip(dsts.iter().copied()).collect();
        assert!(d == expected(&src, &s, &dst, &ids), "seed {seed}");
        // The fewest copies: one per part and per pair that no pair can precede in a run
        // (a destination names one source, so a pair's predecessor, if any, is unique).
        let set: std::collections::HashSet<_> = ids.iter().copied().collect();
        let runs = ids
            .iter()
            .filter(|&&(a, b)| a == 0 || b == 0 || !set.contains(&(a - 1, b - 1)))
            .count();
        assert_eq!(segs.len(), outer * runs, "seed {seed}");
        assert!(
            segs.iter().all(|g| g.len % bytes == 0 && g.len > 0),
            "seed {seed}"
        );
    }
}

/// The three ways `runs` orders a move (a table by destination when the destination side holds
/// few blocks for the ids, one sorted word per pair below 2^32 blocks, sorted pairs above)
/// merge the same runs and name the same destination given twice.
#[test]
fn every_ordering_merges_the_same_runs_and_names_the_same_duplicate() {
    let src: &[usize] = &[9, 3, 4, 3, 5, 0, 7];
    let dst: &[usize] = &[1, 7, 8, 10, 9, 2, 0];
    let want = vec![
        plan::Run {
            src: 7,
            dst: 0,
            len: 1,
        },
        plan::Run {
            src: 9,
            dst: 1,
            len: 1,
        },
        plan::Run {
            src: 0,
            dst: 2,
            len: 1,
        },
        plan::Run {
            src: 3,
            dst: 7,
            len: 3,
        },
        plan::Run {
            src: 3,
            dst: 10,
            len: 1,
        },
    ];
    // Table (11 <= 8 * 7), sorted words (80 > 56), sorted pairs (past 2^32 blocks).
    for (ns, nd) in [(10, 11), (10, 80), (10, 1 << 33), (1 << 33, 11)] {
        let got = plan::runs((src, "s"), (dst, "d"), ns, nd).unwrap();
        assert_eq!(got, want, "{ns} / {nd} blocks");
        let e = plan::runs((src, "s"), (&[5, 4, 9, 5, 4, 1, 0], "d"), ns, nd).unwrap_err();
        assert!(e.to_string().contains("4 twice"), "{ns} / {nd} blocks: {e}");
    }
}

/// A move in the background is checked on the caller's thread by `check_ids` and merged later
/// by `runs`: for every move, valid or not, both give the same verdict and the same error, and
/// `check_ids` leaves its scratch all zeros (the next check starts clean), also after refusing.
#[test]
fn the_unmerged_check_refuses_exactly_what_runs_refuses() {
    let mut seen = Vec::new();
    let mut refused = [0usize; 4];
    for seed in 1..3000u64 {
        let mut r = Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15));
        let (ns, nd) = (1 + r.below(300), 1 + r.below(300));
        let n = r.below(40);
        // Mostly valid ids; now and then one out of range, a destination twice, or a length off.
        let mut src: Vec<usize> = (0..n).map(|_| r.below(ns)).collect();
        let mut dst: Vec<usize> = (0..nd).collect();
        for i in (1..nd).rev() {
            dst.swap(i, r.below(i + 1));
        }
        dst.truncate(n.min(nd));
        src.truncate(dst.len());
        match r.below(8) {
            0 if !src.is_empty() => {
                let i = r.below(src.len());
                src[i] = ns + r.below(3);
            }
            1 if !dst.is_empty() => {
                let i = r.below(dst.len());
                dst[i] = nd + r.below(3);
            }
            2 if dst.len() > 1 => {
                let (a, b) = (r.below(dst.len()), r.below(dst.len()));
                dst[a] = dst[b];
            }
            3 => src.push(0),
            _ => {}
        }
        let merged = plan::runs((&src, "s"), (&dst, "d"), ns, nd);
        let checked = plan::check_ids((&src, "s"), (&dst, "d"), ns, nd, &mut seen);
        match (&merged, &checked) {
            (Ok(_), Ok(())) => refused[0] += 1,
            (Err(a), Err(b)) => {
                assert_eq!(a.to_string(), b.to_string(), "seed {seed}");
                let twice = a.to_string().contains("twice");
                refused[if twice { 1 } else { 2 }] += 1;
            }
            _ => panic!("seed {seed}: runs {merged:?}, check_ids {checked:?}"),
        }
        assert!(
            seen.iter().all(|&w| w == 0),
            "seed {seed}: scratch left dirty"
        );
        refused[3] = refused[3].max(seen.len());
    }
    // Every kind of verdict was seen, and the scratch grew to the largest side's bits.
    assert!(refused[..3].iter().all(|&c| c > 100), "{refused:?}");
    assert_eq!(refused[3], 300usize.div_ceil(64), "{refused:?}");
}

/// Ids past 2^32 (tensors of more blocks) keep their high bits: no path that packs ids into
/// 32-bit halves may take them.
#[test]
fn ids_past_u32_keep_their_high_bits() {
    let big = 1usize << 32;
    let run = |src, dst, len| plan::Run { src, dst, len };
    /// Source ids, destination ids, blocks on each side, the runs wanted.
    type Case<'a> = (&'a [usize], &'a [usize], usize, usize, Vec<plan::Run>);
    let cases: [Case<'_>; 3] = [
        // Both sides past 2^32.
        (
            &[big + 3, big + 4, 5, big + 9],
            &[big + 7, big + 8, 2, 0],
            1 << 33,
            1 << 33,
            vec![run(big + 9, 0, 1), run(5, 2, 1), run(big + 3, big + 7, 2)],
        ),
        // Sources past 2^32, few destination blocks (where a table by destination would do).
        (
            &[big + 3, big + 4, 5],
            &[1, 2, 0],
            1 << 33,
            3,
            vec![run(5, 0, 1), run(big + 3, 1, 2)],
        ),
        // Destinations past 2^32.
        (
            &[3, 4],
            &[big + 1, big + 2],
            10,
            1 << 33,
            vec![run(3, big + 1, 2)],
        ),
    ];
    for (src, dst, ns, nd, want) in cases {
        assert_eq!(plan::runs((src, "s"), (dst, "d"), ns, nd).unwrap(), want);
    }
}

/// `segments` checks runs against its own two tensors (a mover checks ids against the fewest
/// blocks of any pair): a run past either side alone is refused, nothing appended.
#[test]
fn segments_refuse_a_run_past_either_tensor() {
    let (src, dst) = (layout(0, 8, 64, 2), layout(0x1000, 6, 64, 2));
    for r in [
        plan::Run {
            src: 7,
            dst: 0,
            len: 2,
        },
        plan::Run {
            src: 0,
            dst: 5,
            len: 2,
        },
    ] {
        let mut out = Vec::new();
        let e = plan::segments(&src, &dst, &[r], &mut out).unwrap_err();
        assert!(matches!(e, Error::InvalidArgument { .. }), "{e:?}");
        assert!(out.is_empty());
    }
    let mut out = Vec::new();
    plan::segments(
        &src,
        &dst,
        &[plan::Run {
            src: 6,
            dst: 4,
            len: 2,
        }],
        &mut out,
    )
    .unwrap();
    assert_eq!(out.len(), 2);
}

#[rstest]
#[case::block_sizes_differ(layout(0, 8, 64, 2), layout(0, 8, 32, 2), &[1], &[1])]
#[case::parts_differ(layout(0, 8, 64, 2), layout(0, 8, 64, 1), &[1], &[1])]
#[case::lengths_differ(layout(0, 8, 64, 2), layout(0, 8, 64, 2), &[1, 2], &[1])]
#[case::source_out_of_range(layout(0, 8, 64, 2), layout(0, 9, 64, 2), &[8], &[8])]
#[case::destination_out_of_range(layout(0, 9, 64, 2), layout(0, 8, 64, 2), &[8], &[8])]
#[case::destination_twice(layout(0, 8, 64, 2), layout(0, 8, 64, 2), &[1, 2], &[3, 3])]
fn bad_moves_are_refused_and_plan_nothing(
    #[case] src: BlockLayout,
    #[case] dst: BlockLayout,
    #[case] src_ids: &[usize],
    #[case] dst_ids: &[usize],
) {
    let before = vec![Segment {
        src: 1,
        dst: 2,
        len: 3,
    }];
    let mut segs = before.clone();
    let e = plan(&src, &dst, src_ids, dst_ids, &mut segs).unwrap_err();
    assert!(matches!(e, Error::InvalidArgument { .. }), "{e:?}");
    assert_eq!(segs, before);
}

/// Pairs whose device tensor i sits at `dev(i)` and host tensor i at `host(i)`, each `blocks`
/// blocks of 2 parts of 64 bytes (extent `blocks * 128`).
fn pairs(
    n: usize,
    blocks: usize,
    dev: impl Fn(u64) -> u64,
    host: impl Fn(u64) -> u64,
) -> Vec<plan::Pair> {
    (0..n as u64)
        .map(|i| plan::Pair {
            device: layout(dev(i), blocks, 64, 2),
            host: layout(host(i), blocks, 64, 2),
            device_read_only: false,
            host_read_only: false,
        })
        .collect()
}

#[rstest]
#[case::abutting(3, |i| 0x10_0000 + i * 1280, |i| 0x7f00_0000 + i * 1280, Some((1280, 1280)))]
#[case::with_gaps(4, |i| 0x10_0000 + i * 4096, |i| 0x7f00_0000 + i * 2048, Some((4096, 2048)))]
#[case::one_pair(1, |_| 0x10_0000, |_| 0x7f00_0000, None)]
#[case::overlapping(3, |i| 0x10_0000 + i * 1024, |i| 0x7f00_0000 + i * 1280, None)]
#[case::descending(3, |i| 0x10_0000 - i * 1280, |i| 0x7f00_0000 + i * 1280, None)]
#[case::irregular(3, |i| 0x10_0000 + i * 1280 + (i / 2) * 256, |i| 0x7f00_0000 + i * 1280, None)]
#[case::host_irregular(3, |i| 0x10_0000 + i * 1280, |i| 0x7f00_0000 + i * i * 1280, None)]
#[case::past_the_largest_pitch(2, |i| 0x10_0000 + i * (1 << 31), |i| 0x7f00_0000 + i * 1280, None)]
#[case::at_the_largest_pitch(2, |i| 0x10_0000 + i * ((1 << 31) - 1), |i| 0x7f00_0000 + i * 1280, Some(((1 << 31) - 1, 1280)))]
fn two_d_copies_need_one_layout_at_one_stride(
    #[case] n: usize,
    #[case] dev: fn(u64) -> u64,
    #[case] host: fn(u64) -> u64,
    #[case] want: Option<(usize, usize)>,
) {
    assert_eq!(strides::strides(&pairs(n, 10, dev, host)), want);
}

#[test]
fn two_d_copies_need_one_layout() {
    let mut p = pairs(3, 10, |i| 0x10_0000 + i * 1280, |i| 0x7f00_0000 + i * 1280);
    assert!(strides::strides(&p).is_some());
    p[2].host.num_blocks = 9;
    assert_eq!(strides::strides(&p), None);
    p[2].host.num_blocks = 10;
    p[1].device.bytes = 32;
    assert_eq!(strides::strides(&p), None);
    p[1].device.bytes = 64;
    p[1].device.outer = 1;
    assert_eq!(strides::strides(&p), None, "one part fewer");
}

#[rstest]
#[case::load_4k(Direction::Load, 2048, 4 << 10, 2048, true)]
#[case::load_64k(Direction::Load, 2048, 64 << 10, 2048, true)]
#[case::load_merged_1m(Direction::Load, 2048, 64 << 10, 128, true)]
#[case::offload_8k(Direction::Offload, 2048, 8 << 10, 2048, true)]
#[case::offload_past_8k(Direction::Offload, 2048, (8 << 10) + 4, 2048, false)]
#[case::offload_16k(Direction::Offload, 2048, 16 << 10, 2048, false)]
#[case::offload_under_32k(Direction::Offload, 2048, (32 << 10) - 4, 2048, false)]
#[case::offload_32k(Direction::Offload, 2048, 32 << 10, 2048, true)]
#[case::offload_merged_to_16k(Direction::Offload, 4, 4 << 10, 1, false)]
#[case::offload_merged_to_32k(Direction::Offload, 8, 4 << 10, 1, true)]
#[case::nothing(Direction::Load, 0, 4 << 10, 0, false)]
fn two_d_copies_where_they_beat_a_batch(
    #[case] direction: Direction,
    #[case] blocks: usize,
    #[case] part: usize,
    #[case] runs: usize,
    #[case] want: bool,
) {
    assert_eq!(strides::two_d_wins(direction, blocks, part, runs), want);
}

#[rstest]
#[case::few_copies(Direction::Load, 4095, 4 << 10, 1)]
#[case::load(Direction::Load, 4096, 4 << 10, 4)]
#[case::load_large(Direction::Load, 131_072, 64 << 10, 4)]
#[case::offload_8k(Direction::Offload, 131_072, 8 << 10, 1)]
#[case::offload_past_8k(Direction::Offload, 131_072, (8 << 10) + 1, 2)]
#[case::offload_few(Direction::Offload, 4095, 16 << 10, 1)]
#[case::offload_16k(Direction::Offload, 4096, 16 << 10, 2)]
fn batches_of_many_copies_are_issued_from_several_threads(
    #[case] direction: Direction,
    #[case] copies: usize,
    #[case] copy_bytes: usize,
    #[case] want: usize,
) {
    assert_eq!(strides::batch_threads(direction, copies, copy_bytes), want);
}

/// The strategy of a move (`Tensors::how`): 2D copies across the tensors when they sit at one
/// stride and 2D copies win (every load; offloads unless the copies average 9-31 KiB), with each
/// side's pitch and direction; else a batch from as many threads as `batch_threads` says for the
/// move's copies and their average size; one call per copy without the batched call.
#[test]
fn how_picks_2d_copies_a_batch_or_single_copies() {
    use super::issue::Issue;
    use super::tensors::Tensors;
    // Two pairs of [2 parts, 4096 blocks, 16 KiB]: 4 copies per run.
    let two = |bytes: usize| -> Vec<plan::Pair> {
        (0..2u64)
            .map(|i| plan::Pair {
                device: layout(0x1_0000_0000 * (i + 1), 4096, bytes, 2),
                host: layout(0x100_0000_0000 * (i + 1), 4096, bytes, 2),
                device_read_only: false,
                host_read_only: false,
            })
            .collect()
    };
    let strided = Tensors::new(two(16 << 10), true, Some((1000, 2000)));
    // A load: 2D copies, host pitch to device pitch.
    assert!(
        matches!(
            strided.how(Direction::Load, 2048, 2048, None).0,
            Issue::Strided {
                src_pitch: 2000,
                dst_pitch: 1000,
                rows: 2,
                to_host: false
            }
        ),
        "{:?}",
        strided.how(Direction::Load, 2048, 2048, None).0
    );
    // An offload of 2048 blocks in 512 runs: 64 KiB copies, 2D (device pitch to host pitch).
    let wide = strided.how(Direction::Offload, 2048, 512, None).0;
    assert!(
        matches!(
            wide,
            Issue::Strided {
                src_pitch: 1000,
                dst_pitch: 2000,
                rows: 2,
                to_host: true
            }
        ),
        "{wide:?}"
    );
    // In 2048 runs: 16 KiB copies (within 9-31 KiB: a batch), 2048 runs x 4 parts = 8192
    // copies (>= 4096: split) of more than 8 KiB: 2 threads.
    let b = strided.how(Direction::Offload, 2048, 2048, None).0;
    assert!(matches!(b, Issue::Batched { threads: 2 }), "{b:?}");
    // 1023 runs x 4 parts = 4092 copies: too few to split.
    let b = strided.how(Direction::Offload, 1023, 1023, None).0;
    assert!(matches!(b, Issue::Batched { threads: 1 }), "{b:?}");
    // 8 KiB parts, no common stride: 8 KiB offload copies stay on one thread, loads take 4.
    let small = Tensors::new(two(8 << 10), true, None);
    let b = small.how(Direction::Offload, 2048, 2048, None).0;
    assert!(matches!(b, Issue::Batched { threads: 1 }), "{b:?}");
    let b = small.how(Direction::Load, 2048, 2048, None).0;
    assert!(matches!(b, Issue::Batched { threads: 4 }), "{b:?}");
    // No batched call: one call per copy, 2D copies still where they win.
    let old = Tensors::new(two(16 << 10), false, Some((1000, 2000)));
    let b = old.how(Direction::Offload, 2048, 2048, None).0;
    assert!(matches!(b, Issue::PerCopy), "{b:?}");
    assert!(matches!(
        old.how(Direction::Load, 1, 1, None).0,
        Issue::Strided { .. }
    ));
}

/// Two tensors at one stride on each side, 4096 blocks of 2 parts of 16 KiB (64 KiB a block
/// across them), batches and timing on.
pub(super) fn two_at_one_stride() -> super::tensors::Tensors {
    let pairs = (0..2u64)
        .map(|i| plan::Pair {
            device: layout(0x1_0000_0000 * (i + 1), 4096, 16 << 10, 2),
            host: layout(0x100_0000_0000 * (i + 1), 4096, 16 << 10, 2),
            device_read_only: false,
            host_read_only: false,
        })
        .collect();
    super::tensors::Tensors::new(pairs, true, Some((1000, 2000)))
}

#[test]
fn auto_staging_takes_one_direction_at_a_time_unless_copies_are_small() {
    use super::staged::{PAIR_BELOW_COPY, PAIR_UNSTAGED_FROM, Staging};
    let t = two_at_one_stride();
    let (big, small) = (PAIR_UNSTAGED_FROM, PAIR_BELOW_COPY - 1);
    // Auto (the default): while the offload stages, the load does not; then it may.
    let off = t
        .take_staging(Direction::Offload, big)
        .expect("the first turn");
    assert!(t.take_staging(Direction::Load, big).is_none());
    // ... unless the load's copies are small: then both stage, and the load's turn, ending
    // first, leaves the offload's mark.
    let small_load = t
        .take_staging(Direction::Load, small)
        .expect("small copies");
    drop(small_load);
    assert!(t.take_staging(Direction::Load, big).is_none());
    drop(off);
    let load = t.take_staging(Direction::Load, big).expect("free again");
    assert!(t.take_staging(Direction::Offload, big).is_none());
    // A small turn beside it that outlives it clears no mark taken after it.
    let small_off = t
        .take_staging(Direction::Offload, small)
        .expect("small copies");
    drop(load);
    let load = t.take_staging(Direction::Load, big).expect("free again");
    drop(small_off);
    assert!(t.take_staging(Direction::Offload, big).is_none());
    drop(load);
    // Always: both at once (tests, measurements); a turn taken then holds nothing.
    t.set_staging(Staging::Always, super::staged::DEFAULT_CHUNK);
    let off = t.take_staging(Direction::Offload, big).expect("always");
    assert!(t.take_staging(Direction::Load, big).is_some());
    t.set_staging(Staging::Auto, super::staged::DEFAULT_CHUNK);
    assert!(t.take_staging(Direction::Load, big).is_some());
    drop(off);
}

#[test]
fn auto_staging_takes_large_moves_in_copies_under_128_kib() {
    use super::staged::{DEFAULT_CHUNK, Staging};
    let t = two_at_one_stride(); // 64 KiB a block across the tensors
    let staged = |blocks, runs| t.staged(Direction::Load, blocks, runs).is_some();
    // 512 blocks (32 MiB): copies of 16 KiB (every block a run), 112 KiB (runs of 7), 128 KiB.
    assert!(staged(512, 512));
    assert!(staged(512, 73));
    assert!(!staged(512, 64));
    // Under 8 MiB: 127 blocks are 8 MiB less 64 KiB; 128 are 8 MiB.
    assert!(!staged(127, 127));
    assert!(staged(128, 128));
    t.set_staging(Staging::Never, DEFAULT_CHUNK);
    assert!(!staged(512, 512));
    t.set_staging(Staging::Always, DEFAULT_CHUNK);
    assert!(staged(512, 64) && staged(1, 1));
}
