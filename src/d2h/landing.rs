//! Learning that a D2H copy landed without an event: after the copy, the stream writes a
//! pinned word (`cuStreamWriteValue32`, whose default flags fence the stream's earlier writes
//! first; the GPU's front end does it, no SM work) and the waiting host thread spins on that
//! word. Cheaper than recording an event and synchronizing on it, for a caller who waits at once
//! (`copy_d2h`). Each device has 64 words, one cache line each; a wait claims one for its
//! duration, and without a free word (or where the driver refuses stream writes) the copy is
//! waited for through an event as before.

use std::sync::OnceLock;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use crate::cuda::wait::Backoff;
use crate::cuda::{Current, Device, StreamHandle};
use crate::driver;
use crate::error::Result;
use crate::host::{PinnedBuffer, PinnedFlags};

/// Words per device.
const SLOTS: usize = 64;
/// Bytes between words (one cache line each: spinning threads do not share lines).
const STRIDE: usize = 64;
/// How long a wait spins flat out before it also yields and asks the driver about errors.
const SPIN: Duration = Duration::from_micros(200);

/// One device's words.
pub(crate) struct Landing {
    words: PinnedBuffer,
    /// The device address of `words`.
    dev: u64,
    /// Free words (bit set: free).
    free: AtomicU64,
    /// The value each word is written next (its last value + 1), so a late write from an
    /// abandoned wait never matches a new one.
    next: [AtomicU32; SLOTS],
    /// Cleared once the driver refused a stream write: every wait takes the event path.
    usable: AtomicBool,
}

static LANDINGS: [OnceLock<Option<Landing>>; 64] = [const { OnceLock::new() }; 64];

/// Waits that learned of their copy from a landing word within their flat-out spin, waited
/// copies that took an event instead (all words in use, stream writes refused), waits that saw
/// their word only after the spin, and waits that learned it from their idle stream with their
/// word still not there: for tests (feature `testing`; no shared counter on the copies of a
/// release build).
#[cfg(feature = "testing")]
pub(crate) static COUNTS: [AtomicU64; 4] = [const { AtomicU64::new(0) }; 4];

/// Counts a wait that landed within its spin (`0`), a waited copy that took an event (`1`), a
/// wait that landed after its spin (`2`), or one whose stream went idle without its word (`3`),
/// for tests.
#[inline]
pub(crate) fn count(_which: usize) {
    #[cfg(feature = "testing")]
    COUNTS[_which].fetch_add(1, Ordering::Relaxed);
}

/// The device's words, made on first use; `None` where they cannot be had (pinned memory
/// refused, more than 64 devices, stream writes refused before).
pub(crate) fn landing(device: &Device) -> Option<&'static Landing> {
    let slot = LANDINGS.get(usize::try_from(device.ordinal()).ok()?)?;
    let l = slot.get_or_init(|| Landing::new(device).ok()).as_ref()?;
    l.usable.load(Ordering::Relaxed).then_some(l)
}

impl Landing {
    fn new(device: &Device) -> Result<Self> {
        let mut words = PinnedBuffer::new(device, SLOTS * STRIDE, PinnedFlags::MAPPED)?;
        words.as_mut_slice().fill(0);
        let _cur = device.enter()?;
        // SAFETY: memory from cuMemHostAlloc with DEVICEMAP (MAPPED); context current.
        let dev = unsafe { driver::mem::mem_host_get_device_pointer(words.as_ptr() as *mut _) }?;
        Ok(Self {
            words,
            dev,
            free: AtomicU64::new(u64::MAX),
            next: [const { AtomicU32::new(1) }; SLOTS],
            usable: AtomicBool::new(true),
        })
    }

    /// Claims a free word, or `None` when all 64 are in use.
    pub(crate) fn claim(&'static self) -> Option<Claim> {
        let mut f = self.free.load(Ordering::Relaxed);
        loop {
            if f == 0 {
                return None;
            }
            let bit = f.trailing_zeros() as usize;
            match self.free.compare_exchange_weak(
                f,
                f & !(1u64 << bit),
                Ordering::Acquire,
                Ordering::Relaxed,
            ) {
                Ok(_) => {
                    let value = self.next[bit].fetch_add(1, Ordering::Relaxed);
                    return Some(Claim {
                        landing: self,
                        slot: bit,
                        value,
                    });
                }
                Err(now) => f = now,
            }
        }
    }

