//! Frees page-locked and device memory off the caller's thread, once the device is idle.
//!
//! Freeing page-locked memory (`cuMemFreeHost`), unregistering it (`cuMemHostUnregister`) and
//! freeing device memory (`cuMemFree`) wait for all the work queued on the device, whatever
//! stream it is on, and while they wait the driver holds up every other thread's calls into the
//! same context (`lab/c/free_lock.c`: a copy issued on an idle stream took 250 ms while another
//! thread's free waited for a busy one; `cuCtxSynchronize` on that thread held up nothing). So
//! every such free, with the waits for the copies that may still use the memory, goes to one
//! background thread, the reaper, started at the first one, which first waits for the device
//! to drain with `cuCtxSynchronize` ([`free_when_idle`]) and only then frees: the driver's wait
//! inside the free is then short. The caller returns at once. [`wait_for_frees`] waits for everything
//! handed over so far (`empty_cache()`).
//!
//! The reaper runs in the batch scheduling class (`SCHED_BATCH` on Linux): a thread woken in it
//! never preempts the running one, so the reaper, woken by a free and placed beside its waker
//! (as the kernel places woken threads), cannot take the caller's core while the driver's
//! synchronize spins, and it keeps the normal share of the CPU. Not the idle class: there a job
//! ran up to seconds late on busy cores (`lab/c/idle_class_latency.c`), and a lock it held
//! meanwhile (the driver's, inside a free) would hold up other threads' calls as long.
//!
//! Blocks of a host memory pool ([`super::host_pool`]) need none of this: their free waits for
//! nothing, so their job frees at once, without the synchronize.
//!
//! A job runs on the caller's thread instead when no reaper can serve it: in a forked child
//! (the parent's thread is not there; CUDA is unusable there anyway, so the job frees no driver
//! memory), when the thread cannot be started, and on the reaper's own thread (a job whose drop
//! frees more memory).

use std::cell::Cell;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{Sender, channel};

use crate::cuda::Event;
use crate::error::Error;

type Job = Box<dyn FnOnce() + Send>;

struct Reaper {
    tx: Sender<Job>,
    /// The process that started the thread (a forked child has no reaper).
    pid: u32,
    /// Jobs handed over, and jobs finished: [`wait_for_frees`] waits until the second reaches the
    /// first.
    sent: AtomicU64,
    finished: parking_lot::Mutex<u64>,
    finished_cv: parking_lot::Condvar,
}

static REAPER: OnceLock<Option<Reaper>> = OnceLock::new();

thread_local! {
    static ON_REAPER: Cell<bool> = const { Cell::new(false) };
}

fn reaper() -> Option<&'static Reaper> {
    REAPER
        .get_or_init(|| {
            let (tx, rx) = channel::<Job>();
            std::thread::Builder::new()
                .name("pinstage-reaper".into())
                .spawn(move || {
                    ON_REAPER.with(|r| r.set(true));
                    never_preempt_on_wake();
                    while let Ok(job) = rx.recv() {
                        // A job never panics (its drops record their errors); if one did, the
                        // count still moves on, so no `wait_for_frees` waits forever.
                        let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(job));
                        if let Some(r) = REAPER.get().and_then(Option::as_ref) {
                            *r.finished.lock() += 1;
                            r.finished_cv.notify_all();
                        }
                    }
                })
                .ok()?;
            Some(Reaper {
                tx,
                pid: std::process::id(),
                sent: AtomicU64::new(0),
                finished: parking_lot::Mutex::new(0),
                finished_cv: parking_lot::Condvar::new(),
            })
        })
        .as_ref()
        .filter(|r| r.pid == std::process::id())
}

/// Puts the calling thread (the reaper) in the batch scheduling class: when woken it never
/// preempts the running thread; it keeps the normal weight (Linux; elsewhere nothing changes).
fn never_preempt_on_wake() {
    #[cfg(all(target_os = "linux", not(pinstage_lab_variant = "reaper_normal")))]
    {
        let param = libc::sched_param { sched_priority: 0 };
        // SAFETY: pid 0 is the calling thread; `param` is a valid sched_param. A refusal leaves
        // the thread as it was, which is correct, only less polite.
        unsafe { libc::sched_setscheduler(0, libc::SCHED_BATCH, &param) };
    }
}

