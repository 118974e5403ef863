//! What staffing a pageable copy's copy threads costs the caller (the lab's question about
//! `copy_h2d`'s start, `lab/probes/h2d_stamps.py`): a rayon pool built as pinstage's
//! (`src/host/workers.rs`: one thread per core, at most 12), its threads idle for a while before
//! each round, then from the calling thread (outside the pool) inside `in_place_scope`:
//!   each      11 `spawn`s from the caller, one per copy thread (pinstage's default)
//!   fanout    one `spawn` from the caller; that task spawns the other 10 (the lab knob `fanout` of
//!             6453715, removed since)
//! Each task holds its thread for 100 µs, as a fill would (the fanout task after its spawns), so
//! the tasks must spread over the pool's threads. Printed per row and idle time: median [p10
//! p90] µs of 200 rounds of the caller's spawning (until it could start its own fill), of the
//! first task's start and of the last task's start (each from the round's start), and the median
//! count of distinct pool threads that ran the round's tasks. No GPU. Run: `cargo bench --features lab --bench spawn_cost`
//! (or `.gpu/bin/bench-spawn_cost`, `scripts/gpu-run bench-spawn_cost`).

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

const TASKS: usize = 11;
const ROUNDS: usize = 200;
const HOLD: Duration = Duration::from_micros(100);

/// Spins for `HOLD` (a fill keeps its thread busy; a sleep would free it).
fn hold() {
    let t = Instant::now();
    while t.elapsed() < HOLD {
        std::hint::spin_loop();
    }
}

fn pct(v: &mut [f64], p: usize) -> f64 {
    v.sort_by(f64::total_cmp);
    v[(v.len() - 1) * p / 100]
}

fn main() {
    let n = std::thread::available_parallelism()
        .map_or(4, |n| n.get())
        .clamp(1, 12);
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(n)
        .thread_name(|i| format!("spawn-cost-{i}"))
        .build()
        .expect("a rayon pool");
    println!(
        "spawn_cost: a pool of {n} threads (cores {}); {TASKS} tasks a round, {ROUNDS} rounds a row; µs from the round's start, median [p10 p90]",
        std::thread::available_parallelism().map_or(0, |n| n.get())
    );
    let base = Instant::now();
    let ns = |t: Instant| t.duration_since(base).as_nanos() as u64;
    for idle_us in [5000u64, 200, 20] {
        for fanout in [false, true] {
            let (mut caller, mut first, mut last, mut threads) = (vec![], vec![], vec![], vec![]);
            for _ in 0..ROUNDS {
                std::thread::sleep(Duration::from_micros(idle_us));
                let (lo, hi) = (AtomicU64::new(u64::MAX), AtomicU64::new(0));
                let ran_on = AtomicU64::new(0);
                let started = || {
                    let t = ns(Instant::now());
                    lo.fetch_min(t, Ordering::Relaxed);
                    hi.fetch_max(t, Ordering::Relaxed);
                    if let Some(i) = rayon::current_thread_index() {
                        ran_on.fetch_or(1 << (i % 64), Ordering::Relaxed);
                    }
                };
                let t0 = Instant::now();
                let mut t_spawned = t0;
                pool.in_place_scope(|s| {
                    if fanout {
                        s.spawn(|s| {
                            started();
                            for _ in 1..TASKS {
                                s.spawn(|_| {
                                    started();
                                    hold();
                                });
                            }
                            hold();
                        });
                    } else {
                        for _ in 0..TASKS {
                            s.spawn(|_| {
                                started();
                                hold();
                            });
                        }
                    }
                    t_spawned = Instant::now();
                });
                let us = |t: u64| (t.saturating_sub(ns(t0))) as f64 / 1e3;
                caller.push(t_spawned.duration_since(t0).as_nanos() as f64 / 1e3);
                first.push(us(lo.load(Ordering::Relaxed)));
                last.push(us(hi.load(Ordering::Relaxed)));
                threads.push(f64::from(ran_on.load(Ordering::Relaxed).count_ones()));
            }
            let row = |v: &mut Vec<f64>| {
                format!("{:7.1} [{:6.1} {:7.1}]", pct(v, 50), pct(v, 10), pct(v, 90))
            };
            println!(
                "  idle {idle_us:>5} us, {:<6}  caller spawned {}  first task {}  last task {}  threads {:.0}",
                if fanout { "fanout" } else { "each" },
                row(&mut caller),
                row(&mut first),
                row(&mut last),
                pct(&mut threads, 50)
            );
        }
    }
}
