//! `StepTensor`: the DLPack producer of arena fields, fresh blocks and zero-copy slot fields.

use std::sync::Arc;

use dlpark::ffi::{DLDevice, DLDeviceType, DLManagedTensor, DLManagedTensorVersioned};
use dlpark::python::{CudaStreamRequest, DlpackExporter, ExportRequest, export_dlpack};
use dlpark::{DlpackFlags, Managed};
use pyo3::prelude::*;
use pyo3::types::PyTuple;

use crate::cuda::StreamHandle;
use crate::dlpack::DType;
use crate::python::errors::value_err;
use crate::step::{StepBlock, StepStager};

/// What keeps an export's memory alive (a clone goes into each DLPack capsule as its owner).
#[derive(Clone)]
#[allow(
    dead_code,
    reason = "held for ownership only: dropping the last clone frees the memory"
)]
pub(super) enum Keep {
    /// The stager, and its bound arena's producer where it has one.
    Stager(Arc<StepStager>, Option<Arc<BoundArena>>),
    Block(Arc<StepBlock>),
}

/// A bound arena's producer (the caller's buffer, `StepStager(arena=...)`): held by the stager
/// and by every export of its memory, so an import made through `field()` or `arena()` keeps
/// the buffer alive after the stager is gone. Let go with the GIL (its deleter may need it).
pub(crate) struct BoundArena(Option<crate::python::import::Imported>);

impl BoundArena {
    pub(super) fn new(imp: crate::python::import::Imported) -> Self {
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

/// How a consumer's stream is ordered after the writes of the memory.
pub(super) enum Order {
    /// Wait for every commit issued so far (arena exports).
    Commits(Arc<StepStager>),
    /// Wait for the block's copy.
    Block(Arc<StepBlock>),
    /// Host-written memory: nothing to wait for.
    None,
}

/// A DLPack producer over step memory: an arena field, a whole arena, a fresh block, or a
/// zero-copy slot field. Import it with ``torch.from_dlpack``, ``cupy.from_dlpack``,
/// ``jax.dlpack.from_dlpack`` or ``numpy.from_dlpack`` (host memory, no driver); every import
/// shares the memory and keeps it alive.
///
/// Example:
///     >>> t = torch.from_dlpack(st.field("ids"))
#[pyclass(frozen, name = "StepTensor", module = "pinstage._native")]
pub struct StepTensor {
    pub(super) ptr: u64,
    pub(super) dtype: DType,
    pub(super) shape: Vec<i64>,
    /// CUDA ordinal; None: host memory.
    pub(super) device: Option<i32>,
    /// Dropped before `keep` (fields drop in order): the stager's last owner must be `keep`, so
    /// its drop waits for the commits into a bound arena before the arena is let go.
    pub(super) sync: Order,
    pub(super) keep: Keep,
}

impl StepTensor {
    pub(super) fn of_block(b: StepBlock) -> Self {
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

impl DlpackExporter for StepTensor {
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
        py.detach(|| -> crate::Result<()> {
            match (&self.sync, stream) {
                (Order::None, _) => Ok(()),
                (Order::Block(b), Some(s)) => b.wait_on(s),
                (Order::Block(b), None) if omitted => b.synchronize(),
                (Order::Commits(st), Some(s)) => st.order_after_commits(Some(s)),
                (Order::Commits(st), None) if omitted => st.order_after_commits(None),
                _ => Ok(()),
            }
        })?;
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
impl StepTensor {
    /// The DLPack export (the standard protocol); see the class.
    #[pyo3(signature = (*, stream=None, max_version=None, dl_device=None, copy=None))]
    fn __dlpack__(
        &self,
        py: Python<'_>,
        stream: Option<&Bound<'_, PyAny>>,
        max_version: Option<(u32, u32)>,
        dl_device: Option<(u32, i32)>,
        copy: Option<bool>,
    ) -> PyResult<Py<PyAny>> {
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

    /// Address of the first byte (device address, or host address without a driver).
    #[getter]
    fn address(&self) -> u64 {
        self.ptr
    }

    fn __repr__(&self) -> String {
        let dev = match self.device {
            Some(i) => format!("cuda:{i}"),
            None => "cpu".into(),
        };
        format!("StepTensor({}{:?}, {dev})", self.dtype.name(), self.shape)
    }
}
