//! A step layout: named fields, each a dtype and a capacity shape, placed at aligned offsets of
//! one arena. The same layout is used by the device arena and by every pinned slot, so a step's
//! fields travel in one copy.

use std::collections::HashMap;
use std::sync::Arc;

use crate::dlpack::DType;
use crate::error::{Error, Result};

/// Every field starts at a multiple of this many bytes, in the arena and in each slot: enough
/// for any kernel's vector loads, and the copy engine's preferred alignment.
pub const FIELD_ALIGN: usize = 256;
/// The most fields a layout may hold.
pub const MAX_FIELDS: usize = 1024;

/// One field of a [`StepLayout`]: where it lives and what it holds.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Field {
    name: String,
    dtype: DType,
    /// Capacity shape: `[rows]` or `[rows, cols]`.
    shape: Vec<usize>,
    offset: usize,
    skip_unchanged: bool,
}

impl Field {
    /// The field's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Element type.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// Capacity shape: `[rows]` (1-D) or `[rows, cols]` (2-D).
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    /// Capacity in rows (the first dimension).
    pub fn rows(&self) -> usize {
        self.shape[0]
    }

    /// Elements per row: 1 for a 1-D field.
    pub fn cols(&self) -> usize {
        self.shape.get(1).copied().unwrap_or(1)
    }

    /// Bytes per row.
    pub fn row_bytes(&self) -> usize {
        self.cols() * self.dtype.itemsize()
    }

    /// Capacity in bytes.
    pub fn nbytes(&self) -> usize {
        self.rows() * self.row_bytes()
    }

    /// Byte offset of the field in the arena and in each slot (a multiple of [`FIELD_ALIGN`]).
    pub fn offset(&self) -> usize {
        self.offset
    }

    /// Whether a commit skips this field when its values equal the last committed ones.
    pub fn skip_unchanged(&self) -> bool {
        self.skip_unchanged
    }
}

/// A field's index in its layout: [`StepLayout::id`] resolves a name once, so a hot loop does
/// no string lookups.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct FieldId(pub(crate) usize);

impl FieldId {
    /// The id of the field at position `index` (declaration order); checked when used.
    pub fn from_index(index: usize) -> Self {
        Self(index)
    }

    /// The field's position in the layout (declaration order).
    pub fn index(self) -> usize {
        self.0
    }
}

/// Names a field: its name or its [`FieldId`].
pub trait FieldKey {
    /// The field's id in `layout`.
    ///
    /// # Errors
    /// [`Error::UnknownField`] for a name (or id) the layout does not have.
    fn id_in(&self, layout: &StepLayout) -> Result<FieldId>;
}

impl FieldKey for FieldId {
    fn id_in(&self, layout: &StepLayout) -> Result<FieldId> {
        if self.0 < layout.fields().len() {
            Ok(*self)
        } else {
            Err(layout.unknown(&format!("#{}", self.0)))
        }
    }
}

impl FieldKey for &str {
    fn id_in(&self, layout: &StepLayout) -> Result<FieldId> {
        layout.id(self)
    }
}

impl FieldKey for String {
    fn id_in(&self, layout: &StepLayout) -> Result<FieldId> {
        layout.id(self)
    }
}

/// Named fields placed in one arena, in declaration order, each at a multiple of
/// [`FIELD_ALIGN`]. Made by [`StepLayout::builder`]; shared (cheap to clone).
///
/// Declare the fields a step fills most densely first and large, sparsely used capacities last:
/// a commit copies the span from the first to the last written byte in one call when the gaps
/// between the fields' used rows are small (see [`crate::step::StepStagerBuilder::max_gap`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StepLayout {
    inner: Arc<Inner>,
}

#[derive(Debug, PartialEq, Eq)]
struct Inner {
    fields: Vec<Field>,
    by_name: HashMap<String, usize>,
    nbytes: usize,
}

impl std::ops::Deref for StepLayout {
    type Target = [Field];

    fn deref(&self) -> &[Field] {
        &self.inner.fields
    }
}

impl StepLayout {
    /// A builder with no fields yet.
    pub fn builder() -> StepLayoutBuilder {
        StepLayoutBuilder { fields: Vec::new() }
    }

    /// The fields, in declaration (and offset) order.
    pub fn fields(&self) -> &[Field] {
        &self.inner.fields
    }

    /// Bytes of the arena (and of each slot): the last field's end rounded up to
    /// [`FIELD_ALIGN`].
    pub fn nbytes(&self) -> usize {
        self.inner.nbytes
    }