/// Runs `job` on the reaper's thread (see the module docs for when it runs here instead).
pub(crate) fn defer(job: impl FnOnce() + Send + 'static) {
    // The seeded-bug harness (`scripts/gpu-run seeded`): frees on the caller's thread must fail
    // the GPU test that times a call made while the device is busy.
    if ON_REAPER.with(Cell::get) || cfg!(pinstage_seeded_bug = "free_inline") {
        return job();
    }
    let Some(r) = reaper() else {
        return job();
    };
    // Relaxed: `wait_for_frees` reads it on the thread that sent (or after synchronizing with
    // it); another thread's look (`frees_pending`) may miss a job sent just now, as it may miss
    // one sent a moment later.
    r.sent.fetch_add(1, Ordering::Relaxed);
    if let Err(e) = r.tx.send(Box::new(job)) {
        // The thread is gone (it never exits while the process runs): run it here.
        *r.finished.lock() += 1;
        (e.0)();
    }
}

/// Runs `free` (a call that frees driver memory of `device`) once the device drained: after a
/// `cuCtxSynchronize`, which waits without holding up other threads' calls, so the free itself
/// finds nothing to wait for (unless work was queued in between). While another thread captures
/// a CUDA graph the driver may refuse the synchronize: it is tried again every millisecond for
/// up to a second, then the free goes ahead. Without a usable driver (a forked child, the
/// driver gone) `free` runs at once: it finds no context and frees nothing.
pub(crate) fn free_when_idle<T>(device: &crate::cuda::Device, free: impl FnOnce() -> T) -> T {
    if let Ok(cur) = device.enter() {
        for _ in 0..1000 {
            match cur.synchronize() {
                Err(Error::Driver(e)) if e.is_capture_error() => {
                    std::thread::sleep(std::time::Duration::from_millis(1));
                }
                // Done, or failed (a failing context): the free reports what it meets.
                _ => break,
            }
        }
    }
    free()
}

/// Frees `ptr` (from `cuMemAlloc` in `device`'s context) on the reaper, once the device drained
/// ([`free_when_idle`]): `cuMemFree` waits for all the device's work and holds up other
/// threads' calls meanwhile.
///
/// # Safety
/// 1. `ptr` came from `cuMemAlloc` in `device`'s primary context and is freed once: nothing
///    uses it after this call except work already queued, which the free waits for.
pub(crate) unsafe fn free_device_memory(
    device: crate::cuda::Device,
    ptr: crate::driver::CUdeviceptr,
) {
    defer(move || {
        free_when_idle(&device, || match device.enter() {
            // SAFETY: the caller's contract; the context is current.
            Ok(_cur) => crate::error::on_drop(unsafe { crate::driver::mem::mem_free(ptr) }),
            Err(Error::Driver(e)) => crate::error::on_drop::<()>(Err(e)),
            Err(_) => {}
        })
    });
}

/// Waits for every event of `copies`; whether all completed. A failed wait is recorded
/// ([`crate::cuda::drop_errors`]): the driver did not say that the copy stopped using its memory,
/// which the caller then leaks instead of freeing.
pub(crate) fn waited<'e>(copies: impl IntoIterator<Item = &'e Event>) -> bool {
    let mut ok = true;
    for e in copies {
        if let Err(err) = e.synchronize() {
            ok = false;
            if let Error::Driver(err) = err {
                crate::error::record_drop_error(err);
            }
        }
    }
    ok
}

/// Drops `memory` on the reaper's thread once every event of `copies` completed (leaked if a
/// wait fails: [`waited`]).
pub(crate) fn free_after<T: Send + 'static>(copies: Vec<Event>, memory: T) {
    defer(move || {
        if !waited(&copies) {
            std::mem::forget(memory);
        }
    });
}

/// Asserts that a value may go to the reaper's thread: for the parts of a `Send` owner that
/// hold raw pointers (the owner gives up all of them together).
pub(crate) struct Owned<T>(pub(crate) T);

// SAFETY: only built from the parts of a value that is `Send` as a whole (see each use), moved
// together to one thread.
unsafe impl<T> Send for Owned<T> {}

/// Waits until the memory pinstage let go so far is back with the OS. Freeing page-locked or
/// device memory waits for all the work queued on its device and holds up other threads' calls
/// meanwhile, so pinstage frees on a background thread once the device drained (a dropped
/// buffer, stager or pool block never stalls the caller); this waits for that thread, for
/// tests and for callers that want the memory back now.
pub fn wait_for_frees() {
    wait_until(None);
    // The memory host pools kept for reuse goes back too.
    super::host_pool::trim_all();
}

