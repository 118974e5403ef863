//! Step staging without a GPU: layouts, the commit plan, and whole steps against host memory
//! (slots, arena and fresh blocks are plain host bytes when there is no driver; on a GPU machine
//! these tests use a host-bound arena, or read device blocks back, so each runs everywhere).

use pinstage::step::FIELD_ALIGN;
use pinstage::step::StepMode;
use pinstage::testing::plan;
use pinstage::{DType, DeviceView, Error, StepLayout, StepStager, StreamHandle};
use rstest::rstest;

fn engine() -> StepLayout {
    StepLayout::builder()
        .field("input_ids", DType::I32, &[8192])
        .field("positions", DType::I64, &[8192])
        .field("slot_mapping", DType::I64, &[8192])
        .field("seq_lens", DType::I32, &[256])
        .field("query_start_loc", DType::I32, &[257])
        .field("block_table", DType::I32, &[256, 128])
        .build()
        .unwrap()
}

/// A stager that commits into host memory: its own host arena without a driver, a bound host
/// buffer with one. The buffer is returned so it outlives the stager.
fn host_stager(layout: &StepLayout, depth: usize, max_gap: usize) -> (StepStager, Vec<u8>) {
    let mut arena = vec![0xA5u8; layout.nbytes() + FIELD_ALIGN];
    let off = arena.as_ptr().align_offset(FIELD_ALIGN);
    let b = StepStager::builder(layout).depth(depth).max_gap(max_gap);
    let st = if pinstage::cuda::cuda_available() {
        // SAFETY: one thread uses the view.
        let view = unsafe { DeviceView::host_mut(&mut arena[off..off + layout.nbytes()]) };
        // SAFETY: `arena` is returned to the caller, which drops it after the stager; nothing
        // else writes it meanwhile.
        unsafe { b.bind(&view) }.build().unwrap()
    } else {
        b.build().unwrap()
    };
    (st, arena)
}

#[test]
fn layout_places_fields_at_aligned_offsets_in_order() {
    let l = engine();
    let mut end = 0;
    for f in l.fields() {
        assert_eq!(f.offset() % FIELD_ALIGN, 0, "{}", f.name());
        assert!(
            f.offset() >= end,
            "{} overlaps the previous field",
            f.name()
        );
        end = f.offset() + f.nbytes();
    }
    assert_eq!(l.nbytes(), end.next_multiple_of(FIELD_ALIGN));
    let bt = l.field("block_table").unwrap();
    assert_eq!((bt.rows(), bt.cols(), bt.row_bytes()), (256, 128, 512));
    assert_eq!(l.field("query_start_loc").unwrap().nbytes(), 257 * 4);
    assert_eq!(l.id("seq_lens").unwrap().index(), 3);
}

#[rstest]
#[case::no_fields(StepLayout::builder())]
#[case::empty_name(StepLayout::builder().field("", DType::I32, &[4]))]
#[case::repeated(StepLayout::builder().field("a", DType::I32, &[4]).field("a", DType::I8, &[4]))]
#[case::zero_dim(StepLayout::builder().field("a", DType::I32, &[0]))]
#[case::three_dims(StepLayout::builder().field("a", DType::I32, &[2, 2, 2]))]
#[case::no_dims(StepLayout::builder().field("a", DType::I32, &[]))]
fn bad_layouts_are_refused(#[case] b: pinstage::step::StepLayoutBuilder) {
    assert!(matches!(b.build(), Err(Error::InvalidArgument { .. })));
}

#[test]
fn overflowing_layout_is_refused() {
    let r = StepLayout::builder()
        .field("a", DType::I64, &[usize::MAX / 4, 2])
        .build();
    assert!(matches!(r, Err(Error::InvalidArgument { .. })));
}

/// The largest layout: a last field ending `FIELD_ALIGN` below `isize::MAX` (so the arena's
/// size rounds up without overflow) is taken, one byte more is refused. Nothing is allocated.
#[test]
fn layouts_up_to_the_largest_arena_are_taken() {
    let top = isize::MAX as usize - pinstage::step::FIELD_ALIGN;
    let l = StepLayout::builder()
        .field("a", DType::U8, &[top])
        .build()
        .unwrap();
    assert_eq!(
        l.nbytes(),
        top.next_multiple_of(pinstage::step::FIELD_ALIGN)
    );
    let r = StepLayout::builder()
        .field("a", DType::U8, &[top + 1])
        .build();
    assert!(matches!(r, Err(Error::InvalidArgument { .. })), "{r:?}");
}

