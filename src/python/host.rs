//! Host arrays on pinned memory: `alloc_pinned_numpy`, `empty_pinned`, `empty_host`,
//! `is_pinned`, and memory pinned in place (`pin`, `PinnedRegion`).

use super::args::parse_device;
use super::arrays::Memory;
use super::arrays::array_on;
use super::arrays::numel;
use super::arrays::parse_shape;
use super::errors::type_err;
use super::errors::value_err;
use super::pool::host_block;
use super::pool::pool_arg;
use crate::dlpack::DType;
use crate::host::PinnedBuffer;
use crate::host::PinnedFlags;
use numpy::PyUntypedArray;
use numpy::PyUntypedArrayMethods;
use pyo3::prelude::*;
use pyo3::types::PyTuple;

/// A writable numpy array of ``dtype`` and ``shape`` on ``nbytes`` of pinned memory.
///
/// Parameters:
///     nbytes (int): bytes to pin, at least ``prod(shape) * itemsize``.
///     dtype: a numpy, torch, jax or cupy dtype, or its name (``"int32"``).
///     shape (int | sequence of int): the array's shape.
///     pool (PinnedPool, optional): take the block from this pool; it returns there when the
///         last view of the array is gone, and serves the next request of its size class.
///         Without it the block comes from the device's array pool (apart from ``copy_d2h``'s
///         results; 4 GiB of pinned memory at most, cached blocks freed first) and returns
///         there, or, past that pool's budget, is a dedicated allocation freed with the array.
///     device (int | str | device, optional): the CUDA device whose context pins it (default 0).
///
/// Returns:
///     numpy.ndarray: C-contiguous; its ``base`` (a ``PinnedBlock``) returns the memory to its
///     pool (or frees it) when the last view of it is gone.
///
/// Raises:
///     PinstageValueError: ``nbytes`` negative or too small for ``shape``, a negative dimension,
///         a device that does not exist. PinstageTypeError: an unknown dtype, a shape that is not
///         ints, a pool that is not a PinnedPool. CudaUnavailableError: no driver.
///         CudaDriverError: the driver cannot pin the memory. PoolExhaustedError (a RuntimeError):
///         ``pool``'s ``max_outstanding_bytes`` would be passed even with its cached blocks freed;
///         the message names it.
///
/// Example:
///     >>> a = pinstage.alloc_pinned_numpy(64, "float32", (4, 4))
///     >>> pinstage.is_pinned(a)
///     True
#[pyfunction]
#[pyo3(signature = (nbytes, dtype, shape, pool=None, *, device=None))]
fn alloc_pinned_numpy<'py>(
    py: Python<'py>,
    nbytes: &Bound<'py, PyAny>,
    dtype: &Bound<'py, PyAny>,
    shape: &Bound<'py, PyAny>,
    pool: Option<&Bound<'py, PyAny>>,
    device: Option<&Bound<'py, PyAny>>,
) -> PyResult<Bound<'py, PyAny>> {
    let pool = super::pool::pool_arg(pool)?;
    let nbytes = super::args::count_arg(nbytes, "nbytes", 0, isize::MAX as usize)?;
    let device = super::args::parse_device(device)?;
    let dtype = super::dtype::parse_dtype(dtype)?;
    let shape = parse_shape(shape)?;
    let need = numel(&shape)?
        .checked_mul(dtype.itemsize())
        .ok_or_else(|| value_err("shape overflows"))?;
    if nbytes < need {
        return Err(value_err(format!(
            "nbytes={nbytes} is smaller than prod(shape) * itemsize = {need} for shape {shape:?} \
             of {dtype}"
        )));
    }
    pinned_array(py, nbytes, dtype, &shape, pool, device, true)
}

