//! `DeviceArray`: the one DLPack producer of memory pinstage owns or fills: `to_device(...,
//! "dlpack")` results, arena fields and whole arenas, fresh blocks, zero-copy slot fields.

use std::sync::Arc;

use dlpark::ffi::{DLDevice, DLDeviceType, DLManagedTensor, DLManagedTensorVersioned};
use dlpark::python::{CudaStreamRequest, DlpackExporter, ExportRequest, export_dlpack};
use dlpark::{DlpackFlags, Managed};
use pyo3::prelude::*;
use pyo3::types::PyTuple;

use super::errors::{deprecated, value_err};
use super::wait::{parse_timeout, wait_for};
use crate::cuda::StreamHandle;
use crate::dlpack::DType;
use crate::h2d::FreshMem;
use crate::step::{StepBlock, StepStager};

/// What keeps an export's memory alive (a clone goes into each DLPack capsule as its owner).
#[derive(Clone)]
#[allow(
    dead_code,
    reason = "held for ownership only: dropping the last clone frees the memory"
)]
pub(crate) enum Keep {
    /// The stager, and its bound arena's producer where it has one.
    Stager(Arc<StepStager>, Option<Arc<BoundArena>>),
    Block(Arc<StepBlock>),
    /// `to_device`'s memory.
    Fresh(Arc<FreshMem>),
}

/// A bound arena's producer (the caller's buffer, `StepStager(arena=...)`): held by the stager
/// and by every export of its memory, so an import made through `field()` or `arena()` keeps
/// the buffer alive after the stager is gone. Let go with the GIL (its deleter may need it).
pub(crate) struct BoundArena(Option<crate::python::import::Imported>);

impl BoundArena {
    pub(crate) fn new(imp: crate::python::import::Imported) -> Self {
        Self(Some(imp))
    }
}

impl Drop for BoundArena {
    fn drop(&mut self) {
        if let Some(imp) = self.0.take() {
            crate::python::linger::drop_with_gil(imp);
        }
    }
}

/// What the memory's last writes are, for a consumer's stream to be ordered after them.
pub(crate) enum Order {
    /// Every commit issued so far (arena exports).
    Commits(Arc<StepStager>),
    /// The copy that filled a fresh block.
    Block(Arc<StepBlock>),
    /// The copy that filled `to_device`'s memory.
    Fresh(Arc<FreshMem>),
    /// Host-written memory, or a zero-copy slot (its writer orders itself): nothing.
    None,
}

impl Order {
    /// Whether the writes completed (never blocks; a failure counts as done: waits report it).
    fn done(&self) -> crate::Result<bool> {
        match self {
            Order::Commits(st) => st.commits_done(),
            Order::Block(b) => b.is_ready(),
            Order::Fresh(m) => m.ready().query(),
            Order::None => Ok(true),
        }
    }

    /// Orders `stream` after the writes (the device waits); `None`: the host waits (for writes
    /// expected to take about `expected`).
    fn order(
        &self,
        stream: Option<StreamHandle<'_>>,
        expected: std::time::Duration,
    ) -> crate::Result<()> {
        match (self, stream) {
            (Order::None, _) => Ok(()),
            (Order::Commits(st), s) => st.order_after_commits(s),
            (Order::Block(b), Some(s)) => b.wait_on(s),
            (Order::Block(b), None) => b.synchronize(),
            (Order::Fresh(m), Some(s)) => m.ready().wait_on(s),
            (Order::Fresh(m), None) => m.ready().wait_expecting(expected),
        }
    }
}

/// Memory pinstage owns or filled, as a DLPack producer: import it with ``torch.from_dlpack``,
/// ``cupy.from_dlpack``, ``jax.dlpack.from_dlpack`` or ``numpy.from_dlpack`` (host memory);
/// every import shares the memory and keeps it alive, and an importer's stream is ordered after
/// the memory's writes on the device. ``done()`` and ``wait(timeout=None)`` tell and wait on the
/// host.
///
/// What it is: an arena field or a whole arena (``StepStager.field``, ``.arena``: a stable
/// address), a fresh block (fresh-mode commits), a zero-copy slot field, or
/// ``to_device(src, "dlpack")``'s memory. Fresh blocks and ``to_device`` memory return to
/// pinstage when this object and every import are gone, and may be written again then: an
/// import must outlive the work its framework queued on it (JAX keeps that rule; torch and
/// cupy free an import as soon as the array is collected, so keep their arrays alive until
/// their readers ran, or use ``to_device(src, "torch")`` / ``"cupy"``).
///
/// Example:
///     >>> ids = torch.from_dlpack(st.field("ids"))
#[pyclass(frozen, name = "DeviceArray", module = "pinstage._native")]
pub struct DeviceArray {
    pub(crate) ptr: u64,
    pub(crate) dtype: DType,
    pub(crate) shape: Vec<i64>,
    /// CUDA ordinal; None: host memory.
    pub(crate) device: Option<i32>,
    /// Dropped before `keep` (fields drop in order): the stager's last owner must be `keep`, so
    /// its drop waits for the commits into a bound arena before the arena is let go.
    pub(crate) sync: Order,
    pub(crate) keep: Keep,
}