#[test]
fn unknown_field_names_the_known_ones() {
    let e = engine().id("input_id").unwrap_err();
    assert!(matches!(e, Error::UnknownField { .. }));
    assert!(e.to_string().contains("input_ids, positions"), "{e}");
}

#[test]
fn plan_merges_dense_fields_and_splits_at_untouched_ones() {
    let l = engine();
    let f = l.fields();
    let mut segs = Vec::new();
    // The engine step: every field written, gaps below 64 KiB: one span.
    let rows = [256, 256, 256, 64, 65, 64];
    plan(f, &rows, 64 << 10, &mut segs);
    assert_eq!(segs.len(), 1);
    assert_eq!(segs[0].0, 0);
    assert_eq!(segs[0].0 + segs[0].1, f[5].offset() + 64 * 512);
    // max_gap 0: exactly the used rows, one span per field.
    plan(f, &rows, 0, &mut segs);
    assert_eq!(segs.len(), 6);
    for (s, (fi, r)) in segs.iter().zip(f.iter().zip(rows)) {
        assert_eq!(*s, (fi.offset(), r * fi.row_bytes()));
    }
    // An untouched field in the middle splits the span, whatever the gap allowance.
    plan(f, &[256, 0, 256, 64, 65, 64], usize::MAX, &mut segs);
    assert_eq!(segs.len(), 2);
    assert_eq!(segs[0], (0, 256 * 4));
    assert_eq!(segs[1].0, f[2].offset());
    // Nothing written: nothing sent.
    plan(f, &[0; 6], usize::MAX, &mut segs);
    assert!(segs.is_empty());
    // Only the last field.
    plan(f, &[0, 0, 0, 0, 0, 3], 0, &mut segs);
    assert_eq!(segs, vec![(f[5].offset(), 3 * 512)]);
}

#[test]
fn plan_gap_allowance_is_inclusive() {
    let l = StepLayout::builder()
        .field("a", DType::U8, &[1024])
        .field("b", DType::U8, &[1024])
        .build()
        .unwrap();
    let mut segs = Vec::new();
    // a uses 24 bytes: the gap to b is 1000 bytes.
    plan(l.fields(), &[24, 8], 1000, &mut segs);
    assert_eq!(segs, vec![(0, 1024 + 8)]);
    plan(l.fields(), &[24, 8], 999, &mut segs);
    assert_eq!(segs, vec![(0, 24), (1024, 8)]);
}

fn read_i32(st: &StepStager, name: &str) -> Vec<i32> {
    bytemuck::cast_slice(&st.read_field(name).unwrap()).to_vec()
}

#[test]
fn steps_commit_values_and_pads_into_the_arena() {
    let l = engine();
    let (st, _arena) = host_stager(&l, 3, 64 << 10);
    for step_no in 1..=10i32 {
        let ids: Vec<i32> = (0..200).map(|i| step_no * 10_000 + i).collect();
        let table: Vec<i32> = (0..3 * 100).map(|i| -(step_no * 1000 + i)).collect();
        let mut s = st.step().unwrap();
        s.put("input_ids", &ids).unwrap();
        s.put_padded("block_table", &table, (3, 100), Some(-7), Some(4))
            .unwrap();
        let seq = s.field_mut::<i32>("seq_lens", 5).unwrap();
        seq.copy_from_slice(&[step_no, 2, 3, 4, 5]);
        assert_eq!(s.used_rows("seq_lens").unwrap(), 5);
        let c = s.commit(StreamHandle::LEGACY).unwrap();
        assert!(c.calls >= 1);
        assert_eq!(read_i32(&st, "input_ids")[..200], ids[..]);
        assert_eq!(read_i32(&st, "seq_lens")[..5], [step_no, 2, 3, 4, 5]);
        let bt = read_i32(&st, "block_table");
        for r in 0..4 {
            for c in 0..128 {
                let want = if r < 3 && c < 100 {
                    table[r * 100 + c]
                } else {
                    -7
                };
                assert_eq!(bt[r * 128 + c], want, "step {step_no} row {r} col {c}");
            }
        }
    }
    let s = st.stats();
    assert_eq!((s.steps, s.aborted), (10, 0));
}

