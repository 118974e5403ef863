//! numpy arrays over pinned memory. Each array's `base` is a `PinnedBlock` that owns the memory,
//! so the block lives until the array and every view of it are gone.

use numpy::npyffi::{self, NPY_ARRAY_WRITEABLE, PY_ARRAY_API};
use numpy::{PyArrayDescr, PyArrayDescrMethods, PyUntypedArray, PyUntypedArrayMethods};
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;

use super::errors::{type_err, value_err};
use crate::dlpack::DType;
use crate::host::{PinnedBuffer, PinnedFlags, PoolBlock};

/// What a [`PinnedBlock`] owns.
pub(crate) enum Memory {
    /// A dedicated pinned allocation.
    Pinned(PinnedBuffer),
    /// A block from a pool; returns to the pool when dropped.
    Pool(PoolBlock),
    /// Plain host memory (fallbacks).
    Vec(Vec<u8>),
}

/// The memory behind an array made by pinstage: the array's ``base``. It frees (or returns to the
/// pool) the memory once no array or view uses it. ``nbytes``, ``pinned``, ``address``.
#[pyclass(frozen, module = "pinstage._native")]
pub struct PinnedBlock {
    mem: Memory,
    ptr: usize,
    len: usize,
}

impl PinnedBlock {
    pub(crate) fn new(mut mem: Memory) -> Self {
        let (ptr, len) = match &mut mem {
            Memory::Pinned(b) => (b.as_mut_ptr() as usize, b.len()),
            Memory::Pool(b) => (b.as_mut_ptr() as usize, b.len()),
            Memory::Vec(v) => (v.as_mut_ptr() as usize, v.len()),
        };
        Self { mem, ptr, len }
    }

    pub(crate) fn ptr(&self) -> *mut u8 {
        self.ptr as *mut u8
    }
}

#[pymethods]
impl PinnedBlock {
    /// Size of the block in bytes.
    #[getter]
    fn nbytes(&self) -> usize {
        self.len
    }

    /// Whether the memory is page-locked (False for a pageable fallback).
    #[getter]
    pub(crate) fn pinned(&self) -> bool {
        match &self.mem {
            Memory::Pinned(_) => true,
            Memory::Pool(b) => b.is_pinned(),
            Memory::Vec(_) => false,
        }
    }

    /// Address of the block's first byte.
    #[getter]
    fn address(&self) -> usize {
        self.ptr
    }

    fn __repr__(&self) -> String {
        format!(
            "PinnedBlock(nbytes={}, pinned={})",
            self.len,
            super::args::py_bool(self.pinned())
        )
    }
}

static DESCRS: PyOnceLock<Vec<Py<PyArrayDescr>>> = PyOnceLock::new();

/// The numpy dtype of `d`; bfloat16 needs `ml_dtypes`.
pub(crate) fn descr<'py>(py: Python<'py>, d: DType) -> PyResult<Bound<'py, PyArrayDescr>> {
    if d == DType::BF16 {
        let ml = py.import("ml_dtypes").map_err(|_| {
            type_err(
                "bfloat16 results need the ml_dtypes package (pip install ml_dtypes), which \
                 provides numpy's bfloat16 dtype",
            )
        })?;
        let np = py.import("numpy")?;
        return Ok(np
            .call_method1("dtype", (ml.getattr("bfloat16")?,))?
            .cast_into()?);
    }
    let table = DESCRS.get_or_try_init(py, || -> PyResult<_> {
        let np = py.import("numpy")?;
        DType::ALL
            .iter()
            .map(|d| {
                let name = if *d == DType::BF16 {
                    "uint16"
                } else {
                    d.name()
                };
                Ok(np
                    .call_method1("dtype", (name,))?
                    .cast_into::<PyArrayDescr>()?
                    .unbind())
            })
            .collect()
    })?;
    let i = DType::ALL
        .iter()
        .position(|x| *x == d)
        .expect("every dtype is in ALL");
    Ok(table[i].bind(py).clone())
}

