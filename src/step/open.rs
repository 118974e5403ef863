//! An open step: the typed Rust API over a claimed slot.

use std::marker::PhantomData;

use super::layout::{FieldId, FieldKey, StepLayout};
use super::stager::{CommitOutcome, RawStep, StepStager};
use crate::cuda::Event;
use crate::cuda::StreamHandle;
use crate::dlpack::Element;
use crate::error::{Error, Result};

/// An open step: a slot owned by this step until it is committed or dropped (dropping releases
/// it untouched). Not `Send`: a step belongs to the thread that opened it.
pub struct Step<'s> {
    pub(super) stager: &'s StepStager,
    pub(super) raw: Option<RawStep>,
    pub(super) _not_send: PhantomData<*const ()>,
}

impl std::fmt::Debug for Step<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Step")
            .field("slot", &self.raw.as_ref().map(|r| r.claim.index))
            .finish()
    }
}

impl<'s> Step<'s> {
    fn raw(&mut self) -> &mut RawStep {
        self.raw.as_mut().expect("present until commit")
    }

    /// The slot this step owns.
    pub fn slot(&self) -> usize {
        self.raw.as_ref().map_or(0, |r| r.claim.index)
    }

    /// The first `rows` rows of field `key` in the slot, to write in place; the field's used
    /// rows become `rows` (what the commit sends).
    ///
    /// # Errors
    /// [`Error::UnknownField`], [`Error::DtypeMismatch`] when `T` is not the field's dtype,
    /// [`Error::InvalidArgument`] for rows beyond the capacity, [`Error::StepState`] after
    /// zero-copy device addresses were taken.
    pub fn field_mut<T: Element>(&mut self, key: impl FieldKey, rows: usize) -> Result<&mut [T]> {
        let st = self.stager;
        let id = typed_field::<T>(st.layout(), key)?;
        let (ptr, bytes) = st.field_raw(self.raw(), id, rows)?;
        // SAFETY: the slot is ours until commit or drop, which need `self` (the borrow ends
        // first); fields are aligned to 256 bytes; `bytes` is a whole number of elements.
        Ok(unsafe { std::slice::from_raw_parts_mut(ptr.cast::<T>(), bytes / size_of::<T>()) })
    }

    /// Writes `values` into field `key`'s leading rows (whole rows: for a 2-D field
    /// `values.len()` is a multiple of its columns); used rows become the values' rows.
    ///
    /// # Errors
    /// As [`Step::put_padded`].
    pub fn put<T: Element>(&mut self, key: impl FieldKey, values: &[T]) -> Result<()> {
        let st = self.stager;
        let id = key.id_in(st.layout())?;
        let cols = st.layout().fields()[id.0].cols();
        if values.len() % cols != 0 {
            return Err(Error::ShapeMismatch {
                values: vec![values.len()],
                dst: st.layout().fields()[id.0]
                    .shape()
                    .iter()
                    .map(|&d| d as i64)
                    .collect(),
            });
        }
        self.put_padded(id, values, (values.len() / cols, cols), None, None)
    }

    /// Writes `values` (`shape.0` rows of `shape.1` elements) into field `key`'s leading rows;
    /// `pad` fills the rest of those rows and the rows up to `rows` (default: the values' rows),
    /// which become the field's used rows.
    ///
    /// # Errors
    /// [`Error::UnknownField`], [`Error::DtypeMismatch`], [`Error::ShapeMismatch`] for values
    /// larger than the capacity, [`Error::RaggedBytes`] when `values` is not `shape`,
    /// [`Error::InvalidArgument`] for `rows` out of range or a missing pad,
    /// [`Error::StepState`] after zero-copy device addresses were taken. Nothing is written.
    pub fn put_padded<T: Element>(
        &mut self,
        key: impl FieldKey,
        values: &[T],
        shape: (usize, usize),
        pad: Option<T>,
        rows: Option<usize>,
    ) -> Result<()> {
        let st = self.stager;
        let id = typed_field::<T>(st.layout(), key)?;
        let pad = pad.as_ref().map(bytemuck::bytes_of);
        st.put_raw(
            self.raw(),
            id,
            bytemuck::cast_slice(values),
            shape,
            pad,
            rows,
        )
    }

    /// Rows of field `key` written in this step so far (0: not written; the commit leaves its
    /// device bytes as they are).
    ///
    /// # Errors
    /// [`Error::UnknownField`].
    pub fn used_rows(&self, key: impl FieldKey) -> Result<usize> {
        let id = key.id_in(self.stager.layout())?;
        Ok(self
            .stager
            .used_raw(self.raw.as_ref().expect("present until commit"), id))
    }

    /// Zero-copy mode: the device address of field `key` in this step's slot, for a kernel to
    /// read in place; from then on the step's fields can no longer be written from the host.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] in other modes, [`Error::CudaUnavailable`] without a driver,
    /// [`Error::UnknownField`].
    pub fn device_ptr(&mut self, key: impl FieldKey) -> Result<u64> {
        let id = key.id_in(self.stager.layout())?;
        let st = self.stager;
        st.device_ptr_raw(self.raw(), id)
    }

    /// Commits the step on `stream`: the written fields' used rows go to the arena (or a fresh
    /// block) in one copy when they are dense (gaps up to the stager's `max_gap`), else in one
    /// `cuMemcpyBatchAsync` (one copy per span where the driver has no batch or the stream is
    /// the legacy default stream); then the slot's event is recorded. A step with nothing to
    /// send issues nothing. Zero-copy: only the event, recorded after the consumer's work
    /// already queued on `stream`.
    ///
    /// # Errors
    /// [`Error::StreamCapturing`] on a capturing stream, [`Error::Driver`]; the slot is
    /// released either way.
    pub fn commit(mut self, stream: StreamHandle<'_>) -> Result<CommitOutcome> {
        let raw = self.raw.take().expect("present until commit");
        self.stager.commit_raw(raw, stream)
    }
}

impl Drop for Step<'_> {
    fn drop(&mut self) {
        if let Some(raw) = self.raw.take() {
            self.stager.abort_raw(raw);
        }
    }
}

impl StepStager {
    /// Claims a slot for a new step, waiting (blocking) for its last copy if it still runs.
    ///
    /// # Errors
    /// [`Error::Driver`] when the driver fails while learning that the slot's copy completed.
    pub fn step(&self) -> Result<Step<'_>> {
        let raw = self.open(None, &mut |e: &Event| e.synchronize())?;
        Ok(Step {
            stager: self,
            raw: Some(raw),
            _not_send: PhantomData,
        })
    }
}

/// The id of field `key` of `layout`, whose dtype must be `T`'s.
fn typed_field<T: Element>(layout: &StepLayout, key: impl FieldKey) -> Result<FieldId> {
    let id = key.id_in(layout)?;
    let dtype = layout.fields()[id.0].dtype();
    if dtype != T::DTYPE {
        return Err(Error::DtypeMismatch {
            expected: dtype,
            got: T::DTYPE,
        });
    }
    Ok(id)
}