#[test]
fn unwritten_fields_keep_their_values() {
    let l = engine();
    let (st, _arena) = host_stager(&l, 2, usize::MAX);
    let mut s = st.step().unwrap();
    s.put("positions", &[11i64, 12, 13]).unwrap();
    s.put("seq_lens", &[1i32, 2]).unwrap();
    s.commit(StreamHandle::LEGACY).unwrap();
    // The next steps write the fields around `positions` only: even with an unlimited gap the
    // commit must not cover `positions` with the slot's stale bytes.
    for k in 0..4 {
        let mut s = st.step().unwrap();
        s.put("input_ids", &[k; 50]).unwrap();
        s.put("slot_mapping", &[k as i64; 50]).unwrap();
        s.commit(StreamHandle::LEGACY).unwrap();
        let pos: Vec<i64> = bytemuck::cast_slice(&st.read_field("positions").unwrap()).to_vec();
        assert_eq!(pos[..3], [11, 12, 13], "step {k}");
    }
}

/// 64 ids, and an 8 x 4 table that skips unchanged values.
fn ids_and_a_table_that_skips() -> StepLayout {
    StepLayout::builder()
        .field("ids", DType::I32, &[64])
        .field_skip_unchanged("table", DType::I32, &[8, 4])
        .build()
        .unwrap()
}

#[test]
fn skip_unchanged_fields_send_nothing() {
    let l = ids_and_a_table_that_skips();
    let (st, _arena) = host_stager(&l, 2, 0);
    let table: Vec<i32> = (1..=8).collect();
    for k in 0..5 {
        let mut s = st.step().unwrap();
        s.put("table", &table).unwrap();
        let c = s.commit(StreamHandle::LEGACY).unwrap();
        assert_eq!(c.skipped, u32::from(k > 0), "step {k}");
        assert_eq!(
            c.calls,
            u32::from(k == 0),
            "step {k}: an unchanged step issues nothing"
        );
    }
    // Changed values, or other rows, are sent again.
    let mut s = st.step().unwrap();
    s.put("table", &table[..4]).unwrap();
    assert_eq!(s.commit(StreamHandle::LEGACY).unwrap().skipped, 0);
    let stats = st.stats();
    assert_eq!((stats.skipped_fields, stats.empty_steps), (4, 4));
    assert_eq!(read_i32(&st, "table")[..8], table[..]);
}

/// A step that leaves a skip-unchanged field unwritten sends nothing of it and forgets nothing:
/// the destination still holds the values last sent, so the same values in a later step are
/// skipped again; a field that does not skip is sent every time it is written.
#[test]
fn an_unwritten_field_keeps_what_was_last_sent() {
    let l = ids_and_a_table_that_skips();
    let (st, _arena) = host_stager(&l, 2, 0);
    let table: Vec<i32> = (1..=8).map(|i| i * 5 - 2).collect();
    let step = |ids: &[i32], table: Option<&[i32]>| {
        let mut s = st.step().unwrap();
        s.put("ids", ids).unwrap();
        if let Some(t) = table {
            s.put("table", t).unwrap();
        }
        s.commit(StreamHandle::LEGACY).unwrap()
    };
    assert_eq!(step(&[1, 2], Some(&table)).skipped, 0);
    assert_eq!(
        step(&[3, 4], None).skipped,
        0,
        "nothing of the table written"
    );
    let c = step(&[3, 4], Some(&table));
    assert_eq!(c.skipped, 1, "the table's values were the last sent");
    assert_eq!(c.bytes, 8, "the ids alone are sent (they never skip)");
    assert_eq!(read_i32(&st, "table")[..8], table[..]);
    assert_eq!(read_i32(&st, "ids")[..2], [3, 4]);
}