/// `nbytes` of pinned memory as an array: from `pool` (refused past its budget), else with
/// `recycle` from the device's array pool, else (or past that pool's budget) a dedicated
/// allocation freed with the array.
fn pinned_array<'py>(
    py: Python<'py>,
    nbytes: usize,
    dtype: DType,
    shape: &[i64],
    pool: Option<&Bound<'py, super::pool::PyPinnedPool>>,
    device: i32,
    recycle: bool,
) -> PyResult<Bound<'py, PyAny>> {
    let state = super::device::device_state(device)?;
    if let Some(pool) = pool {
        let p = pool.get().pool().ok_or_else(|| {
            PyErr::from(crate::Error::unavailable(
                "the pool was made without a driver",
            ))
        })?;
        return match py.detach(|| p.try_acquire_pinned(nbytes))? {
            Some(block) => array_on(py, Memory::Pool(block), dtype, shape),
            None => {
                let s = p.stats();
                Err(crate::Error::PoolExhausted {
                    budget: s.max_outstanding_bytes,
                    outstanding: s.in_use_bytes + s.pooled_bytes,
                    requested: crate::host::size_class(nbytes),
                }
                .into())
            }
        };
    }
    if recycle && let Some(block) = py.detach(|| state.arrays.try_acquire_pinned(nbytes))? {
        return array_on(py, Memory::Pool(block), dtype, shape);
    }
    let buf = py.detach(|| PinnedBuffer::alloc(&state.device, nbytes, PinnedFlags::PORTABLE))?;
    array_on(py, Memory::Pinned(buf), dtype, shape)
}

/// ``numpy.empty(shape, dtype)`` on pinned memory (dtype defaults to float64).
///
/// Parameters, return value and errors as ``alloc_pinned_numpy``, with ``nbytes`` computed from the
/// shape.
///
/// Example:
///     >>> pinstage.empty_pinned((2, 3), "int64").shape
///     (2, 3)
#[pyfunction]
#[pyo3(signature = (shape, dtype=None, *, device=None))]
fn empty_pinned<'py>(
    py: Python<'py>,
    shape: &Bound<'py, PyAny>,
    dtype: Option<Bound<'py, PyAny>>,
    device: Option<&Bound<'py, PyAny>>,
) -> PyResult<Bound<'py, PyAny>> {
    let dtype = match dtype {
        Some(d) if !d.is_none() => d,
        _ => pyo3::types::PyString::new(py, "float64").into_any(),
    };
    let d = super::dtype::parse_dtype(&dtype)?;
    let s = parse_shape(shape)?;
    let nbytes = numel(&s)?.checked_mul(d.itemsize()).ok_or_else(|| {
        value_err(format!(
            "shape must fit the address space in bytes; got {s:?} of {d}"
        ))
    })?;
    let device = super::args::parse_device(device)?;
    pinned_array(py, nbytes, d, &s, None, device, false)
}

/// Whether a numpy array's data, or an address, lies in page-locked memory known to the driver
/// (pinned by pinstage, torch, cupy, jax...). False without a driver.
///
/// Parameters:
///     obj (numpy.ndarray | int): an array, or an address.
///
/// Raises:
///     PinstageTypeError: anything else.
///
/// Example:
///     >>> pinstage.is_pinned(numpy.zeros(4))
///     False
#[pyfunction]
fn is_pinned(obj: &Bound<'_, PyAny>) -> PyResult<bool> {
    let ptr = if let Ok(a) = obj.cast::<PyUntypedArray>() {
        // SAFETY: reading the data field of a live numpy array object.
        unsafe { (*a.as_array_ptr()).fields.data as usize }
    } else {
        super::args::as_index(obj)?
            .and_then(|i| i.extract::<usize>().ok())
            .ok_or_else(|| type_err("is_pinned() takes a numpy array or an address (an int)"))?
    };
    Ok(crate::host::is_pinned(ptr as *const u8))
}

