//! Step staging for Python: `StepLayout` (layout.rs), `StepStager` (stager.rs), `Step`, a
//! context manager (context.rs), the state of open steps (state.rs) and field names (names.rs).
//! Exports of step memory are `DeviceArray`s (`python::export`).

mod context;
mod layout;
mod names;
mod stager;
mod state;

use pyo3::prelude::*;

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<layout::PyStepLayout>()?;
    m.add_class::<stager::PyStepStager>()?;
    m.add_class::<context::PyStep>()
}
