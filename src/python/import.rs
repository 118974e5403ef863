//! DLPack import and stream arguments, through dlpark.
//!
//! dlpark does the protocol work: the standard `__dlpack_device__` plus
//! `__dlpack__(stream=..., max_version=...)`, a legacy `__dlpack__()`, existing capsules, the
//! CUDA stream argument's encoding, and the C exchange API's managed export. What this module
//! keeps is what dlpark lacks: the exchange table's borrowed view and current work stream called
//! directly (see [`Exchange`]), the retry without `max_version` for producers that reject the
//! keyword (numpy < 2.1), turning the result into pinstage's validated view, and the `stream=`
//! argument parsing.

use dlpark::DlpackFlags;
use dlpark::ffi::{DLDevice, DLDeviceType, DLPackExchangeAPI, DLPackExchangeAPIHeader};
use dlpark::python::consumer::exchange::ExchangeApi;
use dlpark::python::consumer::stream as dlstream;
use dlpark::python::{DlpackStream, ImportRequest, ImportedDlpack, StreamArg};
use pyo3::exceptions::{PyBufferError, PyTypeError};
use pyo3::prelude::*;
use pyo3::types::{PyCapsule, PyDict, PyString};

use super::errors::{type_err, value_err};
use crate::cuda::StreamHandle;
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
    /// The view; `'static` stands for "while `_owner` lives", which every user respects by
    /// keeping the `Imported` alive while the view is used.
    pub view: DeviceView<'static>,
    /// Keeps the producer's memory alive.
    pub _owner: Owner,
    /// The stream the data is ready on: the producer's current work stream (exchange API) or the
    /// stream negotiated through `__dlpack__`.
    pub stream: StreamHandle<'static>,
    /// The producer's exchange table, when it offers one (to re-query its current stream).
    pub exchange: Option<Exchange>,
}

/// A producer's DLPack C exchange table (process-lifetime, per the DLPack spec).
///
/// The hot path (a borrowed view, then the producer's current stream; or the current stream
/// alone for a bound target) calls the table directly: dlpark 0.10 offers the current stream
/// only together with a new view (`with_tensor_view_no_sync`), which a bound target does not
/// need, and keeps `current_work_stream` crate-private. Finding the table walks the `prev_api`
/// chain to a compatible major version as dlpark does; the managed-export fallback goes through
/// dlpark's `ExchangeApi`.
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
            drop(PyErr::take(py));
            return Ok(None);
        }
        // Walk the chain of tables to one of our major version (bounded: a cycle cannot hang).
        let mut header = ptr as *const DLPackExchangeAPIHeader;
        for _ in 0..16 {
            if header.is_null() {
                return Ok(None);
            }
            // SAFETY: the producer promises a chain of static tables, each starting with a
            // header (DLPack spec).
            let h = unsafe { &*header };
            if h.version.major == dlpark::ffi::DLPACK_MAJOR_VERSION {
                // SAFETY: a table of our major version is a whole DLPackExchangeAPI.
                let api: &'static DLPackExchangeAPI =
                    unsafe { &*(header as *const DLPackExchangeAPI) };
                if api.current_work_stream.is_none() {
                    return Ok(None);
                }
                return Ok(Some(Self(api)));
            }
            header = h.prev_api;
        }
        Ok(None)
    }

    /// The producer's current work stream on `device` (torch: `torch.cuda.current_stream()`).
    pub(crate) fn current_stream(
        &self,
        py: Python<'_>,
        device_type: u32,
        id: i32,
    ) -> PyResult<StreamHandle<'static>> {
        let f = self.0.current_work_stream.expect("checked in `of`");
        let mut out: *mut std::ffi::c_void = std::ptr::null_mut();
        // SAFETY: a valid table function; the out-pointer is valid; GIL held.
        let rc = unsafe { f(DLDeviceType(device_type), id, &mut out) };
        if rc != 0 {
            return Err(PyErr::take(py)
                .unwrap_or_else(|| value_err("the producer's DLPack current_work_stream failed")));
        }
        stream_from_producer(out as usize)
    }

    /// A borrowed view (no allocation, no deleter) when the producer offers one, else a managed
    /// export through dlpark; the owner keeps the memory alive.
    fn import(&self, obj: &Bound<'_, PyAny>) -> PyResult<(DeviceView<'static>, Owner)> {
        if let Some(f) = self.0.dltensor_from_py_object_no_sync {
            let mut t = dlpark::ffi::DLTensor::default();
            // SAFETY: a valid table function of obj's type; GIL held; `t` is a valid
            // out-pointer.
            let rc = unsafe { f(obj.as_ptr().cast(), &mut t) };
            if rc != 0 {
                return Err(PyErr::take(obj.py())
                    .unwrap_or_else(|| value_err("the producer's DLPack exchange view failed")));
            }
            // SAFETY: the producer keeps shape/strides and data valid while `obj` lives and is
            // not resized; the owner below holds `obj` for as long as the view is used.
            let view = unsafe { DeviceView::from_dltensor(&t, false) }
                .map_err(|e| PyErr::from(crate::Error::from(e)))?;
            return Ok((view, Owner::Object(obj.clone().unbind())));
        }
        let api = ExchangeApi::from_object(obj.as_borrowed())?
            .ok_or_else(|| value_err("the producer's DLPack exchange table went away"))?;
        let (managed, _) = api.import_managed_no_sync(obj.as_borrowed())?.into_parts();
        let owner = ImportedDlpack::Versioned(managed);
        Ok((view_of(&owner)?, Owner::Dlpack(owner)))
    }
}

