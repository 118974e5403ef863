//! `copy_d2h`, `copy_d2h_async`, `PendingCopy` and the result pool.

use std::time::{Duration, Instant};

use parking_lot::Mutex;
use pyo3::prelude::*;
use pyo3::types::PyDict;

use super::arrays::{Memory, PinnedBlock, array_over, descr, writable_numpy};
use super::errors::value_err;
use super::import::{Imported, import, parse_stream};
use super::wait::wait_interruptibly;
use crate::cuda::Event;
use crate::view::MemoryKind;

/// A raw destination pointer that may cross `py.detach`.
struct SendPtr(*mut u8);
// SAFETY: the memory is kept alive by the result array held in the caller's frame.
unsafe impl Send for SendPtr {}

/// Starts a copy; returns the result array and the event to wait on (None: done).
fn start<'py>(
    py: Python<'py>,
    src: &Bound<'py, PyAny>,
    dst: Option<&Bound<'py, PyAny>>,
    stream: Option<&Bound<'py, PyAny>>,
) -> PyResult<(Bound<'py, PyAny>, Option<Event>, Imported)> {
    let s = parse_stream(stream)?;
    let imp = import(src, s)?;
    let view = &imp.view;
    let (dtype, shape, nbytes) = (view.dtype(), view.shape().to_vec(), view.nbytes());
    descr(py, dtype)?; // fail early (bfloat16 without ml_dtypes) before any copy
    let state = match view.memory() {
        MemoryKind::Cuda(id) => Some(super::device_state(id)?),
        MemoryKind::Host if crate::cuda_available() => Some(super::device_state(0)?),
        MemoryKind::Host => None,
    };
    let (array, ptr, len) = match dst.filter(|d| !d.is_none()) {
        Some(d) => {
            let (ptr, len) = writable_numpy(d)?;
            if len < nbytes {
                return Err(value_err(format!(
                    "dst holds {len} bytes but the source needs {nbytes} bytes ({dtype}, shape \
                     {shape:?})"
                )));
            }
            // SAFETY: dst is a live writable numpy array of `len >= nbytes` bytes; it is the
            // new array's base, so it outlives it.
            let array = unsafe { array_over(d.clone(), ptr as *mut u8, dtype, &shape) }?;
            (array, ptr as *mut u8, len)
        }
        None => {
            let mem = match state {
                Some(state) => Memory::Pool(py.detach(|| state.pool.acquire(nbytes))?),
                None => Memory::Vec(crate::host::zeroed_vec(nbytes, "host result")?),
            };
            let block = PinnedBlock::new(mem);
            let ptr = block.ptr();
            let owner = Bound::new(py, block)?.into_any();
            // SAFETY: the block holds >= nbytes bytes and is the array's base.
            let array = unsafe { array_over(owner, ptr, dtype, &shape) }?;
            (array, ptr, nbytes)
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
            let p = SendPtr(ptr);
            py.detach(move || {
                let p = p;
                // SAFETY: the destination (the result array's memory) is kept alive by the
                // array, which the caller holds until the event completed.
                unsafe { crate::d2h::start_d2h(&state.device, view, p.0, len, stream) }
            })?
            .1
        }
    };
    Ok((array, event, imp))
}

/// Blocks until the copy completed, GIL released (not interruptible: the result array must not
/// be handed back, nor its memory recycled, while the copy may still write it).
fn wait_event(py: Python<'_>, ev: &Event) -> PyResult<()> {
    Ok(py.detach(|| ev.synchronize())?)
}

/// Copies any DLPack tensor (torch, jax, cupy, numpy) to host memory and returns a writable numpy
/// array of its shape and dtype, in pinned memory (`dst`, or a pool block).
#[pyfunction]
#[pyo3(signature = (src, dst=None, *, stream=None))]
fn copy_d2h<'py>(
    py: Python<'py>,
    src: &Bound<'py, PyAny>,
    dst: Option<&Bound<'py, PyAny>>,
    stream: Option<&Bound<'py, PyAny>>,
) -> PyResult<Bound<'py, PyAny>> {
    let (array, event, imp) = start(py, src, dst, stream)?;
    if let Some(ev) = event {
        wait_event(py, &ev)?;
    }
    drop(imp);
    Ok(array)
}

