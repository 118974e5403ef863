//! `copy_d2h` and `copy_d2h_async`: device to host, into a pinned pool block or the caller's array.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::Duration;

use pyo3::prelude::*;

use super::arrays::{PinnedBlock, array_over, writable_numpy};
use super::dtype::descr;
use super::errors::value_err;
use super::import::{Imported, import};
use super::pending::{PendingCopy, SendPtr};
use super::stream::parse_stream;
use crate::cuda::Event;
use crate::dlpack::MemoryKind;

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
///     stream: the stream the copy is ordered on (docs/API.md, "stream="); None: the producer's
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

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PendingCopy>()?;
    m.add_function(wrap_pyfunction!(copy_d2h, m)?)?;
    m.add_function(wrap_pyfunction!(copy_d2h_async, m)?)?;
    Ok(())
}
