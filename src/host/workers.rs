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
