//! DLPack metadata: validation of the raw fields into [`TensorMeta`].

use dlpark::ffi::{DLDeviceType, DLTensor};

use super::dtype::DType;

/// DLPack device type `kDLCPU`.
pub const DL_CPU: u32 = DLDeviceType::CPU.0;
/// DLPack device type `kDLCUDA`.
pub const DL_CUDA: u32 = DLDeviceType::CUDA.0;
/// DLPack device type `kDLCUDAHost` (pinned host memory).
pub const DL_CUDA_HOST: u32 = DLDeviceType::CUDAHOST.0;
/// DLPack device type `kDLCUDAManaged`.
pub const DL_CUDA_MANAGED: u32 = DLDeviceType::CUDAMANAGED.0;

/// Most dimensions a view may have (numpy's limit).
pub const MAX_NDIM: usize = 64;

/// Why DLPack metadata was refused. Every variant names the field and what was expected.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum DlpackError {
    /// A device type pinstage cannot reach.
    #[error(
        "unsupported DLPack device type {0}: expected CPU (1), CUDA (2), CUDA host (3) or CUDA managed (13)"
    )]
    UnsupportedDevice(u32),
    /// A negative device id on a CUDA device.
    #[error("invalid DLPack device id {0} for a CUDA tensor")]
    BadDeviceId(i32),
    /// A dtype outside [`DType`], or lanes != 1.
    #[error(
        "unsupported DLPack dtype (code {code}, bits {bits}, lanes {lanes}): expected lanes 1 and one of bool, int8-64, uint8-64, float16/32/64, bfloat16, complex64/128"
    )]
    UnsupportedDtype {
        /// DLPack type code.
        code: u8,
        /// Bits per lane.
        bits: u8,
        /// Lanes.
        lanes: u16,
    },
    /// `ndim` negative or above [`MAX_NDIM`].
    #[error("invalid ndim {0}: expected 0..={MAX_NDIM}")]
    BadNdim(i64),
    /// A null shape pointer with ndim > 0.
    #[error("DLPack shape pointer is null but ndim is {0}")]
    NullShape(i32),
    /// A negative dimension.
    #[error("shape dimension {axis} is negative ({value})")]
    NegativeDim {
        /// Axis.
        axis: usize,
        /// Value.
        value: i64,
    },
    /// Element count or byte size overflow.
    #[error("tensor size overflows the address space")]
    SizeOverflow,
    /// Strides that are not row-major compact.
    #[error(
        "tensor is not contiguous: strides {strides:?} for shape {shape:?}, expected row-major compact strides {expected:?} (size-1 dimensions may have any stride); make it contiguous first"
    )]
    NotContiguous {
        /// Shape.
        shape: Vec<i64>,
        /// Strides given.
        strides: Vec<i64>,
        /// Compact strides.
        expected: Vec<i64>,
    },
    /// A null data pointer for a non-empty tensor.
    #[error("tensor data pointer is null but it has {0} elements")]
    NullData(usize),
    /// `data + byte_offset + nbytes` overflows.
    #[error("data pointer 0x{data:x} + byte_offset {byte_offset} + {nbytes} bytes overflows")]
    PointerOverflow {
        /// Data pointer.
        data: u64,
        /// Byte offset.
        byte_offset: u64,
        /// Size.
        nbytes: usize,
    },
}

/// Where a view's memory lives.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MemoryKind {
    /// Host memory (DLPack CPU or CUDA host): the CPU writes it directly.
    Host,
    /// Device memory of CUDA device `id` (DLPack CUDA or CUDA managed).
    Cuda(i32),
}

/// Raw DLPack fields, borrowed: the input of [`validate`].
#[derive(Clone, Copy, Debug)]
pub struct TensorDesc<'a> {
    /// DLPack device type.
    pub device_type: u32,
    /// DLPack device id.
    pub device_id: i32,
    /// Data pointer (before `byte_offset`).
    pub data: u64,
    /// Byte offset added to `data`.
    pub byte_offset: u64,
    /// dtype code.
    pub code: u8,
    /// dtype bits.
    pub bits: u8,
    /// dtype lanes.
    pub lanes: u16,
    /// Shape.
    pub shape: &'a [i64],
    /// Strides in elements, or `None` for compact row-major.
    pub strides: Option<&'a [i64]>,
    /// The producer's READ_ONLY flag.
    pub read_only: bool,
}

