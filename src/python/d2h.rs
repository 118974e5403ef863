//! `copy_d2h`, `copy_d2h_async`, `PendingCopy` and the result pool.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use pyo3::prelude::*;
use pyo3::types::PyDict;

use super::arrays::{PinnedBlock, array_over, descr, writable_numpy};
use super::errors::value_err;
use super::import::{Imported, import, parse_stream};
use super::wait::wait_interruptibly;
use crate::cuda::Event;
use crate::dlpack::MemoryKind;

/// A raw destination pointer that may cross `py.detach`.
struct SendPtr(*mut u8);
// SAFETY: the memory is kept alive by the result array held in the caller's frame.
unsafe impl Send for SendPtr {}

/// Copies of at most this many bytes that the caller waits for at once are issued with the GIL
/// held (laboratory setting).
static GIL_HELD_MAX: AtomicUsize = AtomicUsize::new(256 << 10);
/// How long such a copy is spun for with the GIL held before the GIL is released, µs.
static GIL_SPIN_US: AtomicU64 = AtomicU64::new(20);

/// Sets how waited-for copies hold the GIL (laboratory); returns the previous settings.
#[cfg(feature = "lab")]
pub(crate) fn set_gil_tuning(held_max: usize, spin_us: u64) -> (usize, u64) {
    (
        GIL_HELD_MAX.swap(held_max, Ordering::Relaxed),
        GIL_SPIN_US.swap(spin_us, Ordering::Relaxed),
    )
}