    fn word(&self, slot: usize) -> &AtomicU32 {
        // SAFETY: inside `words` (SLOTS * STRIDE bytes), 4-byte aligned (page-aligned buffer,
        // STRIDE a multiple of 4); the GPU writes it with 4-byte writes, the host only reads it
        // atomically; the buffer lives as long as `self`.
        unsafe { &*self.words.as_ptr().add(slot * STRIDE).cast::<AtomicU32>() }
    }
}

/// How many of the device's words are free (`None`: the device has none), for tests.
#[cfg(feature = "testing")]
pub(crate) fn free_words(device: &Device) -> Option<u32> {
    let slot = LANDINGS.get(usize::try_from(device.ordinal()).ok()?)?;
    Some(
        slot.get()?
            .as_ref()?
            .free
            .load(Ordering::Acquire)
            .count_ones(),
    )
}

/// Lets the device's waits use landing words again after a (test's injected) refusal.
#[cfg(feature = "testing")]
pub(crate) fn reset(device: &Device) {
    if let Some(l) = LANDINGS
        .get(usize::try_from(device.ordinal()).unwrap_or(usize::MAX))
        .and_then(|s| s.get())
        .and_then(Option::as_ref)
    {
        l.usable.store(true, Ordering::Relaxed);
    }
}

/// A claimed word: queue its write after a copy ([`Claim::signal`]), then [`Claim::wait`].
/// Returned to the device's free words when dropped.
pub(crate) struct Claim {
    landing: &'static Landing,
    slot: usize,
    value: u32,
}

impl Claim {
    /// Queues the word's write on `stream`, after the work queued there before. `Ok(false)`:
    /// the driver refused the write (never used again on this device); the caller waits another
    /// way.
    ///
    /// # Errors
    /// [`crate::Error::Driver`] for a failure other than a refusal (a failing context).
    pub(crate) fn signal(&self, _cur: &Current<'_>, stream: StreamHandle) -> Result<bool> {
        let addr = self.landing.dev + (self.slot * STRIDE) as u64;
        // SAFETY: our word's device address, allocated for the process's life (the landing is
        // static); the stream is a special handle, ours, or vouched for by its maker; context
        // current (`_cur`).
        match unsafe { driver::stream::stream_write_value32(stream.raw(), addr, self.value) } {
            Ok(()) => Ok(true),
            Err(e) if e.is_not_supported() => {
                self.landing.usable.store(false, Ordering::Relaxed);
                Ok(false)
            }
            Err(e) => Err(e.into()),
        }
    }

    fn landed(&self) -> bool {
        self.landing.word(self.slot).load(Ordering::Acquire) == self.value
    }
}

/// A copy followed by its landing word's write: wait for it with [`Waiter::spin`] (no driver
/// call, for a short while) and [`Waiter::wait`]. Dropped before it saw the word, it waits (the
/// copy's destination must stay untouched until then).
pub(crate) struct Waiter<'s> {
    claim: Claim,
    device: Device,
    stream: StreamHandle<'s>,
    /// About how long the copy takes: the wait's schedule ([`Backoff`]).
    expected: Duration,
    landed: AtomicBool,
}

/// Looks with `landed` flat out (a spin hint between looks) until it says so (`true`) or
/// `within` has passed (`false`); the clock is read every 64 looks.
fn spin_until(within: Duration, mut landed: impl FnMut() -> bool) -> bool {
    let start = Instant::now();
    let mut spins = 0u32;
    loop {
        if landed() {
            return true;
        }
        std::hint::spin_loop();
        spins = spins.wrapping_add(1);
        if spins % 64 == 0 && start.elapsed() >= within {
            return false;
        }
    }
}

impl<'s> Waiter<'s> {
    pub(crate) fn new(
        claim: Claim,
        device: &Device,
        stream: StreamHandle<'s>,
        expected: Duration,
    ) -> Self {
        Self {
            claim,
            device: device.clone(),
            stream,
            expected,
            landed: AtomicBool::new(false),
        }
    }