/// Validated metadata of a contiguous tensor: where its bytes would be and what they hold. Only
/// numbers: holding one promises nothing about the memory (see [`DeviceView`](super::DeviceView)).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorMeta {
    memory: MemoryKind,
    device_type: u32,
    ptr: u64,
    dtype: DType,
    shape: Vec<i64>,
    numel: usize,
    read_only: bool,
}

/// Compact row-major strides of `shape`, saturating on overflow.
fn compact_strides(shape: &[i64]) -> Vec<i64> {
    let mut strides = vec![0i64; shape.len()];
    let mut acc = 1i64;
    for (s, &d) in strides.iter_mut().zip(shape).rev() {
        *s = acc;
        acc = acc.saturating_mul(d.max(1));
    }
    strides
}

/// Validates DLPack fields into [`TensorMeta`]. Pure: reads nothing behind `data`.
///
/// # Errors
/// A [`DlpackError`] naming the field that pinstage cannot use.
pub fn validate(desc: &TensorDesc<'_>) -> Result<TensorMeta, DlpackError> {
    let memory = match desc.device_type {
        DL_CPU | DL_CUDA_HOST => MemoryKind::Host,
        DL_CUDA | DL_CUDA_MANAGED => {
            if desc.device_id < 0 {
                return Err(DlpackError::BadDeviceId(desc.device_id));
            }
            MemoryKind::Cuda(desc.device_id)
        }
        other => return Err(DlpackError::UnsupportedDevice(other)),
    };
    let dtype = DType::from_dlpack(desc.code, desc.bits, desc.lanes).ok_or(
        DlpackError::UnsupportedDtype {
            code: desc.code,
            bits: desc.bits,
            lanes: desc.lanes,
        },
    )?;
    if desc.shape.len() > MAX_NDIM {
        return Err(DlpackError::BadNdim(desc.shape.len() as i64));
    }
    let mut numel: usize = 1;
    for (axis, &d) in desc.shape.iter().enumerate() {
        if d < 0 {
            return Err(DlpackError::NegativeDim { axis, value: d });
        }
        numel = numel
            .checked_mul(d as usize)
            .ok_or(DlpackError::SizeOverflow)?;
    }
    let nbytes = numel
        .checked_mul(dtype.itemsize())
        .ok_or(DlpackError::SizeOverflow)?;
    if nbytes > isize::MAX as usize {
        return Err(DlpackError::SizeOverflow);
    }
    if let Some(strides) = desc.strides
        && numel > 0
    {
        let expected = compact_strides(desc.shape);
        let ok = strides.len() == desc.shape.len()
            && desc
                .shape
                .iter()
                .zip(strides.iter().zip(&expected))
                .all(|(&d, (&s, &e))| d == 1 || s == e);
        if !ok {
            return Err(DlpackError::NotContiguous {
                shape: desc.shape.to_vec(),
                strides: strides.to_vec(),
                expected,
            });
        }
    }
    if numel > 0 && desc.data == 0 {
        return Err(DlpackError::NullData(numel));
    }
    let ptr = desc
        .data
        .checked_add(desc.byte_offset)
        .ok_or(DlpackError::PointerOverflow {
            data: desc.data,
            byte_offset: desc.byte_offset,
            nbytes,
        })?;
    if ptr.checked_add(nbytes as u64).is_none() {
        return Err(DlpackError::PointerOverflow {
            data: desc.data,
            byte_offset: desc.byte_offset,
            nbytes,
        });
    }
    Ok(TensorMeta {
        memory,
        device_type: desc.device_type,
        ptr,
        dtype,
        shape: desc.shape.to_vec(),
        numel,
        read_only: desc.read_only,
    })
}