/// Starts a copy; returns the result array and the event to wait on (None: done). With `wait`,
/// the copy is waited for in the same GIL release that issued it (one hand-over, not two) and
/// the event is None.
fn start<'py>(
    py: Python<'py>,
    src: &Bound<'py, PyAny>,
    dst: Option<&Bound<'py, PyAny>>,
    stream: Option<&Bound<'py, PyAny>>,
    pool: Option<&Bound<'py, PyAny>>,
    wait: bool,
) -> PyResult<(Bound<'py, PyAny>, Option<Event>, Imported)> {
    super::linger::reap(py);
    let pool = super::pool::pool_arg(pool)?;
    let s = parse_stream(stream)?;
    let imp = import(src, s)?;
    let view = &imp.view;
    let (dtype, shape, nbytes) = (view.dtype(), view.shape().to_vec(), view.nbytes());
    let want = descr(py, dtype)?; // fail early (bfloat16 without ml_dtypes) before any copy
    let state = match view.memory() {
        MemoryKind::Cuda(id) => Some(super::device::device_state(id)?),
        MemoryKind::Host if crate::cuda::cuda_available() => Some(super::device::device_state(0)?),
        MemoryKind::Host => None,
    };
    let (array, ptr, len, pinned) = match dst.filter(|d| !d.is_none()) {
        Some(d) => {
            let (ptr, len) = writable_numpy(d)?;
            let pinned = super::arrays::known_pinned(d, ptr, len);
            if len < nbytes {
                return Err(value_err(format!(
                    "dst holds {len} bytes but the source needs {nbytes} bytes ({dtype}, shape \
                     {shape:?})"
                )));
            }
            // A `dst` of the source's dtype and shape is the result itself (no new view).
            use numpy::{PyArrayDescrMethods, PyUntypedArrayMethods};
            let same = d.cast::<numpy::PyUntypedArray>().is_ok_and(|a| {
                a.dtype().is_equiv_to(&want)
                    && a.shape().len() == shape.len()
                    && a.shape().iter().zip(&shape).all(|(&x, &y)| x as i64 == y)
            });
            let array = if same {
                d.clone()
            } else {
                // SAFETY: dst is a live writable numpy array of `len >= nbytes` bytes; it is
                // the new array's base, so it outlives it.
                unsafe { array_over(d.clone(), ptr as *mut u8, dtype, &shape) }?
            };
            (array, ptr as *mut u8, len, pinned)
        }
        None => {
            let device = state.map_or(0, |s| s.device.ordinal());
            let mem = super::pool::host_block(py, pool, nbytes, device)?;
            let block = PinnedBlock::new(mem);
            let (ptr, pinned) = (block.ptr(), block.pinned());
            let owner = Bound::new(py, block)?.into_any();
            // SAFETY: the block holds >= nbytes bytes and is the array's base.
            let array = unsafe { array_over(owner, ptr, dtype, &shape) }?;
            (array, ptr, nbytes, Some(pinned))
        }
    };
    let event = match view.memory() {
        MemoryKind::Host => {
            // A plain host copy (the fallback without a driver, and CPU producers).
            // SAFETY: the source view is readable host memory of nbytes (kept alive by `imp`);
            // the destination holds >= nbytes and is distinct memory (a new block or the
            // caller's dst; overlap is tolerated by memmove).
            unsafe { std::ptr::copy(view.ptr() as *const u8, ptr, nbytes) };
            None
        }
        MemoryKind::Cuda(_) => {
            let state = state.expect("a CUDA source has a device state");
            let stream = s.unwrap_or(imp.stream);
            // Only a pinned destination: a pageable one goes through the bounce ring, which
            // waits behind the stream's work (the GIL must not be held for that). The driver is
            // asked once, and its answer goes to the copy.
            let small = wait && nbytes <= GIL_HELD_MAX.load(Ordering::Relaxed);
            let pinned = match pinned {
                None if small => Some(state.device.is_pinned_range(ptr, nbytes)?),
                known => known,
            };
            let held = small && pinned == Some(true);
            if held {
                // A small copy waited for at once: issued with the GIL held (a few µs of driver
                // calls, as the frameworks' own copies are), then a short spin; the GIL is
                // released only for a copy still running after that (queued behind other work).
                // SAFETY: the destination (the result array's memory) is kept alive by the
                // array until this function returns, and it returns once the copy completed (a
                // dropped completion waits); it is pinned (its block or the driver says so).
                let (_, done) = unsafe {
                    crate::d2h::start_d2h(
                        Some(&state.device),
                        view,
                        ptr,
                        len,
                        stream,
                        true,
                        Some(true),
                    )
                }?;
                let spin = Duration::from_micros(GIL_SPIN_US.load(Ordering::Relaxed));
                if !done.spin(spin) {
                    py.detach(|| done.wait())?;
                }
                None
            } else {
                let p = SendPtr(ptr);
                py.detach(move || -> crate::Result<Option<Event>> {
                    let p = p;
                    // SAFETY: as above; without `wait` the caller holds the array until the
                    // returned event completed.
                    let (_, done) = unsafe {
                        crate::d2h::start_d2h(
                            Some(&state.device),
                            view,
                            p.0,
                            len,
                            stream,
                            wait,
                            pinned,
                        )
                    }?;
                    if wait {
                        done.wait().map(|()| None)
                    } else {
                        done.into_event()
                    }
                })?
            }
        }
    };
    Ok((array, event, imp))
}