    /// Spins on the word for at most `within`; whether it landed.
    pub(crate) fn spin(&self, within: Duration) -> bool {
        // The seeded-bug harness (`landing_early`, scripts/seeded.tsv): a wait that believes the
        // copy landed at once must fail the GPU tests.
        #[cfg(pinstage_seeded_bug = "landing_early")]
        if self.claim.value != 0 {
            self.landed.store(true, Ordering::Relaxed);
            return true;
        }
        if spin_until(within, || self.claim.landed()) {
            self.landed.store(true, Ordering::Relaxed);
            count(0);
            return true;
        }
        false
    }

    /// Waits until the copy landed: flat out for up to 200 µs, then on the schedule of every
    /// pinstage wait for a copy of its size ([`Backoff`]: yielding the core for about as long as
    /// the copy should take, then sleeping at most a sixteenth of the time waited between
    /// looks); the driver is asked about the stream every millisecond, so a failed context or
    /// copy reports its error instead of waiting forever. A refusal because another thread captures a CUDA
    /// graph is no failure: the copy still runs, the wait goes on.
    ///
    /// On the per-thread default stream, the thread that issued the copy must wait (the handle
    /// names each thread's own stream); `copy_d2h` waits on its issuing thread.
    ///
    /// # Errors
    /// [`crate::Error::Driver`]: the stream failed.
    pub(crate) fn wait(&self) -> Result<()> {
        if self.landed.load(Ordering::Relaxed) || self.spin(SPIN) {
            return Ok(());
        }
        let backoff = Backoff::new(self.expected);
        let mut asked = Instant::now();
        loop {
            if self.claim.landed() {
                count(2);
                break;
            }
            if asked.elapsed() > Duration::from_millis(1) {
                asked = Instant::now();
                match self.ask() {
                    Ok(true) => {
                        // The stream is idle, so its write of the word is done: a word that
                        // still differs was never written (or is read at the wrong place).
                        count(if self.claim.landed() { 2 } else { 3 });
                        break;
                    }
                    Ok(false) => {}
                    Err(crate::Error::Driver(e)) if e.is_capture_error() => {}
                    Err(e) => return Err(e),
                }
            }
            backoff.pause();
        }
        self.landed.store(true, Ordering::Relaxed);
        Ok(())
    }

    /// Whether the stream went idle: then the copy completed, whatever the word says (the
    /// stream's work, the copy included, is done and its writes visible to the host).
    fn ask(&self) -> Result<bool> {
        let _cur = self.device.enter()?;
        // SAFETY: the stream is a special handle, ours, or vouched for by its maker; context
        // current.
        Ok(unsafe { driver::stream::stream_query(self.stream.raw()) }?)
    }
}

impl Drop for Waiter<'_> {
    fn drop(&mut self) {
        if !self.landed.load(Ordering::Relaxed)
            && let Err(crate::Error::Driver(e)) = self.wait()
        {
            crate::error::record_drop_error(e);
        }
    }
}

impl Drop for Claim {
    fn drop(&mut self) {
        self.landing
            .free
            .fetch_or(1u64 << self.slot, Ordering::Release);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_spin_gives_up_once_its_time_has_passed() {
        // A word that never lands: `false`, after `within` and not long after (a spin that
        // stopped reading the clock is cut off by the look count and returns `true`).
        let within = Duration::from_millis(5);
        let mut looks = 0u64;
        let t0 = Instant::now();
        let landed = spin_until(within, || {
            looks += 1;
            looks > 50_000_000
        });
        let took = t0.elapsed();
        assert!(!landed, "gave up only after {looks} looks");
        assert!(took >= within && took < Duration::from_secs(2), "{took:?}");
    }

    #[test]
    fn a_spin_sees_a_word_that_lands_within_its_time() {
        let mut looks = 0u32;
        assert!(spin_until(Duration::from_secs(5), || {
            looks += 1;
            looks == 1000
        }));
        assert_eq!(looks, 1000);
        assert!(
            spin_until(Duration::ZERO, || true),
            "a landed word is seen at once"
        );
    }
}