/// Validates a raw `DLTensor`'s metadata.
///
/// # Safety
/// 1. `t.shape` (and `t.strides` when non-null) point to `t.ndim` readable `i64`s.
pub unsafe fn meta_of_dltensor(t: &DLTensor, read_only: bool) -> Result<TensorMeta, DlpackError> {
    if t.ndim < 0 || t.ndim as usize > MAX_NDIM {
        return Err(DlpackError::BadNdim(t.ndim as i64));
    }
    let ndim = t.ndim as usize;
    let shape: &[i64] = if ndim == 0 {
        &[]
    } else if t.shape.is_null() {
        return Err(DlpackError::NullShape(t.ndim));
    } else {
        // SAFETY: caller's contract 1.
        unsafe { std::slice::from_raw_parts(t.shape, ndim) }
    };
    let strides = if t.strides.is_null() || ndim == 0 {
        None
    } else {
        // SAFETY: caller's contract 1.
        Some(unsafe { std::slice::from_raw_parts(t.strides as *const i64, ndim) })
    };
    validate(&TensorDesc {
        device_type: t.device.device_type.0,
        device_id: t.device.device_id,
        data: t.data as u64,
        byte_offset: t.byte_offset,
        code: t.dtype.code.0,
        bits: t.dtype.bits,
        lanes: t.dtype.lanes,
        shape,
        strides,
        read_only,
    })
}

/// Panics unless `numel` elements of `dtype` span at most `isize::MAX` bytes.
fn assert_span(dtype: DType, numel: usize) {
    assert!(
        numel
            .checked_mul(dtype.itemsize())
            .is_some_and(|n| isize::try_from(n).is_ok()),
        "{numel} elements of {} span more bytes than any memory holds",
        dtype.name()
    );
}

impl TensorMeta {
    /// Metadata of a contiguous 1-D host tensor.
    ///
    /// # Panics
    /// If `numel` elements of `dtype` span more than `isize::MAX` bytes (no memory holds them;
    /// [`TensorMeta::nbytes`] could not be trusted).
    pub fn host_1d(addr: u64, dtype: DType, numel: usize, read_only: bool) -> Self {
        assert_span(dtype, numel);
        Self {
            memory: MemoryKind::Host,
            device_type: DL_CPU,
            ptr: addr,
            dtype,
            shape: vec![numel as i64],
            numel,
            read_only,
        }
    }

    /// Metadata of a C-contiguous host tensor of `shape` (checked as [`validate`] checks a
    /// DLPack CPU tensor); `None` where that refuses it.
    #[cfg(any(test, feature = "python"))]
    pub(crate) fn host_nd(addr: u64, dtype: DType, shape: &[i64], read_only: bool) -> Option<Self> {
        let (code, bits) = dtype.dlpack();
        validate(&TensorDesc {
            device_type: DL_CPU,
            device_id: 0,
            data: addr,
            byte_offset: 0,
            code,
            bits,
            lanes: 1,
            shape,
            strides: None,
            read_only,
        })
        .ok()
    }

    /// Metadata of a contiguous 1-D tensor on CUDA device `device`.
    ///
    /// # Panics
    /// As [`TensorMeta::host_1d`].
    pub fn cuda_1d(device: i32, addr: u64, dtype: DType, numel: usize) -> Self {
        assert_span(dtype, numel);
        Self {
            memory: MemoryKind::Cuda(device),
            device_type: DL_CUDA,
            ptr: addr,
            dtype,
            shape: vec![numel as i64],
            numel,
            read_only: false,
        }
    }

    /// Where the memory lives.
    pub fn memory(&self) -> MemoryKind {
        self.memory
    }

    /// The DLPack device type.
    pub fn device_type(&self) -> u32 {
        self.device_type
    }

    /// Address of the first element (`data + byte_offset`).
    pub fn ptr(&self) -> u64 {
        self.ptr
    }

    /// Element type.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// Shape.
    pub fn shape(&self) -> &[i64] {
        &self.shape
    }

    /// Number of elements.
    pub fn numel(&self) -> usize {
        self.numel
    }

    /// Size in bytes.
    pub fn nbytes(&self) -> usize {
        self.numel * self.dtype.itemsize()
    }

    /// Whether the producer marked it read-only.
    pub fn is_read_only(&self) -> bool {
        self.read_only
    }

    /// The same metadata marked read-only.
    pub fn into_read_only(mut self) -> Self {
        self.read_only = true;
        self
    }
}