impl DeviceArray {
    /// A fresh block holding one committed step (1-D uint8 of the layout's bytes).
    pub(crate) fn of_block(b: StepBlock) -> Self {
        let device = b.device().map(|d| d.ordinal());
        let b = Arc::new(b);
        Self {
            ptr: b.ptr(),
            dtype: DType::U8,
            shape: vec![b.len() as i64],
            device,
            keep: Keep::Block(Arc::clone(&b)),
            sync: Order::Block(b),
        }
    }

    /// `to_device`'s memory, of `shape` elements of `dtype`.
    pub(crate) fn of_fresh(mem: Arc<FreshMem>, dtype: DType, shape: Vec<i64>) -> Self {
        Self {
            ptr: mem.ptr(),
            dtype,
            shape,
            device: Some(mem.device().ordinal()),
            keep: Keep::Fresh(Arc::clone(&mem)),
            sync: Order::Fresh(mem),
        }
    }

    fn dl_device(&self) -> DLDevice {
        match self.device {
            Some(id) => DLDevice {
                device_type: DLDeviceType(crate::dlpack::DL_CUDA),
                device_id: id,
            },
            None => DLDevice::CPU,
        }
    }

    fn managed<M: dlpark::ManagedTensorBase>(&self) -> PyResult<Managed<M>> {
        // SAFETY: `ptr` points at `prod(shape)` elements of `dtype` kept alive by `keep`.
        unsafe {
            managed_tensor(
                Box::new(self.keep.clone()),
                self.ptr,
                self.dtype,
                &self.shape,
                self.dl_device(),
            )
        }
    }

    fn nbytes(&self) -> usize {
        self.shape.iter().product::<i64>().max(0) as usize * self.dtype.itemsize()
    }
}

/// A DLPack managed tensor of `shape` (compact) elements of `dtype` at `ptr` on `device`, whose
/// context owns `keep` (dropped by the consumer's deleter). Shared by pinstage's exporters.
///
/// # Safety
/// 1. `ptr` points at `prod(shape)` elements of `dtype` that live as long as `keep`.
pub(crate) unsafe fn managed_tensor<M, K>(
    keep: K,
    ptr: u64,
    dtype: DType,
    shape: &[i64],
    device: DLDevice,
) -> PyResult<Managed<M>>
where
    M: dlpark::ManagedTensorBase,
    K: dlpark::OpaqueContext,
{
    let mut init = dlpark::metadata::Dynamic::compact(shape.to_vec())
        .prepare_as::<M>()
        .map_err(|e| value_err(format!("DLPack export: {e}")))?
        .initialize(keep);
    let (code, bits) = dtype.dlpack();
    init.set_data(ptr as *mut std::ffi::c_void);
    init.set_dtype(dlpark::ffi::DLDataType {
        code: dlpark::ffi::DLDataTypeCode(code),
        bits,
        lanes: 1,
    });
    init.set_device(device);
    // SAFETY: data points at `prod(shape)` elements kept alive by the context (caller);
    // shape and compact strides were written by the metadata builder.
    Ok(unsafe { init.finish() })
}