/// ``numpy.empty(shape, dtype)`` on pinned memory when it can be had: from ``pool`` (or the
/// device's result pool), recycled when the array is collected; pageable memory past the pool's
/// limit or without a driver (``pinstage.is_pinned`` tells which). Never raises for lack of
/// pinned memory.
///
/// Parameters:
///     shape (int | tuple of int): the shape.
///     dtype: a numpy/torch/jax dtype or its name (default float64).
///     pool (PinnedPool, optional): the pool to draw from.
///     device: the device whose result pool serves it without ``pool`` (default 0).
///
/// Returns:
///     numpy.ndarray: C-contiguous, uninitialised.
///
/// Raises:
///     PinstageValueError: a negative dimension, a device that does not exist.
///     PinstageTypeError: an unknown dtype, a ``pool`` that is not a PinnedPool.
///
/// Example:
///     >>> pinstage.empty_host((2, 3), "int32").shape
///     (2, 3)
#[pyfunction]
#[pyo3(signature = (shape, dtype=None, pool=None, *, device=None))]
pub(crate) fn empty_host<'py>(
    py: Python<'py>,
    shape: &Bound<'py, PyAny>,
    dtype: Option<&Bound<'py, PyAny>>,
    pool: Option<&Bound<'py, PyAny>>,
    device: Option<&Bound<'py, PyAny>>,
) -> PyResult<Bound<'py, PyAny>> {
    let d = match dtype.filter(|d| !d.is_none()) {
        Some(d) => super::dtype::parse_dtype(d)?,
        None => crate::DType::F64,
    };
    let s = parse_shape(shape)?;
    let pool = pool_arg(pool)?;
    let device = parse_device(device)?;
    let nbytes = numel(&s)?.checked_mul(d.itemsize()).ok_or_else(|| {
        value_err(format!(
            "shape must fit the address space in bytes; got {s:?} of {d}"
        ))
    })?;
    let mem = host_block(py, pool, nbytes, device)?;
    array_on(py, mem, d, &s)
}

/// An array page-locked in place by ``pin``: ``unpin()`` (or leaving its ``with`` block)
/// unregisters it once the work queued on the GPUs pinstage uses has completed (so no copy still
/// reads or writes its pages; do not unpin inside a CUDA graph capture). Collecting a region
/// still pinned hands the unregistration to pinstage's background thread, which does it once
/// the device's queued work is done (the collecting thread never waits); ``pin`` of the same
/// array meanwhile waits for that (up to 5 s). It keeps the array alive while pinned.
///
/// Example:
///     >>> with pinstage.pin(batch) as a:       # a is batch, pinned
///     ...     pinstage.copy_h2d(dst, a)
#[pyclass(frozen, name = "PinnedRegion", module = "pinstage._native")]
pub(crate) struct PinnedRegion {
    reg: parking_lot::Mutex<Option<crate::host::Registered>>,
    array: Py<PyAny>,
    nbytes: usize,
}

#[pymethods]
impl PinnedRegion {
    /// Unregisters the memory (the array stays, pageable again), after waiting (GIL released)
    /// for the work queued on every GPU pinstage uses, so a copy still reading or writing the
    /// array (``copy_h2d`` from it, ``copy_d2h_async`` into it) completes first. Does nothing
    /// when done.
    fn unpin(&self, py: Python<'_>) {
        let taken = self.reg.lock().take();
        if taken.is_some() {
            py.detach(move || {
                super::device::synchronize_used_devices();
                drop(taken);
            });
        }
    }

    /// Whether the memory is still registered.
    #[getter]
    fn pinned(&self) -> bool {
        self.reg.lock().is_some()
    }

    /// Bytes registered.
    #[getter]
    fn nbytes(&self) -> usize {
        self.nbytes
    }

    /// The array.
    #[getter]
    fn array(&self, py: Python<'_>) -> Py<PyAny> {
        self.array.clone_ref(py)
    }

    fn __enter__(&self, py: Python<'_>) -> Py<PyAny> {
        self.array.clone_ref(py)
    }

    #[pyo3(signature = (*_args))]
    fn __exit__(&self, py: Python<'_>, _args: &Bound<'_, PyTuple>) -> bool {
        self.unpin(py);
        false
    }

    fn __repr__(&self) -> String {
        format!(
            "PinnedRegion(nbytes={}, pinned={})",
            self.nbytes,
            super::args::py_bool(self.pinned())
        )
    }
}