/// A producer's stream pointer as a handle.
fn stream_from_producer(raw: usize) -> PyResult<StreamHandle<'static>> {
    // SAFETY: the producer's own current work stream for the tensor's device, alive while the
    // producer uses it (the DLPack exchange contract).
    unsafe { StreamHandle::from_raw(raw) }.map_err(PyErr::from)
}

/// Our consumer stream, as dlpark passes it to `__dlpack__(stream=...)`.
struct Consumer(StreamHandle<'static>);

// SAFETY: a CUDA stream handle encoded by dlpark's CUDA rules for CUDA devices, and no stream
// for host devices; the handle is a special one or a live stream its maker vouched for.
unsafe impl DlpackStream for Consumer {
    fn as_python_arg(&self, _py: Python<'_>, device: DLDevice) -> PyResult<StreamArg> {
        Ok(if is_cuda(device.device_type.0) {
            dlstream::cuda(self.0.as_raw() as *mut std::ffi::c_void)
        } else {
            dlstream::none()
        })
    }
}

/// Parses a `stream=` argument: None, an int handle, an object with `__cuda_stream__()`, a torch
/// stream (`.cuda_stream`) or a cupy stream (`.ptr`).
pub(crate) fn parse_stream(
    obj: Option<&Bound<'_, PyAny>>,
) -> PyResult<Option<StreamHandle<'static>>> {
    let Some(obj) = obj.filter(|o| !o.is_none()) else {
        return Ok(None);
    };
    let hit = LAST_STREAM.with(|c| {
        c.borrow()
            .as_ref()
            .and_then(|(o, h)| (o.as_ptr() == obj.as_ptr()).then_some(*h))
    });
    let (raw, trusted) = match hit {
        Some(h) => (h, false),
        None => parse_stream_object(obj)?,
    };
    // SAFETY: the handle of a stream object the caller passed, or an integer the caller passed
    // as a stream; the Python API documents that the stream must stay alive while its copies
    // run. Impossible handles are refused here.
    let handle = unsafe { StreamHandle::from_raw(raw) }?;
    if trusted {
        let old = LAST_STREAM.with(|c| c.replace(Some((obj.clone().unbind(), raw))));
        // Dropped outside the borrow: a destructor may run Python code that passes a stream.
        drop(old);
    }
    Ok(Some(handle))
}

thread_local! {
    /// The last torch or cupy stream object this thread passed, and its handle: such an object
    /// holds one stream for its whole life, and the reference held here keeps its address from
    /// being reused, so passing the same object again costs a pointer compare instead of a
    /// Python call (`__cuda_stream__()` or an attribute).
    static LAST_STREAM: std::cell::RefCell<Option<(Py<PyAny>, usize)>> =
        const { std::cell::RefCell::new(None) };
}

