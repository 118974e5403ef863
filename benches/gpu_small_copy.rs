//! The small padded copy on the GPU through the Rust API (256 of 4096 int32): host time per
//! `copy_`, with and without a mirror. Prints a skip line without a GPU.

use std::hint::black_box;

use criterion::{Criterion, criterion_group, criterion_main};
use pinstage::testing::DeviceBuffer;
use pinstage::{DType, Device, H2DMirror, PinnedStager, Stream};

fn small_copy(c: &mut Criterion) {
    let Ok(dev) = Device::new(0) else {
        eprintln!("SKIP gpu_small_copy: no GPU");
        return;
    };
    match pinstage::lab::driver_costs(20_000) {
        Ok(costs) => {
            println!("host cost per driver call (ns):");
            for (name, ns) in costs {
                println!("  {name:<50} {ns:>9.0}");
            }
        }
        Err(e) => println!("driver_costs failed: {e}"),
    }
    let stream = Stream::new(&dev).unwrap();
    let buf = DeviceBuffer::new(&dev, 4096 * 4).unwrap();
    let dst = buf.view(DType::I32);
    let st = PinnedStager::<i32>::builder().numel(256).build().unwrap();
    let sets: Vec<Vec<i32>> = (0..64)
        .map(|k| (0..256).map(|i| k * 1000 + i + 1).collect())
        .collect();
    let mut k = 0;
    c.bench_function("rust copy_ 256 of 4096 int32 (padded)", |b| {
        b.iter(|| {
            k = (k + 1) % 64;
            black_box(
                st.to(&dst)
                    .pad(-1)
                    .stream(stream.handle())
                    .copy(&sets[k])
                    .unwrap(),
            )
        })
    });
    println!(
        "queries per copy: watermark {:.3}",
        st.stats().queries as f64 / st.stats().copies.max(1) as f64,
    );
    let mut m = H2DMirror::new();
    c.bench_function("rust copy_ with mirror, changing values", |b| {
        b.iter(|| {
            k = (k + 1) % 64;
            black_box(
                st.to(&dst)
                    .pad(-1)
                    .mirror(&mut m)
                    .stream(stream.handle())
                    .copy(&sets[k])
                    .unwrap(),
            )
        })
    });
    c.bench_function("rust copy_ with mirror hit (skipped)", |b| {
        b.iter(|| {
            black_box(
                st.to(&dst)
                    .pad(-1)
                    .mirror(&mut m)
                    .stream(stream.handle())
                    .copy(&sets[0])
                    .unwrap(),
            )
        })
    });
    threads(&dev, &st);
    stream.synchronize().unwrap();
    let mut out = vec![0u8; 4096 * 4];
    buf.download(0, &mut out).unwrap();
    let got: &[i32] = bytemuck::cast_slice(&out);
    assert_eq!(&got[..256], &sets[0][..]);
    assert!(got[256..].iter().all(|&x| x == -1));
    println!("stats: {:?}", st.stats());
}

/// One stager shared by 1 and by 4 threads, each on its own stream and destination: calls/s
/// in all, every destination checked afterwards.
fn threads(dev: &Device, st: &PinnedStager<i32>) {
    const CALLS: usize = 50_000;
    const ROUNDS: usize = 5;
    let mut rates = [Vec::new(), Vec::new()];
    for (slot, n) in (0..ROUNDS).flat_map(|_| [(0usize, 1usize), (1, 4)]) {
        let work: Vec<(Stream, DeviceBuffer)> = (0..n)
            .map(|_| {
                (
                    Stream::new(dev).unwrap(),
                    DeviceBuffer::new(dev, 4096 * 4).unwrap(),
                )
            })
            .collect();
        let t0 = std::time::Instant::now();
        std::thread::scope(|s| {
            for (k, (stream, buf)) in work.iter().enumerate() {
                s.spawn(move || {
                    let dst = buf.view(DType::I32);
                    let mut v: Vec<i32> = (0..256).map(|i| (k as i32 + 1) * 1000 + i).collect();
                    for i in 0..CALLS {
                        v[0] = i as i32;
                        st.to(&dst)
                            .pad(-(k as i32) - 1)
                            .stream(stream.handle())
                            .copy(&v)
                            .unwrap();
                    }
                });
            }
        });
        let rate = (n * CALLS) as f64 / t0.elapsed().as_secs_f64();
        for (k, (stream, buf)) in work.iter().enumerate() {
            stream.synchronize().unwrap();
            let mut out = vec![0u8; 4096 * 4];
            buf.download(0, &mut out).unwrap();
            let got: &[i32] = bytemuck::cast_slice(&out);
            assert_eq!(got[0], CALLS as i32 - 1);
            assert!((1..256).all(|i| got[i] == (k as i32 + 1) * 1000 + i as i32));
            assert!(got[256..].iter().all(|&x| x == -(k as i32) - 1));
        }
        rates[slot].push(rate);
        println!("rust, one stager, {n} thread(s), own streams: {rate:.0} calls/s");
    }
    let median = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let (r1, r4) = (median(&mut rates[0]), median(&mut rates[1]));
    println!(
        "rust, one stager: 4 threads / 1 thread = {:.2} ({r4:.0} vs {r1:.0} calls/s, medians of \
         {ROUNDS} rounds; every destination checked)",
        r4 / r1
    );
}

criterion_group! { name = benches; config = Criterion::default().sample_size(30).measurement_time(std::time::Duration::from_secs(2)); targets = small_copy }
criterion_main!(benches);
