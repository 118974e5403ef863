//! Step staging on the GPU (ignored without one; `scripts/gpu-run` runs them with
//! `--include-ignored`): every field of every step checked, slots never rewritten while their
//! copy is queued (streams stalled), the batch and per-span fallbacks, fresh blocks from 8
//! threads.

mod common;

use common::{gpu_or_skip, stall};
use pinstage::dlpack::TensorMeta;
use pinstage::step::FIELD_ALIGN;
use pinstage::step::StepMode;
use pinstage::testing::DeviceBuffer;
use pinstage::{DType, DeviceView, StepLayout, StepStager, Stream, StreamHandle};
use rstest::rstest;

fn layout() -> StepLayout {
    StepLayout::builder()
        .field("ids", DType::I32, &[1024])
        .field("pos", DType::I64, &[1024])
        .field("lens", DType::I32, &[64])
        .field("table", DType::I32, &[64, 32])
        .build()
        .unwrap()
}

/// The values of step `k`: distinct per step and field, never zero.
fn step_values(k: i64) -> (Vec<i32>, Vec<i64>, Vec<i32>, Vec<i32>) {
    let n = 100 + (k as usize % 50);
    (
        (0..n as i32).map(|i| (k as i32) * 10_000 + i + 1).collect(),
        (0..n as i64).map(|i| -(k * 100_000 + i + 1)).collect(),
        (0..16).map(|i| (k as i32) * 7 + i + 3).collect(),
        (0..8 * 20).map(|i| (k as i32) * 1000 + i + 5).collect(),
    )
}

fn fill(s: &mut pinstage::step::Step<'_>, k: i64) {
    let (ids, pos, lens, table) = step_values(k);
    s.put("ids", &ids).unwrap();
    s.field_mut::<i64>("pos", pos.len())
        .unwrap()
        .copy_from_slice(&pos);
    s.put_padded("lens", &lens, (16, 1), Some(0), Some(32))
        .unwrap();
    s.put_padded("table", &table, (8, 20), Some(-1), None)
        .unwrap();
}

/// Checks the arena bytes `got` (the layout's bytes) hold step `k`.
fn check(l: &StepLayout, got: &[u8], k: i64) {
    let (ids, pos, lens, table) = step_values(k);
    let at = |name: &str| l.field(name).unwrap().offset();
    let i32s =
        |off: usize, n: usize| -> Vec<i32> { bytemuck::pod_collect_to_vec(&got[off..off + 4 * n]) };
    assert_eq!(i32s(at("ids"), ids.len()), ids, "ids, step {k}");
    let p: Vec<i64> = bytemuck::pod_collect_to_vec(&got[at("pos")..at("pos") + 8 * pos.len()]);
    assert_eq!(p, pos, "pos, step {k}");
    let l32 = i32s(at("lens"), 32);
    assert_eq!(l32[..16], lens[..], "lens, step {k}");
    assert!(l32[16..].iter().all(|&x| x == 0), "lens pad, step {k}");
    let t = i32s(at("table"), 8 * 32);
    for r in 0..8 {
        for c in 0..32 {
            let want = if c < 20 { table[r * 20 + c] } else { -1 };
            assert_eq!(t[r * 32 + c], want, "table[{r}, {c}], step {k}");
        }
    }
}

