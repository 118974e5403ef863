//! Lab experiment: time-stamp counter points inside a step commit, summed per point (cycles
//! since the previous point on this thread). Read with [`take`].

use std::cell::Cell;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

/// Points of a commit.
pub const POINTS: usize = 10;
static SUM: [AtomicU64; POINTS] = [const { AtomicU64::new(0) }; POINTS];
static HITS: [AtomicU64; POINTS] = [const { AtomicU64::new(0) }; POINTS];

thread_local! {
    static LAST: Cell<u64> = const { Cell::new(0) };
}

#[inline(always)]
fn tsc() -> u64 {
    // SAFETY: rdtsc has no preconditions on x86-64.
    unsafe { std::arch::x86_64::_rdtsc() }
}

/// Starts a timeline on this thread.
#[inline(always)]
pub fn start() {
    LAST.with(|l| l.set(tsc()));
}

/// Adds the cycles since the previous point to point `i`.
#[inline(always)]
pub fn point(i: usize) {
    let now = tsc();
    LAST.with(|l| {
        SUM[i].fetch_add(now - l.get(), Relaxed);
        HITS[i].fetch_add(1, Relaxed);
        l.set(tsc());
    });
}

/// The mean ns per hit of each point since the last call (cycles converted with a measured
/// clock), and resets them.
pub fn take() -> [(f64, u64); POINTS] {
    let t0 = std::time::Instant::now();
    let c0 = tsc();
    std::thread::sleep(std::time::Duration::from_millis(20));
    let ghz = (tsc() - c0) as f64 / t0.elapsed().as_nanos() as f64;
    std::array::from_fn(|i| {
        let s = SUM[i].swap(0, Relaxed);
        let h = HITS[i].swap(0, Relaxed);
        (if h == 0 { 0.0 } else { s as f64 / h as f64 / ghz }, h)
    })
}