/// A device-to-host copy in flight.
#[pyclass(frozen, module = "pinstage._native")]
pub struct PendingCopy {
    event: Mutex<Option<Event>>,
    array: Py<PyAny>,
    src: Mutex<Option<Imported>>,
}

#[pymethods]
impl PendingCopy {
    /// Whether the copy completed.
    fn done(&self) -> PyResult<bool> {
        match &*self.event.lock() {
            Some(ev) => ev.query().map_err(PyErr::from),
            None => Ok(true),
        }
    }

    /// Waits (GIL released) and returns the array; raises TimeoutError after `timeout` seconds,
    /// and KeyboardInterrupt on Ctrl-C; either way the copy stays pending and guarded, and
    /// `wait()` may be called again.
    #[pyo3(signature = (timeout=None))]
    fn wait(&self, py: Python<'_>, timeout: Option<f64>) -> PyResult<Py<PyAny>> {
        let deadline = match timeout {
            Some(t) if !(t >= 0.0 && t.is_finite()) => {
                return Err(value_err(format!(
                    "timeout={t}: expected None or a finite number of seconds >= 0"
                )));
            }
            Some(t) => Some(Instant::now() + Duration::from_secs_f64(t)),
            None => None,
        };
        let ev = self.event.lock().take();
        if let Some(ev) = ev {
            let done = wait_interruptibly(py, &ev, deadline);
            if !matches!(done, Ok(true)) {
                *self.event.lock() = Some(ev);
                done?;
                return Err(pyo3::exceptions::PyTimeoutError::new_err(format!(
                    "the copy did not complete within {} s",
                    timeout.unwrap_or_default()
                )));
            }
        }
        drop(self.src.lock().take());
        Ok(self.array.clone_ref(py))
    }

    fn __repr__(&self) -> PyResult<String> {
        Ok(format!("PendingCopy(done={})", self.done()?))
    }
}

impl Drop for PendingCopy {
    fn drop(&mut self) {
        // Never release the source (or let the destination die) while the copy runs.
        if let Some(ev) = self.event.get_mut().take()
            && let Err(crate::Error::Driver(e)) = ev.synchronize()
        {
            crate::error::record_drop_error(e);
        }
    }
}

/// Starts a device-to-host copy and returns a `PendingCopy` at once.
#[pyfunction]
#[pyo3(signature = (src, dst=None, *, stream=None))]
fn copy_d2h_async<'py>(
    py: Python<'py>,
    src: &Bound<'py, PyAny>,
    dst: Option<&Bound<'py, PyAny>>,
    stream: Option<&Bound<'py, PyAny>>,
) -> PyResult<PendingCopy> {
    let (array, event, imp) = start(py, src, dst, stream)?;
    Ok(PendingCopy {
        event: Mutex::new(event),
        array: array.unbind(),
        src: Mutex::new(Some(imp)),
    })
}

/// Counters of the result pool of `device` (zeros, and the budget, without a driver).
#[pyfunction]
#[pyo3(signature = (device=None))]
fn pool_stats<'py>(
    py: Python<'py>,
    device: Option<&Bound<'py, PyAny>>,
) -> PyResult<Bound<'py, PyDict>> {
    let ordinal = super::args::parse_device(device)?;
    let s = if crate::cuda_available() {
        super::device_state(ordinal)?.pool.stats()
    } else {
        crate::PoolStats {
            budget_bytes: super::POOL_BUDGET.load(std::sync::atomic::Ordering::Relaxed),
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

/// Frees the pool's cached blocks (and the D2H bounce buffers) on every device.
#[pyfunction]
fn empty_cache(py: Python<'_>) {
    py.detach(|| {
        if let Some(table) = super::DEVICES.get() {
            for s in table.iter().filter_map(|s| s.get()) {
                s.pool.empty_cache();
            }
        }
        crate::d2h::release_bounce_buffers();
    });
}

/// Sets the pinned byte budget of the result pools (every device).
#[pyfunction]
fn set_pool_budget(py: Python<'_>, nbytes: &Bound<'_, PyAny>) -> PyResult<()> {
    let nbytes = super::args::count_arg(nbytes, "nbytes", 0, isize::MAX as usize)?;
    super::POOL_BUDGET.store(nbytes, std::sync::atomic::Ordering::Relaxed);
    py.detach(|| {
        if let Some(table) = super::DEVICES.get() {
            for s in table.iter().filter_map(|s| s.get()) {
                s.pool.set_budget(nbytes);
            }
        }
    });
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