#[rstest]
#[case::max_gap_default(64 << 10, true)]
#[case::exact_spans_batched(0, true)]
#[case::exact_spans_separate_copies(0, false)]
#[ignore = "needs a GPU"]
fn arena_steps_land_field_by_field(#[case] max_gap: usize, #[case] batch: bool) {
    let Some(dev) = gpu_or_skip("arena_steps_land_field_by_field") else {
        return;
    };
    let l = layout();
    let arena = DeviceBuffer::new(&dev, l.nbytes()).unwrap();
    let stream = Stream::new(&dev).unwrap();
    let view = arena.view(DType::U8);
    // SAFETY: `arena` outlives the stager (declared before it); nothing else writes it.
    let st = unsafe {
        StepStager::builder(&l)
            .depth(3)
            .max_gap(max_gap)
            .batch(batch)
            .bind(&view)
    }
    .build()
    .unwrap();
    let mut got = vec![0u8; l.nbytes()];
    for k in 1..=60 {
        st.order_after_commits(None).unwrap();
        arena.upload(0, &vec![0xEE; l.nbytes()]).unwrap(); // poison before every step
        let mut s = st.step().unwrap();
        fill(&mut s, k);
        let c = s.commit(stream.handle()).unwrap();
        assert_eq!(c.batched, max_gap == 0 && batch, "step {k}");
        assert_eq!(
            c.calls,
            if max_gap > 0 || batch { 1 } else { 4 },
            "step {k}"
        );
        st.order_after_commits(None).unwrap();
        arena.download(0, &mut got).unwrap();
        check(&l, &got, k);
    }
    let s = st.stats();
    assert_eq!(s.steps, 60);
    if max_gap == 0 && batch {
        assert_eq!((s.batches, s.batch_entries), (60, 240));
    }
}

#[test]
#[ignore = "needs a GPU"]
fn legacy_stream_splits_go_as_separate_copies() {
    let Some(dev) = gpu_or_skip("legacy_stream_splits_go_as_separate_copies") else {
        return;
    };
    let l = layout();
    let arena = DeviceBuffer::new(&dev, l.nbytes()).unwrap();
    let view = arena.view(DType::U8);
    // SAFETY: as above.
    let st = unsafe { StepStager::builder(&l).max_gap(0).bind(&view) }
        .build()
        .unwrap();
    // Both spellings of the legacy stream: 0 and CU_STREAM_LEGACY (1); the batched call refuses
    // either.
    // SAFETY: a special handle.
    let explicit = unsafe { StreamHandle::from_raw(1) }.unwrap();
    for (k, stream) in [(3, StreamHandle::LEGACY), (4, explicit)] {
        arena.upload(0, &vec![0xEE; l.nbytes()]).unwrap();
        let mut s = st.step().unwrap();
        fill(&mut s, k);
        let c = s.commit(stream).unwrap();
        assert_eq!(
            (c.calls, c.batched),
            (4, false),
            "handle {}",
            stream.as_raw()
        );
        let mut got = vec![0u8; l.nbytes()];
        st.order_after_commits(None).unwrap();
        arena.download(0, &mut got).unwrap();
        check(&l, &got, k);
    }
}

/// Fresh mode with the stream stalled: every step's block must hold that step's values, so no
/// slot was rewritten while its copy waited behind the stall.
#[rstest]
#[case(1)]
#[case(2)]
#[case(16)]
#[ignore = "needs a GPU"]
fn slots_are_not_rewritten_while_their_copy_is_queued(#[case] depth: usize) {
    let Some(dev) = gpu_or_skip("slots_are_not_rewritten_while_their_copy_is_queued") else {
        return;
    };
    let l = layout();
    let stream = Stream::new(&dev).unwrap();
    let st = StepStager::builder(&l)
        .depth(depth)
        .mode(StepMode::Fresh)
        .build()
        .unwrap();
    // Warm the block pool before stalling (allocations may synchronize the device).
    let warm: Vec<_> = (0..3 * depth + 8)
        .map(|_| {
            st.step()
                .unwrap()
                .commit(stream.handle())
                .unwrap()
                .block
                .unwrap()
        })
        .collect();
    stream.synchronize().unwrap();
    drop(warm);
    let before = st.stats();
    let steps = 3 * depth as i64 + 2;
    // Where the worker was when (µs after the stall was queued): claimed, filled, committed.
    let timeline = parking_lot::Mutex::new(Vec::new());
    let (blocks, during) = std::thread::scope(|sc| {
        let gate = stall(&stream);
        let t0 = std::time::Instant::now();
        let (st, stream, timeline) = (&st, &stream, &timeline);
        let worker = sc.spawn(move || {
            let at = |what: &'static str, k: i64| {
                timeline.lock().push((what, k, t0.elapsed().as_micros()));
            };
            (0..steps)
                .map(|k| {
                    at("claim", k);
                    let mut s = st.step().unwrap();
                    at("fill", k);
                    fill(&mut s, k);
                    at("commit", k);
                    let b = s.commit(stream.handle()).unwrap().block.unwrap();
                    at("committed", k);
                    b
                })
                .collect::<Vec<_>>()
        });
        // The worker fills `depth` slots, then waits for the stalled copies.
        std::thread::sleep(std::time::Duration::from_millis(300));
        let during = st.stats();
        gate.release();
        (worker.join().unwrap(), during)
    });
    stream.synchronize().unwrap();
    // The stall held: while it did, exactly `depth` steps were committed (one per slot) and the
    // next claim was waiting for a stalled copy.
    assert_eq!(
        during.steps - before.steps,
        depth as u64,
        "steps committed while every slot's copy was stalled; the worker (µs after the stall): \
         {:?}",
        &timeline.lock()[..]
    );
    assert!(
        during.waits > before.waits,
        "the worker was not waiting for a stalled slot when the stall was released"
    );
    for (k, b) in blocks.iter().enumerate() {
        check(&l, &read_block(&dev, b), k as i64);
    }
}

