//! `PinnedPool` (a pool of pinned blocks with an outstanding-bytes limit), `empty_host`, and
//! `nvtx_range`.

use pyo3::prelude::*;
use pyo3::types::{PyDict, PyTuple};

use super::args::{count_arg, parse_device};
use super::arrays::{Memory, array_on, numel, parse_shape};
use super::errors::value_err;
use crate::error::Error;
use crate::host::PinnedPool;

/// A pool of pinned host blocks for ``alloc_pinned_numpy(pool=)``, ``empty_host(pool=)`` and
/// ``copy_d2h(pool=)``: a block returns to the pool when the last array over it is collected and
/// serves the next request of its size class (whole 4 KiB pages: less than a page of waste;
/// bytes are counted in those pages). The pool holds at most ``max_outstanding_bytes`` pinned
/// bytes, in use and cached together: past it the cached blocks are freed first (largest
/// first), then ``alloc_pinned_numpy`` raises ``PoolExhaustedError`` (a ``RuntimeError`` naming
/// the budget) while ``empty_host`` and ``copy_d2h`` fall back to pageable memory. At most
/// ``max_pooled_bytes`` stay cached (returned blocks past it are freed, largest first). Works
/// without a driver (nothing is pinned then: ``empty_host`` gives pageable arrays, counted as
/// ``pageable_fallbacks``; the byte counts stay 0).
///
/// Parameters:
///     max_outstanding_bytes (int, optional): the limit on pinned bytes alive (>= 0); None: no
///         limit.
///     max_pooled_bytes (int, optional): the limit on cached bytes (>= 0); None: only the first
///         limit.
///     device: the device whose context pins the memory (default 0; pinned memory is usable from
///         every device).
///
/// Raises:
///     PinstageValueError: a negative limit, a device that does not exist. PinstageTypeError: a
///         limit that is not an int.
///
/// Example:
///     >>> pool = pinstage.PinnedPool(max_outstanding_bytes=1 << 30)
///     >>> a = pinstage.alloc_pinned_numpy(4096, "float32", 1024, pool=pool)
///     >>> pool.outstanding_bytes
///     4096
#[pyclass(frozen, name = "PinnedPool", module = "pinstage._native")]
pub(crate) struct PyPinnedPool {
    pool: Option<PinnedPool>,
    max: Option<usize>,
    max_pooled: Option<usize>,
    /// Without a driver: the requests served by pageable memory (every one).
    driverless_fallbacks: std::sync::atomic::AtomicU64,
}

impl PyPinnedPool {
    pub(crate) fn pool(&self) -> Option<&PinnedPool> {
        self.pool.as_ref()
    }

    /// Counts a request served by pageable memory because there is no driver.
    pub(crate) fn count_driverless_fallback(&self) {
        self.driverless_fallbacks
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    }
}

fn limit_arg(m: Option<&Bound<'_, PyAny>>, name: &str) -> PyResult<Option<usize>> {
    match m.filter(|m| !m.is_none()) {
        Some(m) => Ok(Some(count_arg(m, name, 0, isize::MAX as usize)?)),
        None => Ok(None),
    }
}

