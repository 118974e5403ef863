//! `StepLayout`: named fields at aligned offsets of one arena.

use super::super::dtype::parse_dtype;
use super::super::errors::type_err;
use super::super::errors::value_err;
use super::names::field_name;
use crate::Error;
use crate::step::StepLayout;
use pyo3::prelude::*;
use pyo3::types::PyDict;
use pyo3::types::PyList;
use pyo3::types::PyString;
use pyo3::types::PyTuple;

/// Named fields placed in one arena: each a dtype and a capacity shape ``(rows,)`` or
/// ``(rows, cols)``, at offsets aligned to 256 bytes, in declaration order. A ``StepStager``
/// keeps pinned slots laid out the same way, so a step's fields travel in ONE copy.
///
/// Parameters:
///     fields: a dict ``{name: (dtype, shape)}`` or a sequence of ``(name, dtype, shape)``;
///         ``shape`` is an int or a 1- or 2-tuple of ints >= 1. Declare densely written fields
///         first and large, sparsely used capacities last.
///     skip_unchanged (True, str or sequence of str, optional, keyword-only): fields whose
///         commit is skipped when their values and rows equal the last committed ones (the
///         arena still holds them); True: every field.
///
/// Raises:
///     PinstageValueError: no fields, a repeated or empty name, a bad shape, a layout past
///         2**63-1 bytes, a name given twice in ``skip_unchanged``. UnknownFieldError (a
///         ``KeyError``): an unknown name in ``skip_unchanged``. PinstageTypeError: an
///         unsupported dtype, a malformed entry, a ``skip_unchanged`` that is not True, a name
///         or a sequence of names.
///
/// Example:
///     >>> layout = pinstage.StepLayout({"ids": ("int32", 8192), "table": ("int32", (256, 128))})
///     >>> layout.nbytes
///     163840
#[pyclass(frozen, name = "StepLayout", module = "pinstage._native")]
pub struct PyStepLayout {
    pub(super) layout: StepLayout,
}

/// `skip_unchanged`: None or False (no field), True (every field), one name, or a sequence of
/// distinct names (`all`: the layout's names).
pub(super) fn skip_names(obj: Option<&Bound<'_, PyAny>>, all: &[String]) -> PyResult<Vec<String>> {
    let Some(obj) = obj.filter(|o| !o.is_none()) else {
        return Ok(Vec::new());
    };
    if let Ok(b) = obj.cast::<pyo3::types::PyBool>() {
        return Ok(if b.is_true() {
            all.to_vec()
        } else {
            Vec::new()
        });
    }
    let bad = || {
        type_err(format!(
            "skip_unchanged must be True, a field name or a sequence of field names; got {}",
            crate::python::errors::type_name(obj)
        ))
    };
    if let Ok(s) = obj.cast::<PyString>() {
        return Ok(vec![s.to_cow()?.into_owned()]);
    }
    if obj.is_instance_of::<PyDict>() || obj.is_instance_of::<pyo3::types::PySet>() {
        return Err(bad());
    }
    let names: Vec<String> = obj
        .try_iter()
        .map_err(|_| bad())?
        .map(|it| it?.extract::<String>().map_err(|_| bad()))
        .collect::<PyResult<_>>()?;
    for (i, n) in names.iter().enumerate() {
        if names[..i].contains(n) {
            return Err(value_err(format!(
                "skip_unchanged must name each field once; got {n:?} twice"
            )));
        }
    }
    Ok(names)
}

pub(super) fn parse_shape(obj: &Bound<'_, PyAny>, name: &str) -> PyResult<Vec<usize>> {
    let dims = crate::python::args::shape_dims(obj)?.ok_or_else(|| {
        type_err(format!(
            "field {name:?}: shape must be an int or a tuple of ints; got {}",
            crate::python::errors::type_name(obj)
        ))
    })?;
    dims.iter()
        .map(|&d| {
            usize::try_from(d).map_err(|_| {
                value_err(format!(
                    "field {name:?}: shape {dims:?} has a negative dimension"
                ))
            })
        })
        .collect()
}

