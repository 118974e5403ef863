//! `PinnedPool` (a pool of pinned blocks with an outstanding-bytes limit) and the result pool's
//! functions (`pool_stats`, `set_pool_budget`, `empty_cache`).

use pyo3::prelude::*;
use pyo3::types::{PyDict, PyTuple};

use super::args::{count_arg, parse_device};
use super::arrays::Memory;
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
            s.in_use_bytes + s.pooled_bytes
        })
    }

    /// Pinned bytes cached for reuse now.
    #[getter]
    fn pooled_bytes(&self) -> usize {
        self.pool.as_ref().map_or(0, |p| p.stats().pooled_bytes)
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

    /// Counters: ``hits``, ``misses``, ``pageable_fallbacks``, ``evictions``, ``in_use_bytes``
    /// (handed out), ``pooled_bytes`` (cached for reuse), ``outstanding_bytes`` (both),
    /// ``peak_bytes``, ``max_outstanding_bytes`` and ``max_pooled_bytes`` (the limits; None: no
    /// limit). Never raises.
    ///
    /// Returns:
    ///     dict: the counters.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        // Without a driver there is no pool: its limits are the ones given.
        let s =
            self.pool
                .as_ref()
                .map(|p| p.stats())
                .unwrap_or_else(|| crate::host::PinnedPoolStats {
                    max_pooled_bytes: self.max_pooled.unwrap_or(usize::MAX),
                    ..Default::default()
                });
        let fallbacks = self
            .driverless_fallbacks
            .load(std::sync::atomic::Ordering::Relaxed);
        super::helpers::host_pool_stats(py, "PinnedPool.stats()", &s, fallbacks, self.max)
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
                "pool must be a pinstage.PinnedPool; got {}",
                super::errors::type_name(o)
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

/// Counters of the pinned pool behind ``copy_d2h`` results, for ``device`` (default 0).
///
/// Returns:
///     dict: ``hits``, ``misses``, ``pageable_fallbacks``, ``evictions``, ``in_use_bytes``
///     (handed out), ``pooled_bytes`` (cached for reuse), ``outstanding_bytes`` (both),
///     ``peak_bytes``, ``max_outstanding_bytes`` (the budget) and ``max_pooled_bytes``.
///     Without a driver: zeros and the budget.
///
/// Raises:
///     PinstageValueError: a device that does not exist.
///
/// Example:
///     >>> pinstage.pool_stats()["max_outstanding_bytes"]
///     4294967296
#[pyfunction]
#[pyo3(signature = (*legacy, device=None), text_signature = "(*, device=None)")]
fn pool_stats<'py>(
    py: Python<'py>,
    legacy: &Bound<'py, PyTuple>,
    mut device: Option<Bound<'py, PyAny>>,
) -> PyResult<Bound<'py, PyDict>> {
    super::args::legacy_positional(
        legacy,
        &["device"],
        &mut [&mut device],
        "pool_stats(device)",
        "pool_stats(device=device)",
    )?;
    super::linger::reap(py);
    let ordinal = super::args::parse_device(device.as_ref())?;
    let s = if crate::cuda::cuda_available() {
        super::device::device_state(ordinal)?.pool.stats()
    } else {
        crate::host::PinnedPoolStats {
            max_outstanding_bytes: super::device::pool_budget(),
            max_pooled_bytes: usize::MAX,
            ..Default::default()
        }
    };
    super::helpers::host_pool_stats(py, "pool_stats()", &s, 0, Some(s.max_outstanding_bytes))
}

/// Frees the pools' cached blocks (results' and ``alloc_pinned_numpy``'s; blocks in use stay),
/// the bounce buffers, and the device memory ``to_device`` keeps for reuse, on every device, and
/// waits (GIL released) until the memory pinstage let go so far is back with the OS: freeing
/// device memory, and page-locked memory that is not a host pool block (drivers before 12.6,
/// stager slots), waits for the work queued on the GPU, which every other call leaves to
/// pinstage's background thread. Works without a driver. Never raises.
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

/// Sets the pinned byte budget of the result pools (every device; default 4 GiB): their
/// ``max_outstanding_bytes`` in ``pool_stats()``. Cached blocks beyond it are freed now; past it,
/// results use pageable memory. Works without a driver.
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
    m.add_class::<PyPinnedPool>()?;
    m.add_function(wrap_pyfunction!(pool_stats, m)?)?;
    m.add_function(wrap_pyfunction!(empty_cache, m)?)?;
    m.add_function(wrap_pyfunction!(set_pool_budget, m)?)?;
    Ok(())
}