/// A writable C-contiguous array of `dtype` and `shape` over `ptr`, whose base is `owner`.
///
/// # Safety
/// 1. `ptr` is valid for `prod(shape) * itemsize` bytes for as long as `owner` lives.
pub(crate) unsafe fn array_over<'py>(
    owner: Bound<'py, PyAny>,
    ptr: *mut u8,
    dtype: DType,
    shape: &[i64],
) -> PyResult<Bound<'py, PyAny>> {
    let py = owner.py();
    let descr = descr(py, dtype)?;
    let mut dims: Vec<npyffi::npy_intp> = shape.iter().map(|&d| d as npyffi::npy_intp).collect();
    // SAFETY: numpy's C API: NewFromDescr steals a reference to descr (we give it one); the
    // data pointer is valid (caller); flags ask for a writable, C-contiguous array.
    unsafe {
        let descr_ptr = descr.into_ptr() as *mut npyffi::PyArray_Descr;
        let arr = PY_ARRAY_API.PyArray_NewFromDescr(
            py,
            npyffi::get_type_object(py, npyffi::NpyTypes::PyArray_Type),
            descr_ptr,
            dims.len() as i32,
            dims.as_mut_ptr(),
            std::ptr::null_mut(),
            ptr.cast(),
            npyffi::NPY_ARRAY_C_CONTIGUOUS | NPY_ARRAY_WRITEABLE | npyffi::NPY_ARRAY_ALIGNED,
            std::ptr::null_mut(),
        );
        if arr.is_null() {
            return Err(PyErr::fetch(py));
        }
        let arr = Bound::from_owned_ptr(py, arr);
        // SetBaseObject steals a reference to the owner.
        if PY_ARRAY_API.PyArray_SetBaseObject(py, arr.as_ptr().cast(), owner.into_ptr()) < 0 {
            return Err(PyErr::fetch(py));
        }
        Ok(arr)
    }
}

/// A new array on a fresh pinned block (or on `mem` if given).
pub(crate) fn array_on<'py>(
    py: Python<'py>,
    mem: Memory,
    dtype: DType,
    shape: &[i64],
) -> PyResult<Bound<'py, PyAny>> {
    let block = PinnedBlock::new(mem);
    let ptr = block.ptr();
    let need = numel(shape)? * dtype.itemsize();
    if need > block.len {
        return Err(value_err(format!(
            "block of {} bytes cannot hold {need} bytes",
            block.len
        )));
    }
    let owner = Bound::new(py, block)?.into_any();
    // SAFETY: the block holds `need` bytes and lives as long as the owner (the array's base).
    unsafe { array_over(owner, ptr, dtype, shape) }
}

pub(crate) fn numel(shape: &[i64]) -> PyResult<usize> {
    shape.iter().try_fold(1usize, |acc, &d| {
        usize::try_from(d)
            .ok()
            .and_then(|d| acc.checked_mul(d))
            .ok_or_else(|| value_err(format!("invalid shape {shape:?}")))
    })
}

pub(crate) fn parse_shape(obj: &Bound<'_, PyAny>) -> PyResult<Vec<i64>> {
    let shape = super::args::shape_dims(obj)?.ok_or_else(|| {
        type_err(format!(
            "shape must be an int or a sequence of ints, got {}",
            super::import::type_name(obj)
        ))
    })?;
    if let Some(d) = shape.iter().find(|&&d| d < 0) {
        return Err(value_err(format!(
            "shape {shape:?} has a negative dimension {d}"
        )));
    }
    Ok(shape)
}

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
    let dtype = super::import::parse_dtype(dtype)?;
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
                    budget: s.budget_bytes,
                    outstanding: s.in_use_bytes + s.cached_bytes,
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
    let d = super::import::parse_dtype(&dtype)?;
    let s = parse_shape(shape)?;
    let nbytes = numel(&s)?
        .checked_mul(d.itemsize())
        .ok_or_else(|| value_err(format!("shape {s:?} overflows")))?;
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