/// Copies any DLPack tensor (torch, jax, cupy, numpy) to host memory and waits.
///
/// Parameters:
///     src: the tensor; CUDA tensors are copied by the GPU's copy engine, host ones by memcpy.
///     dst (numpy.ndarray, optional): a writable, C-contiguous array used as a raw region of at
///         least ``src.nbytes`` bytes (pinned: one DMA; pageable: a pinned bounce ring). Its dtype
///         and shape do not matter: the RESULT is the returned array, a view of ``dst``'s memory in
///         ``src``'s dtype and shape (``dst`` itself when it has them already), and ``dst`` then
///         holds those bytes. Without ``dst`` the
///         result lives in a block of the pinned pool (pageable memory past the pool's budget).
///     stream: the stream the copy is ordered on (see the README's "Rules"); None: the producer's
///         current stream, else the legacy default stream.
///     pool (PinnedPool, optional): without ``dst``, the result's block comes from this pool
///         (pageable memory past its ``max_outstanding_bytes``) instead of the device's result
///         pool; it returns there when the result is collected.
///
/// Returns:
///     numpy.ndarray: writable, of ``src``'s shape and dtype (bfloat16 through ``ml_dtypes``).
///
/// Raises:
///     PinstageTypeError: not a DLPack producer, an unsupported dtype, ``dst`` not a numpy array.
///     PinstageValueError: ``dst`` too small, read-only or not contiguous; a non-contiguous
///         ``src``; an impossible stream handle. CudaUnavailableError: a CUDA ``src`` without a
///         driver. CudaDriverError: the copy failed.
///
/// Not interruptible: the result's memory must not be released while the copy writes it; use
/// ``copy_d2h_async(...).wait()`` to answer Ctrl-C.
///
/// Example:
///     >>> host = pinstage.copy_d2h(torch.arange(4, device="cuda"))
///     >>> host.tolist()
///     [0, 1, 2, 3]
#[pyfunction]
#[pyo3(signature = (src, dst=None, *, stream=None, pool=None))]
fn copy_d2h<'py>(
    py: Python<'py>,
    src: &Bound<'py, PyAny>,
    dst: Option<&Bound<'py, PyAny>>,
    stream: Option<&Bound<'py, PyAny>>,
    pool: Option<&Bound<'py, PyAny>>,
) -> PyResult<Bound<'py, PyAny>> {
    let (array, event, imp) = start(py, src, dst, stream, pool, true)?;
    debug_assert!(event.is_none(), "waited for in start");
    drop(imp);
    Ok(array)
}

/// A copy in flight (from ``copy_d2h_async`` or ``copy_h2d``): ``done()``,
/// ``wait(timeout=None)``. It keeps the source and the destination alive; dropped before the
/// copy completed, it leaves them to pinstage, which lets them go once the copy completed
/// (never blocking the drop).
#[pyclass(frozen, module = "pinstage._native")]
pub(crate) struct PendingCopy {
    /// The copy's event until a wait saw it complete. Shared, so threads waiting at once all
    /// wait on it (none may see `None` while the copy still runs).
    event: Mutex<Option<Arc<Event>>>,
    /// The result array (D2H) or the destination (H2D), handed back by `wait`.
    array: Py<PyAny>,
    /// The source, kept alive (a pinned H2D source unchanged) until the copy completed.
    src: Mutex<Option<Imported>>,
    /// About how long the copy takes once it runs: how long a wait stays busy.
    expected: Duration,
}

impl PendingCopy {
    /// A copy of `src`'s bytes that completes with `event` (`None`: completed).
    pub(crate) fn new(event: Option<Event>, array: Py<PyAny>, src: Imported) -> Self {
        Self {
            event: Mutex::new(event.map(Arc::new)),
            array,
            expected: crate::cuda::wait::copy_time(src.view.nbytes()),
            src: Mutex::new(Some(src)),
        }
    }

    /// Whether the copy completed (never blocks).
    pub(crate) fn is_done(&self) -> crate::Result<bool> {
        match &*self.event.lock() {
            Some(ev) => ev.query(),
            None => Ok(true),
        }
    }
}

#[pymethods]
impl PendingCopy {
    /// Whether the copy completed (never blocks).
    ///
    /// Raises:
    ///     CudaDriverError: the copy failed.
    fn done(&self) -> PyResult<bool> {
        Ok(self.is_done()?)
    }