#[rstest]
#[case::too_many_values(|s: &mut pinstage::step::Step<'_>| s.put("seq_lens", &[1i32; 257]))]
#[case::wrong_dtype(|s: &mut pinstage::step::Step<'_>| s.put("seq_lens", &[1i64; 2]))]
#[case::unknown(|s: &mut pinstage::step::Step<'_>| s.put("nope", &[1i32]))]
#[case::ragged_rows(|s: &mut pinstage::step::Step<'_>| s.put("block_table", &[1i32; 130]))]
#[case::missing_pad(|s: &mut pinstage::step::Step<'_>| s.put_padded("seq_lens", &[1i32; 2], (2, 1), None, Some(5)))]
#[case::rows_beyond(|s: &mut pinstage::step::Step<'_>| s.put_padded("seq_lens", &[1i32; 2], (2, 1), Some(0), Some(257)))]
#[case::cols_beyond(|s: &mut pinstage::step::Step<'_>| s.put_padded("block_table", &[1i32; 129], (1, 129), Some(0), None))]
#[case::short_values(|s: &mut pinstage::step::Step<'_>| s.put_padded("block_table", &[1i32; 5], (2, 3), Some(0), None))]
#[case::partial_rows_without_pad(|s: &mut pinstage::step::Step<'_>| s.put_padded("block_table", &[1i32; 6], (2, 3), None, None))]
#[case::view_beyond(|s: &mut pinstage::step::Step<'_>| s.field_mut::<i32>("seq_lens", 257).map(|_| ()))]
fn bad_puts_are_typed_errors_and_write_nothing(
    #[case] bad: fn(&mut pinstage::step::Step<'_>) -> pinstage::Result<()>,
) {
    let l = engine();
    let (st, _arena) = host_stager(&l, 1, 64 << 10);
    let mut s = st.step().unwrap();
    s.put("seq_lens", &[5i32, 6]).unwrap();
    assert!(bad(&mut s).is_err());
    // Nothing changed: the good write is what the commit sends.
    assert_eq!(s.used_rows("seq_lens").unwrap(), 2);
    assert_eq!(s.used_rows("block_table").unwrap(), 0);
    s.commit(StreamHandle::LEGACY).unwrap();
    assert_eq!(read_i32(&st, "seq_lens")[..2], [5, 6]);
}

#[test]
fn a_dropped_step_releases_its_slot_untouched() {
    let l = engine();
    let (st, _arena) = host_stager(&l, 1, 64 << 10);
    let mut s = st.step().unwrap();
    s.put("seq_lens", &[9i32; 4]).unwrap();
    drop(s);
    // depth 1: the next step gets the same slot; nothing was sent.
    let s = st.step().unwrap();
    s.commit(StreamHandle::LEGACY).unwrap();
    assert_eq!(st.stats().aborted, 1);
    assert_ne!(read_i32(&st, "seq_lens")[..4], [9; 4]);
}

#[test]
fn threads_commit_concurrently_into_their_own_slots() {
    let l = StepLayout::builder()
        .field("a", DType::I64, &[512])
        .field("b", DType::I64, &[512])
        .build()
        .unwrap();
    // Host blocks without a driver, device blocks (read back) with one.
    let st = StepStager::builder(&l)
        .depth(4)
        .mode(StepMode::Fresh)
        .build()
        .unwrap();
    std::thread::scope(|sc| {
        for t in 0..8i64 {
            let st = &st;
            let l = &l;
            sc.spawn(move || {
                for k in 0..500i64 {
                    let v: Vec<i64> = (0..512).map(|i| t * 1_000_000 + k * 1000 + i).collect();
                    let mut s = st.step().unwrap();
                    s.put("a", &v).unwrap();
                    s.field_mut::<i64>("b", 512).unwrap().copy_from_slice(&v);
                    let block = s.commit(StreamHandle::LEGACY).unwrap().block.unwrap();
                    let got: Vec<i64> = bytemuck::pod_collect_to_vec(&block_bytes(&block));
                    assert_eq!(got[..512], v[..], "thread {t} step {k}");
                    let b_off = l.field("b").unwrap().offset() / 8;
                    assert_eq!(got[b_off..b_off + 512], v[..], "thread {t} step {k}");
                }
            });
        }
    });
    assert_eq!(st.stats().steps, 4000);
    // At least one block was made (the counter counts them), and they are reused.
    assert!(
        (1..=16).contains(&st.stats().blocks),
        "blocks made: {}",
        st.stats().blocks
    );
}