/// A block's bytes, copied to the host after its copy completed.
fn read_block(dev: &pinstage::Device, b: &pinstage::step::StepBlock) -> Vec<u8> {
    b.synchronize().unwrap();
    let meta = TensorMeta::cuda_1d(dev.ordinal(), b.ptr(), DType::U8, b.len());
    // SAFETY: the block's device memory, held (not rewritten) by `b` during the copy.
    let view = unsafe { DeviceView::from_meta(meta) };
    let mut got = vec![0u8; b.len()];
    pinstage::copy_d2h(&view, &mut got, StreamHandle::LEGACY).unwrap();
    got
}

#[test]
#[ignore = "needs a GPU"]
fn eight_threads_commit_steps_to_one_stager() {
    let Some(dev) = gpu_or_skip("eight_threads_commit_steps_to_one_stager") else {
        return;
    };
    let l = layout();
    let st = StepStager::builder(&l)
        .depth(8)
        .mode(StepMode::Fresh)
        .build()
        .unwrap();
    let steps = 300i64;
    std::thread::scope(|sc| {
        for t in 0..8i64 {
            let (st, l, dev) = (&st, &l, &dev);
            sc.spawn(move || {
                let stream = Stream::new(dev).unwrap();
                let blocks: Vec<_> = (0..steps)
                    .map(|k| {
                        let mut s = st.step().unwrap();
                        fill(&mut s, t * 10_000 + k);
                        s.commit(stream.handle()).unwrap().block.unwrap()
                    })
                    .collect();
                stream.synchronize().unwrap();
                for (k, b) in blocks.iter().enumerate() {
                    check(l, &read_block(dev, b), t * 10_000 + k as i64);
                }
            });
        }
    });
    assert_eq!(st.stats().steps, 8 * steps as u64);
}