    /// Waits for the copy with the GIL released and returns the result array.
    ///
    /// Parameters:
    ///     timeout (float, optional): seconds to wait at most; None waits for as long as it takes.
    ///
    /// Returns:
    ///     the result array (``copy_d2h_async``), or the destination (``copy_h2d``).
    ///
    /// Raises:
    ///     TimeoutError: not complete within ``timeout``. KeyboardInterrupt: Ctrl-C (answered within
    ///     about 20 ms). Either way the copy stays pending and guarded, and ``wait()`` may be called
    ///     again. PinstageValueError: a negative, NaN or infinite timeout. CudaDriverError: the copy
    ///     failed.
    #[pyo3(signature = (timeout=None))]
    fn wait(&self, py: Python<'_>, timeout: Option<&Bound<'_, PyAny>>) -> PyResult<Py<PyAny>> {
        let timeout = match timeout.filter(|t| !t.is_none()) {
            None => None,
            Some(t) if t.is_instance_of::<pyo3::types::PyBool>() => {
                return Err(super::errors::type_err(
                    "timeout must be None or a number of seconds, got a bool",
                ));
            }
            Some(t) => Some(t.extract::<f64>().map_err(|_| {
                super::errors::type_err(format!(
                    "timeout must be None or a number of seconds, got {}",
                    super::import::type_name(t)
                ))
            })?),
        };
        let deadline = match timeout {
            None => None,
            Some(t) => Some(
                Duration::try_from_secs_f64(t)
                    .ok()
                    .and_then(|d| Instant::now().checked_add(d))
                    .ok_or_else(|| {
                        value_err(format!(
                            "timeout={t}: expected None or a finite number of seconds >= 0 (at \
                             most about 10^11)"
                        ))
                    })?,
            ),
        };
        let ev = self.event.lock().clone();
        if let Some(ev) = ev {
            let done = wait_interruptibly(py, &ev, deadline, self.expected);
            if !matches!(done, Ok(true)) {
                done?;
                return Err(pyo3::exceptions::PyTimeoutError::new_err(format!(
                    "the copy did not complete within {} s",
                    timeout.unwrap_or_default()
                )));
            }
            // Completed: every waiter may let the event go.
            *self.event.lock() = None;
        }
        drop(self.src.lock().take());
        Ok(self.array.clone_ref(py))
    }

    fn __repr__(&self) -> PyResult<String> {
        Ok(format!(
            "PendingCopy(done={})",
            super::args::py_bool(self.done()?)
        ))
    }
}

impl Drop for PendingCopy {
    fn drop(&mut self) {
        // Never release the source (or let the destination die) while the copy runs: they
        // linger until it completed, without blocking here.
        if let Some(ev) = self.event.get_mut().take() {
            // A pyclass drops with the GIL held (attach only confirms it).
            let array = Python::attach(|py| std::mem::replace(&mut self.array, py.None()));
            super::linger::linger(super::linger::Lingering {
                until: super::linger::Until::Event(ev),
                array: Some(array),
                src: self.src.get_mut().take(),
            });
        }
    }
}

/// Starts the copy of ``copy_d2h`` and returns at once.
///
/// Parameters and errors as ``copy_d2h``. A pinned destination (``dst`` or a pool block) gets a
/// truly asynchronous DMA; a pageable ``dst`` is filled before this returns.
///
/// Returns:
///     PendingCopy: ``done()`` and ``wait(timeout=None)``; the source and the destination are kept
///     alive until the copy completed, even when the handle is dropped first (dropping it never
///     blocks).
///
/// Example:
///     >>> p = pinstage.copy_d2h_async(torch.ones(3, device="cuda"))
///     >>> p.wait().tolist()
///     [1.0, 1.0, 1.0]
#[pyfunction]
#[pyo3(signature = (src, dst=None, *, stream=None, pool=None))]
fn copy_d2h_async<'py>(
    py: Python<'py>,
    src: &Bound<'py, PyAny>,
    dst: Option<&Bound<'py, PyAny>>,
    stream: Option<&Bound<'py, PyAny>>,
    pool: Option<&Bound<'py, PyAny>>,
) -> PyResult<PendingCopy> {
    let (array, event, imp) = start(py, src, dst, stream, pool, false)?;
    Ok(PendingCopy::new(event, array.unbind(), imp))
}