/// Whether `obj` is a stream object of torch or cupy that owns its stream: its handle is fixed,
/// and the stream lives, as long as the object. An `ExternalStream` wraps a handle its caller
/// owns (and may destroy): it is checked like an int.
///
/// Each thread remembers the answer for the last type it asked about (holding the type, so
/// its address cannot be reused): `torch.cuda.current_stream()` returns a new object on every
/// call, of the same type.
fn is_framework_stream(obj: &Bound<'_, PyAny>) -> bool {
    thread_local! {
        static LAST_TYPE: std::cell::RefCell<Option<(Py<pyo3::types::PyType>, bool)>> =
            const { std::cell::RefCell::new(None) };
    }
    let ty = obj.get_type();
    let hit = LAST_TYPE.with(|c| {
        c.borrow()
            .as_ref()
            .and_then(|(t, v)| t.bind(obj.py()).is(&ty).then_some(*v))
    });
    if let Some(v) = hit {
        return v;
    }
    let module = ty.module().map(|m| m.to_string()).unwrap_or_default();
    let name = type_name(obj);
    let v = (module.starts_with("torch.") || module.starts_with("cupy."))
        && name.contains("Stream")
        && !name.contains("External");
    // The old entry is dropped after the borrow ends (its drop may run Python code).
    let old = LAST_TYPE.with(|c| c.replace(Some((ty.unbind(), v))));
    drop(old);
    v
}

/// The handle of a stream argument, and whether it is trusted without a check (and may be
/// remembered): a torch or cupy stream object's.
fn parse_stream_object(obj: &Bound<'_, PyAny>) -> PyResult<(usize, bool)> {
    let py = obj.py();
    if obj.is_instance_of::<pyo3::types::PyBool>() {
        return Err(type_err(
            "stream must be a stream object or an int handle, got a bool",
        ));
    }
    // An int, or a numpy integer (a handle kept in an array, say).
    let int = if obj.is_instance_of::<pyo3::types::PyInt>() {
        Some(obj.clone())
    } else if obj
        .get_type()
        .module()
        .is_ok_and(|m| m.to_cow().is_ok_and(|m| m == "numpy"))
        && obj.is_instance(&py.import("numpy")?.getattr("integer")?)?
    {
        super::args::as_index(obj)?
    } else {
        None
    };
    if let Some(int) = int {
        let h = int.extract::<usize>().map_err(|_| {
            value_err(format!(
                "stream={}: an int stream handle is 0 to 2**64 - 1 (0, 1, 2 or a stream's handle)",
                int.repr().map(|r| r.to_string()).unwrap_or_default()
            ))
        })?;
        return checked_int_stream(h).map(|h| (h, false));
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
            // A torch or cupy stream object holds a live stream while it lives; any other
            // object's handle is checked as an int would be (a stale or made-up handle would
            // fault in the driver).
            if is_framework_stream(obj) {
                return Ok((h, true));
            }
            return checked_int_stream(h).map(|h| (h, false));
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
                // A torch or cupy stream object holds a live stream while it lives; anything
                // else with such an attribute (a cupy Event or MemoryPointer: `.ptr`) is checked
                // as an int would be.
                if is_framework_stream(obj) {
                    return Ok((h, true));
                }
                return checked_int_stream(h).map(|h| (h, false));
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
        type_name(obj)
    )))
}

fn view_of(imported: &ImportedDlpack) -> PyResult<DeviceView<'static>> {
    let read_only = imported.flags().contains(DlpackFlags::READ_ONLY);
    let r = match imported {
        // SAFETY: dlpark's Managed keeps shape/strides readable and the memory valid while it
        // lives; the view is only used while `Imported` holds the owner.
        ImportedDlpack::Versioned(m) => unsafe { DeviceView::from_dltensor(m.tensor(), read_only) },
        // SAFETY: as above.
        ImportedDlpack::Legacy(m) => unsafe { DeviceView::from_dltensor(m.tensor(), read_only) },
    };
    r.map_err(|e| crate::Error::from(e).into())
}

fn is_cuda(device_type: u32) -> bool {
    device_type == DL_CUDA || device_type == DL_CUDA_MANAGED
}