#[test]
#[ignore = "needs a GPU"]
fn zero_copy_slots_are_device_addressable() {
    let Some(dev) = gpu_or_skip("zero_copy_slots_are_device_addressable") else {
        return;
    };
    let l = layout();
    let stream = Stream::new(&dev).unwrap();
    let st = StepStager::builder(&l)
        .depth(2)
        .mode(StepMode::ZeroCopy)
        .build()
        .unwrap();
    for k in 0..20 {
        let mut s = st.step().unwrap();
        fill(&mut s, k);
        let base = s.device_ptr("ids").unwrap();
        // The device reads the slot in place: a D2H copy from its device address (the copy
        // engine standing in for a kernel) sees the step's values.
        let meta = TensorMeta::cuda_1d(dev.ordinal(), base, DType::U8, l.nbytes());
        // SAFETY: the slot's mapped memory (the layout's bytes from field 0), ours until commit.
        let view = unsafe { DeviceView::from_meta(meta) };
        let mut got = vec![0u8; l.nbytes()];
        pinstage::copy_d2h(&view, &mut got, stream.handle()).unwrap();
        drop(view);
        check(&l, &got, k);
        // Every field through its own device address (not only the one at offset 0): the
        // step's address and the stager's for this slot agree, and each reads that field.
        for f in l.fields() {
            let ptr = s.device_ptr(f.name()).unwrap();
            assert_eq!(
                ptr,
                st.slot_device_ptr(s.slot(), f.name()).unwrap(),
                "{}",
                f.name()
            );
            assert_eq!(ptr - base, f.offset() as u64, "{}", f.name());
            let other = st.slot_device_ptr(1 - s.slot(), f.name()).unwrap();
            assert_ne!(other, ptr, "another slot's {} is elsewhere", f.name());
            let meta = TensorMeta::cuda_1d(dev.ordinal(), ptr, DType::U8, f.nbytes());
            // SAFETY: the field's bytes in the slot's mapped memory, ours until commit.
            let view = unsafe { DeviceView::from_meta(meta) };
            let mut field = vec![0x5Au8; f.nbytes()];
            pinstage::copy_d2h(&view, &mut field, stream.handle()).unwrap();
            assert_eq!(
                field[..],
                got[f.offset()..f.offset() + f.nbytes()],
                "{} read through its own address, step {k}",
                f.name()
            );
        }
        assert!(
            s.put("ids", &[1i32]).is_err(),
            "host writes after device_ptr are refused"
        );
        let c = s.commit(stream.handle()).unwrap();
        assert_eq!((c.calls, c.bytes), (0, 0));
    }
}

#[test]
#[ignore = "needs a GPU"]
fn bound_arena_on_the_gpu_is_checked() {
    let Some(dev) = gpu_or_skip("bound_arena_on_the_gpu_is_checked") else {
        return;
    };
    let l = layout();
    let buf = DeviceBuffer::new(&dev, l.nbytes() + FIELD_ALIGN).unwrap();
    let small = buf.view_at(0, DType::U8, l.nbytes() - 1);
    // SAFETY: refused before use.
    let r = unsafe { StepStager::builder(&l).bind(&small) }.build();
    assert!(
        matches!(r, Err(pinstage::Error::ArenaTooSmall { .. })),
        "{r:?}"
    );
    let mis = buf.view_at(8, DType::U8, l.nbytes());
    // SAFETY: refused before use.
    let r = unsafe { StepStager::builder(&l).bind(&mis) }.build();
    assert!(
        matches!(r, Err(pinstage::Error::InvalidArgument { .. })),
        "{r:?}"
    );
}

/// Stagers and fresh blocks give their device memory back once dropped (the reaper frees it):
/// four arena stagers and four fresh-mode stagers of a 32 MiB layout, each committing three
/// steps; a stager that kept its arena, or a pool that kept its blocks, leaves 128 MiB or more
/// missing from the device's free memory. That memory is the whole device's: other processes on
/// the GPU disturb it (scripts/gpu-run runs this binary alone, one test at a time).
#[test]
#[ignore = "needs a GPU"]
fn dropped_stagers_and_blocks_give_their_device_memory_back() {
    let Some(dev) = gpu_or_skip("dropped_stagers_and_blocks_give_their_device_memory_back") else {
        return;
    };
    let l = StepLayout::builder()
        .field("x", DType::U8, &[32 << 20])
        .build()
        .unwrap();
    let stream = Stream::new(&dev).unwrap();
    let free = || {
        pinstage::host::wait_for_frees();
        pinstage::testing::device_free_bytes(&dev).unwrap()
    };
    let before = free();
    for mode in [StepMode::Arena, StepMode::Fresh] {
        for round in 0..4u8 {
            let st = StepStager::builder(&l).depth(2).mode(mode).build().unwrap();
            let blocks: Vec<_> = (0..3u8)
                .map(|k| {
                    let mut s = st.step().unwrap();
                    s.put("x", &[round * 16 + k + 1; 4096]).unwrap();
                    s.commit(stream.handle()).unwrap().block
                })
                .collect();
            stream.synchronize().unwrap();
            assert_eq!(
                blocks.iter().filter(|b| b.is_some()).count(),
                if mode == StepMode::Fresh { 3 } else { 0 },
                "{mode:?}"
            );
            drop(blocks);
            drop(st);
        }
        let after = free();
        assert!(
            after + (64 << 20) >= before,
            "{mode:?}: {} MiB free before, {} MiB after dropping every stager and block",
            before >> 20,
            after >> 20
        );
    }
}