#[pymethods]
impl PyStepLayout {
    #[new]
    #[pyo3(
        signature = (fields, *legacy, skip_unchanged=None),
        text_signature = "(fields, *, skip_unchanged=None)"
    )]
    fn new<'py>(
        fields: &Bound<'py, PyAny>,
        legacy: &Bound<'py, PyTuple>,
        mut skip_unchanged: Option<Bound<'py, PyAny>>,
    ) -> PyResult<Self> {
        crate::python::args::legacy_positional(
            legacy,
            &["skip_unchanged"],
            &mut [&mut skip_unchanged],
            "StepLayout(fields, names)",
            "StepLayout(fields, skip_unchanged=names)",
        )?;
        let mut entries: Vec<(String, Bound<'_, PyAny>, Bound<'_, PyAny>)> = Vec::new();
        if let Ok(d) = fields.cast::<PyDict>() {
            for (k, v) in d.iter() {
                let name: String = k
                    .extract()
                    .map_err(|_| type_err("field names must be str"))?;
                let (dtype, shape): (Bound<'_, PyAny>, Bound<'_, PyAny>) =
                    v.extract().map_err(|_| {
                        type_err(format!("field {name:?}: expected a (dtype, shape) tuple"))
                    })?;
                entries.push((name, dtype, shape));
            }
        } else {
            let items: Vec<Bound<'_, PyAny>> = fields
                .try_iter()
                .map_err(|_| {
                    type_err("fields must be a dict or a sequence of (name, dtype, shape)")
                })?
                .collect::<PyResult<_>>()?;
            for it in items {
                let (name, dtype, shape): (String, Bound<'_, PyAny>, Bound<'_, PyAny>) =
                    it.extract().map_err(|_| {
                        type_err("fields must be a dict or a sequence of (name, dtype, shape)")
                    })?;
                entries.push((name, dtype, shape));
            }
        }
        let all: Vec<String> = entries.iter().map(|e| e.0.clone()).collect();
        let skip = skip_names(skip_unchanged.as_ref(), &all)?;
        for s in &skip {
            if !entries.iter().any(|(n, _, _)| n == s) {
                return Err(Error::UnknownField {
                    name: s.clone(),
                    known: entries
                        .iter()
                        .map(|e| e.0.as_str())
                        .collect::<Vec<_>>()
                        .join(", "),
                }
                .into());
            }
        }
        let mut b = StepLayout::builder();
        for (name, dtype, shape) in entries {
            let d = parse_dtype(&dtype)?;
            let shape = parse_shape(&shape, &name)?;
            b = if skip.contains(&name) {
                b.field_skip_unchanged(name, d, &shape)
            } else {
                b.field(name, d, &shape)
            };
        }
        Ok(Self { layout: b.build()? })
    }

    /// Bytes of the arena and of each slot.
    #[getter]
    fn nbytes(&self) -> usize {
        self.layout.nbytes()
    }

    /// Layouts are equal when their fields are: the same names, dtypes, shapes and
    /// ``skip_unchanged`` flags in the same order (so the same offsets).
    fn __eq__(&self, other: &Bound<'_, PyAny>) -> bool {
        other
            .cast::<PyStepLayout>()
            .is_ok_and(|o| o.get().layout == self.layout)
    }

    fn __hash__(&self) -> u64 {
        use std::hash::{Hash, Hasher};
        let mut h = std::collections::hash_map::DefaultHasher::new();
        for f in self.layout.iter() {
            (f.name(), f.dtype().name(), f.shape(), f.skip_unchanged()).hash(&mut h);
        }
        h.finish()
    }

    /// Pickling (and ``copy.deepcopy``): rebuilt from its fields, e.g. in a worker process.
    fn __reduce__<'py>(slf: &Bound<'py, Self>) -> PyResult<Bound<'py, PyTuple>> {
        let py = slf.py();
        let me = slf.get();
        let fields = PyList::empty(py);
        let mut skip = Vec::new();
        for f in me.layout.iter() {
            fields.append((f.name(), f.dtype().name(), PyTuple::new(py, f.shape())?))?;
            if f.skip_unchanged() {
                skip.push(f.name().to_owned());
            }
        }
        // `functools.partial(StepLayout, skip_unchanged=names)(fields)`: rebuilt through the
        // keyword (a positional `skip_unchanged` is deprecated and would warn).
        let kwargs = PyDict::new(py);
        kwargs.set_item("skip_unchanged", PyList::new(py, skip)?)?;
        let ctor = py
            .import("functools")?
            .getattr("partial")?
            .call((slf.get_type(),), Some(&kwargs))?;
        PyTuple::new(
            py,
            [ctor, PyTuple::new(py, [fields.into_any()])?.into_any()],
        )
    }

    /// Field names in declaration order.
    #[getter]
    fn names(&self) -> Vec<String> {
        self.layout.iter().map(|f| f.name().to_owned()).collect()
    }

    /// One dict per field: ``name``, ``dtype``, ``shape``, ``offset``, ``nbytes``,
    /// ``skip_unchanged``.
    #[getter]
    fn fields<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        let out = PyList::empty(py);
        for f in self.layout.iter() {
            let d = PyDict::new(py);
            d.set_item("name", f.name())?;
            d.set_item("dtype", f.dtype().name())?;
            d.set_item("shape", PyTuple::new(py, f.shape())?)?;
            d.set_item("offset", f.offset())?;
            d.set_item("nbytes", f.nbytes())?;
            d.set_item("skip_unchanged", f.skip_unchanged())?;
            out.append(d)?;
        }
        Ok(out)
    }

    /// Splits a packed step (a 1-D uint8 array of ``nbytes``, e.g. a fresh block imported into
    /// JAX) into its fields, by slicing and bitcasting: traceable inside ``jax.jit``; works on
    /// torch, cupy and numpy arrays too (views, no copy).
    ///
    /// Parameters:
    ///     packed: a 1-D uint8 array of ``nbytes`` bytes.
    ///
    /// Returns:
    ///     dict: ``{name: array of the field's dtype and capacity shape}``.
    ///
    /// Raises:
    ///     PinstageValueError: ``packed`` of the wrong size. PinstageTypeError: a 64-bit field in
    ///         JAX without ``jax_enable_x64``.
    ///
    /// Example:
    ///     >>> fields = layout.unpack(jax.dlpack.from_dlpack(stager.stage({"ids": ids})))
    fn unpack<'py>(
        slf: &Bound<'py, Self>,
        packed: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyAny>> {
        crate::python::helpers::unpack(slf.as_any(), packed)
    }

    fn __len__(&self) -> usize {
        self.layout.len()
    }

    fn __contains__(&self, name: &Bound<'_, PyAny>) -> bool {
        field_name(name).is_ok_and(|n| self.layout.id(&n).is_ok())
    }

    fn __repr__(&self) -> String {
        let fields: Vec<String> = self
            .layout
            .iter()
            .map(|f| format!("{}: {}{:?}", f.name(), f.dtype().name(), f.shape()))
            .collect();
        format!(
            "StepLayout({}; {} bytes)",
            fields.join(", "),
            self.layout.nbytes()
        )
    }
}
