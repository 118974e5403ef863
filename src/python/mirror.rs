//! `H2DMirror` for Python: what a stager copy recorded (Rust mirror), and what `record`
//! recorded under any hashable key.

use parking_lot::Mutex;
use pyo3::prelude::*;
use pyo3::types::PyBytes;

use super::errors::type_err;
use super::errors::type_name;
use crate::H2DMirror as CoreMirror;

/// What a mirror remembers for `matches` / `record`: a key compared with Python's `==` and the
/// values' dtype and bytes.
#[derive(Default)]
struct Recorded {
    key: Option<Py<PyAny>>,
    values: Vec<u8>,
}

/// H2DMirror()
///
/// What a destination holds, compared exactly (never by hash). As ``mirror=`` of
/// ``PinnedStager.copy_`` it records each copy and skips one whose values ``dst`` already holds;
/// one mirror per destination (another destination raises until ``invalidate()``). Its own
/// ``matches``/``record`` keep a ``(key, values)`` pair for callers' bookkeeping.
///
/// Example:
///     >>> m = pinstage.H2DMirror()
///     >>> m.record((4096, -1), numpy.arange(3))
///     >>> m.matches((4096, -1), numpy.arange(3))
///     True
#[pyclass(frozen, module = "pinstage._native", name = "H2DMirror")]
pub struct PyMirror {
    /// What stager copies recorded (`copy_(..., mirror=m)`).
    pub(crate) inner: Mutex<CoreMirror>,
    /// What `record` recorded.
    recorded: Mutex<Recorded>,
    /// The destination object stager copies bound the mirror to, kept alive while bound: its
    /// memory cannot be freed and its address given to another destination, which the mirror
    /// (bound by address) would take for it.
    pub(crate) bound_dst: Mutex<Option<Py<PyAny>>>,
}

/// Locks `m`, waiting with the GIL released when another thread holds it (that thread may
/// hold it while waiting for the GIL).
pub(crate) fn lock_detached<'m, T: Send>(
    py: Python<'_>,
    m: &'m Mutex<T>,
) -> parking_lot::MutexGuard<'m, T> {
    m.try_lock().unwrap_or_else(|| py.detach(|| m.lock()))
}

fn raw_bytes(values: &Bound<'_, PyAny>) -> PyResult<Vec<u8>> {
    if let Ok(b) = values.cast::<PyBytes>() {
        return Ok(b.as_bytes().to_vec());
    }
    let np = values.py().import("numpy")?;
    let arr = np
        .call_method1("ascontiguousarray", (values,))
        .map_err(|e| {
            type_err(format!(
                "mirror values must be bytes or an array numpy takes; got {} ({e})",
                type_name(values)
            ))
        })?;
    let dtype = arr.getattr("dtype")?;
    // Python objects' bytes are their addresses: equal values would differ, and a reused
    // address would make different values match.
    if dtype.getattr("hasobject")?.is_truthy()? {
        return Err(type_err(format!(
            "mirror values must be bytes or numbers; got {} that numpy holds as Python objects",
            type_name(values)
        )));
    }
    // dtype identity matters: int32 [1] and int64 [1] are different contents.
    let mut out = dtype.str()?.to_string().into_bytes();
    out.push(0);
    out.extend_from_slice(arr.call_method0("tobytes")?.cast::<PyBytes>()?.as_bytes());
    Ok(out)
}

fn hashable(key: &Bound<'_, PyAny>) -> PyResult<()> {
    key.hash().map(drop).map_err(|e| {
        type_err(format!(
            "mirror key must be hashable (compared by ==, like a dict key); got {} ({e})",
            type_name(key)
        ))
    })
}

#[pymethods]
impl PyMirror {
    /// Makes an empty mirror: nothing matches.
    #[new]
    fn new() -> Self {
        Self {
            inner: Mutex::new(CoreMirror::new()),
            recorded: Mutex::new(Recorded::default()),
            bound_dst: Mutex::new(None),
        }
    }

    /// Whether ``(key, values)`` equals the last recorded pair.
    ///
    /// Parameters:
    ///     key: any hashable object, compared with ``==`` (``1`` matches ``1.0``).
    ///     values: bytes, or anything numpy takes; compared by dtype and bytes.
    ///
    /// Raises:
    ///     PinstageTypeError: an unhashable key.
    fn matches(&self, key: &Bound<'_, PyAny>, values: &Bound<'_, PyAny>) -> PyResult<bool> {
        hashable(key)?;
        let bytes = raw_bytes(values)?;
        let stored = {
            let r = self.recorded.lock();
            match &r.key {
                Some(k) if r.values == bytes => Some(k.clone_ref(key.py())),
                _ => None,
            }
        };
        match stored {
            Some(k) => key.eq(k.bind(key.py())),
            None => Ok(false),
        }
    }

    /// Records ``(key, values)`` (see ``matches``).
    ///
    /// Raises:
    ///     PinstageTypeError: an unhashable key.
    fn record(&self, key: &Bound<'_, PyAny>, values: &Bound<'_, PyAny>) -> PyResult<()> {
        hashable(key)?;
        let bytes = raw_bytes(values)?;
        let old = {
            let mut r = self.recorded.lock();
            r.values = bytes;
            r.key.replace(key.clone().unbind())
        };
        drop(old);
        Ok(())
    }

    /// Forgets everything, including the destination a stager bound it to.
    fn invalidate(&self, py: Python<'_>) {
        lock_detached(py, &self.inner).invalidate();
        let old = std::mem::take(&mut *self.recorded.lock());
        let dst = self.bound_dst.lock().take();
        drop((old, dst));
    }

    fn __repr__(&self, py: Python<'_>) -> String {
        let valid = lock_detached(py, &self.inner).is_valid() || self.recorded.lock().key.is_some();
        format!("H2DMirror(valid={})", if valid { "True" } else { "False" })
    }
}