/// A fresh block's bytes on the host (read back from the device with a driver).
fn block_bytes(block: &pinstage::step::StepBlock) -> Vec<u8> {
    if !pinstage::cuda::cuda_available() {
        // SAFETY: a host block of `len` bytes, not rewritten while held.
        return unsafe { std::slice::from_raw_parts(block.ptr() as *const u8, block.len()) }
            .to_vec();
    }
    block.synchronize().unwrap();
    let meta = pinstage::dlpack::TensorMeta::cuda_1d(0, block.ptr(), DType::U8, block.len());
    // SAFETY: the block's device memory, held (not rewritten) by `block` during the copy.
    let view = unsafe { DeviceView::from_meta(meta) };
    let mut got = vec![0u8; block.len()];
    pinstage::copy_d2h(&view, &mut got, StreamHandle::LEGACY).unwrap();
    got
}

#[test]
fn zero_copy_device_addresses_need_a_driver() {
    let l = engine();
    let st = StepStager::builder(&l)
        .mode(StepMode::ZeroCopy)
        .build()
        .unwrap();
    let mut s = st.step().unwrap();
    s.put("seq_lens", &[1i32]).unwrap();
    let slot = s.slot();
    let got = s.device_ptr("seq_lens");
    if pinstage::cuda::cuda_available() {
        // The field's address in this slot (tests/gpu_step.rs reads every field through it).
        assert_eq!(got.unwrap(), st.slot_device_ptr(slot, "seq_lens").unwrap());
    } else {
        assert!(matches!(got, Err(Error::CudaUnavailable { .. })), "{got:?}");
    }
    s.commit(StreamHandle::LEGACY).unwrap();
}

#[rstest]
#[case::depth0(StepStager::builder(&engine()).depth(0))]
#[case::negative_device(StepStager::builder(&engine()).device(-1))]
fn bad_stager_arguments(#[case] b: pinstage::step::StepStagerBuilder) {
    assert!(matches!(b.build(), Err(Error::InvalidArgument { .. })));
}

#[test]
fn bound_arenas_are_checked() {
    let l = engine();
    let mut small = vec![0u8; l.nbytes() + 2 * FIELD_ALIGN];
    let off = small.as_ptr().align_offset(FIELD_ALIGN);
    // SAFETY: one thread uses the view.
    let short = unsafe { DeviceView::host_mut(&mut small[off..off + l.nbytes() - 1]) };
    // SAFETY: refused before use.
    let r = unsafe { StepStager::builder(&l).bind(&short) }.build();
    assert!(matches!(r, Err(Error::ArenaTooSmall { .. })), "{r:?}");
    drop(short);
    // SAFETY: one thread uses the view.
    let mis = unsafe { DeviceView::host_mut(&mut small[off + 4..off + 4 + l.nbytes()]) };
    // SAFETY: refused before use.
    let r = unsafe { StepStager::builder(&l).bind(&mis) }.build();
    assert!(matches!(r, Err(Error::InvalidArgument { .. })), "{r:?}");
    drop(mis);
    // SAFETY: one thread uses the view.
    let ok = unsafe { DeviceView::host_mut(&mut small[off..off + l.nbytes()]) };
    // SAFETY: refused before use (fresh mode has no arena to bind).
    let r = unsafe { StepStager::builder(&l).mode(StepMode::Fresh).bind(&ok) }.build();
    assert!(matches!(r, Err(Error::InvalidArgument { .. })), "{r:?}");
}

