//! pinstage's copy threads: the workers that fill and drain bounce buffers beside the caller.

use std::sync::OnceLock;

/// Most threads pinstage's copy workers run on, per device. (The lab's variant `copy16` takes
/// 16: more threads for fills that are slow per thread, such as cached stores.)
const MAX_WORKER_THREADS: usize = if cfg!(pinstage_lab_variant = "copy16") {
    16
} else {
    12
};

/// pinstage's own copy threads (not the global rayon pool, which the caller's code may keep
/// busy). `None` when no thread could be started: the bounced paths then run on the caller's
/// thread alone.
pub(crate) fn workers() -> Option<&'static rayon::ThreadPool> {
    static POOL: OnceLock<Option<rayon::ThreadPool>> = OnceLock::new();
    POOL.get_or_init(|| {
        // Up to 12 per device (copies to several GPUs at once each want their workers), at
        // most one per core.
        let devices = crate::driver::probe().map_or(1, |p| p.device_count.clamp(1, 8) as usize);
        let n = std::thread::available_parallelism()
            .map_or(4, |n| n.get())
            .clamp(1, MAX_WORKER_THREADS * devices);
        rayon::ThreadPoolBuilder::new()
            .num_threads(n)
            .thread_name(|i| format!("pinstage-copy-{i}"))
            .build()
            .ok()
    })
    .as_ref()
}

/// Bumped when a copy staffs its threads (or a [`Wake`] ends): spinning threads stop.
static STAFFED: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// How long a woken copy thread spins for the copy that woke it.
const WAKE_SPIN: std::time::Duration = std::time::Duration::from_micros(400);

/// The laboratory's `prewake` ([`crate::h2d::tuning::H2DTuning::prewake`]): every copy thread
/// woken to spin until the next copy staffs them, at most [`WAKE_SPIN`]; dropped, it releases
/// them (a call that took another path).
#[cfg_attr(not(feature = "python"), allow(dead_code))]
pub(crate) struct Wake;

impl Wake {
    /// Wakes the copy threads; `None` without a pool.
    #[cfg_attr(not(feature = "python"), allow(dead_code))]
    pub(crate) fn start() -> Option<Self> {
        use std::sync::atomic::Ordering;
        let pool = workers()?;
        let epoch = STAFFED.load(Ordering::Relaxed);
        pool.spawn_broadcast(move |_| {
            let t = std::time::Instant::now();
            // Relaxed: a hint to stop spinning; the copy's tasks are found through the pool.
            while STAFFED.load(Ordering::Relaxed) == epoch && t.elapsed() < WAKE_SPIN {
                std::hint::spin_loop();
            }
        });
        Some(Self)
    }
}

impl Drop for Wake {
    fn drop(&mut self) {
        staffed();
    }
}

/// Releases threads spinning for a copy: its tasks are queued ([`Wake`]).
pub(crate) fn staffed() {
    STAFFED.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
}
