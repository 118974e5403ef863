//! numpy arrays over pinned memory. Each array's `base` is a `PinnedBlock` that owns the memory,
//! so the block lives until the array and every view of it are gone.

use numpy::npyffi::{self, NPY_ARRAY_WRITEABLE, PY_ARRAY_API};
use numpy::{PyArrayDescrMethods, PyUntypedArray, PyUntypedArrayMethods};
use pyo3::prelude::*;

use super::dtype::descr;
use super::errors::{type_err, value_err};
use crate::dlpack::DType;
use crate::host::{PinnedBuffer, PoolBlock};

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
            .ok_or_else(|| {
                value_err(format!(
                    "shape must hold at most 2**63-1 elements; got {shape:?}"
                ))
            })
    })
}

pub(crate) fn parse_shape(obj: &Bound<'_, PyAny>) -> PyResult<Vec<i64>> {
    let shape = super::args::shape_dims(obj)?.ok_or_else(|| {
        type_err(format!(
            "shape must be an int or a sequence of ints; got {}",
            super::errors::type_name(obj)
        ))
    })?;
    if let Some(d) = shape.iter().find(|&&d| d < 0) {
        return Err(value_err(format!(
            "shape must have no negative dimension; got {shape:?} (dimension {d})"
        )));
    }
    if shape.len() > 64 {
        return Err(value_err(format!(
            "shape must have at most 64 dimensions (numpy's limit); got {}",
            shape.len()
        )));
    }
    Ok(shape)
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
            "dst must be a numpy array; got {}",
            super::errors::type_name(obj)
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
    m.add_class::<PinnedBlock>()
}