impl Drop for PinnedRegion {
    fn drop(&mut self) {
        // Collected while pinned: unregistered by the reaper thread (unregistering waits for the
        // work queued on the device), without waiting for the GPUs first (a collection may run
        // anywhere: inside a graph capture, where a synchronize would break it, or in a host
        // callback of the stream it would wait for). `unpin()` waits. The array goes after the
        // registration: pyo3 releases a reference dropped without the GIL at the next
        // acquisition of the GIL.
        if let Some(reg) = self.reg.get_mut().take() {
            let array = Python::attach(|py| std::mem::replace(&mut self.array, py.None()));
            reg.unregister_in_background(move || drop(array));
        }
    }
}

/// Page-locks an existing numpy array in place (``cuMemHostRegister``, at its exact size): copies
/// from and into it then run as one DMA at the link's rate, without a bounce buffer. Registering
/// costs about 1 ms for 4 MiB and 26 ms for 1 GiB on the H200 (``cuMemHostAlloc``: 2.8 and 561 ms).
///
/// Parameters:
///     array (numpy.ndarray): C- or F-contiguous, of numbers; read-only arrays are registered
///         read-only (the device only reads them).
///     device: the device whose context registers it (default 0; usable from every device).
///
/// Returns:
///     PinnedRegion: ``unpin()``, or use it as a context manager (it yields the array).
///
/// Raises:
///     PinstageTypeError: not a numpy array, or an array of Python objects. PinstageValueError: an
///         empty or non-contiguous array, memory that is page-locked already (pinned memory, or
///         pages shared with another registration; a collected region's registration that
///         pinstage has yet to undo is waited for first). CudaUnavailableError: no driver.
///         CudaDriverError: memory the driver cannot lock.
///
/// Example:
///     >>> region = pinstage.pin(batch)
///     >>> pinstage.is_pinned(batch)
///     True
///     >>> region.unpin()
#[pyfunction]
#[pyo3(signature = (array, *, device=None))]
pub(crate) fn pin(
    py: Python<'_>,
    array: &Bound<'_, PyAny>,
    device: Option<&Bound<'_, PyAny>>,
) -> PyResult<PinnedRegion> {
    use numpy::{PyArrayDescrMethods, PyUntypedArray, PyUntypedArrayMethods};
    let a = array.cast::<PyUntypedArray>().map_err(|_| {
        super::errors::type_err(format!(
            "pin(array): a numpy array; got {}",
            super::errors::type_name(array)
        ))
    })?;
    if a.dtype().has_object() {
        return Err(super::errors::type_err(
            "pin(array): an array of Python objects has nothing to copy",
        ));
    }
    if !(a.is_c_contiguous() || a.is_fortran_contiguous()) {
        return Err(value_err("pin(array): the array must be contiguous"));
    }
    let nbytes = a.len() * a.dtype().itemsize();
    if nbytes == 0 {
        return Err(value_err("pin(array): the array is empty"));
    }
    // SAFETY: reading fields of a live numpy array.
    let (data, flags) = unsafe {
        let f = &(*a.as_array_ptr()).fields;
        (f.data as usize, f.flags)
    };
    let read_only = flags & numpy::npyffi::NPY_ARRAY_WRITEABLE == 0;
    let state = super::device::device_state(parse_device(device)?)?;
    let addr = data;
    let reg = py.detach(move || {
        // SAFETY: the array's memory stays mapped while the region lives: the region holds the
        // array, and numpy does not move an array's data (resizing an array with references is
        // refused).
        unsafe { crate::host::Registered::new(&state.device, addr as *mut u8, nbytes, read_only) }
    })?;
    Ok(PinnedRegion {
        reg: parking_lot::Mutex::new(Some(reg)),
        array: array.clone().unbind(),
        nbytes,
    })
}

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(alloc_pinned_numpy, m)?)?;
    m.add_function(wrap_pyfunction!(empty_pinned, m)?)?;
    m.add_function(wrap_pyfunction!(empty_host, m)?)?;
    m.add_function(wrap_pyfunction!(is_pinned, m)?)?;
    m.add_class::<PinnedRegion>()?;
    m.add_function(wrap_pyfunction!(pin, m)?)?;
    Ok(())
}
