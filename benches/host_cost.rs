//! Host-side costs that need no GPU: slot claim (uncontended, with the completion check's
//! bookkeeping, and 4 threads contended), padding write, mirror compare at 16/256/4096 elements.

use std::hint::black_box;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use criterion::{BenchmarkId, Criterion, criterion_group, criterion_main};
use pinstage::H2DMirror;
use pinstage::lab::{Ring, write_padded};

fn slot_claim(c: &mut Criterion) {
    let ring = Ring::new(8);
    c.bench_function("slot claim+release, uncontended", |b| {
        b.iter(|| black_box(ring.claim_release()))
    });
    for amortize in [true, false] {
        let ring = Ring::new(16);
        let mut queries = 0u64;
        let mut calls = 0u64;
        let name = if amortize {
            "slot claim+check+release, watermark (events answer complete)"
        } else {
            "slot claim+check+release, a query per claim (events answer complete)"
        };
        c.bench_function(name, |b| {
            b.iter(|| {
                calls += 1;
                if amortize {
                    black_box(ring.claim_check_release(&mut queries))
                } else {
                    black_box(ring.claim_query_release(&mut queries))
                }
            })
        });
        println!(
            "  {:.3} queries per claim",
            queries as f64 / calls.max(1) as f64
        );
    }
    let ring = Arc::new(Ring::new(8));
    let stop = Arc::new(AtomicBool::new(false));
    let others: Vec<_> = (0..3)
        .map(|_| {
            let (ring, stop) = (ring.clone(), stop.clone());
            std::thread::spawn(move || {
                while !stop.load(Ordering::Relaxed) {
                    black_box(ring.claim_release());
                }
            })
        })
        .collect();
    c.bench_function("slot claim+release, 4 threads contended", |b| {
        b.iter(|| black_box(ring.claim_release()))
    });
    stop.store(true, Ordering::Relaxed);
    others.into_iter().for_each(|t| t.join().unwrap());
}

fn padding(c: &mut Criterion) {
    let mut g = c.benchmark_group("write values+padding (int32, 256 of N)");
    for total in [256usize, 4096, 65536] {
        let values: Vec<u8> = (0..1024).map(|i| (i % 251) as u8 + 1).collect();
        let mut dst = vec![0u8; total * 4];
        g.bench_with_input(BenchmarkId::from_parameter(total), &total, |b, _| {
            b.iter(|| {
                write_padded(
                    black_box(&mut dst),
                    black_box(&values),
                    &[0xFF, 0xFF, 0xFF, 0xFF],
                )
            })
        });
    }
    g.finish();
}

fn mirror(c: &mut Criterion) {
    let mut g = c.benchmark_group("mirror compare (int32 elements, equal)");
    for n in [16usize, 256, 4096] {
        let v: Vec<u8> = (0..n * 4).map(|i| (i % 253) as u8 + 1).collect();
        let mut m = H2DMirror::new();
        m.record(b"key", &v);
        g.bench_with_input(BenchmarkId::from_parameter(n), &n, |b, _| {
            b.iter(|| black_box(m.matches(black_box(b"key"), black_box(&v))))
        });
    }
    g.finish();
}

criterion_group!(benches, slot_claim, padding, mirror);
criterion_main!(benches);
