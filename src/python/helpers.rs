//! The Python pieces of the native module (`helpers.py` beside this file), loaded from the
//! extension itself, never from the `pinstage` package: the stats dicts, `NvtxRange` as a
//! decorator, and `StepLayout.unpack`.

use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyDict, PyType};

static SOURCE: &str = include_str!("helpers.py");
static MODULE: PyOnceLock<Py<PyModule>> = PyOnceLock::new();

/// The module `pinstage._helpers` (made once per interpreter).
pub(crate) fn module(py: Python<'_>) -> PyResult<&Bound<'_, PyModule>> {
    MODULE
        .get_or_try_init(py, || -> PyResult<_> {
            let src = std::ffi::CString::new(SOURCE).expect("no NUL in helpers.py");
            let m = PyModule::from_code(py, &src, c"pinstage/_helpers.py", c"pinstage._helpers")?;
            use super::errors::{Kind, class};
            m.setattr("PinstageTypeError", class(py, Kind::Type)?)?;
            m.setattr("PinstageValueError", class(py, Kind::Value)?)?;
            Ok(m.unbind())
        })
        .map(|m| m.bind(py))
}

/// A new stats dict of `owner` (how users spell the call, `"pool_stats()"`), whose keys
/// renamed `{old: new}` still read (with a `DeprecationWarning`) for one minor version.
pub(crate) fn stats<'py>(
    py: Python<'py>,
    owner: &'static str,
    renamed: &[(&str, &str)],
) -> PyResult<Bound<'py, PyDict>> {
    static CLASSES: PyOnceLock<Py<PyDict>> = PyOnceLock::new();
    let classes = CLASSES
        .get_or_init(py, || PyDict::new(py).unbind())
        .bind(py);
    let class = match classes.get_item(owner)? {
        Some(c) => c,
        None => {
            let c = module(py)?
                .getattr("stats_class")?
                .call1((owner, PyDict::from_sequence(&renamed.into_pyobject(py)?)?))?;
            classes.set_item(owner, &c)?;
            c
        }
    };
    Ok(class
        .cast_into::<PyType>()?
        .call0()?
        .cast_into::<PyDict>()?)
}

/// `func` wrapped so that each call runs inside the context manager `cm`.
pub(crate) fn wrap<'py>(
    cm: &Bound<'py, PyAny>,
    func: &Bound<'py, PyAny>,
) -> PyResult<Bound<'py, PyAny>> {
    module(cm.py())?.getattr("wrap")?.call1((cm, func))
}

/// `StepLayout.unpack(packed)`.
pub(crate) fn unpack<'py>(
    layout: &Bound<'py, PyAny>,
    packed: &Bound<'py, PyAny>,
) -> PyResult<Bound<'py, PyAny>> {
    module(layout.py())?
        .getattr("unpack")?
        .call1((layout, packed))
}

/// The counters of a host pool (`pool_stats()` and `PinnedPool.stats()`): one shape, the same
/// keys. `max_*` None: no limit.
pub(crate) fn host_pool_stats<'py>(
    py: Python<'py>,
    owner: &'static str,
    s: &crate::host::PinnedPoolStats,
    fallbacks: u64,
    max_outstanding: Option<usize>,
) -> PyResult<Bound<'py, PyDict>> {
    let d = stats(
        py,
        owner,
        &[
            ("cached_bytes", "pooled_bytes"),
            ("budget_bytes", "max_outstanding_bytes"),
        ],
    )?;
    d.set_item("hits", s.hits)?;
    d.set_item("misses", s.misses)?;
    d.set_item("pageable_fallbacks", s.pageable_fallbacks + fallbacks)?;
    d.set_item("evictions", s.evictions)?;
    d.set_item("in_use_bytes", s.in_use_bytes)?;
    d.set_item("pooled_bytes", s.pooled_bytes)?;
    d.set_item("outstanding_bytes", s.in_use_bytes + s.pooled_bytes)?;
    d.set_item("peak_bytes", s.peak_bytes)?;
    d.set_item("max_outstanding_bytes", max_outstanding)?;
    d.set_item(
        "max_pooled_bytes",
        (s.max_pooled_bytes != usize::MAX).then_some(s.max_pooled_bytes),
    )?;
    Ok(d)
}