#[pymethods]
impl PyPinnedPool {
    #[new]
    #[pyo3(signature = (max_outstanding_bytes=None, *, max_pooled_bytes=None, device=None))]
    fn new(
        max_outstanding_bytes: Option<&Bound<'_, PyAny>>,
        max_pooled_bytes: Option<&Bound<'_, PyAny>>,
        device: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Self> {
        let max = limit_arg(max_outstanding_bytes, "max_outstanding_bytes")?;
        let max_pooled = limit_arg(max_pooled_bytes, "max_pooled_bytes")?;
        let ordinal = parse_device(device)?;
        let pool = match super::device::device_state(ordinal) {
            Ok(state) => Some(PinnedPool::with_max_outstanding(
                &state.device,
                max,
                max_pooled,
            )),
            Err(Error::CudaUnavailable { .. }) => None,
            Err(e) => return Err(e.into()),
        };
        Ok(Self {
            pool,
            max,
            max_pooled,
            driverless_fallbacks: std::sync::atomic::AtomicU64::new(0),
        })
    }

    /// Pinned bytes alive in the pool now: handed out (arrays alive) and cached.
    #[getter]
    fn outstanding_bytes(&self) -> usize {
        self.pool.as_ref().map_or(0, |p| {
            let s = p.stats();
            s.in_use_bytes + s.cached_bytes
        })
    }

    /// Pinned bytes cached for reuse now.
    #[getter]
    fn pooled_bytes(&self) -> usize {
        self.pool.as_ref().map_or(0, |p| p.stats().cached_bytes)
    }

    /// The limit on pinned bytes alive (None: none).
    #[getter]
    fn max_outstanding_bytes(&self) -> Option<usize> {
        self.max
    }

    /// The limit on cached bytes (None: none but ``max_outstanding_bytes``).
    #[getter]
    fn max_pooled_bytes(&self) -> Option<usize> {
        self.max_pooled
    }

    /// Frees the cached blocks (blocks in use stay, and return to the pool later).
    fn clear(&self, py: Python<'_>) {
        if let Some(p) = &self.pool {
            py.detach(|| p.empty_cache());
        }
    }

    /// Counters: ``hits``, ``misses``, ``pageable_fallbacks``, ``evictions``,
    /// ``outstanding_bytes`` (in use and cached), ``in_use_bytes``, ``pooled_bytes``,
    /// ``peak_bytes``.
    ///
    /// Returns:
    ///     dict: the counters.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let s = self.pool.as_ref().map(|p| p.stats()).unwrap_or_default();
        let d = PyDict::new(py);
        d.set_item("hits", s.hits)?;
        d.set_item("misses", s.misses)?;
        d.set_item(
            "pageable_fallbacks",
            s.pageable_fallbacks
                + self
                    .driverless_fallbacks
                    .load(std::sync::atomic::Ordering::Relaxed),
        )?;
        d.set_item("evictions", s.evictions)?;
        d.set_item("outstanding_bytes", s.in_use_bytes + s.cached_bytes)?;
        d.set_item("in_use_bytes", s.in_use_bytes)?;
        d.set_item("pooled_bytes", s.cached_bytes)?;
        d.set_item("peak_bytes", s.peak_bytes)?;
        Ok(d)
    }

    fn __repr__(&self) -> String {
        let opt = |m: Option<usize>| m.map_or("None".to_owned(), |m| m.to_string());
        format!(
            "PinnedPool(max_outstanding_bytes={}, max_pooled_bytes={}, outstanding_bytes={}, \
             pooled_bytes={})",
            opt(self.max),
            opt(self.max_pooled),
            self.outstanding_bytes(),
            self.pooled_bytes()
        )
    }
}

/// Parses a `pool=` argument.
pub(crate) fn pool_arg<'a, 'py>(
    obj: Option<&'a Bound<'py, PyAny>>,
) -> PyResult<Option<&'a Bound<'py, PyPinnedPool>>> {
    match obj.filter(|o| !o.is_none()) {
        None => Ok(None),
        Some(o) => o.cast::<PyPinnedPool>().map(Some).map_err(|_| {
            super::errors::type_err(format!(
                "pool must be a pinstage.PinnedPool, got {}",
                super::import::type_name(o)
            ))
        }),
    }
}

/// A block of `nbytes` from `pool` (pinned, or pageable past its limit), or from the device's
/// result pool, or pageable memory without a driver.
pub(crate) fn host_block(
    py: Python<'_>,
    pool: Option<&Bound<'_, PyPinnedPool>>,
    nbytes: usize,
    device: i32,
) -> PyResult<Memory> {
    if let Some(p) = pool.and_then(|p| p.get().pool()) {
        return pinned_or_pageable(py, p, nbytes);
    }
    if let Some(p) = pool {
        p.get().count_driverless_fallback();
    }
    if pool.is_none() && crate::cuda::cuda_available() {
        let state = super::device::device_state(device)?;
        return pinned_or_pageable(py, &state.pool, nbytes);
    }
    Ok(Memory::Vec(crate::host::zeroed_vec(nbytes, "host array")?))
}

/// A block of `nbytes` from `pool`: pinned, or pageable past its budget or when the memory
/// cannot be pinned (the driver refusing, the host short of memory it can lock), so
/// `empty_host` and `copy_d2h` never fail for lack of pinned memory.
fn pinned_or_pageable(py: Python<'_>, pool: &PinnedPool, nbytes: usize) -> PyResult<Memory> {
    match py.detach(|| pool.acquire(nbytes)) {
        Ok(b) => Ok(Memory::Pool(b)),
        Err(Error::Driver(_) | Error::OutOfMemory { .. }) => {
            pool.count_fallback();
            Ok(Memory::Vec(crate::host::zeroed_vec(
                nbytes,
                "pageable fallback",
            )?))
        }
        Err(e) => Err(e.into()),
    }
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
        Some(d) => super::import::parse_dtype(d)?,
        None => crate::DType::F64,
    };
    let s = parse_shape(shape)?;
    let pool = pool_arg(pool)?;
    let device = parse_device(device)?;
    let nbytes = numel(&s)?
        .checked_mul(d.itemsize())
        .ok_or_else(|| value_err(format!("shape {s:?} overflows")))?;
    let mem = host_block(py, pool, nbytes, device)?;
    array_on(py, mem, d, &s)
}

