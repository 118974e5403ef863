//! Concurrency primitives behind a `cfg(loom)` shim, as crossbeam does: under `--cfg loom` the
//! ring protocol runs on loom's model-checked atomics and cells.

#[cfg(loom)]
pub(crate) use loom::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
#[cfg(not(loom))]
pub(crate) use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

#[cfg(loom)]
pub(crate) use loom::thread::yield_now;
#[cfg(not(loom))]
pub(crate) use std::thread::yield_now;

/// `UnsafeCell` with loom's closure API on both sides.
#[derive(Debug)]
pub(crate) struct UnsafeCell<T>(
    #[cfg(loom)] loom::cell::UnsafeCell<T>,
    #[cfg(not(loom))] std::cell::UnsafeCell<T>,
);

impl<T> UnsafeCell<T> {
    pub(crate) fn new(v: T) -> Self {
        #[cfg(loom)]
        return Self(loom::cell::UnsafeCell::new(v));
        #[cfg(not(loom))]
        return Self(std::cell::UnsafeCell::new(v));
    }

    /// Runs `f` with a mutable pointer to the contents.
    ///
    /// # Safety
    /// 1. The caller has exclusive access (here: it owns the slot in state WRITING).
    #[inline]
    pub(crate) unsafe fn with_mut<R>(&self, f: impl FnOnce(*mut T) -> R) -> R {
        #[cfg(loom)]
        return self.0.with_mut(f);
        #[cfg(not(loom))]
        return f(self.0.get());
    }
}
