//! Field names and dict arguments of the step calls.

use super::super::errors::type_err;
use super::super::errors::value_err;
use crate::Error;
use crate::step::FieldId;
use crate::step::RawStep;
use crate::step::StepLayout;
use crate::step::StepStager;
use numpy::npyffi;
use pyo3::prelude::*;
use pyo3::types::PyDict;
use pyo3::types::PyString;

/// A field-name argument: a str, else a typed error naming the parameter.
pub(super) fn field_name(obj: &Bound<'_, PyAny>) -> PyResult<String> {
    match obj.cast::<PyString>() {
        Ok(s) => Ok(name_text(s)?.into_owned()),
        Err(_) => Err(type_err(format!(
            "name must be a str (a field name); got {}",
            crate::python::errors::type_name(obj)
        ))),
    }
}

/// The text of a field name; a str that is not valid UTF-8 (a lone surrogate) names no field:
/// `UnknownFieldError` (a `KeyError`), as any other name the layout lacks.
pub(super) fn name_text<'a>(s: &'a Bound<'_, PyString>) -> PyResult<std::borrow::Cow<'a, str>> {
    s.to_cow().map_err(|_| {
        Error::UnknownField {
            name: s.repr().map(|r| r.to_string()).unwrap_or_default(),
            known: "none is named by a str that is not valid UTF-8".into(),
        }
        .into()
    })
}

/// An optional dict argument `param`, else a typed error naming it.
pub(super) fn dict_arg<'a, 'py>(
    obj: Option<&'a Bound<'py, PyAny>>,
    param: &str,
) -> PyResult<Option<&'a Bound<'py, PyDict>>> {
    match obj.filter(|o| !o.is_none()) {
        None => Ok(None),
        Some(o) => o.cast::<PyDict>().map(Some).map_err(|_| {
            type_err(format!(
                "{param} must be a dict {{field name: ...}}; got {}",
                crate::python::errors::type_name(o)
            ))
        }),
    }
}

/// Calls `f` on each (key, value) of `d` in order; a dict that changes size meanwhile (a
/// value's `__array__` mutating it, say) stops the loop with an error instead of pyo3's panic.
pub(super) fn for_each_item<'py>(
    d: &Bound<'py, PyDict>,
    mut f: impl FnMut(Bound<'py, PyAny>, Bound<'py, PyAny>) -> PyResult<()>,
) -> PyResult<()> {
    let py = d.py();
    let n = d.len();
    let mut pos: pyo3::ffi::Py_ssize_t = 0;
    let mut k = std::ptr::null_mut();
    let mut v = std::ptr::null_mut();
    // SAFETY: `PyDict_Next` on a live dict with the GIL held; it hands out borrowed references,
    // which `from_borrowed_ptr` turns into owned ones before anything can run.
    while unsafe { pyo3::ffi::PyDict_Next(d.as_ptr(), &mut pos, &mut k, &mut v) } != 0 {
        prefetch_next(py, d, pos);
        // SAFETY: as above: valid borrowed pointers of this iteration.
        let (key, value) = unsafe {
            (
                Bound::from_borrowed_ptr(py, k),
                Bound::from_borrowed_ptr(py, v),
            )
        };
        f(key, value)?;
        if d.len() != n {
            return Err(value_err(
                "the dict changed size while pinstage read it (a value's conversion changed it?)",
            ));
        }
    }
    Ok(())
}

/// Asks the CPU for the value of `d` after position `pos` when it is a numpy array: its shape
/// and its first bytes, to arrive while the current value is written. Values made well before the
/// call (out of the caches) otherwise cost a miss on each line of each field in turn
/// (benches/RESULTS.md, the k sweep).
#[inline]
fn prefetch_next(py: Python<'_>, d: &Bound<'_, PyDict>, mut pos: pyo3::ffi::Py_ssize_t) {
    // The laboratory's control: the same build without the prefetch.
    if cfg!(pinstage_lab_variant = "no_prefetch") {
        return;
    }
    let mut k = std::ptr::null_mut();
    let mut v = std::ptr::null_mut();
    // SAFETY: `PyDict_Next` on a live dict with the GIL held; the value it hands out is read at
    // once (its type, then its header if an ndarray), before any Python code can run.
    unsafe {
        if pyo3::ffi::PyDict_Next(d.as_ptr(), &mut pos, &mut k, &mut v) == 0
            || npyffi::PyArray_CheckExact(py, v) == 0
        {
            return;
        }
        let a = &(*(v as *mut npyffi::PyArrayObject)).fields;
        prefetch(a.dimensions as *const u8);
        for line in 0..PREFETCH_LINES {
            prefetch((a.data as *const u8).wrapping_add(64 * line));
        }
    }
}

/// Lines of a value's data [`prefetch_next`] asks for (1 KiB; 4 lines gained nothing measurable).
const PREFETCH_LINES: usize = 16;

/// A hint that the cache line at `p` will be read soon. It never faults and changes nothing the
/// program can observe, whatever `p` is.
#[inline(always)]
fn prefetch(p: *const u8) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: a prefetch instruction accesses no memory architecturally; any address is allowed.
    unsafe {
        std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(p.cast());
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = p;
}