/// The consumer stream an export request names: `None` when omitted or when the consumer
/// asked for no synchronisation (the caller tells the two apart if it must).
pub(crate) fn consumer_stream(req: &ExportRequest<'_>) -> PyResult<Option<StreamHandle<'static>>> {
    Ok(match req.cuda_stream()? {
        CudaStreamRequest::Omitted | CudaStreamRequest::NoSync => None,
        CudaStreamRequest::LegacyDefault => Some(StreamHandle::LEGACY),
        CudaStreamRequest::PerThreadDefault => Some(StreamHandle::PER_THREAD),
        CudaStreamRequest::Pointer(p) => {
            // An integer that is not a live stream's handle is refused first.
            let p = crate::python::stream::checked_int_stream(p)?;
            // SAFETY: the consumer's own stream, alive during its import (DLPack contract).
            Some(unsafe { StreamHandle::from_raw(p) }?)
        }
    })
}

impl DlpackExporter for DeviceArray {
    fn device(&self) -> DLDevice {
        self.dl_device()
    }

    fn flags(&self) -> DlpackFlags {
        DlpackFlags::empty()
    }

    fn prepare_export(&self, py: Python<'_>, request: &ExportRequest<'_>) -> PyResult<()> {
        if self.device.is_none() {
            return Ok(());
        }
        let omitted = matches!(request.cuda_stream()?, CudaStreamRequest::Omitted);
        let stream = consumer_stream(request)?;
        if stream.is_none() && !omitted {
            // The consumer asked for no synchronisation.
            return Ok(());
        }
        let expected = crate::cuda::wait::copy_time(self.nbytes());
        py.detach(|| self.sync.order(stream, expected))?;
        Ok(())
    }

    fn export_legacy(&self, _py: Python<'_>) -> PyResult<Managed<DLManagedTensor>> {
        self.managed()
    }

    fn export_versioned(&self, _py: Python<'_>) -> PyResult<Managed<DLManagedTensorVersioned>> {
        self.managed()
    }
}

#[pymethods]
impl DeviceArray {
    /// The DLPack export (the standard protocol); see the class.
    #[pyo3(signature = (*, stream=None, max_version=None, dl_device=None, copy=None))]
    fn __dlpack__(
        &self,
        py: Python<'_>,
        stream: Option<&Bound<'_, PyAny>>,
        max_version: Option<&Bound<'_, PyAny>>,
        dl_device: Option<&Bound<'_, PyAny>>,
        copy: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Py<PyAny>> {
        let max_version = pair::<u32, u32>(max_version, "max_version", "(major, minor)")?;
        let dl_device = pair::<u32, i32>(dl_device, "dl_device", "(device_type, device_id)")?;
        let copy = match copy.filter(|c| !c.is_none()) {
            None => None,
            Some(c) => Some(
                c.cast::<pyo3::types::PyBool>()
                    .map(|b| b.is_true())
                    .map_err(|_| {
                        super::errors::type_err(format!(
                            "copy must be True, False or None; got {}",
                            super::errors::type_name(c)
                        ))
                    })?,
            ),
        };
        let req = ExportRequest::parse(stream, max_version, dl_device, copy)?;
        export_dlpack(self, py, req)
    }

    fn __dlpack_device__(&self) -> (u32, i32) {
        let d = self.dl_device();
        (d.device_type.0, d.device_id)
    }

    /// The shape.
    #[getter]
    fn shape<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyTuple>> {
        PyTuple::new(py, &self.shape)
    }

    /// The dtype's name.
    #[getter]
    fn dtype(&self) -> &'static str {
        self.dtype.name()
    }

    /// The CUDA ordinal (None: host memory).
    #[getter]
    fn device(&self) -> Option<i32> {
        self.device
    }

    /// Bytes.
    #[getter(nbytes)]
    fn nbytes_py(&self) -> usize {
        self.nbytes()
    }

    /// Address of the first byte (device address, or host address without a driver).
    #[getter]
    fn address(&self) -> u64 {
        self.ptr
    }

    /// Whether the memory's writes completed (never blocks).
    ///
    /// Raises:
    ///     CudaDriverError: a write failed.
    fn done(&self) -> PyResult<bool> {
        Ok(self.sync.done()?)
    }

    /// Waits with the GIL released until the memory's writes completed, and returns this
    /// object. An importer never needs this (its stream is ordered after the writes); it is for
    /// host code that reads the memory some other way.
    ///
    /// Parameters:
    ///     timeout (float, optional): seconds to wait at most; None waits for as long as it takes.
    ///
    /// Raises:
    ///     TimeoutError: not complete within ``timeout``. KeyboardInterrupt: Ctrl-C (answered
    ///     within about 20 ms). PinstageValueError: a negative, NaN or infinite timeout.
    ///     PinstageTypeError: a timeout that is not a number. CudaDriverError: a write failed.
    #[pyo3(signature = (timeout=None))]
    fn wait<'py>(
        slf: &Bound<'py, Self>,
        timeout: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<Bound<'py, Self>> {
        let (secs, deadline) = parse_timeout(timeout)?;
        let me = slf.get();
        let expected = crate::cuda::wait::copy_time(me.nbytes());
        if !wait_for(slf.py(), deadline, expected, || me.sync.done())? {
            return Err(pyo3::exceptions::PyTimeoutError::new_err(format!(
                "the writes did not complete within {} s",
                secs.unwrap_or_default()
            )));
        }
        Ok(slf.clone())
    }

    /// Deprecated: ``done()``.
    fn ready(&self, py: Python<'_>) -> PyResult<bool> {
        deprecated(py, "DeviceArray.ready()", "DeviceArray.done()")?;
        self.done()
    }

    /// Deprecated: ``wait()``.
    fn synchronize<'py>(slf: &Bound<'py, Self>) -> PyResult<()> {
        deprecated(slf.py(), "DeviceArray.synchronize()", "DeviceArray.wait()")?;
        Self::wait(slf, None).map(|_| ())
    }

    fn __repr__(&self) -> String {
        let dev = match self.device {
            Some(i) => format!("cuda:{i}"),
            None => "cpu".into(),
        };
        format!("DeviceArray({}{:?}, {dev})", self.dtype.name(), self.shape)
    }
}

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<DeviceArray>()
}

/// A DLPack keyword that is a pair of ints (`max_version`, `dl_device`): None, or a typed error
/// that names it.
fn pair<'py, A, B>(
    obj: Option<&Bound<'py, PyAny>>,
    name: &str,
    form: &str,
) -> PyResult<Option<(A, B)>>
where
    A: for<'a> FromPyObject<'a, 'py>,
    B: for<'a> FromPyObject<'a, 'py>,
{
    let Some(obj) = obj.filter(|o| !o.is_none()) else {
        return Ok(None);
    };
    obj.extract::<(A, B)>().map(Some).map_err(|_| {
        super::errors::type_err(format!(
            "{name} must be a tuple {form} of two ints; got {}",
            obj.repr()
                .map_or_else(|_| super::errors::type_name(obj), |r| r.to_string())
        ))
    })
}