    /// The id of the field called `name`.
    ///
    /// # Errors
    /// [`Error::UnknownField`] when there is none.
    pub fn id(&self, name: &str) -> Result<FieldId> {
        // A few fields: comparing names beats hashing one (SipHash).
        const SCAN: usize = 16;
        let found = if self.inner.fields.len() <= SCAN {
            self.inner.fields.iter().position(|f| f.name() == name)
        } else {
            self.inner.by_name.get(name).copied()
        };
        found.map(FieldId).ok_or_else(|| self.unknown(name))
    }

    /// The field `key` names.
    ///
    /// # Errors
    /// [`Error::UnknownField`] when there is none.
    pub fn field(&self, key: impl FieldKey) -> Result<&Field> {
        Ok(&self.inner.fields[key.id_in(self)?.0])
    }

    fn unknown(&self, name: &str) -> Error {
        Error::UnknownField {
            name: name.to_owned(),
            known: self
                .inner
                .fields
                .iter()
                .map(|f| f.name.as_str())
                .collect::<Vec<_>>()
                .join(", "),
        }
    }

    /// Whether any field skips unchanged values.
    pub(crate) fn any_skip(&self) -> bool {
        self.inner.fields.iter().any(|f| f.skip_unchanged)
    }
}

/// Builds a [`StepLayout`].
#[derive(Clone, Debug, Default)]
#[must_use]
pub struct StepLayoutBuilder {
    fields: Vec<(String, DType, Vec<usize>, bool)>,
}

impl StepLayoutBuilder {
    /// Adds a field of `dtype` with capacity `shape` (`[rows]` or `[rows, cols]`, each >= 1).
    pub fn field(mut self, name: impl Into<String>, dtype: DType, shape: &[usize]) -> Self {
        self.fields
            .push((name.into(), dtype, shape.to_vec(), false));
        self
    }

    /// Adds a field whose commit is skipped when its values (and used rows) equal the last
    /// committed ones: the device arena still holds them (mirror semantics, for fields such as
    /// a block table that change rarely).
    pub fn field_skip_unchanged(
        mut self,
        name: impl Into<String>,
        dtype: DType,
        shape: &[usize],
    ) -> Self {
        self.fields.push((name.into(), dtype, shape.to_vec(), true));
        self
    }

    /// Places the fields.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for no fields, more than [`MAX_FIELDS`], an empty or
    /// repeated name, a shape that is not 1-D or 2-D or has a 0 dimension;
    /// or a layout whose size passes `isize::MAX` bytes.
    pub fn build(self) -> Result<StepLayout> {
        if self.fields.is_empty() {
            return Err(Error::arg("fields", "none", "at least one field"));
        }
        if self.fields.len() > MAX_FIELDS {
            return Err(Error::arg(
                "fields",
                self.fields.len(),
                "at most 1024 fields",
            ));
        }
        let overflow = |name: &str, shape: &[usize]| {
            Error::arg(
                "shape",
                format!("{shape:?} (field {name:?}, the arena passing that size)"),
                "fields that fit one arena of at most 9223372036854775807 bytes",
            )
        };
        let mut fields = Vec::with_capacity(self.fields.len());
        let mut by_name = HashMap::with_capacity(self.fields.len());
        let mut end = 0usize;
        for (i, (name, dtype, shape, skip)) in self.fields.into_iter().enumerate() {
            if name.is_empty() {
                return Err(Error::arg("name", "\"\"", "a non-empty field name"));
            }
            if by_name.insert(name.clone(), i).is_some() {
                return Err(Error::arg("name", format!("{name:?}"), "a name used once"));
            }
            if !(1..=2).contains(&shape.len()) || shape.contains(&0) {
                return Err(Error::arg(
                    "shape",
                    format!("{shape:?} (field {name:?})"),
                    "(rows,) or (rows, cols), each at least 1",
                ));
            }
            let offset = end
                .checked_next_multiple_of(FIELD_ALIGN)
                .ok_or_else(|| overflow(&name, &shape))?;
            let bytes = shape
                .iter()
                .try_fold(dtype.itemsize(), |a, &d| a.checked_mul(d))
                .ok_or_else(|| overflow(&name, &shape))?;
            end = offset
                .checked_add(bytes)
                .filter(|&e| e <= isize::MAX as usize - FIELD_ALIGN)
                .ok_or_else(|| overflow(&name, &shape))?;
            fields.push(Field {
                name,
                dtype,
                shape,
                offset,
                skip_unchanged: skip,
            });
        }
        // `end` stays a field-alignment below isize::MAX (checked per field): no overflow here.
        let nbytes = end.next_multiple_of(FIELD_ALIGN);
        Ok(StepLayout {
            inner: Arc::new(Inner {
                fields,
                by_name,
                nbytes,
            }),
        })
    }
}