#[test]
fn layout_accessors_describe_each_field() {
    let l = StepLayout::builder()
        .field("a", DType::I32, &[4])
        .field_skip_unchanged("b", DType::I64, &[2, 3])
        .build()
        .unwrap();
    let names: Vec<&str> = l.fields().iter().map(|f| f.name()).collect();
    assert_eq!(names, ["a", "b"]);
    assert_eq!(l.field("a").unwrap().shape(), &[4]);
    assert_eq!(l.field("b").unwrap().shape(), &[2, 3]);
    assert!(!l.field("a").unwrap().skip_unchanged());
    assert!(l.field("b").unwrap().skip_unchanged());
    assert_eq!(l.field("b").unwrap().dtype(), DType::I64);
    // An id past the last field is refused, not used.
    let past = pinstage::step::FieldId::from_index(2);
    assert!(matches!(l.field(past), Err(Error::UnknownField { .. })));
    assert_eq!(
        l.field(pinstage::step::FieldId::from_index(1))
            .unwrap()
            .name(),
        "b"
    );
}

#[test]
fn the_field_count_limit_is_exact() {
    let mut b = StepLayout::builder();
    for i in 0..pinstage::step::MAX_FIELDS {
        b = b.field(format!("f{i}"), DType::U8, &[1]);
    }
    let at_limit = b.clone().build();
    assert!(at_limit.is_ok());
    let over = b.field("one more", DType::U8, &[1]).build();
    assert!(matches!(over, Err(Error::InvalidArgument { .. })));
}

#[test]
fn without_skip_unchanged_fields_every_write_is_sent() {
    let l = StepLayout::builder()
        .field("ids", DType::I32, &[8])
        .build()
        .unwrap();
    let (st, _arena) = host_stager(&l, 1, 0);
    for _ in 0..3 {
        let mut s = st.step().unwrap();
        s.put("ids", &[1i32, 2]).unwrap();
        let c = s.commit(StreamHandle::LEGACY).unwrap();
        assert_eq!((c.calls, c.skipped), (1, 0));
    }
}

#[test]
fn the_automatic_plan_sends_the_engine_step_in_one_copy() {
    let l = engine();
    // The default gap allowance (no max_gap): without a driver, or on the legacy stream, the
    // engine step's gaps (at most 62 KiB) are spanned by one copy.
    let st = StepStager::builder(&l).build().unwrap();
    let mut s = st.step().unwrap();
    s.put("input_ids", &[1i32; 256]).unwrap();
    s.put("positions", &[2i64; 256]).unwrap();
    s.put("slot_mapping", &[3i64; 256]).unwrap();
    s.put("seq_lens", &[4i32; 64]).unwrap();
    s.put("query_start_loc", &[5i32; 65]).unwrap();
    s.put("block_table", &[6i32; 64 * 128]).unwrap();
    assert_eq!(s.commit(StreamHandle::LEGACY).unwrap().calls, 1);
    const {
        assert!(
            pinstage::testing::AUTO_GAP_BATCH >= 32 << 10
                && pinstage::testing::AUTO_GAP_COPIES >= 64 << 10
        )
    };
}

#[test]
fn padding_stays_inside_its_field() {
    // `t` is exactly 256 bytes, so `u` starts right after it: any write past `t` lands in `u`.
    let l = StepLayout::builder()
        .field("t", DType::I32, &[8, 8])
        .field("u", DType::I32, &[64])
        .build()
        .unwrap();
    assert_eq!(l.field("u").unwrap().offset(), 256);
    let (st, _arena) = host_stager(&l, 1, 0);
    let mut s = st.step().unwrap();
    s.put("u", &[77i32; 64]).unwrap();
    let vals: Vec<i32> = (1..=10).collect();
    s.put_padded("t", &vals, (2, 5), Some(-1), Some(8)).unwrap();
    s.commit(StreamHandle::LEGACY).unwrap();
    let t = read_i32(&st, "t");
    for r in 0..8 {
        for c in 0..8 {
            let want = if r < 2 && c < 5 { vals[r * 5 + c] } else { -1 };
            assert_eq!(t[r * 8 + c], want, "t[{r}, {c}]");
        }
    }
    assert_eq!(
        read_i32(&st, "u"),
        vec![77; 64],
        "u was overwritten by t's padding"
    );
}

#[test]
fn rows_below_the_values_rows_are_refused() {
    let l = engine();
    let (st, _arena) = host_stager(&l, 1, 0);
    let mut s = st.step().unwrap();
    let r = s.put_padded("seq_lens", &[1i32; 4], (4, 1), Some(0), Some(3));
    assert!(matches!(r, Err(Error::InvalidArgument { .. })), "{r:?}");
    assert_eq!(s.used_rows("seq_lens").unwrap(), 0);
}

