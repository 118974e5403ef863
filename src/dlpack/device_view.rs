//! [`DeviceView`]: validated metadata and the lifetime for which its memory is there.

use std::marker::PhantomData;
use std::ops::Deref;

use dlpark::ffi::DLTensor;

use super::dtype::Element;
use super::meta::{DlpackError, TensorMeta, meta_of_dltensor};

/// A tensor the copies may read or write: validated metadata and a lifetime `'a` for which the
/// memory is there. Dereferences to its [`TensorMeta`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceView<'a> {
    meta: TensorMeta,
    _memory: PhantomData<&'a ()>,
}

impl<'a> DeviceView<'a> {
    /// A view of the memory `meta` describes.
    ///
    /// # Safety
    /// 1. For `'a`, the `meta.nbytes()` bytes at `meta.ptr()` are live memory of the kind
    ///    `meta.memory()` says (host memory this process may access, or memory of that CUDA
    ///    device), readable, and writable too unless `meta.is_read_only()`.
    /// 2. For `'a`, nothing else writes that memory while a pinstage copy reads or writes it, and
    ///    nobody else relies on it staying unchanged unless it is marked read-only.
    /// 3. Device memory stays allocated until every asynchronous copy issued through the view
    ///    completed (a [`PendingCopy`](crate::host::PendingCopy), a stager copy's event, a step's
    ///    commit), which may be after `'a` ends: the borrow does not cover queued device work.
    pub unsafe fn from_meta(meta: TensorMeta) -> Self {
        Self {
            meta,
            _memory: PhantomData,
        }
    }

    /// Validates a raw `DLTensor` into a view.
    ///
    /// # Errors
    /// A [`DlpackError`] naming the field that pinstage cannot use.
    ///
    /// # Safety
    /// 1. `t.shape` (and `t.strides` when non-null) point to `t.ndim` readable `i64`s.
    /// 2. The memory `t` describes satisfies [`DeviceView::from_meta`]'s contract for `'a`.
    pub unsafe fn from_dltensor(t: &DLTensor, read_only: bool) -> Result<Self, DlpackError> {
        // SAFETY: caller's contract 1.
        let meta = unsafe { meta_of_dltensor(t, read_only) }?;
        // SAFETY: caller's contract 2.
        Ok(unsafe { Self::from_meta(meta) })
    }

    /// A read-only 1-D view of host memory borrowed from `values`.
    pub fn host<T: Element>(values: &'a [T]) -> Self {
        Self {
            meta: TensorMeta::host_1d(values.as_ptr() as u64, T::DTYPE, values.len(), true),
            _memory: PhantomData,
        }
    }

    /// A writable 1-D view of host memory borrowed from `values`: copies into it write there.
    ///
    /// # Safety
    /// 1. The view (and anything borrowing it) is used by one copy at a time: copies write
    ///    through `&DeviceView`, and two at once on two threads would race on `values`.
    pub unsafe fn host_mut<T: Element>(values: &'a mut [T]) -> Self {
        Self {
            meta: TensorMeta::host_1d(values.as_mut_ptr() as u64, T::DTYPE, values.len(), false),
            _memory: PhantomData,
        }
    }

    /// The metadata.
    pub fn meta(&self) -> &TensorMeta {
        &self.meta
    }
}

impl Deref for DeviceView<'_> {
    type Target = TensorMeta;

    fn deref(&self) -> &TensorMeta {
        &self.meta
    }
}

impl DeviceView<'_> {
    /// The same view marked read-only (copies will refuse to write through it).
    pub fn into_read_only(self) -> Self {
        Self {
            meta: self.meta.into_read_only(),
            _memory: PhantomData,
        }
    }
}
