//! Writing an open step's fields: values and pads, in-place views, zero-copy device addresses.

use super::layout::{FieldId, FieldKey};
use super::stager::RawStep;
use super::stager::{StepMode, StepStager};
use crate::cuda::StreamHandle;
use crate::error::{Error, Result};
use crate::ring::protocol::Release;
use crate::ring::write::write_padded;

impl StepStager {
    fn check_open(&self, s: &RawStep) -> Result<()> {
        if s.frozen {
            return Err(Error::StepState(
                "the step's fields were handed to the device (zero-copy): they can no longer be \
                 written",
            ));
        }
        Ok(())
    }

    /// Writes `values` (`shape.0` rows of `shape.1` elements, raw bytes of the field's dtype)
    /// into the leading rows of field `id`; with `pad`, the rest of each of those rows and the
    /// rows up to `rows` (default: the values' rows) take `pad`. The field's used rows become
    /// `rows`. Checked before anything is written.
    pub(crate) fn put_raw(
        &self,
        s: &mut RawStep,
        id: FieldId,
        values: &[u8],
        shape: (usize, usize),
        pad: Option<&[u8]>,
        rows: Option<usize>,
    ) -> Result<()> {
        self.check_open(s)?;
        let f = &self.layout.fields()[id.0];
        let item = f.dtype().itemsize();
        let (r, c) = shape;
        let dims = || {
            if f.shape().len() == 1 {
                vec![r]
            } else {
                vec![r, c]
            }
        };
        if r.checked_mul(c).and_then(|n| n.checked_mul(item)) != Some(values.len()) {
            return Err(Error::RaggedBytes {
                bytes: values.len(),
                itemsize: item,
            });
        }
        if c > f.cols() || r > f.rows() {
            return Err(Error::ShapeMismatch {
                values: dims(),
                dst: f.shape().iter().map(|&d| d as i64).collect(),
            });
        }
        if let Some(p) = pad
            && p.len() != item
        {
            return Err(Error::PadSize {
                got: p.len(),
                expected: item,
                dtype: f.dtype(),
            });
        }
        let rows = rows.unwrap_or(r);
        if rows < r || rows > f.rows() {
            return Err(Error::arg(
                "rows",
                rows,
                "at least the values' rows and at most the field's capacity",
            ));
        }
        if pad.is_none() && (c < f.cols() || rows > r) {
            return Err(Error::arg(
                "pad_value",
                "None",
                "given when the values do not fill the rows written (or the field's columns)",
            ));
        }
        // Seeded bug (scripts/seeded.tsv): the pad is never written.
        #[cfg(pinstage_seeded_bug = "pad_skipped")]
        let pad: Option<&[u8]> = None;
        let base = self.field_base(s, id);
        let row_bytes = f.row_bytes();
        // SAFETY: we own the slot; rows <= capacity so every write stays in the field; values
        // may alias the slot (a view of it), so the copies are memmoves.
        unsafe {
            if c == f.cols() {
                write_padded(base, values, pad, rows * row_bytes, true);
            } else {
                let vrow = c * item;
                for i in 0..r {
                    write_padded(
                        base.add(i * row_bytes),
                        &values[i * vrow..(i + 1) * vrow],
                        pad,
                        row_bytes,
                        true,
                    );
                }
                write_padded(
                    base.add(r * row_bytes),
                    &[],
                    pad,
                    (rows - r) * row_bytes,
                    false,
                );
            }
            self.set_used(s, id, rows);
        }
        Ok(())
    }

    #[inline]
    fn field_base(&self, s: &RawStep, id: FieldId) -> *mut u8 {
        // SAFETY: the field lies within the slot.
        unsafe {
            self.slot_base(s.claim.index)
                .add(self.layout.fields()[id.0].offset())
        }
    }

    /// # Safety
    /// The caller owns the step's slot.
    #[inline]
    unsafe fn set_used(&self, s: &RawStep, id: FieldId, rows: usize) {
        // SAFETY: the caller owns the slot.
        unsafe { (&mut *self.core.data(s.claim.index)).used[id.0] = rows };
    }

