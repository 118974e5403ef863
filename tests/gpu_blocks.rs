//! GPU tests of the block mover: every block of every tensor checked after every move (values
//! distinct per tensor, part and block; destinations poisoned; blocks not moved still poisoned),
//! both directions, three layouts, three kinds of stream; refusals that issue nothing.

mod common;

use common::{POISON, gpu_or_skip, stall_handle};

/// Shared by every test, held alone by the one that stalls a stream: while the legacy stream is
/// stalled, a test on another thread that frees pinned memory or synchronizes waits for the
/// stall inside the driver, and the driver calls of the stalling test then wait for it in turn
/// until the stall's 20 s bound lets go, after which the moves "under the stall" have completed
/// (runs h-k: the legacy-stream case failed so with 4 test threads, a lock among the stalling
/// tests alone did not help; alone, every case passed).
static GPU: std::sync::RwLock<()> = std::sync::RwLock::new(());

/// The test's share of the GPU (see [`GPU`]).
fn shared() -> std::sync::RwLockReadGuard<'static, ()> {
    GPU.read().unwrap_or_else(|e| e.into_inner())
}
use pinstage::blocks::{BlockMover, Choice, Direction, Staging, Strategy};
use pinstage::host::PinnedFlags;
use pinstage::testing::DeviceBuffer;
use pinstage::{DeviceView, Error, PinnedBuffer, Stream, StreamHandle};
use rstest::rstest;

/// The view of `len` bytes at `ptr` as a u8 tensor of `shape` (`device`: CUDA ordinal, or host).
fn view(ptr: u64, device: Option<i32>, shape: &[i64]) -> DeviceView<'static> {
    // SAFETY: every test keeps the buffer behind `ptr` alive while the view is used.
    unsafe { pinstage::testing::bytes_view(ptr, device, shape, false) }
}