/// What the Rust API says of a stager and of a fresh block, and the waits consumers order
/// through (a block's `is_ready`, `synchronize` and `wait_on`; the stager's
/// `commits_done` and `order_after_commits`), each checked while a stall holds the commits'
/// copies and after it let go.
#[test]
#[ignore = "needs a GPU"]
fn accessors_and_the_waits_consumers_order_through() {
    use pinstage::cuda::Event;
    use std::time::Duration;
    let Some(dev) = gpu_or_skip("accessors_and_the_waits_consumers_order_through") else {
        return;
    };
    let l = layout();
    let arena = StepStager::builder(&l).depth(2).build().unwrap();
    assert!(arena.has_cuda() && !arena.arena_is_host() && arena.arena_ptr().is_some());
    assert_eq!(arena.ordinal(), dev.ordinal());
    assert_eq!(arena.device().map(|d| d.ordinal()), Some(dev.ordinal()));
    let fresh = StepStager::builder(&l)
        .depth(2)
        .mode(StepMode::Fresh)
        .build()
        .unwrap();
    let [a, b, c] = [0; 3].map(|_| Stream::new(&dev).unwrap());
    // One step each before the stall (first allocations may synchronize the device).
    for st in [&arena, &fresh] {
        let mut s = st.step().unwrap();
        fill(&mut s, 1);
        s.commit(a.handle()).unwrap();
    }
    a.synchronize().unwrap();
    let (after_block, after_arena) = (Event::new(&dev).unwrap(), Event::new(&dev).unwrap());
    let stall = stall(&a);
    let mut s = fresh.step().unwrap();
    fill(&mut s, 7);
    let block = s.commit(a.handle()).unwrap().block.unwrap();
    let mut s = arena.step().unwrap();
    fill(&mut s, 8);
    s.commit(a.handle()).unwrap();
    assert!(!block.is_empty() && block.len() == l.nbytes());
    assert_eq!(block.device().map(|d| d.ordinal()), Some(dev.ordinal()));
    assert!(format!("{block:?}").contains(&format!("{:#x}", block.ptr())));
    assert!(
        !block.is_ready().unwrap(),
        "a block whose copy waits behind a stall"
    );
    assert!(
        !arena.commits_done().unwrap(),
        "a commit waiting behind a stall"
    );
    block.wait_on(b.handle()).unwrap();
    after_block.record(b.handle()).unwrap();
    arena.order_after_commits(Some(c.handle())).unwrap();
    after_arena.record(c.handle()).unwrap();
    std::thread::sleep(Duration::from_millis(20));
    assert!(!after_block.query().unwrap(), "b ran past the block's copy");
    assert!(
        !after_arena.query().unwrap(),
        "c ran past the arena's commit"
    );
    std::thread::scope(|sc| {
        sc.spawn(|| {
            std::thread::sleep(Duration::from_millis(100));
            stall.release();
        });
        block.synchronize().unwrap();
        assert!(
            block.is_ready().unwrap(),
            "synchronize returned before the copy completed"
        );
    });
    check(&l, &read_block(&dev, &block), 7);
    for s in [&a, &b, &c] {
        s.synchronize().unwrap();
    }
    assert!(arena.commits_done().unwrap());
    assert!(after_block.query().unwrap() && after_arena.query().unwrap());
}
