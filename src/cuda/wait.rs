//! Waiting for the device without naps: look again and again for about as long as the work
//! should take (spinning, then yielding the core), then sleep in slices that stay a small
//! fraction of the time already waited, so a long wait neither burns a core nor oversleeps.
//!
//! Every host wait of pinstage (a pending copy's `wait`, a claim of a busy slot, a landing word,
//! a bounce slot) runs this schedule; the driver's own `cuEventSynchronize` would spin for as
//! long as the work runs (the primary context's default scheduling), and a fixed nap costs more
//! than the small copies it waits for.

use std::time::{Duration, Instant};

/// Spin (`spin_loop`) between looks for the first this long.
const SPIN: Duration = Duration::from_micros(20);
/// Busy (spinning, then yielding) for at least this long before the first sleep...
const MIN_BUSY: Duration = Duration::from_millis(1);
/// ...and at most this long, whatever the work's expected time.
const MAX_BUSY: Duration = Duration::from_millis(50);
/// A sleep lasts at most this fraction of the time waited so far...
const SLEEP_FRACTION: u32 = 16;
/// ...and at most this long.
const MAX_SLEEP: Duration = Duration::from_millis(1);

/// What to do before the next look.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Pause {
    /// A few `spin_loop` hints: the work is expected any moment.
    Spin,
    /// `yield_now`: give the core to another runnable thread, if any.
    Yield,
    /// Sleep this long (the OS adds its timer slack, about 50 µs on Linux).
    Sleep(Duration),
}

/// The schedule of one wait (see the module docs).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Backoff {
    start: Instant,
    busy: Duration,
}

impl Backoff {
    /// A wait for work expected to take about `expected`.
    pub(crate) fn new(expected: Duration) -> Self {
        Self {
            start: Instant::now(),
            busy: busy_for(expected),
        }
    }

    /// The pause after `waited` (a pure function of the schedule, for tests).
    pub(crate) fn pause_after(&self, waited: Duration) -> Pause {
        if waited < SPIN {
            Pause::Spin
        } else if waited < self.busy {
            Pause::Yield
        } else {
            Pause::Sleep((waited / SLEEP_FRACTION).min(MAX_SLEEP))
        }
    }

    /// Pauses before the next look.
    #[inline]
    pub(crate) fn pause(&self) {
        match self.pause_after(self.start.elapsed()) {
            Pause::Spin => (0..32).for_each(|_| std::hint::spin_loop()),
            // The lab variant `spin_wait` (a control): no system call while busy.
            Pause::Yield if cfg!(pinstage_lab_variant = "spin_wait") => {
                (0..32).for_each(|_| std::hint::spin_loop())
            }
            Pause::Yield => std::thread::yield_now(),
            Pause::Sleep(d) => std::thread::sleep(d),
        }
    }
}

/// How long a wait stays busy: one and a half times the expected time, within
/// [`MIN_BUSY`]..=[`MAX_BUSY`].
fn busy_for(expected: Duration) -> Duration {
    (expected + expected / 2).clamp(MIN_BUSY, MAX_BUSY)
}

/// About how long a copy of `bytes` over the PCIe link takes once it starts: the driver's
/// ~7 µs of latency plus the bytes at ~50 GB/s. Only the wait's schedule depends on it.
pub(crate) fn copy_time(bytes: usize) -> Duration {
    Duration::from_micros(7) + Duration::from_nanos((bytes / 50) as u64)
}

/// Looks with `done` until it says `Ok(true)` (returned), fails (returned), or `until` passed
/// (`Ok(false)`), pausing between looks as `backoff` says.
///
/// The seeded-bug harness (`wait_early`, scripts/seeded.tsv): a wait that returns before the work
/// completed must fail the GPU tests.
pub(crate) fn wait_until<E>(
    backoff: &Backoff,
    until: Option<Instant>,
    mut done: impl FnMut() -> Result<bool, E>,
) -> Result<bool, E> {
    if cfg!(pinstage_seeded_bug = "wait_early") {
        return Ok(true);
    }
    loop {
        if done()? {
            return Ok(true);
        }
        if until.is_some_and(|u| Instant::now() >= u) {
            return Ok(false);
        }
        backoff.pause();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spins_then_yields_then_sleeps_a_fraction_of_the_time_waited() {
        for expected in [0, 10, 300, 5_000, 100_000].map(Duration::from_micros) {
            let b = Backoff::new(expected);
            assert_eq!(b.pause_after(Duration::ZERO), Pause::Spin);
            assert_eq!(b.pause_after(Duration::from_micros(19)), Pause::Spin);
            // Busy for at least the expected time (up to the cap) and at least 1 ms.
            let busy = (expected + expected / 2).clamp(MIN_BUSY, MAX_BUSY);
            assert!(busy >= expected.min(MAX_BUSY) && busy >= MIN_BUSY);
            assert_eq!(b.pause_after(busy - Duration::from_nanos(1)), Pause::Yield);
            for waited in [
                busy,
                busy * 2,
                Duration::from_millis(100),
                Duration::from_secs(5),
            ] {
                let Pause::Sleep(d) = b.pause_after(waited) else {
                    panic!("no sleep after {waited:?}")
                };
                assert!(
                    d > Duration::ZERO && d <= waited / 16 && d <= MAX_SLEEP,
                    "{d:?}"
                );
            }
        }
    }

    #[test]
    fn a_copy_is_expected_to_take_its_bytes_at_line_rate() {
        assert_eq!(copy_time(0), Duration::from_micros(7));
        let t = copy_time(16 << 20);
        assert!(
            t > Duration::from_micros(300) && t < Duration::from_micros(400),
            "{t:?}"
        );
    }

    #[test]
    fn returns_when_done_fails_or_times_out() {
        let b = Backoff::new(Duration::ZERO);
        let mut n = 0;
        assert_eq!(
            wait_until::<()>(&b, None, || {
                n += 1;
                Ok(n == 5)
            }),
            Ok(true)
        );
        assert_eq!(n, 5);
        assert_eq!(wait_until(&b, None, || Err::<bool, _>(7)), Err(7));
        let past = Some(Instant::now());
        assert_eq!(wait_until::<()>(&b, past, || Ok(false)), Ok(false));
    }
}