/// [`wait_for_frees`] for at most `limit`.
fn wait_for_frees_within(limit: std::time::Duration) {
    wait_until(Some(std::time::Instant::now() + limit));
}

/// Waits until the jobs handed over so far finished, or `deadline` passed.
fn wait_until(deadline: Option<std::time::Instant>) {
    let Some(r) = started() else { return };
    let target = r.sent.load(Ordering::Relaxed);
    let mut finished = r.finished.lock();
    while *finished < target {
        match deadline {
            Some(d) if r.finished_cv.wait_until(&mut finished, d).timed_out() => return,
            Some(_) => {}
            None => r.finished_cv.wait(&mut finished),
        }
    }
}

/// The longest an allocation out of memory waits for pending frees ([`retry_after_frees`]): the
/// device's queued work first, which may be long; past it the caller gets its error, not a hang
/// (a free may wait for work that waits for the caller: a host function needing a lock it holds).
const RETRY_WAIT: std::time::Duration = std::time::Duration::from_secs(5);

/// Runs `alloc`; if the memory ran out while frees handed to the reaper are still pending (or
/// one finished meanwhile), waits for them (up to [`RETRY_WAIT`]) and runs it once more. Memory
/// pinstage let go is back with the driver only once the reaper freed it, behind the device's
/// queued work: an allocation right after a large drop would otherwise fail. The caller waits for the device only on this path
/// (out of memory, frees pending), where it would have failed.
pub(crate) fn retry_after_frees<T>(alloc: impl FnMut() -> crate::Result<T>) -> crate::Result<T> {
    retry_within(RETRY_WAIT, alloc)
}

fn retry_within<T>(
    limit: std::time::Duration,
    mut alloc: impl FnMut() -> crate::Result<T>,
) -> crate::Result<T> {
    // The seeded-bug harness: without the second try, the GPU test that allocates again what
    // a drop let go behind a busy device must fail.
    if cfg!(pinstage_seeded_bug = "alloc_no_retry") {
        return alloc();
    }
    // A job that finished between the refusal and the look at what is pending gave its memory
    // back too: tried again.
    let before = finished();
    match alloc() {
        Err(e) if is_out_of_memory(&e) && (frees_pending() || finished() != before) => {
            wait_for_frees_within(limit);
            // The memory host pools keep for reuse goes back too.
            super::host_pool::trim_all();
            alloc()
        }
        r => r,
    }
}

/// Waits (up to [`RETRY_WAIT`]) for the jobs handed to the reaper so far: for a refusal a job
/// known to be pending lifts (an unregistration of the same pages).
pub(crate) fn wait_for_frees_a_while() {
    if !cfg!(pinstage_seeded_bug = "alloc_no_retry") {
        wait_for_frees_within(RETRY_WAIT);
    }
}

fn is_out_of_memory(e: &Error) -> bool {
    match e {
        Error::OutOfMemory { .. } => true,
        Error::Driver(d) => d.is_out_of_memory(),
        _ => false,
    }
}

/// This process's reaper if it was started (never on the reaper's own thread, whose wait for
/// jobs could not end).
fn started() -> Option<&'static Reaper> {
    if ON_REAPER.with(Cell::get) {
        return None;
    }
    REAPER
        .get()
        .and_then(Option::as_ref)
        .filter(|r| r.pid == std::process::id())
}

/// Whether jobs handed to the reaper have not finished.
fn frees_pending() -> bool {
    started().is_some_and(|r| *r.finished.lock() < r.sent.load(Ordering::Relaxed))
}