#[test]
fn slot_device_addresses_are_checked() {
    let l = engine();
    let zc = StepStager::builder(&l)
        .depth(2)
        .mode(StepMode::ZeroCopy)
        .build()
        .unwrap();
    let first = zc.slot_device_ptr(0, "seq_lens");
    if pinstage::cuda::cuda_available() {
        // Each field at its offset from the slot's first; the next slot elsewhere (every
        // field's bytes are read through these on the GPU: tests/gpu_step.rs).
        let base = zc.slot_device_ptr(0, "input_ids").unwrap();
        for f in l.fields() {
            let p = zc.slot_device_ptr(0, f.name()).unwrap();
            assert_eq!(p - base, f.offset() as u64, "{}", f.name());
            let q = zc.slot_device_ptr(1, f.name()).unwrap();
            assert!(q >= base + l.nbytes() as u64 || q + (l.nbytes() as u64) <= base);
        }
        assert!(first.is_ok());
    } else {
        assert!(matches!(first, Err(Error::CudaUnavailable { .. })));
    }
    assert!(matches!(
        zc.slot_device_ptr(2, "seq_lens"),
        Err(Error::InvalidArgument { .. })
    ));
    assert!(matches!(
        zc.slot_device_ptr(0, "nope"),
        Err(Error::UnknownField { .. })
    ));
    let arena = StepStager::builder(&l).build().unwrap();
    assert!(matches!(
        arena.slot_device_ptr(0, "seq_lens"),
        Err(Error::InvalidArgument { .. })
    ));
}

#[test]
fn shape_errors_name_the_values_shape() {
    let l = engine();
    let (st, _arena) = host_stager(&l, 1, 0);
    let mut s = st.step().unwrap();
    match s.put_padded("block_table", &[1i32; 129], (1, 129), Some(0), None) {
        Err(Error::ShapeMismatch { values, dst }) => {
            assert_eq!((values, dst), (vec![1, 129], vec![256, 128]));
        }
        other => panic!("{other:?}"),
    }
    match s.put("seq_lens", &[1i32; 257]) {
        Err(Error::ShapeMismatch { values, dst }) => {
            assert_eq!((values, dst), (vec![257], vec![256]));
        }
        other => panic!("{other:?}"),
    }
}

/// The stager's and step's descriptions as a user reads them: mode names, Display, Debug, depth,
/// the slots of steps open at once (distinct), and what a host-only stager says of its device.
#[test]
fn names_accessors_and_open_slots() {
    assert_eq!(
        [StepMode::Arena, StepMode::Fresh, StepMode::ZeroCopy].map(|m| m.to_string()),
        ["arena", "fresh", "zero_copy"]
    );
    assert_eq!(StepMode::ZeroCopy.name(), "zero_copy");
    let l = engine();
    let b = StepStager::builder(&l).depth(3);
    assert!(format!("{b:?}").starts_with("StepStagerBuilder"), "{b:?}");
    let (st, _arena) = host_stager(&l, 3, 0);
    assert_eq!(st.depth(), 3);
    let dbg = format!("{st:?}");
    assert!(
        dbg.starts_with("StepStager") && dbg.contains("depth"),
        "{dbg}"
    );
    if !pinstage::cuda::cuda_available() {
        assert!(!st.has_cuda() && st.device().is_none() && st.arena_is_host());
        // Without a driver any ordinal is served from host memory, and reported as built.
        let st3 = StepStager::builder(&l).device(3).build().unwrap();
        assert_eq!(st3.ordinal(), 3);
    }
    // Three steps open at once own three different slots, each below the depth.
    let steps = [st.step().unwrap(), st.step().unwrap(), st.step().unwrap()];
    let mut slots: Vec<usize> = steps.iter().map(|s| s.slot()).collect();
    slots.sort_unstable();
    assert_eq!(slots, [0, 1, 2]);
    assert!(format!("{:?}", steps[2]).contains(&format!("Some({})", steps[2].slot())));
}
