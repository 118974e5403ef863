//! DLPack import, through dlpark.
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
use pyo3::types::{PyCapsule, PyDict};

use super::errors::describe;
use super::errors::type_name;
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
        Self::of_type(&obj.get_type())
    }

    /// The table the arrays of type `ty` offer (torch: `torch.Tensor`), if any.
    pub(crate) fn of_type(ty: &Bound<'_, pyo3::types::PyType>) -> PyResult<Option<Self>> {
        let py = ty.py();
        let cap = match ty.getattr(pyo3::intern!(py, "__dlpack_c_exchange_api__")) {
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
        && let Some(imp) = numpy_source(obj)?
    {
        return Ok(imp);
    }
    let exchange = Exchange::of(obj)?;
    if let Some(ex) = &exchange {
        let (view, owner) = ex.import(obj)?;
        let current = match view.memory() {
            MemoryKind::Cuda(id) => Some(ex.current_stream(obj.py(), view.device_type(), id)?),
            MemoryKind::Host => None,
        };
        match (stream, current) {
            (None, cur) => {
                return Ok(Imported {
                    view,
                    _owner: owner,
                    stream: cur.unwrap_or(StreamHandle::LEGACY),
                    exchange,
                });
            }
            // The stream given is the producer's current one: its work is already in order
            // before ours, so the producer is not asked to synchronize (torch would record an
            // event and make the stream wait on it: ~15 µs for nothing).
            (Some(s), Some(cur)) if s == cur => {
                return Ok(Imported {
                    view,
                    _owner: owner,
                    stream: s,
                    exchange,
                });
            }
            // Another stream: the standard import below asks the producer to order its work
            // before it. The view just taken is let go (a borrowed one costs no allocation;
            // the current stream could not be asked for without the tensor's device).
            _ => {}
        }
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
             array); got {}",
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

/// Whether `obj` is a JAX array: JAX treats its arrays as immutable and may share their buffers,
/// so pinstage never writes into one.
pub(crate) fn is_jax_array(obj: &Bound<'_, PyAny>) -> bool {
    obj.get_type().module().is_ok_and(|m| {
        let m = m.to_string();
        m == "jax" || m.starts_with("jax.") || m.starts_with("jaxlib")
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

/// Imports a host array for an H2D copy: anything with DLPack on the CPU, or an object numpy
/// can view (``__array__`` / ``__array_interface__``).
pub(crate) fn import_host_source(src: &Bound<'_, PyAny>) -> PyResult<Imported> {
    let py = src.py();
    if let Some(from) = numpy_source(src)? {
        return Ok(from);
    }
    let from_obj = if src.hasattr(pyo3::intern!(py, "__dlpack__"))? {
        src.clone()
    } else if src.hasattr(pyo3::intern!(py, "__array__"))?
        || src.hasattr(pyo3::intern!(py, "__array_interface__"))?
    {
        py.import("numpy")?.call_method1("asarray", (src,))?
    } else {
        return Err(type_err(format!(
            "src must be a host array (numpy, a torch CPU tensor, anything with DLPack on the \
             CPU); got {}",
            describe(src)
        )));
    };
    let from = import(&from_obj, None)?;
    if from.view.memory() != MemoryKind::Host {
        return Err(type_err(format!(
            "src is {}, on a CUDA device: pinstage copies host arrays to the device \
             (device-to-device copies are the framework's)",
            describe(src)
        )));
    }
    Ok(from)
}

/// A numpy array (exactly `numpy.ndarray`), C-contiguous, of one of numpy's own dtypes (or
/// ml_dtypes' bfloat16): its view
/// read straight from the array (no DLPack capsule; read-only arrays too, which numpy's
/// `__dlpack__` refuses to export). `None`: the general path.
pub(crate) fn numpy_source(src: &Bound<'_, PyAny>) -> PyResult<Option<Imported>> {
    use numpy::{PyUntypedArray, PyUntypedArrayMethods};
    let Ok(arr) = src.cast_exact::<PyUntypedArray>() else {
        return Ok(None);
    };
    if !arr.is_c_contiguous() {
        return Ok(None);
    }
    let Some(dtype) = super::dtype::dtype_of(src.py(), &arr.dtype())? else {
        return Ok(None);
    };
    // SAFETY: reading fields of a live numpy array object.
    let (data, flags) = unsafe {
        (
            (*arr.as_array_ptr()).fields.data as u64,
            (*arr.as_array_ptr()).fields.flags,
        )
    };
    let shape: Vec<i64> = arr.shape().iter().map(|&d| d as i64).collect();
    let read_only = flags & numpy::npyffi::NPY_ARRAY_WRITEABLE == 0;
    let Some(meta) = crate::dlpack::TensorMeta::host_nd(data, dtype, &shape, read_only) else {
        return Ok(None);
    };
    // SAFETY: the array's own C-contiguous buffer of `numel * itemsize` bytes, kept alive by the
    // owner (the array) for as long as the view is used; a source is only read.
    let view = unsafe { crate::dlpack::DeviceView::from_meta(meta) };
    Ok(Some(Imported {
        view,
        _owner: super::import::Owner::Object(src.clone().unbind()),
        stream: crate::cuda::StreamHandle::LEGACY,
        exchange: None,
    }))
}
