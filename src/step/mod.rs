//! Step staging: all of an engine step's small inputs in one driver call.
//!
//! A [`StepLayout`] places named fields at aligned offsets of one arena; a [`StepStager`] keeps
//! a ring of pinned slots laid out the same way. A [`Step`] claims a slot, its fields are written
//! in place or with [`Step::put`], and [`Step::commit`] sends the used rows with one copy when
//! they are dense (else one batch), then records the slot's event. See [`StepMode`] for where
//! the bytes go: a persistent arena (stable addresses for CUDA graphs), a fresh block per step
//! (immutable consumers such as JAX), or nowhere (zero-copy: kernels read the slot in place).

mod commit;
mod fill;
mod layout;
pub(crate) mod mem;
mod open;
pub(crate) mod plan;
mod send;
mod stager;

pub use layout::{
    FIELD_ALIGN, Field, FieldId, FieldKey, MAX_FIELDS, StepLayout, StepLayoutBuilder,
};
pub use mem::StepBlock;
pub use open::Step;
#[cfg(feature = "python")]
pub(crate) use stager::RawStep;
pub use stager::{
    CommitOutcome, DEFAULT_STEP_DEPTH, StepMode, StepStager, StepStagerBuilder, StepStagerStats,
};