    /// The first `rows` rows of field `id` in the step's slot, marked used: `(address, bytes)`.
    pub(crate) fn field_raw(
        &self,
        s: &mut RawStep,
        id: FieldId,
        rows: usize,
    ) -> Result<(*mut u8, usize)> {
        self.check_open(s)?;
        let f = &self.layout.fields()[id.0];
        if rows > f.rows() {
            return Err(Error::arg("rows", rows, "at most the field's capacity"));
        }
        // SAFETY: we own the slot.
        unsafe { self.set_used(s, id, rows) };
        Ok((self.field_base(s, id), rows * f.row_bytes()))
    }

    /// Rows of field `id` written in the step so far.
    pub(crate) fn used_raw(&self, s: &RawStep, id: FieldId) -> usize {
        // SAFETY: we own the slot; a read.
        unsafe { (&*self.core.data(s.claim.index)).used[id.0] }
    }

    /// Refuses (a typed error) unless the stager is in zero-copy mode: device views of a slot.
    fn zero_copy_only(&self) -> Result<()> {
        if self.mode == StepMode::ZeroCopy {
            return Ok(());
        }
        Err(Error::arg(
            "mode",
            format!("'{}'", self.mode),
            "'zero_copy' for device views of a slot (make the stager with mode='zero_copy'; in \
             arena mode export the arena's field with field(name))",
        ))
    }

    /// Zero-copy mode: the device address of field `id` in the step's slot; the step's fields
    /// can no longer be written from the host.
    pub(crate) fn device_ptr_raw(&self, s: &mut RawStep, id: FieldId) -> Result<u64> {
        self.zero_copy_only()?;
        if self.core.device().is_none() {
            return Err(self.core.unavailable());
        }
        s.frozen = true;
        let off = s.claim.index * self.layout.nbytes() + self.layout.fields()[id.0].offset();
        Ok(self.mem_dev + off as u64)
    }

    /// Zero-copy mode: the device address of field `key` in slot `slot` (whatever step owns it).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] in other modes or for a slot out of range,
    /// [`Error::CudaUnavailable`], [`Error::UnknownField`].
    pub fn slot_device_ptr(&self, slot: usize, key: impl FieldKey) -> Result<u64> {
        let f = self.layout.field(key)?;
        self.zero_copy_only()?;
        if slot >= self.depth() {
            return Err(Error::arg("slot", slot, "a slot below the depth"));
        }
        if self.core.device().is_none() {
            return Err(self.core.unavailable());
        }
        Ok(self.mem_dev + (slot * self.layout.nbytes() + f.offset()) as u64)
    }

    /// Releases a step's slot untouched (see [`Self::abort_raw_on`]; no stream known).
    pub(crate) fn abort_raw(&self, s: RawStep) {
        self.abort_raw_on(s, None);
    }

    /// Releases a step's slot untouched. A zero-copy step whose device addresses were handed
    /// out may have kernels reading the slot: with `stream`, the stream its readers were queued
    /// on (as its commit would have been told), the slot's event is recorded there after them,
    /// as a zero-copy commit does; without one, the context is synchronized first (all its
    /// streams). Never blocks on the caller's behalf otherwise.
    pub(crate) fn abort_raw_on(&self, s: RawStep, stream: Option<StreamHandle<'_>>) {
        self.stats.aborted.add(1);
        if s.frozen
            && let Some(device) = self.core.device()
        {
            let r = match stream {
                Some(stream) => self.release_after_readers(s, stream),
                None => {
                    // A failed synchronize: a failed context, where no work runs any longer.
                    let r = device.enter().and_then(|cur| cur.synchronize());
                    self.core.ring().release(s.claim.index, Release::Idle);
                    r
                }
            };
            // Drop never panics: the error is recorded.
            if let Err(Error::Driver(err)) = r {
                crate::error::record_drop_error(err);
            }
            return;
        }
        // The slot's last copy is known complete (open) and nothing new was issued.
        self.core.ring().release(s.claim.index, Release::Idle);
    }
}