/// How many jobs the reaper finished so far.
fn finished() -> u64 {
    started().map_or(0, |r| *r.finished.lock())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::sync::atomic::AtomicBool;

    /// The reaper is one per process: its tests take turns (one counts the jobs pending).
    static SERIAL: parking_lot::Mutex<()> = parking_lot::Mutex::new(());

    #[test]
    fn jobs_run_off_the_callers_thread_and_wait_for_frees_waits_for_them() {
        let _serial = SERIAL.lock();
        let me = std::thread::current().id();
        let ran = Arc::new(parking_lot::Mutex::new(None));
        let gate = Arc::new(AtomicBool::new(false));
        let (r, g) = (Arc::clone(&ran), Arc::clone(&gate));
        defer(move || {
            while !g.load(Ordering::Acquire) {
                std::thread::yield_now();
            }
            *r.lock() = Some(std::thread::current().id());
        });
        // The job waits for the gate: `defer` returned without running it.
        assert!(ran.lock().is_none());
        gate.store(true, Ordering::Release);
        wait_for_frees();
        let on = ran
            .lock()
            .expect("the job ran before wait_for_frees returned");
        assert_ne!(on, me);
    }

    #[cfg(all(target_os = "linux", not(pinstage_lab_variant = "reaper_normal")))]
    #[test]
    fn the_reaper_runs_in_the_batch_scheduling_class() {
        let _serial = SERIAL.lock();
        let policy = Arc::new(parking_lot::Mutex::new(None));
        let p = Arc::clone(&policy);
        // SAFETY: sched_getscheduler(0) reads the calling thread's policy.
        defer(move || *p.lock() = Some(unsafe { libc::sched_getscheduler(0) }));
        wait_for_frees();
        assert_eq!(*policy.lock(), Some(libc::SCHED_BATCH));
        // SAFETY: as above, for the test's own thread, which keeps the normal class.
        assert_eq!(unsafe { libc::sched_getscheduler(0) }, libc::SCHED_OTHER);
    }

    /// An allocation refused for memory while a free is pending waits for the free and succeeds;
    /// refused with nothing pending, or for another reason, it fails at once, tried once.
    #[test]
    fn an_allocation_out_of_memory_waits_for_pending_frees_then_tries_again() {
        let _serial = SERIAL.lock();
        let oom = || Error::OutOfMemory {
            what: "test",
            bytes: 1,
        };
        let freed = Arc::new(AtomicBool::new(false));
        let gate = Arc::new(AtomicBool::new(false));
        let (f, g) = (Arc::clone(&freed), Arc::clone(&gate));
        defer(move || {
            while !g.load(Ordering::Acquire) {
                std::thread::yield_now();
            }
            f.store(true, Ordering::Release);
        });
        let opener = {
            let g = Arc::clone(&gate);
            std::thread::spawn(move || {
                std::thread::sleep(std::time::Duration::from_millis(20));
                g.store(true, Ordering::Release);
            })
        };
        let mut tries = 0;
        let got = retry_after_frees(|| {
            tries += 1;
            if freed.load(Ordering::Acquire) {
                Ok(7)
            } else {
                Err(oom())
            }
        });
        opener.join().unwrap();
        assert_eq!((got.ok(), tries), (Some(7), 2));
        // Nothing pending now: one try, the error as it came.
        wait_for_frees();
        let mut tries = 0;
        let got: crate::Result<()> = retry_after_frees(|| {
            tries += 1;
            Err(oom())
        });
        assert!(matches!(got, Err(Error::OutOfMemory { .. })) && tries == 1);
        // A free that does not finish in time: tried again after the limit, the error then.
        let gate = Arc::new(AtomicBool::new(false));
        let g = Arc::clone(&gate);
        defer(move || {
            while !g.load(Ordering::Acquire) {
                std::thread::yield_now();
            }
        });
        let (mut tries, t0) = (0, std::time::Instant::now());
        let got: crate::Result<()> = retry_within(std::time::Duration::from_millis(50), || {
            tries += 1;
            Err(oom())
        });
        let took = t0.elapsed();
        gate.store(true, Ordering::Release);
        wait_for_frees();
        assert!(matches!(got, Err(Error::OutOfMemory { .. })) && tries == 2);
        assert!(
            took >= std::time::Duration::from_millis(50)
                && took < std::time::Duration::from_secs(5),
            "{took:?}"
        );
        // Another error is never retried, frees pending or not.
        let gate = Arc::new(AtomicBool::new(false));
        let g = Arc::clone(&gate);
        defer(move || {
            while !g.load(Ordering::Acquire) {
                std::thread::yield_now();
            }
        });
        let mut tries = 0;
        let got: crate::Result<()> = retry_after_frees(|| {
            tries += 1;
            Err(Error::ReadOnly)
        });
        gate.store(true, Ordering::Release);
        wait_for_frees();
        assert!(matches!(got, Err(Error::ReadOnly)) && tries == 1);
    }

    #[test]
    fn a_job_deferred_by_a_job_runs_at_once_on_the_reaper() {
        let _serial = SERIAL.lock();
        let order = Arc::new(parking_lot::Mutex::new(Vec::new()));
        let o = Arc::clone(&order);
        defer(move || {
            let inner = Arc::clone(&o);
            defer(move || inner.lock().push("inner"));
            o.lock().push("outer");
        });
        wait_for_frees();
        assert_eq!(*order.lock(), ["inner", "outer"]);
    }
}