/// Counters of the pinned pool behind ``copy_d2h`` results, for ``device`` (default 0).
///
/// Returns:
///     dict: ``hits``, ``misses``, ``pageable_fallbacks``, ``evictions``, ``in_use_bytes``,
///     ``cached_bytes``, ``peak_bytes``, ``budget_bytes``. Without a driver: zeros and the budget.
///
/// Raises:
///     PinstageValueError: a device that does not exist.
///
/// Example:
///     >>> pinstage.pool_stats()["budget_bytes"]
///     4294967296
#[pyfunction]
#[pyo3(signature = (device=None))]
fn pool_stats<'py>(
    py: Python<'py>,
    device: Option<&Bound<'py, PyAny>>,
) -> PyResult<Bound<'py, PyDict>> {
    super::linger::reap(py);
    let ordinal = super::args::parse_device(device)?;
    let s = if crate::cuda::cuda_available() {
        super::device::device_state(ordinal)?.pool.stats()
    } else {
        crate::host::PinnedPoolStats {
            budget_bytes: super::device::pool_budget(),
            ..Default::default()
        }
    };
    let d = PyDict::new(py);
    d.set_item("hits", s.hits)?;
    d.set_item("misses", s.misses)?;
    d.set_item("pageable_fallbacks", s.pageable_fallbacks)?;
    d.set_item("evictions", s.evictions)?;
    d.set_item("in_use_bytes", s.in_use_bytes)?;
    d.set_item("cached_bytes", s.cached_bytes)?;
    d.set_item("peak_bytes", s.peak_bytes)?;
    d.set_item("budget_bytes", s.budget_bytes)?;
    Ok(d)
}

/// Frees the pools' cached blocks (results' and ``alloc_pinned_numpy``'s; blocks in use stay),
/// the bounce buffers, and the device memory ``to_device`` keeps for reuse, on every device, and
/// waits (GIL released) until the pinned memory pinstage let go so far is back with the OS:
/// freeing page-locked memory waits for the work queued on the GPU, which every other call
/// leaves to pinstage's background thread. Works without a driver. Never raises.
#[pyfunction]
fn empty_cache(py: Python<'_>) {
    super::linger::reap(py);
    py.detach(|| {
        for s in super::device::used() {
            s.pool.empty_cache();
            s.arrays.empty_cache();
        }
        crate::host::release_bounce_buffers();
        if let Err(crate::Error::Driver(e)) = crate::h2d::trim_device_pools() {
            crate::error::record_drop_error(e);
        }
        crate::host::wait_for_frees();
    });
}

/// Sets the pinned byte budget of the result pools (every device; default 4 GiB). Cached blocks
/// beyond it are freed now; past it, results use pageable memory. Works without a driver.
///
/// Parameters:
///     nbytes (int): the budget, >= 0.
///
/// Raises:
///     PinstageValueError: a negative value. PinstageTypeError: not an int.
///
/// Example:
///     >>> pinstage.set_pool_budget(1 << 30)
#[pyfunction]
fn set_pool_budget(py: Python<'_>, nbytes: &Bound<'_, PyAny>) -> PyResult<()> {
    let nbytes = super::args::count_arg(nbytes, "nbytes", 0, isize::MAX as usize)?;
    py.detach(|| super::device::set_pool_budget(nbytes));
    Ok(())
}

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PendingCopy>()?;
    m.add_function(wrap_pyfunction!(copy_d2h, m)?)?;
    m.add_function(wrap_pyfunction!(copy_d2h_async, m)?)?;
    m.add_function(wrap_pyfunction!(pool_stats, m)?)?;
    m.add_function(wrap_pyfunction!(empty_cache, m)?)?;
    m.add_function(wrap_pyfunction!(set_pool_budget, m)?)?;
    Ok(())
}
