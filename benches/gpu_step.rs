//! Step staging through the Rust API on the GPU: host ns per step, beside the driver's floor
//! (one `cuMemcpyHtoDAsync` + `cuEventRecord` of the step's used bytes, and one copy per field),
//! measured in the same run; the k-field sweep; zero-copy; and the plan's crossover (one copy
//! spanning a gap vs one batch of two spans: host and copy-engine time per step). Every timed
//! batch's result is checked. Prints a skip line without a GPU.

use std::time::Instant;

use pinstage::step::StepMode;
use pinstage::testing::DeviceBuffer;
use pinstage::{DType, Device, StepLayout, StepStager, Stream};

const ITERS: usize = 20_000;
const ROUNDS: usize = 5;

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

struct Vals {
    ids: Vec<i32>,
    pos: Vec<i64>,
    slots: Vec<i64>,
    lens: Vec<i32>,
    qsl: Vec<i32>,
    table: Vec<i32>,
}

fn vals(k: i64) -> Vals {
    Vals {
        ids: (0..256).map(|i| (k * 1000 + i + 1) as i32).collect(),
        pos: (0..256).map(|i| k * 1_000_000 + i + 1).collect(),
        slots: (0..256).map(|i| -(k * 1_000_000 + i + 1)).collect(),
        lens: (0..64).map(|i| (k + i + 1) as i32).collect(),
        qsl: (0..65).map(|i| (k * 3 + i) as i32).collect(),
        table: (0..64 * 128).map(|i| (k * 7 + i + 1) as i32).collect(),
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn read(st: &StepStager, arena: &DeviceBuffer, l: &StepLayout, name: &str, n: usize) -> Vec<u8> {
    st.order_after_commits(None).unwrap();
    let f = l.field(name).unwrap();
    let mut out = vec![0u8; n];
    arena.download(f.offset(), &mut out).unwrap();
    out
}

/// Host ns per engine step through `st` (median of [`ROUNDS`] batches of [`ITERS`] steps, values
/// changing every step); the arena is poisoned before each batch and its last step checked after.
fn engine_rounds(
    st: &StepStager,
    arena: &DeviceBuffer,
    l: &StepLayout,
    sets: &[Vals],
    stream: &Stream,
) -> f64 {
    let ids = l.id("input_ids").unwrap();
    let mut ns = Vec::new();
    for _ in 0..ROUNDS {
        st.order_after_commits(None).unwrap();
        arena.upload(0, &vec![0xEE; l.nbytes()]).unwrap();
        let t0 = Instant::now();
        for i in 0..ITERS {
            let v = &sets[i % 64];
            let mut s = st.step().unwrap();
            s.put(ids, &v.ids).unwrap();
            s.put("positions", &v.pos).unwrap();
            s.put("slot_mapping", &v.slots).unwrap();
            s.put("seq_lens", &v.lens).unwrap();
            s.put("query_start_loc", &v.qsl).unwrap();
            s.put("block_table", &v.table).unwrap();
            s.commit(stream.handle()).unwrap();
        }
        ns.push(t0.elapsed().as_nanos() as f64 / ITERS as f64);
        let last = &sets[(ITERS - 1) % 64];
        assert_eq!(
            read(st, arena, l, "block_table", 64 * 512),
            bytemuck::cast_slice::<i32, u8>(&last.table),
            "block_table after the timed batch"
        );
        assert_eq!(
            read(st, arena, l, "input_ids", 1024),
            bytemuck::cast_slice::<i32, u8>(&last.ids)
        );
    }
    median(ns)
}

/// Steps of the paced measurements.
const PACED: usize = 2000;

/// Paced engine steps through `st`: the stream is synchronized before each step (outside the
/// timing), as a step arrives while an engine's GPU is idle or busy elsewhere. Returns the host
/// ns of each step's claim, puts and commit (median and mean), and the medians of the claim, the
/// puts and the commit alone. With `check_each`, every step's fields are read back and checked
/// after it (the values change every step); else the last step's, after the run (the reads
/// between steps evict what the next step would find in the caches).
fn engine_paced(
    st: &StepStager,
    arena: &DeviceBuffer,
    l: &StepLayout,
    sets: &[Vals],
    stream: &Stream,
    check_each: bool,
) -> ((f64, f64), [f64; 3]) {
    st.order_after_commits(None).unwrap();
    arena.upload(0, &vec![0xEE; l.nbytes()]).unwrap();
    let mut ns = Vec::with_capacity(PACED);
    let mut parts: [Vec<f64>; 3] = Default::default();
    for i in 0..PACED {
        let v = &sets[i % 64];
        stream.synchronize().unwrap();
        let t0 = Instant::now();
        let mut s = st.step().unwrap();
        let t1 = Instant::now();
        s.put("input_ids", &v.ids).unwrap();
        s.put("positions", &v.pos).unwrap();
        s.put("slot_mapping", &v.slots).unwrap();
        s.put("seq_lens", &v.lens).unwrap();
        s.put("query_start_loc", &v.qsl).unwrap();
        s.put("block_table", &v.table).unwrap();
        let t2 = Instant::now();
        s.commit(stream.handle()).unwrap();
        let t3 = Instant::now();
        ns.push((t3 - t0).as_nanos() as f64);
        parts[0].push((t1 - t0).as_nanos() as f64);
        parts[1].push((t2 - t1).as_nanos() as f64);
        parts[2].push((t3 - t2).as_nanos() as f64);
        if !check_each && i + 1 < PACED {
            continue;
        }
        let want: [(&str, &[u8]); 6] = [
            ("input_ids", bytemuck::cast_slice(&v.ids)),
            ("positions", bytemuck::cast_slice(&v.pos)),
            ("slot_mapping", bytemuck::cast_slice(&v.slots)),
            ("seq_lens", bytemuck::cast_slice(&v.lens)),
            ("query_start_loc", bytemuck::cast_slice(&v.qsl)),
            ("block_table", bytemuck::cast_slice(&v.table)),
        ];
        for (name, bytes) in want {
            assert_eq!(
                read(st, arena, l, name, bytes.len()),
                bytes,
                "paced step {i}: {name}"
            );
        }
    }
    (pinstage::lab::median_mean(ns), parts.map(median))
}

fn main() {
    let Ok(dev) = Device::new(0) else {
        eprintln!("SKIP gpu_step: no GPU");
        return;
    };
    let stream = Stream::new(&dev).unwrap();
    let l = engine();
    let sets: Vec<Vals> = (0..64).map(vals).collect();
    let arena = DeviceBuffer::new(&dev, l.nbytes()).unwrap();
    let view = arena.view(DType::U8);
    // SAFETY: `arena` outlives the stager; nothing else writes it while steps run.
    let st = unsafe { StepStager::builder(&l).depth(8).bind(&view) }
        .build()
        .unwrap();
    let used: usize = 256 * 4 + 256 * 8 * 2 + 64 * 4 + 65 * 4 + 64 * 512;
    let step = engine_rounds(&st, &arena, &l, &sets, &stream);
    let planned = st.stats();
    // The same step sent as one copy over every gap (the whole span).
    // SAFETY: as above.
    let st_span = unsafe {
        StepStager::builder(&l)
            .depth(8)
            .max_gap(usize::MAX)
            .bind(&view)
    }
    .build()
    .unwrap();
    let span_step = engine_rounds(&st_span, &arena, &l, &sets, &stream);
    let paced = engine_paced(&st, &arena, &l, &sets, &stream, true);
    let paced_span = engine_paced(&st_span, &arena, &l, &sets, &stream, true);
    let paced_quiet = engine_paced(&st, &arena, &l, &sets, &stream, false);
    drop(st_span);
    let (floor_used, floor_six) =
        pinstage::lab::step_floor(&dev, &stream, used, 6, ITERS, ROUNDS).unwrap();
    let span = l.field("block_table").unwrap().offset() + 64 * 512;
    let (floor_span, _) = pinstage::lab::step_floor(&dev, &stream, span, 1, ITERS, ROUNDS).unwrap();
    println!("engine step, Rust, host ns per step (loop, {ITERS} steps, median of {ROUNDS}):");
    println!(
        "  StepStager step + 6 put + commit          {step:9.0}   (default plan: {} batches of {} entries, {} copies)",
        planned.batches, planned.batch_entries, planned.copies
    );
    println!("  the same, one copy over the whole span    {span_step:9.0}");
    println!(
        "  driver: 1 HtoD of the used {used} B + record {floor_used:9.0}   step / floor = {:.2}",
        step / floor_used
    );
    println!("  driver: 1 HtoD of the span {span} B + record {floor_span:9.0}");
    println!(
        "  driver: 6 HtoD (one per field) + record    {floor_six:9.0}   six / step = {:.2}",
        floor_six / step
    );
    println!("  stats: {planned:?}");
    let (f_used, f_used_mean) =
        pinstage::lab::step_floor_paced(&dev, &stream, used, PACED).unwrap();
    let (f_span, f_span_mean) =
        pinstage::lab::step_floor_paced(&dev, &stream, span, PACED).unwrap();
    println!(
        "engine step, paced (the stream idle as each step arrives; every step checked), host ns \
         per step, median / mean of {PACED}:"
    );
    let row = |name: &str, ((m, mean), [claim, puts, commit]): ((f64, f64), [f64; 3])| {
        println!(
            "  {name:<41} {m:9.0} / {mean:9.0}   step / floor(used) = {:.2}; claim {claim:.0}, \
             6 put {puts:.0}, commit {commit:.0}",
            m / f_used
        );
    };
    row("StepStager step + 6 put + commit", paced);
    row("the same, one copy over the whole span", paced_span);
    row("the same, checked after the run only", paced_quiet);
    println!("  driver: 1 HtoD of the used {used} B + record {f_used:9.0} / {f_used_mean:9.0}");
    println!("  driver: 1 HtoD of the span {span} B + record {f_span:9.0} / {f_span_mean:9.0}");
    // The same work as a step: the six fields' values written into the pinned source (packed,
    // no gaps), then one copy of the used bytes and its record; the last step checked.
    let packed_of = |v: &Vals, out: &mut [u8]| {
        let mut at = 0;
        for b in [
            bytemuck::cast_slice::<i32, u8>(&v.ids),
            bytemuck::cast_slice(&v.pos),
            bytemuck::cast_slice(&v.slots),
            bytemuck::cast_slice(&v.lens),
            bytemuck::cast_slice(&v.qsl),
            bytemuck::cast_slice(&v.table),
        ] {
            out[at..at + b.len()].copy_from_slice(b);
            at += b.len();
        }
        assert_eq!(at, out.len());
    };
    let ((f_fill, f_fill_mean), landed) =
        pinstage::lab::step_floor_paced_filled(&dev, &stream, used, PACED, &mut |buf, i| {
            packed_of(&sets[i % 64], buf)
        })
        .unwrap();
    let mut want = vec![0u8; used];
    packed_of(&sets[(PACED - 1) % 64], &mut want);
    assert_eq!(landed, want, "the filled floor's last step");
    println!(
        "  driver: the 6 fields' values written + 1 HtoD of the used bytes + record \
         {f_fill:9.0} / {f_fill_mean:9.0}"
    );
    let [enter, capturing, get_id, copy, record, fill] =
        pinstage::lab::commit_parts_paced(&dev, &stream, used, PACED, &mut |buf, i| {
            packed_of(&sets[i % 64], buf)
        })
        .unwrap();
    println!(
        "  driver, call by call after the values were written (median ns): write values {fill:.0}, \
         cuCtxGetCurrent {enter:.0}, cuStreamIsCapturing {capturing:.0}, cuStreamGetId \
         {get_id:.0}, cuMemcpyHtoDAsync {copy:.0}, cuEventRecord {record:.0}"
    );
    for (name, ((m, _), _)) in [
        ("StepStager, every step checked", paced),
        ("StepStager, one copy over the span", paced_span),
        ("StepStager, checked after the run", paced_quiet),
    ] {
        println!(
            "  goal (same work): {name:<36} / driver with the values written = {:.2}",
            m / f_fill
        );
    }

    // k fields of 1 KiB.
    println!("k fields of 1 KiB, host ns per step:");
    let mut k1 = 0.0;
    for k in [1usize, 2, 4, 8, 16, 32] {
        let mut b = StepLayout::builder();
        for i in 0..k {
            b = b.field(format!("f{i}"), DType::I32, &[256]);
        }
        let lk = b.build().unwrap();
        let ak = DeviceBuffer::new(&dev, lk.nbytes()).unwrap();
        let vk = ak.view(DType::U8);
        // SAFETY: as above.
        let sk = unsafe { StepStager::builder(&lk).depth(8).bind(&vk) }
            .build()
            .unwrap();
        let data: Vec<Vec<i32>> = (0..64)
            .map(|j| (0..256).map(|i| j * 1000 + i + 1).collect())
            .collect();
        // Every field of the arena holds the last of `n` steps' values (the step `it` put
        // `data[(it + f) % 64]` into field f).
        let check_last = |n: usize, what: &str| {
            for f in 0..k {
                let got = read(&sk, &ak, &lk, &format!("f{f}"), 1024);
                assert_eq!(
                    got,
                    bytemuck::cast_slice::<i32, u8>(&data[(n - 1 + f) % 64]),
                    "k={k} field {f}{what}"
                );
            }
        };
        let mut ns = Vec::new();
        for _ in 0..ROUNDS {
            ak.upload(0, &vec![0xEE; lk.nbytes()]).unwrap();
            let t0 = Instant::now();
            for it in 0..ITERS {
                let mut s = sk.step().unwrap();
                for f in 0..k {
                    s.put(pinstage::step::FieldId::from_index(f), &data[(it + f) % 64])
                        .unwrap();
                }
                s.commit(stream.handle()).unwrap();
            }
            ns.push(t0.elapsed().as_nanos() as f64 / ITERS as f64);
            check_last(ITERS, "");
        }
        let m = median(ns);
        if k == 1 {
            k1 = m;
        }
        // Where a step's time goes, in a loop and paced (one more round each, timed in parts,
        // not part of the figure above; the parts' own clocks add ~20 ns each).
        let mut parts = [[0f64; 3]; 2];
        for (pi, paced) in [false, true].into_iter().enumerate() {
            ak.upload(0, &vec![0xEE; lk.nbytes()]).unwrap();
            let n = if paced { 2000 } else { ITERS };
            for it in 0..n {
                if paced {
                    stream.synchronize().unwrap();
                }
                let t0 = Instant::now();
                let mut s = sk.step().unwrap();
                let t1 = Instant::now();
                for f in 0..k {
                    s.put(pinstage::step::FieldId::from_index(f), &data[(it + f) % 64])
                        .unwrap();
                }
                let t2 = Instant::now();
                s.commit(stream.handle()).unwrap();
                let t3 = Instant::now();
                parts[pi][0] += (t1 - t0).as_nanos() as f64 / n as f64;
                parts[pi][1] += (t2 - t1).as_nanos() as f64 / n as f64;
                parts[pi][2] += (t3 - t2).as_nanos() as f64 / n as f64;
            }
            check_last(n, " (parts)");
        }
        let [lp, pp] = parts;
        println!(
            "  k={k:<3} {m:9.0}   ({:.2}x k=1);   mean parts, loop: claim {:.0} puts {:.0} commit {:.0};   paced: claim {:.0} puts {:.0} commit {:.0}",
            m / k1,
            lp[0],
            lp[1],
            lp[2],
            pp[0],
            pp[1],
            pp[2]
        );
    }

    // Zero-copy: the step's bookkeeping and its event, fields written in place.
    let ids = l.id("input_ids").unwrap();
    let zc = StepStager::builder(&l)
        .depth(8)
        .mode(StepMode::ZeroCopy)
        .build()
        .unwrap();
    let mut ns = Vec::new();
    for round in 0..ROUNDS {
        // Poison every slot first (held steps, ended uncommitted: the slot keeps what was written).
        stream.synchronize().unwrap();
        let mut held: Vec<_> = (0..8).map(|_| zc.step().unwrap()).collect();
        for s in &mut held {
            s.field_mut::<i32>(ids, 1).unwrap()[0] = -7;
        }
        drop(held);
        let base = (round * ITERS) as i32;
        let t0 = Instant::now();
        for i in 0..ITERS {
            let mut s = zc.step().unwrap();
            s.field_mut::<i32>(ids, 1).unwrap()[0] = base + i as i32;
            s.commit(stream.handle()).unwrap();
        }
        ns.push(t0.elapsed().as_nanos() as f64 / ITERS as f64);
        // The last 8 steps are in the 8 slots, one each: claim every slot (their readers done)
        // and read what the host last wrote there; the steps end uncommitted.
        stream.synchronize().unwrap();
        let mut held: Vec<_> = (0..8).map(|_| zc.step().unwrap()).collect();
        let mut got: Vec<i32> = held
            .iter_mut()
            .map(|s| s.field_mut::<i32>(ids, 1).unwrap()[0])
            .collect();
        drop(held);
        got.sort_unstable();
        let want: Vec<i32> = (ITERS - 8..ITERS).map(|i| base + i as i32).collect();
        assert_eq!(
            got, want,
            "zero-copy: the slots do not hold the last 8 steps' writes"
        );
    }
    println!(
        "zero-copy step (claim + one write + event record; the last 8 steps checked after each batch), host ns: {:.0}",
        median(ns)
    );

    // The plan's crossover: two fields written, a gap of G unused bytes between them.
    println!(
        "crossover: 2 spans of 4 KiB with a gap of G bytes; host ns per step / wall ns per step \
         until the stream drained (depth 8)"
    );
    println!(
        "  {:>9} {:>22} {:>22} {:>22}",
        "G", "one copy over the gap", "one batch of 2", "two copies"
    );
    for gap in [
        0usize,
        1 << 10,
        4 << 10,
        8 << 10,
        16 << 10,
        64 << 10,
        256 << 10,
        1 << 20,
    ] {
        let lg = StepLayout::builder()
            .field("a", DType::U8, &[4096 + gap])
            .field("b", DType::U8, &[4096])
            .build()
            .unwrap();
        let ag = DeviceBuffer::new(&dev, lg.nbytes()).unwrap();
        let vg = ag.view(DType::U8);
        let mut row = Vec::new();
        for (max_gap, batch) in [(usize::MAX, true), (0, true), (0, false)] {
            // SAFETY: as above.
            let sg = unsafe {
                StepStager::builder(&lg)
                    .depth(8)
                    .max_gap(max_gap)
                    .batch(batch)
                    .bind(&vg)
            }
            .build()
            .unwrap();
            let n = 4000;
            let mut best = (f64::MAX, f64::MAX);
            for r in 0..3u8 {
                let a = vec![r + 3; 4096];
                stream.synchronize().unwrap();
                let t0 = Instant::now();
                for _ in 0..n {
                    let mut s = sg.step().unwrap();
                    s.put("a", &a).unwrap();
                    s.put("b", &a).unwrap();
                    s.commit(stream.handle()).unwrap();
                }
                let host = t0.elapsed().as_nanos() as f64 / n as f64;
                stream.synchronize().unwrap();
                let wall = t0.elapsed().as_nanos() as f64 / n as f64;
                best = (best.0.min(host), best.1.min(wall));
                assert_eq!(read(&sg, &ag, &lg, "b", 4096), a);
                assert_eq!(read(&sg, &ag, &lg, "a", 4096), a);
            }
            row.push(format!("{:>9.0} / {:>9.0}", best.0, best.1));
        }
        println!("  {gap:>9} {:>22} {:>22} {:>22}", row[0], row[1], row[2]);
    }
}