/// The pinstage dtype of a numpy dtype that is one of numpy's own (native byte order) dtype
/// objects; `None` for any other (bfloat16, big-endian, structured...: the general paths).
pub(crate) fn dtype_of(py: Python<'_>, have: &Bound<'_, PyArrayDescr>) -> PyResult<Option<DType>> {
    descr(py, DType::F32)?; // fills the table
    let table = DESCRS.get(py).expect("filled above");
    let found = DType::ALL
        .iter()
        .zip(table)
        .find(|(d, t)| **d != DType::BF16 && t.as_ptr() == have.as_ptr())
        .map(|(d, _)| *d);
    if found.is_some() {
        return Ok(found);
    }
    // ml_dtypes' bfloat16: a user dtype, known by its scalar type (asked only off the fast path).
    let bf16 = have.itemsize() == 2
        && have.kind() == b'V'
        && have.typeobj().name()? == "bfloat16"
        && have
            .typeobj()
            .module()
            .is_ok_and(|m| m.to_cow().is_ok_and(|m| m.starts_with("ml_dtypes")));
    Ok(bf16.then_some(DType::BF16))
}

/// Whether `len` bytes at `ptr` of the numpy array `obj` are pinned, when pinstage knows without
/// asking the driver: the array's memory is one of its blocks (`empty_pinned`,
/// `alloc_pinned_numpy`, pool results and their views). `None`: not known.
pub(crate) fn known_pinned(obj: &Bound<'_, PyAny>, ptr: usize, len: usize) -> Option<bool> {
    let a = obj.cast::<PyUntypedArray>().ok()?;
    // SAFETY: reading a field of a live numpy array object; a non-null base is a live object
    // the array holds a reference to.
    let base = unsafe { (*a.as_array_ptr()).fields.base };
    if base.is_null() {
        return None;
    }
    // SAFETY: see above: a borrowed reference to a live object, valid while `obj` lives.
    let base = unsafe { Bound::from_borrowed_ptr(obj.py(), base) };
    let block = base.cast::<PinnedBlock>().ok()?.get();
    let inside = ptr >= block.ptr && ptr.checked_add(len)? <= block.ptr + block.len;
    inside.then(|| block.pinned())
}

/// A writable, C-contiguous numpy array's (address, nbytes), or a clear error.
pub(crate) fn writable_numpy(obj: &Bound<'_, PyAny>) -> PyResult<(usize, usize)> {
    let Ok(a) = obj.cast::<PyUntypedArray>() else {
        return Err(type_err(format!(
            "dst must be a numpy array, got {}",
            super::import::type_name(obj)
        )));
    };
    if !a.is_c_contiguous() {
        return Err(value_err("dst must be C-contiguous"));
    }
    if a.dtype().has_object() {
        // Its bytes are Python object pointers: writing raw bytes there would corrupt the
        // interpreter's memory.
        return Err(type_err(format!(
            "dst holds Python objects (dtype {}): pinstage writes raw bytes into arrays of \
             numbers only",
            a.dtype()
        )));
    }
    // SAFETY: reading fields of a live numpy array object.
    let (data, flags) = unsafe {
        (
            (*a.as_array_ptr()).fields.data as usize,
            (*a.as_array_ptr()).fields.flags,
        )
    };
    if flags & NPY_ARRAY_WRITEABLE == 0 {
        return Err(value_err("dst is read-only"));
    }
    let nbytes = a.len() * a.dtype().itemsize();
    Ok((data, nbytes))
}

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PinnedBlock>()?;
    m.add_function(wrap_pyfunction!(alloc_pinned_numpy, m)?)?;
    m.add_function(wrap_pyfunction!(empty_pinned, m)?)?;
    m.add_function(wrap_pyfunction!(is_pinned, m)?)?;
    Ok(())
}