/// Imports any DLPack producer. `stream`: the consumer stream the caller will use, or `None` for
/// "the producer's current work stream if it has an exchange table, else the legacy default".
pub(crate) fn import(
    obj: &Bound<'_, PyAny>,
    stream: Option<StreamHandle<'static>>,
) -> PyResult<Imported> {
    // numpy cannot export ml_dtypes' bfloat16 through DLPack: such arrays are read directly.
    if let Ok(arr) = obj.cast_exact::<numpy::PyUntypedArray>()
        && numpy::PyArrayDescrMethods::kind(&numpy::PyUntypedArrayMethods::dtype(arr)) == b'V'
        && let Some(imp) = super::h2d::numpy_source(obj)?
    {
        return Ok(imp);
    }
    let exchange = Exchange::of(obj)?;
    if let Some(ex) = &exchange
        && stream.is_none()
    {
        let (view, owner) = ex.import(obj)?;
        let stream = match view.memory() {
            MemoryKind::Cuda(id) => ex.current_stream(obj.py(), view.device_type(), id)?,
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
    // torch refuses to export for the per-thread default stream; that stream is a blocking
    // one, so work on it after the legacy default stream's waits for that stream: the producer
    // is asked to order its work before the legacy stream instead.
    let asked = if consumer == StreamHandle::PER_THREAD {
        StreamHandle::LEGACY
    } else {
        consumer
    };
    let owner = import_standard(obj, asked)?;
    let view = view_of(&owner)?;
    Ok(Imported {
        view,
        _owner: Owner::Dlpack(owner),
        stream: consumer,
        exchange,
    })
}

/// The standard protocol through dlpark; for producers that reject `max_version` (numpy < 2.1),
/// `__dlpack__(stream=...)` and then `__dlpack__()`, which dlpark does not retry.
fn import_standard(
    obj: &Bound<'_, PyAny>,
    stream: StreamHandle<'static>,
) -> PyResult<ImportedDlpack> {
    let py = obj.py();
    if !obj.is_instance_of::<PyCapsule>() && !obj.hasattr(pyo3::intern!(py, "__dlpack__"))? {
        return Err(type_err(format!(
            "expected a DLPack producer (an object with __dlpack__, e.g. a torch/jax/cupy/numpy \
             array), got {}",
            type_name(obj)
        )));
    }
    let consumer = Consumer(stream);
    let request = ImportRequest::new(obj.as_borrowed()).map_err(|e| explain(obj, e))?;
    let device = request.device().ok();
    // A producer orders its pending work before our stream through its *current* device's
    // stream (torch's `__dlpack__(stream=)` syncs `torch.cuda.current_stream()`): make the
    // tensor's device current for the call, so a cuda:1 tensor is not synchronized through
    // device 0's stream. The thread's previous context is current again after.
    let _cur = match device {
        Some(d) if is_cuda(d.device_type.0) => super::device::device_state(d.device_id)
            .ok()
            .map(|s| s.device.enter())
            .transpose()?,
        _ => None,
    };
    let with_stream = if obj.is_instance_of::<PyCapsule>() || device.is_none() {
        None
    } else {
        Some(&consumer as &dyn DlpackStream)
    };
    match request.import(with_stream, None) {
        Ok(t) => Ok(t),
        Err(e) if e.is_instance_of::<PyTypeError>(py) => {
            let kwargs = PyDict::new(py);
            if device.is_some_and(|d| is_cuda(d.device_type.0)) {
                // DLPack: 1 is the legacy default stream (0 is not allowed), 2 the per-thread one.
                let value = match stream.as_raw() {
                    0 => 1usize,
                    h => h,
                };
                kwargs.set_item(pyo3::intern!(py, "stream"), value)?;
            }
            let method = obj.getattr(pyo3::intern!(py, "__dlpack__"))?;
            let capsule = match method.call((), Some(&kwargs)) {
                Ok(c) => c,
                Err(e2) if e2.is_instance_of::<PyTypeError>(py) && !kwargs.is_empty() => {
                    method.call0()?
                }
                Err(e2) => return Err(explain(obj, e2)),
            };
            dlpark::python::from_dlpack(capsule.as_borrowed(), None, None)
                .map_err(|e| value_err(format!("invalid DLPack capsule: {e}")))
        }
        Err(e) => Err(explain(obj, e)),
    }
}

/// A producer's refusal (numpy's BufferError for big-endian, read-only or object arrays) as a
/// pinstage error that says what was being imported.
fn explain(obj: &Bound<'_, PyAny>, e: PyErr) -> PyErr {
    let py = obj.py();
    let said = |what: &str| {
        e.is_instance_of::<pyo3::exceptions::PyValueError>(py) && e.to_string().contains(what)
    };
    let err = if said("neither dltensor nor dltensor_versioned") {
        type_err(format!(
            "__dlpack__() of {} did not return a DLPack capsule",
            describe(obj)
        ))
    } else if said("DLPack device changed during import") {
        // The producer's __dlpack_device__ and its capsule disagree.
        value_err(format!(
            "{} exported its data on another device than its __dlpack_device__() says ({e})",
            describe(obj)
        ))
    } else if e.is_instance_of::<PyBufferError>(py) || e.is_instance_of::<PyTypeError>(py) {
        type_err(format!(
            "{} cannot be shared through DLPack ({e}); pass a C-contiguous array of a \
             native-endian numeric dtype",
            describe(obj)
        ))
    } else {
        return e;
    };
    err.set_cause(py, Some(e));
    err
}

/// "a numpy array of dtype >i4", "a torch Tensor", ...: for messages.
pub(crate) fn describe(obj: &Bound<'_, PyAny>) -> String {
    let ty = type_name(obj);
    match obj
        .getattr("dtype")
        .and_then(|d| d.str().map(|s| s.to_string()))
    {
        Ok(d) => format!("a {ty} of dtype {d}"),
        Err(_) => format!("a {ty}"),
    }
}

/// The name of an object's type, for messages.
pub(crate) fn type_name(obj: &Bound<'_, PyAny>) -> String {
    obj.get_type()
        .name()
        .map(|n| n.to_string())
        .unwrap_or_else(|_| "?".into())
}

/// Whether `obj` is a JAX array: JAX treats its arrays as immutable and may share their buffers,
/// so pinstage never writes into one.
pub(crate) fn is_jax_array(obj: &Bound<'_, PyAny>) -> bool {
    obj.get_type().module().is_ok_and(|m| {
        let m = m.to_string();
        m == "jax" || m.starts_with("jax.") || m.starts_with("jaxlib")
    })
}

/// Resolves a dtype argument: numpy dtypes/types/strings, torch dtypes, jax and cupy dtypes.
pub(crate) fn parse_dtype(obj: &Bound<'_, PyAny>) -> PyResult<crate::DType> {
    let py = obj.py();
    if obj.is_none() {
        return Err(type_err(
            "dtype=None: name a dtype (e.g. numpy.int32, 'float32' or torch.int64)",
        ));
    }
    // As numpy reads it: the dtype's name, refused when its byte order is not the host's.
    let numpy_name = |obj: &Bound<'_, PyAny>| -> PyResult<Option<String>> {
        let Ok(d) = py.import("numpy")?.call_method1("dtype", (obj,)) else {
            return Ok(None);
        };
        if !d.getattr("isnative")?.is_truthy()? {
            return Err(type_err(format!(
                "unsupported dtype {}: its byte order is not the host's (use a native one, e.g. \
                 numpy.dtype('{}').newbyteorder('='))",
                d.repr()?,
                d.getattr("str")?
            )));
        }
        Ok(Some(d.getattr("name")?.extract()?))
    };
    let name: String = if let Ok(s) = obj.cast::<PyString>() {
        let s = s.to_string();
        if crate::DType::from_name(&s).is_some() {
            s
        } else {
            // Type strings such as '<f4', '=i8', '|u1' (dtype.str, .npy headers).
            numpy_name(obj)?.unwrap_or(s)
        }
    } else {
        let module = obj
            .get_type()
            .module()
            .map(|m| m.to_string())
            .unwrap_or_default();
        if module.starts_with("torch") {
            obj.str()?.to_string()
        } else {
            match numpy_name(obj)? {
                Some(n) => n,
                None => obj.str()?.to_string(),
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

/// Imports a destination the stager may write: refuses JAX arrays (immutable, possibly shared)
/// and read-only tensors, before anything is written.
pub(crate) fn import_destination(
    dst: &Bound<'_, PyAny>,
    stream: Option<StreamHandle<'static>>,
) -> PyResult<Imported> {
    import_writable(dst, stream, "dst")
}

/// [`import_destination`] for the argument named `arg` (its messages name it).
pub(crate) fn import_writable(
    dst: &Bound<'_, PyAny>,
    stream: Option<StreamHandle<'static>>,
    arg: &str,
) -> PyResult<Imported> {
    let imp = import(dst, stream)?;
    // JAX arrays offer no C exchange table: the check costs nothing on the torch path.
    if imp.exchange.is_none() && is_jax_array(dst) {
        return Err(value_err(format!(
            "{arg} is {}: JAX arrays are immutable (JAX may share their buffers), so pinstage \
             never writes into one; copy into a torch or cupy tensor, or make a new JAX array \
             with pinstage.to_device(src, \"jax\")",
            describe(dst)
        )));
    }
    if imp.view.is_read_only() {
        if arg == "dst" {
            return Err(crate::Error::ReadOnly.into());
        }
        return Err(value_err(format!(
            "{arg} is read-only (its DLPack producer set the READ_ONLY flag)"
        )));
    }
    Ok(imp)
}

/// An integer given as a stream handle, if the driver may see it: 0, 1, 2, or the handle of a
/// live stream (its driver object holds it back, read without faulting). An integer the driver
/// would dereference into a fault (a segfault, not an error) is refused here with a typed error.
/// Where the driver's layout could not be learnt, the handle must at least lie in private
/// read-write heap or anonymous memory, where stream objects live.
pub(crate) fn checked_int_stream(h: usize) -> PyResult<usize> {
    let live = match crate::cuda::liveness(h) {
        crate::cuda::Liveness::Live => true,
        crate::cuda::Liveness::NotAStream => false,
        // Only a possible handle other than 0, 1, 2 is unknown.
        crate::cuda::Liveness::Unknown => stream_memory_plausible(h),
    };
    if live {
        Ok(h)
    } else {
        Err(crate::Error::BadStreamHandle { handle: h }.into())
    }
}

/// Whether `addr` can be a stream object, judged from the memory map alone: readable, writable,
/// private memory that is anonymous or the heap (where the driver allocates its stream objects),
/// not a mapping of a file or of a device (`/dev/nvidia*`: pinned and unified memory). The
/// fallback where the driver's stream layout is unknown: an address inside the heap that is not
/// a live stream passes it.
fn stream_memory_plausible(addr: usize) -> bool {
    use std::sync::atomic::Ordering::Relaxed;
    // The map is read once per handle (a torch process has thousands of mappings).
    if PLAUSIBLE.iter().any(|a| a.load(Relaxed) == addr) {
        return true;
    }
    let Ok(maps) = std::fs::read_to_string("/proc/self/maps") else {
        // No /proc: nothing can be checked; the handle is used as given, as documented.
        return true;
    };
    let ok = maps.lines().any(|line| {
        let mut parts = line.split_whitespace();
        let (Some(range), Some(perms)) = (parts.next(), parts.next()) else {
            return false;
        };
        let path = parts.nth(3).unwrap_or("");
        let Some((lo, hi)) = range.split_once('-') else {
            return false;
        };
        let (Ok(lo), Ok(hi)) = (usize::from_str_radix(lo, 16), usize::from_str_radix(hi, 16))
        else {
            return false;
        };
        (lo..hi).contains(&addr)
            && addr.checked_add(64).is_some_and(|end| end <= hi)
            && perms.starts_with("rw")
            && perms.ends_with('p')
            && (path.is_empty() || path == "[heap]" || path.starts_with("[anon"))
    });
    if ok {
        PLAUSIBLE[addr / 16 % PLAUSIBLE.len()].store(addr, Relaxed);
    }
    ok
}

/// Handles the memory-map check accepted recently (the fallback's cache).
static PLAUSIBLE: [std::sync::atomic::AtomicUsize; 8] =
    [const { std::sync::atomic::AtomicUsize::new(0) }; 8];
