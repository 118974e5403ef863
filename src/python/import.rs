//! DLPack import and stream arguments.
//!
//! Order: the C exchange API (`type(obj).__dlpack_c_exchange_api__`, about 0.1 µs, which also
//! gives the producer's current work stream), else `__dlpack__(stream=..., max_version=(1, 3))`,
//! else `__dlpack__(stream=...)` (numpy < 2.1 rejects `max_version`), else `__dlpack__()`.

use std::ffi::c_void;

use dlpark::ffi::{DLDevice, DLDeviceType, DLManagedTensorVersioned, DLPackExchangeAPI};
use dlpark::python::ImportedDlpack;
use dlpark::{DlpackFlags, Managed};
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyCapsule, PyDict, PyString, PyTuple};

use super::errors::{type_err, value_err};
use crate::device::StreamHandle;
use crate::dlpack::{DL_CUDA, DL_CUDA_MANAGED, DeviceView, MemoryKind};

/// What keeps an imported tensor's memory alive.
pub(crate) enum Owner {
    /// A DLPack managed tensor; dropping it calls the producer's deleter.
    Dlpack(#[allow(dead_code)] ImportedDlpack),
    /// The producer object itself (borrowed-view imports through the exchange API).
    Object(#[allow(dead_code)] Py<PyAny>),
}

/// An imported tensor: the validated view and the owner that keeps its memory alive.
/// The owner must be dropped with the GIL held (some producers' deleters need it).
pub(crate) struct Imported {
    pub view: DeviceView,
    /// Keeps the producer's memory alive.
    pub _owner: Owner,
    /// The stream the data is ready on: the producer's current work stream (exchange API) or the
    /// stream negotiated through `__dlpack__`.
    pub stream: StreamHandle,
    /// The producer's exchange table, when it offers one (to re-query its current stream).
    pub exchange: Option<Exchange>,
}

/// A producer's DLPack C exchange table (process-lifetime, per the DLPack spec).
#[derive(Clone, Copy)]
pub(crate) struct Exchange(&'static DLPackExchangeAPI);

// SAFETY: the table is immutable and lives for the whole process (DLPack spec); its functions
// are called with the GIL held.
unsafe impl Send for Exchange {}
// SAFETY: see Send.
unsafe impl Sync for Exchange {}

impl Exchange {
    fn of(obj: &Bound<'_, PyAny>) -> PyResult<Option<Self>> {
        let py = obj.py();
        let cap = match obj
            .get_type()
            .getattr(pyo3::intern!(py, "__dlpack_c_exchange_api__"))
        {
            Ok(c) => c,
            Err(e) if e.is_instance_of::<pyo3::exceptions::PyAttributeError>(py) => {
                return Ok(None);
            }
            Err(e) => return Err(e),
        };
        let Ok(cap) = cap.cast_into::<PyCapsule>() else {
            return Ok(None);
        };
        // SAFETY: PyCapsule_GetPointer checks the capsule name; null means wrong name.
        let ptr = unsafe {
            pyo3::ffi::PyCapsule_GetPointer(cap.as_ptr(), c"dlpack_exchange_api".as_ptr())
        };
        if ptr.is_null() {
            let _ = PyErr::take(py);
            return Ok(None);
        }
        // SAFETY: the producer promises a static DLPackExchangeAPI behind the capsule.
        let api: &'static DLPackExchangeAPI = unsafe { &*(ptr as *const DLPackExchangeAPI) };
        if api.header.version.major != dlpark::ffi::DLPACK_MAJOR_VERSION
            || api.managed_tensor_from_py_object_no_sync.is_none()
            || api.current_work_stream.is_none()
        {
            return Ok(None);
        }
        Ok(Some(Self(api)))
    }

    /// The producer's current work stream on `device` (torch: `torch.cuda.current_stream()`).
    pub(crate) fn current_stream(
        &self,
        py: Python<'_>,
        device_type: u32,
        id: i32,
    ) -> PyResult<StreamHandle> {
        let f = self.0.current_work_stream.expect("checked in `of`");
        let mut out: *mut c_void = std::ptr::null_mut();
        // SAFETY: a valid table function; the out-pointer is valid; GIL held.
        let rc = unsafe { f(DLDeviceType(device_type), id, &mut out) };
        if rc != 0 {
            return Err(PyErr::take(py)
                .unwrap_or_else(|| value_err("the producer's DLPack current_work_stream failed")));
        }
        Ok(StreamHandle(out as usize))
    }

    /// A borrowed view through `dltensor_from_py_object_no_sync` (no allocation, no deleter),
    /// when the producer offers it. Valid while `obj` lives and is not resized.
    fn view(&self, obj: &Bound<'_, PyAny>) -> PyResult<Option<DeviceView>> {
        let Some(f) = self.0.dltensor_from_py_object_no_sync else {
            return Ok(None);
        };
        let mut t = dlpark::ffi::DLTensor::default();
        // SAFETY: a valid table function of obj's type; GIL held; `t` is a valid out-pointer.
        let rc = unsafe { f(obj.as_ptr().cast(), &mut t) };
        if rc != 0 {
            return Err(PyErr::take(obj.py())
                .unwrap_or_else(|| value_err("the producer's DLPack exchange view failed")));
        }
        // SAFETY: the producer keeps shape/strides and data valid while `obj` lives; the view
        // copies the shape and is used only while the caller holds `obj`.
        unsafe { DeviceView::from_dltensor(&t, false) }
            .map(Some)
            .map_err(|e| super::errors::to_py(e.into()))
    }

    fn import(&self, obj: &Bound<'_, PyAny>) -> PyResult<Managed<DLManagedTensorVersioned>> {
        let f = self
            .0
            .managed_tensor_from_py_object_no_sync
            .expect("checked in `of`");
        let mut out: *mut DLManagedTensorVersioned = std::ptr::null_mut();
        // SAFETY: a valid table function of obj's type; GIL held; valid out-pointer.
        let rc = unsafe { f(obj.as_ptr().cast(), &mut out) };
        if rc != 0 {
            return Err(PyErr::take(obj.py())
                .unwrap_or_else(|| value_err("the producer's DLPack exchange export failed")));
        }
        // SAFETY: on success the producer hands us ownership of an initialised managed tensor.
        unsafe { Managed::from_raw(out) }.map_err(|e| value_err(format!("DLPack export: {e}")))
    }
}

/// Parses a `stream=` argument: None, an int handle, an object with `__cuda_stream__()`, a torch
/// stream (`.cuda_stream`) or a cupy stream (`.ptr`).
pub(crate) fn parse_stream(obj: Option<&Bound<'_, PyAny>>) -> PyResult<Option<StreamHandle>> {
    let Some(obj) = obj else { return Ok(None) };
    if obj.is_none() {
        return Ok(None);
    }
    parse_stream_object(obj).and_then(|s| match s {
        Some(h) => h.check().map(Some).map_err(super::errors::to_py),
        None => Ok(None),
    })
}

fn parse_stream_object(obj: &Bound<'_, PyAny>) -> PyResult<Option<StreamHandle>> {
    let py = obj.py();
    if let Ok(h) = obj.extract::<usize>() {
        return Ok(Some(StreamHandle(h)));
    }
    if obj.hasattr(pyo3::intern!(py, "__cuda_stream__"))? {
        // A closed stream object (cuda.core's Stream.close()) refuses to give its handle or
        // gives None: a typed error, never a handle the driver would dereference.
        let r = obj
            .call_method0(pyo3::intern!(py, "__cuda_stream__"))
            .map_err(|e| {
                value_err(format!(
                    "the stream object's __cuda_stream__() failed (is the stream closed?): {e}"
                ))
            })?;
        if let Ok((_, h)) = r.extract::<(i64, usize)>() {
            return Ok(Some(StreamHandle(h)));
        }
        if let Ok((_, h)) = r.extract::<(i64, Bound<'_, PyAny>)>()
            && h.is_none()
        {
            return Err(value_err(
                "the stream object has no handle (__cuda_stream__() gave None): it is closed",
            ));
        }
        return Err(type_err(format!(
            "__cuda_stream__() returned {}, expected a (version, handle) tuple",
            r.repr()?
        )));
    }
    for attr in ["cuda_stream", "ptr"] {
        if let Ok(v) = obj.getattr(attr) {
            if let Ok(h) = v.extract::<usize>() {
                return Ok(Some(StreamHandle(h)));
            }
            if v.is_none() {
                return Err(value_err(format!(
                    "the stream object's .{attr} is None: the stream is closed"
                )));
            }
        }
    }
    Err(type_err(format!(
        "stream must be None, an int handle, an object with __cuda_stream__(), a torch stream or a \
         cupy stream; got {}",
        obj.get_type().name()?
    )))
}

/// The value `__dlpack__(stream=...)` expects for a CUDA stream handle.
fn dlpack_stream_arg(py: Python<'_>, s: StreamHandle) -> PyResult<Bound<'_, PyAny>> {
    // DLPack: 1 is the legacy default stream, 2 the per-thread default; 0 is disallowed.
    let v = if s.0 == 0 { 1 } else { s.0 };
    Ok(v.into_pyobject(py)?.into_any())
}

fn view_of(imported: &ImportedDlpack) -> PyResult<DeviceView> {
    let read_only = imported.flags().contains(DlpackFlags::READ_ONLY);
    let r = match imported {
        // SAFETY: dlpark's Managed keeps shape/strides readable while it lives; the view is only
        // used while `Imported` holds the owner.
        ImportedDlpack::Versioned(m) => unsafe { DeviceView::from_dltensor(m.tensor(), read_only) },
        // SAFETY: as above.
        ImportedDlpack::Legacy(m) => unsafe { DeviceView::from_dltensor(m.tensor(), read_only) },
    };
    r.map_err(|e| super::errors::to_py(e.into()))
}

fn is_cuda(device_type: u32) -> bool {
    device_type == DL_CUDA || device_type == DL_CUDA_MANAGED
}

/// Imports any DLPack producer. `stream`: the consumer stream the caller will use, or `None` for
/// "the producer's current work stream if it has an exchange table, else the legacy default".
pub(crate) fn import(obj: &Bound<'_, PyAny>, stream: Option<StreamHandle>) -> PyResult<Imported> {
    let py = obj.py();
    let exchange = Exchange::of(obj)?;
    if let Some(ex) = exchange
        && stream.is_none()
    {
        let (view, owner) = match ex.view(obj)? {
            Some(view) => (view, Owner::Object(obj.clone().unbind())),
            None => {
                let owner = ImportedDlpack::Versioned(ex.import(obj)?);
                (view_of(&owner)?, Owner::Dlpack(owner))
            }
        };
        let stream = match view.memory() {
            MemoryKind::Cuda(id) => ex.current_stream(py, view.device_type(), id)?,
            MemoryKind::Host => StreamHandle::LEGACY,
        };
        return Ok(Imported {
            view,
            _owner: owner,
            stream,
            exchange,
        });
    }
    let consumer = stream.unwrap_or(StreamHandle::LEGACY);
    let owner = import_standard(obj, consumer)?;
    let view = view_of(&owner)?;
    Ok(Imported {
        view,
        _owner: Owner::Dlpack(owner),
        stream: consumer,
        exchange,
    })
}

fn import_standard(obj: &Bound<'_, PyAny>, stream: StreamHandle) -> PyResult<ImportedDlpack> {
    let py = obj.py();
    if obj.is_instance_of::<PyCapsule>() {
        return dlpark::python::from_dlpack(obj.as_borrowed(), None, None);
    }
    let Ok(method) = obj.getattr(pyo3::intern!(py, "__dlpack__")) else {
        return Err(type_err(format!(
            "expected a DLPack producer (an object with __dlpack__, e.g. a torch/jax/cupy/numpy \
             array), got {}",
            obj.get_type().name()?
        )));
    };
    let device: Option<(u32, i32)> = match obj.getattr(pyo3::intern!(py, "__dlpack_device__")) {
        Ok(f) => Some(f.call0()?.extract().map_err(|_| {
            type_err("__dlpack_device__() must return a (device_type, device_id) tuple")
        })?),
        Err(_) => None,
    };
    let stream_arg = match device {
        Some((t, _)) if is_cuda(t) => Some(dlpack_stream_arg(py, stream)?),
        _ => None,
    };
    let kwargs = PyDict::new(py);
    if let Some(s) = &stream_arg {
        kwargs.set_item(pyo3::intern!(py, "stream"), s)?;
    }
    kwargs.set_item(
        pyo3::intern!(py, "max_version"),
        PyTuple::new(
            py,
            [
                dlpark::ffi::DLPACK_MAJOR_VERSION,
                dlpark::ffi::DLPACK_MINOR_VERSION,
            ],
        )?,
    )?;
    let capsule = match method.call((), Some(&kwargs)) {
        Ok(c) => c,
        Err(e) if e.is_instance_of::<PyTypeError>(py) => {
            // numpy < 2.1 and older producers reject max_version; very old ones any keyword.
            kwargs.del_item(pyo3::intern!(py, "max_version"))?;
            match method.call((), Some(&kwargs)) {
                Ok(c) => c,
                Err(e2) if e2.is_instance_of::<PyTypeError>(py) && stream_arg.is_some() => {
                    method.call0()?
                }
                Err(e2) => return Err(e2),
            }
        }
        Err(e) => return Err(e),
    };
    if !capsule.is_instance_of::<PyCapsule>() {
        return Err(type_err(format!(
            "__dlpack__() returned {}, expected a DLPack capsule",
            capsule.get_type().name()?
        )));
    }
    let imported = dlpark::python::from_dlpack(capsule.as_borrowed(), None, None)
        .map_err(|e| value_err(format!("invalid DLPack capsule: {e}")))?;
    if let Some((t, id)) = device {
        let d = dlpark_device(&imported);
        if d.device_type.0 != t || d.device_id != id {
            return Err(PyValueError::new_err(format!(
                "__dlpack_device__() said ({t}, {id}) but the capsule is on ({}, {})",
                d.device_type.0, d.device_id
            )));
        }
    }
    Ok(imported)
}

fn dlpark_device(imported: &ImportedDlpack) -> DLDevice {
    match imported {
        // SAFETY: reading the descriptor of an owned, live managed tensor.
        ImportedDlpack::Versioned(m) => unsafe { m.tensor() }.device,
        // SAFETY: as above.
        ImportedDlpack::Legacy(m) => unsafe { m.tensor() }.device,
    }
}

/// The name of an object's type, for messages.
pub(crate) fn type_name(obj: &Bound<'_, PyAny>) -> String {
    obj.get_type()
        .name()
        .map(|n| n.to_string())
        .unwrap_or_else(|_| "?".into())
}

/// Resolves a dtype argument: numpy dtypes/types/strings, torch dtypes, jax and cupy dtypes.
pub(crate) fn parse_dtype(obj: &Bound<'_, PyAny>) -> PyResult<crate::DType> {
    let py = obj.py();
    let name: String = if let Ok(s) = obj.cast::<PyString>() {
        s.to_string()
    } else {
        let module = obj
            .get_type()
            .module()
            .map(|m| m.to_string())
            .unwrap_or_default();
        if module.starts_with("torch") {
            obj.str()?.to_string()
        } else {
            let np = py.import("numpy")?;
            match np.call_method1("dtype", (obj,)) {
                Ok(d) => d.getattr("name")?.extract()?,
                Err(_) => obj.str()?.to_string(),
            }
        }
    };
    crate::DType::from_name(&name).ok_or_else(|| {
        type_err(format!(
            "unsupported dtype {name:?}: expected bool, int8-64, uint8-64, float16/32/64, \
             bfloat16, complex64/128"
        ))
    })
}

/// Host ns per call of `f`: one warm-up call, then the mean of `n` calls. For the benches.
pub(crate) fn ns_per_call(n: usize, f: &mut dyn FnMut() -> PyResult<()>) -> PyResult<f64> {
    let n = n.max(1);
    f()?;
    let t0 = std::time::Instant::now();
    for _ in 0..n {
        f()?;
    }
    Ok(t0.elapsed().as_nanos() as f64 / n as f64)
}

/// Host ns per call of each step of importing `obj` (exchange table lookup, borrowed view,
/// managed export, current stream, the whole import), `n` times each. For the benches.
pub(crate) fn profile_import(
    obj: &Bound<'_, PyAny>,
    n: usize,
) -> PyResult<Vec<(&'static str, f64)>> {
    let py = obj.py();
    let mut out = Vec::new();
    let mut time = |name: &'static str, f: &mut dyn FnMut() -> PyResult<()>| -> PyResult<()> {
        out.push((name, ns_per_call(n, f)?));
        Ok(())
    };
    time("exchange table lookup", &mut || {
        Exchange::of(obj).map(|_| ())
    })?;
    if let Some(ex) = Exchange::of(obj)? {
        time("exchange borrowed view", &mut || ex.view(obj).map(|_| ()))?;
        time("exchange managed export", &mut || ex.import(obj).map(drop))?;
        if let Ok(Some(v)) = ex.view(obj)
            && let MemoryKind::Cuda(id) = v.memory()
        {
            time("exchange current stream", &mut || {
                ex.current_stream(py, v.device_type(), id).map(|_| ())
            })?;
        }
    }
    time("whole import", &mut || import(obj, None).map(drop))?;
    Ok(out)
}