/// Byte `i` of block `b`, part `p`, tensor `t` on side `side` of move `m`: never the poison.
fn byte(side: u8, m: u32, t: usize, p: usize, b: usize, i: usize) -> u8 {
    let x = (m as u64) << 40 ^ (t as u64) << 32 ^ (p as u64) << 28 ^ (b as u64) << 12 ^ i as u64;
    let x = (x ^ side as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    let v = (x >> 56) as u8;
    if v == POISON { v ^ 0x0F } else { v }
}

/// The shape of one side: `(shape, block_dim, parts)` for `blocks` blocks of `bytes` bytes per
/// part, `tensors` tensors (`cross`: one tensor holding them all).
#[derive(Clone, Copy, Debug)]
enum Layout {
    /// `[2, blocks, bytes]`, block_dim 1: K and V.
    KvFirst,
    /// `[blocks, 2, bytes]`, block_dim 0.
    BlocksFirst,
    /// One `[blocks, tensors, 2, bytes]` tensor, block_dim 0.
    Cross,
}

impl Layout {
    fn shape(self, blocks: usize, bytes: usize, tensors: usize) -> (Vec<i64>, usize) {
        let (b, n, l) = (blocks as i64, bytes as i64, tensors as i64);
        match self {
            Layout::KvFirst => (vec![2, b, n], 1),
            Layout::BlocksFirst => (vec![b, 2, n], 0),
            Layout::Cross => (vec![b, l, 2, n], 0),
        }
    }
    fn tensors(self, tensors: usize) -> usize {
        if matches!(self, Layout::Cross) {
            1
        } else {
            tensors
        }
    }
    /// Offset of byte 0 of (part p, block b) in a tensor of `blocks` blocks of `bytes` per part,
    /// and the length of a part as the mover sees it.
    fn at(self, blocks: usize, bytes: usize, tensors: usize, p: usize, b: usize) -> usize {
        match self {
            Layout::KvFirst => (p * blocks + b) * bytes,
            Layout::BlocksFirst => b * 2 * bytes + p * bytes,
            Layout::Cross => b * tensors * 2 * bytes + p * bytes,
        }
    }
    /// Parts of one block of one tensor as the test writes them.
    fn parts(self, tensors: usize) -> usize {
        if matches!(self, Layout::Cross) {
            2 * tensors
        } else {
            2
        }
    }
}

/// Deterministic distinct ids: the first `n` of a permutation of `0..range` (the tests splice
/// runs of adjacent pairs in where they want them).
fn ids(n: usize, range: usize, seed: u64) -> Vec<usize> {
    pinstage::testing::shuffled_ids(n, range, seed)
}

struct Sides {
    dev: Vec<DeviceBuffer>,
    host: Vec<PinnedBuffer>,
    /// Tensor t's (buffer, byte offset) on each side: one buffer per tensor, or (pooled) all
    /// tensors in one buffer at a regular stride, as slices of one allocation are.
    dev_at: Vec<(usize, usize)>,
    host_at: Vec<(usize, usize)>,
    layout: Layout,
    tensors: usize,
    bytes: usize,
    dev_blocks: usize,
    host_blocks: usize,
}

impl Sides {
    fn new(
        d: &pinstage::Device,
        layout: Layout,
        tensors: usize,
        bytes: usize,
        dev_blocks: usize,
        host_blocks: usize,
    ) -> Self {
        Self::with(d, layout, tensors, bytes, dev_blocks, host_blocks, false)
    }

    /// `pooled`: each side's tensors in one allocation, `stride` apart (a 256-byte gap after
    /// each tensor).
    fn with(
        d: &pinstage::Device,
        layout: Layout,
        tensors: usize,
        bytes: usize,
        dev_blocks: usize,
        host_blocks: usize,
        pooled: bool,
    ) -> Self {
        let n = layout.tensors(tensors);
        let per = |blocks| 2 * blocks * bytes * if n == 1 { tensors } else { 1 };
        // (buffers, each buffer's bytes, tensor t's (buffer, offset))
        let place = |blocks: usize| -> (usize, usize, Vec<(usize, usize)>) {
            if pooled {
                let stride = per(blocks) + 256;
                (1, stride * n, (0..n).map(|t| (0, t * stride)).collect())
            } else {
                (n, per(blocks), (0..n).map(|t| (t, 0)).collect())
            }
        };
        let (nd, dlen, dev_at) = place(dev_blocks);
        let (nh, hlen, host_at) = place(host_blocks);
        Sides {
            dev: (0..nd)
                .map(|_| DeviceBuffer::new(d, dlen).unwrap())
                .collect(),
            host: (0..nh)
                .map(|_| PinnedBuffer::new(d, hlen, PinnedFlags::PORTABLE).unwrap())
                .collect(),
            dev_at,
            host_at,
            layout,
            tensors,
            bytes,
            dev_blocks,
            host_blocks,
        }
    }

    fn views(&self) -> (Vec<DeviceView<'static>>, Vec<DeviceView<'static>>, usize) {
        let (ds, dim) = self.layout.shape(self.dev_blocks, self.bytes, self.tensors);
        let (hs, _) = self
            .layout
            .shape(self.host_blocks, self.bytes, self.tensors);
        let ord = self.dev[0].device().ordinal();
        (
            self.dev_at
                .iter()
                .map(|&(b, o)| view(self.dev[b].ptr() + o as u64, Some(ord), &ds))
                .collect(),
            self.host_at
                .iter()
                .map(|&(b, o)| view(self.host[b].as_ptr() as u64 + o as u64, None, &hs))
                .collect(),
            dim,
        )
    }

    /// Bytes of one tensor of side `side` (0 device, 1 host).
    fn tensor_len(&self, side: u8) -> usize {
        let blocks = if side == 0 {
            self.dev_blocks
        } else {
            self.host_blocks
        };
        let n = self.layout.tensors(self.tensors);
        2 * blocks * self.bytes * if n == 1 { self.tensors } else { 1 }
    }

    /// Fills side `side` (0 device, 1 host) with move `m`'s values.
    fn fill(&mut self, side: u8, m: u32) -> Vec<Vec<u8>> {
        let blocks = if side == 0 {
            self.dev_blocks
        } else {
            self.host_blocks
        };
        let n = self.layout.tensors(self.tensors);
        let parts = self.layout.parts(self.tensors);
        let mut all = Vec::new();
        for t in 0..n {
            let mut data =
                vec![POISON; 2 * blocks * self.bytes * if n == 1 { self.tensors } else { 1 }];
            for b in 0..blocks {
                for p in 0..parts {
                    let at = self.layout.at(blocks, self.bytes, self.tensors, p, b);
                    for i in 0..self.bytes {
                        data[at + i] = byte(side, m, t, p, b, i);
                    }
                }
            }
            if side == 0 {
                let (b, o) = self.dev_at[t];
                self.dev[b].upload(o, &data).unwrap();
            } else {
                let (b, o) = self.host_at[t];
                self.host[b].as_mut_slice()[o..o + data.len()].copy_from_slice(&data);
            }
            all.push(data);
        }
        all
    }

    /// Poisons every byte of side `side`'s buffers (the gaps between pooled tensors too).
    fn poison(&mut self, side: u8) {
        if side == 0 {
            for b in &mut self.dev {
                let len = b.len();
                b.upload(0, &vec![POISON; len]).unwrap();
            }
        } else {
            for b in &mut self.host {
                b.as_mut_slice().fill(POISON);
            }
        }
    }

    /// Tensor `t` of side `side` (pooled: and the gap after it, which must stay poisoned).
    fn read(&self, side: u8, t: usize) -> Vec<u8> {
        let len = self.tensor_len(side);
        if side == 0 {
            let (b, o) = self.dev_at[t];
            let end = (o + len + 256).min(self.dev[b].len());
            let mut out = vec![0u8; end - o];
            self.dev[b].download(o, &mut out).unwrap();
            out
        } else {
            let (b, o) = self.host_at[t];
            let end = (o + len + 256).min(self.host[b].len());
            self.host[b].as_slice()[o..end].to_vec()
        }
    }

    /// Checks that destination side `dst` holds `src[t]`'s block `s` at block `d` for every
    /// pair, and poison everywhere else.
    fn check(&self, dst: u8, src: &[Vec<u8>], src_ids: &[usize], dst_ids: &[usize], what: &str) {
        self.check_onto(dst, None, src, src_ids, dst_ids, what);
    }

    /// As [`Sides::check`], where side `dst` held `base` (its own fill, `None`: poison) before
    /// the move: every other block must still hold it, the gaps poison.
    fn check_onto(
        &self,
        dst: u8,
        base: Option<&[Vec<u8>]>,
        src: &[Vec<u8>],
        src_ids: &[usize],
        dst_ids: &[usize],
        what: &str,
    ) {
        let (sb, db) = if dst == 0 {
            (self.host_blocks, self.dev_blocks)
        } else {
            (self.dev_blocks, self.host_blocks)
        };
        let parts = self.layout.parts(self.tensors);
        for (t, src) in src.iter().enumerate() {
            let mut want = vec![POISON; self.read(dst, t).len()];
            if let Some(base) = base {
                want[..base[t].len()].copy_from_slice(&base[t]);
            }
            for (&s, &d) in src_ids.iter().zip(dst_ids) {
                for p in 0..parts {
                    let from = self.layout.at(sb, self.bytes, self.tensors, p, s);
                    let to = self.layout.at(db, self.bytes, self.tensors, p, d);
                    want[to..to + self.bytes].copy_from_slice(&src[from..from + self.bytes]);
                }
            }
            let got = self.read(dst, t);
            if got != want {
                let first = got.iter().zip(&want).position(|(a, b)| a != b).unwrap();
                panic!(
                    "{what}: tensor {t}: byte {first} is {:#x}, expected {:#x}",
                    got[first], want[first]
                );
            }
        }
    }
}

/// One move between `dev_ids` and `host_ids` in `direction` (in the background or not): the
/// source side filled with values `m`, the destination poisoned; waited for, every block checked.
#[allow(clippy::too_many_arguments)]
fn move_checked(
    s: &mut Sides,
    mover: &BlockMover<'_>,
    direction: Direction,
    dev_ids: &[usize],
    host_ids: &[usize],
    stream: StreamHandle<'_>,
    background: bool,
    m: u32,
) {
    let (from, to) = match direction {
        Direction::Offload => (0, 1),
        Direction::Load => (1, 0),
    };
    let src = s.fill(from, m);
    s.poison(to);
    // SAFETY: waited for below; the buffers outlive the move; nothing else touches them.
    let c = unsafe {
        match (direction, background) {
            (Direction::Offload, false) => mover.offload(dev_ids, host_ids, stream),
            (Direction::Offload, true) => mover.offload_in_background(dev_ids, host_ids, stream),
            (Direction::Load, false) => mover.load(host_ids, dev_ids, stream),
            (Direction::Load, true) => mover.load_in_background(host_ids, dev_ids, stream),
        }
    }
    .unwrap();
    c.wait().unwrap();
    let (src_ids, dst_ids) = match direction {
        Direction::Offload => (dev_ids, host_ids),
        Direction::Load => (host_ids, dev_ids),
    };
    s.check(
        to,
        &src,
        src_ids,
        dst_ids,
        &format!("{} {m}", direction.name()),
    );
}

#[rstest]
#[ignore = "needs a CUDA GPU: run with --include-ignored (scripts/gpu-run does)"]
fn gpu_blocks_every_block_lands(
    #[values(Layout::KvFirst, Layout::BlocksFirst, Layout::Cross)] layout: Layout,
    #[values(64, 4100, 65536)] bytes: usize,
    #[values(0, 1, 2)] stream_kind: u8,
    #[values(false, true)] pooled: bool,
    #[values(false, true)] background: bool,
) {
    let Some(d) = gpu_or_skip("gpu_blocks_every_block_lands") else {
        return;
    };
    let _gpu = shared();
    let own = Stream::new(&d).unwrap();
    let stream = match stream_kind {
        0 => StreamHandle::LEGACY,
        1 => StreamHandle::PER_THREAD,
        _ => own.handle(),
    };
    let (tensors, dev_blocks, host_blocks) = (3, 48, 40);
    let mut s = Sides::with(&d, layout, tensors, bytes, dev_blocks, host_blocks, pooled);
    let (dv, hv, dim) = s.views();
    let mover = BlockMover::new(&dv, &hv, dim).unwrap();
    for m in 0..6u32 {
        let n = [1, 7, 16, 40, 3, 25][m as usize];
        // Ids with a run of adjacent pairs in every other move.
        let (dev_ids, host_ids) = move_ids(m, n, (dev_blocks, host_blocks), (11, 97), (30, 2));
        // Offload into a poisoned host side, then new host values into a poisoned device side.
        let (d, h) = (&dev_ids, &host_ids);
        move_checked(
            &mut s,
            &mover,
            Direction::Offload,
            d,
            h,
            stream,
            background,
            m,
        );
        move_checked(
            &mut s,
            &mover,
            Direction::Load,
            d,
            h,
            stream,
            background,
            m + 100,
        );
    }
    let plan = mover.plan(Direction::Load, &[1, 2, 3], &[5, 6, 9]).unwrap();
    assert_eq!(plan.runs, 2);
    let per_tensor_parts = if matches!(layout, Layout::KvFirst) {
        2
    } else {
        1
    };
    // Strided: tensors at one stride (pooled, several of them); a load then always takes one
    // 2D copy per run and part across every tensor.
    if pooled && layout.tensors(tensors) > 1 {
        assert_eq!(plan.strategy, Strategy::Strided);
        assert_eq!(plan.copies, 2 * per_tensor_parts);
    } else {
        assert_eq!(plan.strategy, Strategy::Batched);
        assert_eq!(plan.copies, 2 * per_tensor_parts * layout.tensors(tensors));
    }
}

/// Ids for move `m`: `n` random pairs of `blocks` (device, host) drawn from `seeds`, with a run
/// of four pairs adjacent on both sides (one copy per part, from block `at.0` on the device and
/// `at.1` on the host) first in every other move.
fn move_ids(
    m: u32,
    n: usize,
    blocks: (usize, usize),
    seeds: (u64, u64),
    at: (usize, usize),
) -> (Vec<usize>, Vec<usize>) {
    let mut dev_ids = ids(n, blocks.0, seeds.0 + m as u64);
    let mut host_ids = ids(n, blocks.1, seeds.1 + m as u64);
    if m % 2 == 1 && n >= 6 {
        let splice = |v: &mut Vec<usize>, at: usize| {
            let rest: Vec<usize> = v
                .iter()
                .copied()
                .filter(|b| !(at..at + 4).contains(b))
                .collect();
            *v = (at..at + 4).chain(rest).take(n).collect();
        };
        splice(&mut dev_ids, at.0);
        splice(&mut host_ids, at.1);
    }
    (dev_ids, host_ids)
}

#[rstest]
#[ignore = "needs a CUDA GPU: run with --include-ignored (scripts/gpu-run does)"]
fn gpu_blocks_staged_moves_land_every_block(
    #[values(Layout::KvFirst, Layout::BlocksFirst, Layout::Cross)] layout: Layout,
    #[values(64, 4100, 65536)] bytes: usize,
    #[values(0, 2)] stream_kind: u8,
) {
    let Some(d) = gpu_or_skip("gpu_blocks_staged_moves_land_every_block") else {
        return;
    };
    let _gpu = shared();
    let own = Stream::new(&d).unwrap();
    let stream = if stream_kind == 0 {
        StreamHandle::LEGACY
    } else {
        own.handle()
    };
    // Staged moves in 64 KiB chunks: a move of up to 40 blocks x 3 tensors x 2 parts of 64 KiB
    // takes dozens of chunks, so the ring of four wraps within a move and from move to move; a
    // 64 KiB part across 3 tensors is split over pieces.
    let (tensors, dev_blocks, host_blocks) = (3, 48, 40);
    let mut s = Sides::with(&d, layout, tensors, bytes, dev_blocks, host_blocks, true);
    let (dv, hv, dim) = s.views();
    let mover = BlockMover::new(&dv, &hv, dim).unwrap();
    mover.set_staging(Staging::Always, 64 << 10).unwrap();
    assert_eq!(mover.staging(), (Staging::Always, 64 << 10));
    assert_eq!(mover.staging_bytes(), 0);
    for m in 0..6u32 {
        let n = [1, 7, 16, 40, 3, 25][m as usize];
        let (dev_ids, host_ids) = move_ids(m, n, (dev_blocks, host_blocks), (211, 307), (20, 5));
        let plan = mover
            .plan_in_background(Direction::Offload, &dev_ids, &host_ids)
            .unwrap();
        assert_eq!(plan.strategy, Strategy::Staged, "{plan:?}");
        assert!(
            plan.calls > plan.copies && plan.reason.contains("always"),
            "{plan:?}"
        );
        let (d_, h_) = (&dev_ids, &host_ids);
        move_checked(&mut s, &mover, Direction::Offload, d_, h_, stream, true, m);
        move_checked(
            &mut s,
            &mover,
            Direction::Load,
            d_,
            h_,
            stream,
            true,
            m + 100,
        );
        // The staged path ran: each direction holds its ring (4 chunks on each side).
        assert_eq!(mover.staging_bytes(), 2 * 2 * 4 * (64 << 10));
    }
    // On the caller's thread a move is never staged.
    let plan = mover.plan(Direction::Load, &[1, 2, 3], &[5, 6, 9]).unwrap();
    assert_ne!(plan.strategy, Strategy::Staged);
}

#[test]
#[ignore = "needs a CUDA GPU: run with --include-ignored (scripts/gpu-run does)"]
fn gpu_blocks_staging_auto_takes_large_moves_of_small_blocks() {
    let Some(d) = gpu_or_skip("gpu_blocks_staging_auto_takes_large_moves_of_small_blocks") else {
        return;
    };
    let _gpu = shared();
    let stream = Stream::new(&d).unwrap();
    // 4 tensors x 2 parts x 16 KiB: 128 KiB a block; 96 random blocks: 12 MiB in 1 MiB chunks.
    let (tensors, bytes, blocks) = (4, 16 << 10, 256);
    let mut s = Sides::with(&d, Layout::KvFirst, tensors, bytes, blocks, blocks, true);
    let (dv, hv, dim) = s.views();
    let mover = BlockMover::new(&dv, &hv, dim).unwrap();
    assert_eq!(
        mover.staging(),
        (Staging::Auto, pinstage::blocks::DEFAULT_CHUNK)
    );
    mover.set_staging(Staging::Auto, 1 << 20).unwrap();
    for m in 0..3u32 {
        let (dev_ids, host_ids) = (
            ids(96, blocks, 5 + m as u64),
            ids(96, blocks, 50 + m as u64),
        );
        for direction in [Direction::Offload, Direction::Load] {
            let (src, dst) = match direction {
                Direction::Offload => (&dev_ids, &host_ids),
                Direction::Load => (&host_ids, &dev_ids),
            };
            let plan = mover.plan_in_background(direction, src, dst).unwrap();
            assert_eq!(plan.strategy, Strategy::Staged, "{plan:?}");
            assert!(plan.calls >= plan.copies + 12, "{plan:?}");
            assert_ne!(
                mover.plan(direction, src, dst).unwrap().strategy,
                Strategy::Staged
            );
            // Under 8 MiB: not staged.
            let small = mover
                .plan_in_background(direction, &src[..40], &dst[..40])
                .unwrap();
            assert_ne!(small.strategy, Strategy::Staged, "{small:?}");
        }
        let (d_, h_) = (&dev_ids, &host_ids);
        let h = stream.handle();
        move_checked(&mut s, &mover, Direction::Offload, d_, h_, h, true, m);
        move_checked(&mut s, &mover, Direction::Load, d_, h_, h, true, m + 100);
    }
    // One run: copies of 12 MiB each side, not staged.
    let run: Vec<usize> = (0..96).collect();
    let plan = mover
        .plan_in_background(Direction::Offload, &run, &run)
        .unwrap();
    assert_ne!(plan.strategy, Strategy::Staged, "{plan:?}");
    mover.set_staging(Staging::Never, 1 << 20).unwrap();
    let (a, b) = (ids(96, blocks, 1), ids(96, blocks, 2));
    let plan = mover
        .plan_in_background(Direction::Offload, &a, &b)
        .unwrap();
    assert_ne!(plan.strategy, Strategy::Staged, "{plan:?}");
    // The rings of the staged moves: 4 chunks of 1 MiB each side, each direction.
    assert_eq!(mover.staging_bytes(), (2 * 2 * 4) << 20);
    for bad in [4096, (1 << 30) + 1] {
        assert!(matches!(
            mover.set_staging(Staging::Always, bad),
            Err(Error::InvalidArgument { .. })
        ));
    }
    assert_eq!(mover.staging().0, Staging::Never);
}

#[rstest]
#[ignore = "needs a CUDA GPU: run with --include-ignored (scripts/gpu-run does)"]
fn gpu_blocks_offload_and_load_at_once_every_move_checked(#[values(false, true)] background: bool) {
    let Some(d) = gpu_or_skip("gpu_blocks_offload_and_load_at_once_every_move_checked") else {
        return;
    };
    let _gpu = shared();
    // Two movers over disjoint halves of one cache: one offloads while the other loads, on two
    // streams, 30 rounds, every block of both checked each round.
    let (a_s, b_s) = (Stream::new(&d).unwrap(), Stream::new(&d).unwrap());
    let mut a = Sides::new(&d, Layout::KvFirst, 4, 16384, 64, 64);
    let mut b = Sides::new(&d, Layout::KvFirst, 4, 16384, 64, 64);
    let (av, ah, dim) = a.views();
    let (bv, bh, _) = b.views();
    let ma = BlockMover::new(&av, &ah, dim).unwrap();
    let mb = BlockMover::new(&bv, &bh, dim).unwrap();
    for m in 0..30u32 {
        let ids_a = ids(32, 64, 5 + m as u64);
        let ids_b = ids(32, 64, 500 + m as u64);
        let src_a = a.fill(0, m);
        a.poison(1);
        let src_b = b.fill(1, m);
        b.poison(0);
        // SAFETY: waited for below; the buffers outlive it.
        let (ca, cb) = unsafe {
            if background {
                // In the background, from one thread: the second call need not wait for the
                // driver to take the first move's copies. The first move is dropped unwaited
                // every third round: its drop waits.
                (
                    ma.offload_in_background(&ids_a, &ids_b, a_s.handle()),
                    mb.load_in_background(&ids_a, &ids_b, b_s.handle()),
                )
            } else {
                (
                    ma.offload(&ids_a, &ids_b, a_s.handle()),
                    mb.load(&ids_a, &ids_b, b_s.handle()),
                )
            }
        };
        let (ca, cb) = (ca.unwrap(), cb.unwrap());
        if m % 3 == 0 {
            drop(ca); // must wait: checked at once
        } else {
            ca.wait().unwrap();
        }
        a.check(1, &src_a, &ids_a, &ids_b, &format!("offload round {m}"));
        cb.wait().unwrap();
        b.check(0, &src_b, &ids_a, &ids_b, &format!("load round {m}"));
    }
}

#[rstest]
#[ignore = "needs a CUDA GPU: run with --include-ignored (scripts/gpu-run does)"]
fn gpu_blocks_one_mover_offloads_and_loads_at_once_every_block_checked(
    #[values(4 << 10, 16 << 10, 64 << 10)] bytes: usize,
) {
    let Some(d) =
        gpu_or_skip("gpu_blocks_one_mover_offloads_and_loads_at_once_every_block_checked")
    else {
        return;
    };
    let _gpu = shared();
    // One mover under auto staging (1 MiB chunks), each round an offload of device blocks of
    // the first half into host blocks of the first half and a load of host blocks of the second
    // half into device blocks of the second half, sent back to back in the background: moves
    // of 10-40 MiB whose copies average about 4 KiB (both directions stage at once), 16 KiB
    // (the load stages; a staged offload beside it hands its chunks not yet begun over to 2D
    // copies) or 64 KiB (the second move goes unstaged, and a staged first one hands over).
    // Both sides filled with their own values first: every block of both checked each round,
    // the untouched ones unchanged.
    let (a_s, b_s) = (Stream::new(&d).unwrap(), Stream::new(&d).unwrap());
    let tensors = 4;
    let blocks = if bytes >= 64 << 10 { 256 } else { 1024 };
    let n = blocks * 5 / 16;
    let handovers = pinstage::testing::staged_handovers();
    // More host blocks than device blocks: the two sides' tensors at different strides.
    let mut s = Sides::with(
        &d,
        Layout::KvFirst,
        tensors,
        bytes,
        blocks,
        blocks + 64,
        true,
    );
    let (dv, hv, dim) = s.views();
    let mover = BlockMover::new(&dv, &hv, dim).unwrap();
    mover.set_staging(Staging::Auto, 1 << 20).unwrap();
    let (half, host_half) = (blocks / 2, (blocks + 64) / 2);
    for m in 0..8u32 {
        let seed = 7 + 2 * m as u64;
        let (off_dev, off_host) = (ids(n, half, seed), ids(n, host_half, seed + 1000));
        let up = |v: Vec<usize>, by| v.into_iter().map(|i| i + by).collect::<Vec<_>>();
        let load_host = up(ids(n, host_half, seed + 1), host_half);
        let load_dev = up(ids(n, half, seed + 1001), half);
        for (direction, src, dst) in [
            (Direction::Offload, &off_dev, &off_host),
            (Direction::Load, &load_host, &load_dev),
        ] {
            let plan = mover.plan_in_background(direction, src, dst).unwrap();
            assert_eq!(plan.strategy, Strategy::Staged, "{plan:?}");
        }
        s.poison(0);
        s.poison(1);
        let dev = s.fill(0, m);
        let host = s.fill(1, m + 100);
        // SAFETY: waited for below; the buffers outlive the moves; the two moves touch
        // disjoint blocks.
        let (off, load) = unsafe {
            let first = |load_first: bool| {
                if load_first {
                    mover.load_in_background(&load_host, &load_dev, b_s.handle())
                } else {
                    mover.offload_in_background(&off_dev, &off_host, a_s.handle())
                }
            };
            // Each direction goes first in turn.
            let (x, y) = (first(m % 2 == 1), first(m % 2 == 0));
            if m % 2 == 1 { (y, x) } else { (x, y) }
        };
        let (off, load) = (off.unwrap(), load.unwrap());
        off.wait().unwrap();
        load.wait().unwrap();
        let what = format!("round {m}");
        s.check_onto(
            1,
            Some(&host),
            &dev,
            &off_dev,
            &off_host,
            &format!("offload {what}"),
        );
        s.check_onto(
            0,
            Some(&dev),
            &host,
            &load_host,
            &load_dev,
            &format!("load {what}"),
        );
    }
    if bytes >= 64 << 10 {
        // Eight pairs sent back to back: the second move of at least one started while the
        // first was staging (a 40 MiB move takes about a millisecond).
        assert!(pinstage::testing::staged_handovers() > handovers);
    }
}

#[test]
#[ignore = "needs a CUDA GPU: run with --include-ignored (scripts/gpu-run does)"]
fn gpu_blocks_refusals_issue_nothing() {
    let Some(d) = gpu_or_skip("gpu_blocks_refusals_issue_nothing") else {
        return;
    };
    let _gpu = shared();
    let mut s = Sides::new(&d, Layout::KvFirst, 2, 256, 16, 8);
    let (dv, hv, dim) = s.views();
    let mover = BlockMover::new(&dv, &hv, dim).unwrap();
    s.fill(0, 1);
    s.poison(1);
    let stream = StreamHandle::LEGACY;
    let bad: [(&[usize], &[usize], &str); 5] = [
        (&[1, 2], &[3, 3], "host_ids"),  // a destination twice
        (&[16], &[0], "device_ids"),     // out of range on the device side
        (&[0], &[8], "host_ids"),        // out of range on the host side
        (&[0, 1], &[0], "block ids"),    // counts differ
        (&[15, 0], &[7, 9], "host_ids"), // the second id out of range
    ];
    for (src, dst, param) in bad {
        // SAFETY: nothing is issued (the move is refused); the buffers outlive the call.
        let e = unsafe { mover.offload(src, dst, stream) }.unwrap_err();
        assert!(
            matches!(&e, Error::InvalidArgument { param: p, .. } if *p == param),
            "{src:?} -> {dst:?}: {e}"
        );
        // A move in the background is checked on the caller's thread (its runs merged later on
        // the mover's): the same error, before anything is handed over.
        // SAFETY: as above.
        let b = unsafe { mover.offload_in_background(src, dst, stream) }.unwrap_err();
        assert_eq!(
            b.to_string(),
            e.to_string(),
            "{src:?} -> {dst:?} in the background"
        );
    }
    // Loads (host ids first): refused alike on both paths.
    let bad_loads: [(&[usize], &[usize], &str); 4] = [
        (&[1, 2], &[3, 3], "device_ids"), // a destination twice
        (&[8], &[0], "host_ids"),         // out of range on the host side
        (&[0], &[16], "device_ids"),      // out of range on the device side
        (&[0, 1], &[0], "block ids"),     // counts differ
    ];
    for (src, dst, param) in bad_loads {
        // SAFETY: nothing is issued (the move is refused); the buffers outlive the call.
        let l = unsafe { mover.load(src, dst, stream) }.unwrap_err();
        assert!(
            matches!(&l, Error::InvalidArgument { param: p, .. } if *p == param),
            "load {src:?} -> {dst:?}: {l}"
        );
        // SAFETY: as above.
        let lb = unsafe { mover.load_in_background(src, dst, stream) }.unwrap_err();
        assert_eq!(lb.to_string(), l.to_string(), "load {src:?} -> {dst:?}");
    }
    // After those refusals (a destination given twice among them), a move in the background
    // into the block it named twice lands: the check's marks were cleared.
    // SAFETY: waited for at once; the buffers outlive it.
    unsafe { mover.offload_in_background(&[4, 9], &[3, 5], stream) }
        .unwrap()
        .wait()
        .unwrap();
    // A valid move on the same stream, waited for: anything a refused move had queued before
    // it (on the stream, or the side stream it forks onto) has landed by then.
    // SAFETY: waited for at once; the buffers outlive it.
    unsafe { mover.offload(&[5], &[6], stream) }
        .unwrap()
        .wait()
        .unwrap();
    let at = |part: usize, b: usize| s.layout.at(8, 256, 2, part, b);
    let moved = [6, 3, 5];
    let written = |i: usize| {
        moved
            .iter()
            .any(|&b| (0..2).any(|part| (at(part, b)..at(part, b) + 256).contains(&i)))
    };
    let (k, v) = (at(0, 6), at(1, 6));
    for t in 0..2 {
        let host = s.read(1, t);
        assert!(
            host.iter()
                .enumerate()
                .all(|(i, &b)| b == POISON || written(i)),
            "a refused move wrote host tensor {t}"
        );
        assert!(
            host[k] != POISON && host[v] != POISON,
            "the valid move did not land"
        );
        for b in [3, 5] {
            assert!(
                (0..2).all(|part| host[at(part, b)..at(part, b) + 256] != [POISON; 256]),
                "the move in the background did not land in host block {b} of tensor {t}"
            );
        }
    }
    // Read-only host tensors: an offload into them is refused on either path, before anything
    // is issued; a load from them reads.
    let (hs, _) = Layout::KvFirst.shape(8, 256, 2);
    let read_only: Vec<_> = hv
        .iter()
        // SAFETY: the host buffers outlive the views.
        .map(|h| unsafe { pinstage::testing::bytes_view(h.meta().ptr(), None, &hs, true) })
        .collect();
    let ro = BlockMover::new(&dv, &read_only, dim).unwrap();
    s.poison(1);
    // SAFETY: refused before anything is issued.
    let e = unsafe { ro.offload(&[1], &[2], stream) }.unwrap_err();
    assert!(e.to_string().contains("read-only"), "{e}");
    // SAFETY: as above.
    let b = unsafe { ro.offload_in_background(&[1], &[2], stream) }.unwrap_err();
    assert_eq!(b.to_string(), e.to_string());
    // SAFETY: waited for at once; the buffers outlive it; the device side is written.
    unsafe { ro.load(&[2], &[3], stream) }
        .unwrap()
        .wait()
        .unwrap();
    for t in 0..2 {
        assert!(
            s.read(1, t).iter().all(|&b| b == POISON),
            "a refused offload wrote read-only host tensor {t}"
        );
    }
    // A pageable host tensor, a dtype pair that differs, block sizes that differ.
    let (ds, _) = Layout::KvFirst.shape(16, 256, 2);
    let pageable = vec![POISON; 2 * 8 * 256];
    let pv = view(pageable.as_ptr() as u64, None, &[2, 8, 256]);
    let e = BlockMover::new(&dv[..1], &[pv], 1).unwrap_err();
    assert!(e.to_string().contains("pageable"), "{e}");
    let half = view(s.host[0].as_ptr() as u64, None, &[2, 8, 128]);
    let e = BlockMover::new(&dv[..1], &[half], 1).unwrap_err();
    assert!(
        matches!(
            e,
            Error::InvalidArgument {
                param: "tensors",
                ..
            }
        ),
        "{e}"
    );
    let dev_view = view(s.dev[0].ptr(), Some(d.ordinal()), &ds);
    let e = BlockMover::new(
        std::slice::from_ref(&dev_view),
        std::slice::from_ref(&dev_view),
        1,
    )
    .unwrap_err();
    assert!(e.to_string().contains("device memory"), "{e}");
    assert!(pageable.iter().all(|&b| b == POISON));
}

#[test]
#[ignore = "needs a CUDA GPU: run with --include-ignored (scripts/gpu-run does)"]
fn gpu_blocks_never_take_2d_copies_across_allocations() {
    let Some(d) = gpu_or_skip("gpu_blocks_never_take_2d_copies_across_allocations") else {
        return;
    };
    let _gpu = shared();
    // Two device tensors in one allocation, two host tensors in two allocations: any two
    // addresses sit "at one stride", but a 2D copy may not cross from one allocation into the
    // other (the driver refuses it), so small moves must go batched, and land.
    let (blocks, bytes) = (16, 1024);
    let per = 2 * blocks * bytes;
    let dev = DeviceBuffer::new(&d, 2 * per).unwrap();
    let mut host: Vec<PinnedBuffer> = (0..2)
        .map(|_| PinnedBuffer::new(&d, per, PinnedFlags::PORTABLE).unwrap())
        .collect();
    host.sort_by_key(|h| h.as_ptr() as u64);
    let shape = [2, blocks as i64, bytes as i64];
    let dv: Vec<_> = (0..2)
        .map(|t| view(dev.ptr() + (t * per) as u64, Some(d.ordinal()), &shape))
        .collect();
    let hv: Vec<_> = host
        .iter()
        .map(|h| view(h.as_ptr() as u64, None, &shape))
        .collect();
    let mover = BlockMover::new(&dv, &hv, 1).unwrap();
    let (src, dst) = ([3usize, 9, 12], [0usize, 5, 15]);
    assert_eq!(
        mover.plan(Direction::Offload, &src, &dst).unwrap().strategy,
        Strategy::Batched
    );
    let data: Vec<u8> = (0..2 * per).map(|i| byte(0, 1, i / per, 0, 0, i)).collect();
    dev.upload(0, &data).unwrap();
    for h in &mut host {
        h.as_mut_slice().fill(POISON);
    }
    // SAFETY: waited for at once; the buffers outlive it.
    unsafe { mover.offload(&src, &dst, StreamHandle::LEGACY) }
        .unwrap()
        .wait()
        .unwrap();
    for (t, h) in host.iter().enumerate() {
        let mut want = vec![POISON; per];
        for (&s, &b) in src.iter().zip(&dst) {
            for p in 0..2 {
                let (from, to) = (t * per + (p * blocks + s) * bytes, (p * blocks + b) * bytes);
                want[to..to + bytes].copy_from_slice(&data[from..from + bytes]);
            }
        }
        assert!(h.as_slice() == &want[..], "host tensor {t}");
    }
}

#[test]
#[ignore = "needs a CUDA GPU: run with --include-ignored (scripts/gpu-run does)"]
fn gpu_blocks_moves_past_one_batch_take_several_calls_and_land() {
    let Some(d) = gpu_or_skip("gpu_blocks_moves_past_one_batch_take_several_calls_and_land") else {
        return;
    };
    let _gpu = shared();
    // 40000 blocks of 8 bytes, none adjacent to the next on both sides: 2 parts x 40000 runs =
    // 80000 copies, more than one cuMemcpyBatchAsync carries (MAX_BATCH = 65536).
    let (blocks, bytes) = (80_000usize, 8usize);
    let mut s = Sides::new(&d, Layout::KvFirst, 1, bytes, blocks, blocks);
    let (dv, hv, dim) = s.views();
    let mover = BlockMover::new(&dv, &hv, dim).unwrap();
    let dev_ids: Vec<usize> = (0..40_000).map(|i| 2 * i).collect();
    let host_ids: Vec<usize> = (0..40_000).map(|i| blocks - 1 - 2 * i).collect();
    let plan = mover.plan(Direction::Offload, &dev_ids, &host_ids).unwrap();
    assert_eq!(
        (plan.strategy, plan.copies, plan.calls),
        (Strategy::Batched, 80_000, 2)
    );
    let src = s.fill(0, 7);
    s.poison(1);
    let own = Stream::new(&d).unwrap();
    // SAFETY: waited for at once; the buffers outlive it.
    unsafe { mover.offload(&dev_ids, &host_ids, own.handle()) }
        .unwrap()
        .wait()
        .unwrap();
    s.check(1, &src, &dev_ids, &host_ids, "offload of 80000 copies");
    // Back: a load of as many copies is issued from 4 threads (20000 copies each, one call
    // each), every block checked.
    let plan = mover.plan(Direction::Load, &host_ids, &dev_ids).unwrap();
    assert_eq!(
        (plan.strategy, plan.copies, plan.calls, plan.threads),
        (Strategy::Batched, 80_000, 4, 4)
    );
    let src = s.fill(1, 8);
    s.poison(0);
    // SAFETY: waited for at once; the buffers outlive it.
    unsafe { mover.load(&host_ids, &dev_ids, own.handle()) }
        .unwrap()
        .wait()
        .unwrap();
    s.check(0, &src, &host_ids, &dev_ids, "load of 80000 copies");
}

#[rstest]
#[ignore = "needs a CUDA GPU: run with --include-ignored (scripts/gpu-run does)"]
fn gpu_blocks_batches_from_several_threads_land(
    #[values(0, 2)] stream_kind: u8,
    #[values(false, true)] background: bool,
) {
    let Some(d) = gpu_or_skip("gpu_blocks_batches_from_several_threads_land") else {
        return;
    };
    let _gpu = shared();
    // 8 tensors in separate allocations (batched), 16 KiB parts, 300 random ids: about 4800
    // copies, issued from 2 threads (offload) and 4 (load), each on its own stream; on the
    // legacy stream they fork from a side stream. Every block of every move checked.
    let (tensors, bytes, blocks) = (8, 16384, 600);
    let mut s = Sides::new(&d, Layout::KvFirst, tensors, bytes, blocks, blocks);
    let (dv, hv, dim) = s.views();
    let mover = BlockMover::new(&dv, &hv, dim).unwrap();
    let own = Stream::new(&d).unwrap();
    let stream = if stream_kind == 0 {
        StreamHandle::LEGACY
    } else {
        own.handle()
    };
    for m in 0..4u32 {
        let dev_ids = ids(300, blocks, 41 + m as u64);
        let host_ids = ids(300, blocks, 73 + m as u64);
        let plan = mover.plan(Direction::Offload, &dev_ids, &host_ids).unwrap();
        assert!(plan.copies >= 4096, "{plan:?}");
        assert_eq!(
            (plan.strategy, plan.threads),
            (Strategy::Batched, 2),
            "{plan:?}"
        );
        let (d, h) = (&dev_ids, &host_ids);
        move_checked(
            &mut s,
            &mover,
            Direction::Offload,
            d,
            h,
            stream,
            background,
            m,
        );
        let plan = mover.plan(Direction::Load, &host_ids, &dev_ids).unwrap();
        assert_eq!(
            (plan.strategy, plan.threads),
            (Strategy::Batched, 4),
            "{plan:?}"
        );
        move_checked(
            &mut s,
            &mover,
            Direction::Load,
            d,
            h,
            stream,
            background,
            m + 50,
        );
    }
}

#[rstest]
#[ignore = "needs a CUDA GPU: run with --include-ignored (scripts/gpu-run does)"]
fn gpu_blocks_stream_order_holds_without_a_wait(
    #[values(false, true)] pooled: bool,
    #[values(0, 2)] stream_kind: u8,
    #[values(false, true)] background: bool,
) {
    let Some(d) = gpu_or_skip("gpu_blocks_stream_order_holds_without_a_wait") else {
        return;
    };
    // Alone on the GPU (see [`GPU`]).
    let _alone = GPU.write().unwrap_or_else(|e| e.into_inner());
    // A load, then an offload of the loaded blocks, then a load that overwrites them, all on
    // one stalled stream with no wait in between: each must see the one before and none the
    // one after. The offload reads in the reverse order of the
    // load's writes, so copies that overlapped would read poison. In the background the
    // offload must still run after the load queued before it (its fork), and the last load
    // after it once the stream joined it (`stream_wait`).
    let (tensors, bytes, blocks) = (4, 65536, 128);
    let mut s = Sides::with(&d, Layout::KvFirst, tensors, bytes, blocks, blocks, pooled);
    let (dv, hv, dim) = s.views();
    let mover = BlockMover::new(&dv, &hv, dim).unwrap();
    // Unstaged: a staged offload's `stream_wait` waits on the host until its host blocks hold
    // the data, which the stall would hold up to its bound (the staged moves' order is checked
    // by `gpu_blocks_staged_moves_land_every_block` and the seeded `staged_early_scatter`).
    mover
        .set_staging(Staging::Never, pinstage::blocks::DEFAULT_CHUNK)
        .unwrap();
    let own = Stream::new(&d).unwrap();
    // The legacy stream too: batched moves there fork onto a side stream and join back.
    let stream = if stream_kind == 0 {
        StreamHandle::LEGACY
    } else {
        own.handle()
    };
    // Warm-up moves of one block each way (nothing the mover sets up on first use waits
    // behind the stall).
    // SAFETY: waited for at once; the buffers outlive them.
    unsafe { mover.offload(&[0], &[0], stream) }
        .unwrap()
        .wait()
        .unwrap();
    // SAFETY: as above.
    unsafe { mover.load(&[0], &[0], stream) }
        .unwrap()
        .wait()
        .unwrap();
    if background {
        // The issuing thread and its stream exist before the stall.
        // SAFETY: as above.
        unsafe { mover.offload_in_background(&[0], &[0], stream) }
            .unwrap()
            .wait()
            .unwrap();
    }
    let first: Vec<usize> = (0..40).collect(); // host blocks loaded first
    let back: Vec<usize> = (40..80).collect(); // host blocks the offload writes
    let second: Vec<usize> = (80..120).collect(); // host blocks loaded last
    let dev_ids: Vec<usize> = (0..40).map(|i| 3 * i + 1).collect();
    let rev: Vec<usize> = dev_ids.iter().rev().copied().collect();
    let back_rev: Vec<usize> = back.iter().rev().copied().collect();
    for round in 0..3u32 {
        let host = s.fill(1, round);
        s.poison(0);
        let stall = stall_handle(&d, stream);
        // SAFETY: waited for below (the copies drop last); the buffers outlive them.
        let c1 = unsafe { mover.load(&first, &dev_ids, stream) }.unwrap();
        let c2 = if background {
            // SAFETY: as above; joined on `stream` before the next move.
            let c2 = unsafe { mover.offload_in_background(&rev, &back_rev, stream) }.unwrap();
            // Not done: not yet issued, or issued behind the stall (a ticket's event queried
            // before its thread recorded it would say done).
            let q = c2.query();
            assert!(
                matches!(q, Ok(false)),
                "round {round}: a background move under a stall: {q:?}"
            );
            c2.stream_wait(stream).unwrap();
            c2
        } else {
            // SAFETY: as above.
            unsafe { mover.offload(&rev, &back_rev, stream) }.unwrap()
        };
        // SAFETY: as above.
        let c3 = unsafe { mover.load(&second, &dev_ids, stream) }.unwrap();
        let q = c2.query();
        assert!(
            matches!(q, Ok(false)),
            "round {round}: the offload under a stall: {q:?} (Ok(true): completed)"
        );
        stall.release();
        // The offload's event: once it completed, its host blocks hold the first load's values
        // (read here at once, with no other wait).
        c2.wait().unwrap();
        let mut want_host = host.clone();
        for (t, want) in want_host.iter_mut().enumerate() {
            for (&h, &b) in first.iter().zip(&back) {
                for p in 0..2 {
                    let from = s.layout.at(blocks, bytes, tensors, p, h);
                    let to = s.layout.at(blocks, bytes, tensors, p, b);
                    let block = host[t][from..from + bytes].to_vec();
                    want[to..to + bytes].copy_from_slice(&block);
                }
            }
        }
        for (t, want) in want_host.iter().enumerate() {
            let got = s.read(1, t);
            if got[..want.len()] != want[..] {
                let first = got.iter().zip(want).position(|(a, b)| a != b).unwrap();
                panic!(
                    "round {round}: host tensor {t}: byte {first} is {:#x}, expected {:#x} \
                     (the offload did not see the first load, or saw the second)",
                    got[first], want[first]
                );
            }
        }
        c3.wait().unwrap();
        c1.wait().unwrap();
        s.check(
            0,
            &host,
            &second,
            &dev_ids,
            &format!("round {round}: the last load"),
        );
    }
}

#[test]
#[ignore = "needs a CUDA GPU: run with --include-ignored (scripts/gpu-run does)"]
fn gpu_blocks_a_staged_load_reads_its_host_blocks_after_the_work_before_it() {
    let Some(d) =
        gpu_or_skip("gpu_blocks_a_staged_load_reads_its_host_blocks_after_the_work_before_it")
    else {
        return;
    };
    // Alone on the GPU (see [`GPU`]).
    let _alone = GPU.write().unwrap_or_else(|e| e.into_inner());
    // On one stalled stream: an offload on the caller's thread writes host blocks `mid`, then a
    // staged load in the background reads them into device blocks `back`. The staged load's
    // copy threads read the host blocks on the host, so its thread must wait for the work
    // queued before the call, not only order its copies after it on the device.
    let (tensors, bytes, blocks) = (4, 16 << 10, 64);
    let mut s = Sides::with(&d, Layout::KvFirst, tensors, bytes, blocks, blocks, true);
    let (dv, hv, dim) = s.views();
    let mover = BlockMover::new(&dv, &hv, dim).unwrap();
    mover.set_staging(Staging::Always, 256 << 10).unwrap();
    let own = Stream::new(&d).unwrap();
    let stream = own.handle();
    let out: Vec<usize> = (0..24).map(|i| 2 * i + 1).collect();
    let back: Vec<usize> = (0..24).rev().map(|i| 2 * i).collect();
    let mid: Vec<usize> = (40..64).collect();
    // Warm-up: the issuing thread, its stream and its ring exist before the stall.
    // SAFETY: waited for at once; the buffers outlive the moves.
    unsafe { mover.load_in_background(&mid, &back, stream) }
        .unwrap()
        .wait()
        .unwrap();
    for round in 0..3u32 {
        let src = s.fill(0, round);
        s.poison(1);
        let stall = stall_handle(&d, stream);
        // SAFETY: waited for below; the buffers outlive the moves.
        let c1 = unsafe { mover.offload(&out, &mid, stream) }.unwrap();
        // SAFETY: as above.
        let c2 = unsafe { mover.load_in_background(&mid, &back, stream) }.unwrap();
        // Time for a load that does not wait to read the poisoned host blocks.
        std::thread::sleep(std::time::Duration::from_millis(20));
        let q = c2.query();
        assert!(
            matches!(q, Ok(false)),
            "round {round}: the load under a stall: {q:?}"
        );
        stall.release();
        c2.wait().unwrap();
        c1.wait().unwrap();
        // Device block back[i] holds device block out[i]; every other block its own values.
        for (t, src) in src.iter().enumerate() {
            let mut want = src.clone();
            for (&o, &b) in out.iter().zip(&back) {
                for p in 0..2 {
                    let from = s.layout.at(blocks, bytes, tensors, p, o);
                    let to = s.layout.at(blocks, bytes, tensors, p, b);
                    want.copy_within(from..from + bytes, to);
                }
            }
            let got = s.read(0, t);
            if got[..want.len()] != want[..] {
                let first = got.iter().zip(&want).position(|(a, b)| a != b).unwrap();
                panic!(
                    "round {round}: device tensor {t}: byte {first} is {:#x}, expected {:#x} \
                     (the load read its host blocks before the offload wrote them)",
                    got[first], want[first]
                );
            }
        }
    }
}

/// Blocks-first sides of `tensors` tensors at one stride (2D copies possible), `blocks` blocks
/// each side, the host side pooled, and their mover: the timing tests' setup.
fn pooled_mover(
    d: &pinstage::Device,
    tensors: usize,
    bytes: usize,
    blocks: usize,
) -> (Sides, BlockMover<'static>) {
    let s = Sides::with(d, Layout::BlocksFirst, tensors, bytes, blocks, blocks, true);
    let (dv, hv, dim) = s.views();
    let mover = BlockMover::new(&dv, &hv, dim).unwrap();
    // The timings of unstaged ways: moves in the background go as moves on this thread do.
    mover
        .set_staging(Staging::Never, pinstage::blocks::DEFAULT_CHUNK)
        .unwrap();
    (s, mover)
}

#[test]
#[ignore = "needs a CUDA GPU: run with --include-ignored (scripts/gpu-run does)"]
fn gpu_blocks_large_moves_are_timed_both_ways_then_take_the_faster() {
    let Some(d) = gpu_or_skip("gpu_blocks_large_moves_are_timed_both_ways_then_take_the_faster")
    else {
        return;
    };
    let _gpu = shared();
    let own = Stream::new(&d).unwrap();
    // 8 tensors at one stride (2D copies possible), blocks of 16 KiB: a move of 64 ids carries
    // 8 MiB, the least a timed move carries.
    let (tensors, blocks, bytes, n) = (8, 96, 8 << 10, 64);
    let (mut s, mover) = pooled_mover(&d, tensors, bytes, blocks);
    for (k, direction) in [Direction::Load, Direction::Offload]
        .into_iter()
        .enumerate()
    {
        let mut seen = Vec::new();
        for m in 0..8u32 {
            let dev_ids = ids(n, blocks, 5 + m as u64 + 100 * k as u64);
            let host_ids = ids(n, blocks, 50 + m as u64 + 100 * k as u64);
            let (src, dst) = match direction {
                Direction::Offload => (&dev_ids, &host_ids),
                Direction::Load => (&host_ids, &dev_ids),
            };
            let plan = mover.plan(direction, src, dst).unwrap();
            assert_eq!(plan.bytes, 8 << 20);
            // Every timed move checked too, in the background every other time.
            let stream = own.handle();
            move_checked(
                &mut s,
                &mover,
                direction,
                &dev_ids,
                &host_ids,
                stream,
                m % 2 == 1,
                m,
            );
            seen.push((plan.strategy, plan.choice));
        }
        let what = format!("{}: {seen:?}", direction.name());
        // The first four moves are timed, the two ways taking turns (the table's first).
        assert!(
            seen[..4].iter().all(|&(_, c)| c == Choice::Timing),
            "{what}"
        );
        let ways: Vec<Strategy> = seen[..4].iter().map(|&(st, _)| st).collect();
        assert_ne!(ways[0], ways[1], "{what}");
        assert_eq!((ways[0], ways[1]), (ways[2], ways[3]), "{what}");
        // Then every move takes the faster by the rates timed.
        for &(st, c) in &seen[4..] {
            let Choice::Measured {
                strided,
                batched,
                batched_one_thread,
            } = c
            else {
                panic!("{what}: not decided after four timed moves");
            };
            assert!(strided > 0 && batched > 0, "{what}");
            // 512 copies: a batch from one thread only, nothing more to time.
            assert_eq!(batched_one_thread, None, "{what}");
            // The batch takes the class only when it beats the 2D copies by 5%
            // (src/blocks/tuning.rs, BATCH_MARGIN).
            let faster = if batched as f64 > strided as f64 * 1.05 {
                Strategy::Batched
            } else {
                Strategy::Strided
            };
            assert_eq!(st, faster, "{what}");
        }
    }
    // A small move is not timed.
    let plan = mover.plan(Direction::Load, &[1, 2], &[3, 4]).unwrap();
    assert_eq!(plan.choice, Choice::Table);
}

/// Where a move's batch would be issued from several threads (4096 copies or more), the mover
/// times the same batch from one thread too: its first six large loads take the three ways in
/// turn (2D copies, the split batch, the batch from one thread), then every load takes the
/// fastest by the mean rates `plan()` reports, a batch only by the margin. Every move checked.
#[test]
#[ignore = "needs a CUDA GPU: run with --include-ignored (scripts/gpu-run does)"]
fn gpu_blocks_a_split_batch_is_timed_against_the_batch_from_one_thread() {
    let Some(d) =
        gpu_or_skip("gpu_blocks_a_split_batch_is_timed_against_the_batch_from_one_thread")
    else {
        return;
    };
    let _gpu = shared();
    let own = Stream::new(&d).unwrap();
    // 64 tensors at one stride, blocks of 2 KiB, 64 ids with no two device ids adjacent (no
    // runs merge): 4096 copies, 8 MiB a move.
    let (tensors, blocks, bytes, n) = (64, 256, 1 << 10, 64);
    let (mut s, mover) = pooled_mover(&d, tensors, bytes, blocks);
    let mut seen = Vec::new();
    for m in 0..9u32 {
        let dev_ids: Vec<usize> = ids(n, blocks / 2, 7 + u64::from(m))
            .into_iter()
            .map(|i| 2 * i)
            .collect();
        let host_ids = ids(n, blocks, 70 + u64::from(m));
        let plan = mover.plan(Direction::Load, &host_ids, &dev_ids).unwrap();
        assert_eq!((plan.bytes, plan.runs), (8 << 20, n), "{plan:?}");
        move_checked(
            &mut s,
            &mover,
            Direction::Load,
            &dev_ids,
            &host_ids,
            own.handle(),
            m % 2 == 1,
            m,
        );
        seen.push((plan.strategy, plan.threads, plan.choice));
    }
    let what = format!("{seen:?}");
    // Six timed moves: the three ways, twice in the same order.
    assert!(
        seen[..6].iter().all(|&(_, _, c)| c == Choice::Timing),
        "{what}"
    );
    let ways: Vec<_> = seen[..6].iter().map(|&(st, t, _)| (st, t > 1)).collect();
    assert_eq!(ways[..3], ways[3..], "{what}");
    for way in [
        (Strategy::Strided, false),
        (Strategy::Batched, true),
        (Strategy::Batched, false),
    ] {
        assert!(ways[..3].contains(&way), "{what}: {way:?} never timed");
    }
    for &(st, threads, c) in &seen[6..] {
        let Choice::Measured {
            strided,
            batched,
            batched_one_thread: Some(one),
        } = c
        else {
            panic!("{what}: not decided with the batch from one thread after six timed moves");
        };
        assert!(strided > 0 && batched > 0 && one > 0, "{what}");
        let (batch, rate) = if one > batched {
            ((Strategy::Batched, 1), one)
        } else {
            ((Strategy::Batched, 4), batched)
        };
        let want = if rate as f64 > strided as f64 * 1.05 {
            batch
        } else {
            (Strategy::Strided, 1)
        };
        assert_eq!((st, threads), want, "{what}");
    }
}