/// A layout's fields by name, for the step calls: the names as interned Python strings in
/// layout order (a dict key that is one of these objects, as string literals are, resolves by
/// pointer, without decoding), `{name: index}` for any other str (through Python's dict, with
/// the hash the str caches), and each field's numpy dtype for the exact-array fast path.
pub(super) struct FieldNames {
    names: Vec<Py<PyString>>,
    index: Py<PyDict>,
    descrs: Vec<Option<Py<numpy::PyArrayDescr>>>,
}

impl FieldNames {
    pub(super) fn new(py: Python<'_>, layout: &StepLayout) -> PyResult<Self> {
        let names: Vec<Py<PyString>> = layout
            .iter()
            .map(|f| PyString::intern(py, f.name()).unbind())
            .collect();
        let index = PyDict::new(py);
        for (i, n) in names.iter().enumerate() {
            index.set_item(n.bind(py), i)?;
        }
        let descrs = layout
            .iter()
            // bfloat16 without ml_dtypes has no numpy dtype: that field takes the general path.
            .map(|f| {
                crate::python::dtype::descr(py, f.dtype())
                    .ok()
                    .map(Bound::unbind)
            })
            .collect();
        Ok(Self {
            names,
            index: index.unbind(),
            descrs,
        })
    }

    /// The field a str names: by pointer for the interned names of a small layout (string
    /// literals), else through the `{name: index}` dict.
    pub(super) fn id(&self, st: &StepStager, name: &Bound<'_, PyString>) -> PyResult<FieldId> {
        self.id_near(st, name, usize::MAX)
    }

    /// [`Self::id`], trying field `hint` first (the next field in layout order, where a
    /// dict of a step's values usually has it): the same interned object, or the same text.
    pub(super) fn id_near(
        &self,
        st: &StepStager,
        name: &Bound<'_, PyString>,
        hint: usize,
    ) -> PyResult<FieldId> {
        if let Some(n) = self.names.get(hint) {
            if n.as_ptr() == name.as_ptr() {
                return Ok(FieldId::from_index(hint));
            }
            // SAFETY: two live str objects, GIL held.
            let r = unsafe { pyo3::ffi::PyUnicode_Compare(n.as_ptr(), name.as_ptr()) };
            if r == 0 {
                return Ok(FieldId::from_index(hint));
            }
            // -1 is also "less than": an error only when one is set (a legacy string that
            // cannot be made ready, before Python 3.12).
            if r == -1
                && let Some(e) = PyErr::take(name.py())
            {
                return Err(e);
            }
        }
        if self.names.len() <= 8
            && let Some(i) = self.names.iter().position(|n| n.as_ptr() == name.as_ptr())
        {
            return Ok(FieldId::from_index(i));
        }
        match self.index.bind(name.py()).get_item(name)? {
            Some(i) => Ok(FieldId::from_index(i.extract()?)),
            // Not a field (the layout says which names exist).
            None => Ok(st.layout().id(&name_text(name)?)?),
        }
    }

    /// The common case of `stage`, without building a `Values`: a C-contiguous numpy array of
    /// exactly the field's dtype (the same descriptor object) and rank. Returns whether it
    /// applied; `false` sends the call down the general path (which checks everything).
    pub(super) fn put_exact(
        &self,
        st: &StepStager,
        raw: &mut RawStep,
        id: FieldId,
        v: &Bound<'_, PyAny>,
    ) -> PyResult<bool> {
        let py = v.py();
        // SAFETY: numpy's type check on a live object, GIL held.
        if unsafe { npyffi::PyArray_Check(py, v.as_ptr()) } == 0 {
            return Ok(false);
        }
        let f = &st.layout().fields()[id.index()];
        let Some(want) = &self.descrs[id.index()] else {
            return Ok(false);
        };
        let want = want.as_ptr() as *mut npyffi::PyArray_Descr;
        // SAFETY: `v` is a live numpy array (checked); we read its fields with the GIL held and
        // keep `v` alive while its data is read.
        let (data, nd, dims, descr, flags) = unsafe {
            let a = &(*(v.as_ptr() as *mut npyffi::PyArrayObject)).fields;
            (a.data, a.nd, a.dimensions, a.descr, a.flags)
        };
        if descr != want
            || flags & npyffi::NPY_ARRAY_C_CONTIGUOUS == 0
            || nd as usize != f.shape().len()
        {
            return Ok(false);
        }
        // SAFETY: `nd` dimensions of a live array.
        let dims = unsafe { std::slice::from_raw_parts(dims, nd as usize) };
        let rows = dims[0] as usize;
        let cols = if nd == 2 { dims[1] as usize } else { 1 };
        if cols != f.cols() {
            return Ok(false);
        }
        let bytes = rows * cols * f.dtype().itemsize();
        // SAFETY: a C-contiguous array of `rows * cols` elements of the field's dtype.
        let values = unsafe { std::slice::from_raw_parts(data as *const u8, bytes) };
        st.put_raw(raw, id, values, (rows, cols), None, None)?;
        Ok(true)
    }
}