/// An NVTX range for Nsight Systems, as a context manager: ``with pinstage.nvtx_range("step"):``.
/// NVTX is loaded at run time (``libnvToolsExt``, shipped with the CUDA toolkit); without it this
/// does nothing. pinstage's own copies (``copy_d2h``, ``copy_h2d``, step commits) are ranges too.
/// Ranges are per thread: leave the block on the thread that entered it.
///
/// Also a decorator: ``@pinstage.nvtx_range("plan")`` runs each call of the function inside the
/// range.
///
/// Parameters:
///     message (str): the range's name.
///
/// Raises:
///     PinstageTypeError: a message that is not a str; decorating something not callable.
///
/// Example:
///     >>> with pinstage.nvtx_range("plan step"):
///     ...     pass
#[pyclass(frozen, name = "nvtx_range", module = "pinstage._native")]
pub(crate) struct NvtxRangeCtx {
    name: std::ffi::CString,
    depth: std::sync::atomic::AtomicUsize,
}

#[pymethods]
impl NvtxRangeCtx {
    #[new]
    fn new(message: &Bound<'_, PyAny>) -> PyResult<Self> {
        let s = message
            .cast::<pyo3::types::PyString>()
            .map_err(|_| super::errors::type_err("nvtx_range(message): message must be a str"))?
            .to_cow()?
            .replace('\0', " ");
        Ok(Self {
            name: std::ffi::CString::new(s).expect("NULs replaced"),
            depth: std::sync::atomic::AtomicUsize::new(0),
        })
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        let me = slf.get();
        if crate::nvtx::push(&me.name) {
            me.depth.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
        slf
    }

    #[pyo3(signature = (*_args))]
    fn __exit__(&self, _args: &Bound<'_, PyTuple>) -> bool {
        let d = &self.depth;
        if d.load(std::sync::atomic::Ordering::Relaxed) > 0 {
            d.fetch_sub(1, std::sync::atomic::Ordering::Relaxed);
            crate::nvtx::pop();
        }
        false
    }

    /// As a decorator: ``func`` wrapped so that each call runs inside this range.
    fn __call__<'py>(
        slf: &Bound<'py, Self>,
        func: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyAny>> {
        if !func.is_callable() {
            return Err(super::errors::type_err(format!(
                "nvtx_range(...) decorates a callable, got {}",
                super::import::type_name(func)
            )));
        }
        slf.py()
            .import(pyo3::intern!(slf.py(), "pinstage._decorate"))?
            .call_method1(pyo3::intern!(slf.py(), "wrap"), (slf, func))
    }

    /// Whether NVTX was found (ranges reach a profiler when one is attached).
    #[staticmethod]
    fn available() -> bool {
        crate::nvtx::nvtx_available()
    }
}

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyPinnedPool>()?;
    m.add_class::<NvtxRangeCtx>()?;
    m.add_function(wrap_pyfunction!(empty_host, m)?)?;
    m.add_class::<PinnedRegion>()?;
    m.add_function(wrap_pyfunction!(pin, m)?)?;
    Ok(())
}

/// An array page-locked in place by ``pin``: ``unpin()`` (or leaving its ``with`` block)
/// unregisters it once the work queued on the GPUs pinstage uses has completed (so no copy still
/// reads or writes its pages; do not unpin inside a CUDA graph capture). Collecting a region
/// still pinned unregisters it at once, without that wait. It keeps the array alive while
/// pinned.
///
/// Example:
///     >>> with pinstage.pin(batch) as a:       # a is batch, pinned
///     ...     pinstage.copy_h2d(dst, a).wait()
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
            crate::host::reaper::defer(move || {
                let device = reg.device().clone();
                crate::host::reaper::free_when_idle(&device, || drop(reg));
                drop(array);
            });
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
///         pages shared with another registration). CudaUnavailableError: no driver.
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
            "pin(array): a numpy array, got {}",
            super::import::type_name(array)
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
