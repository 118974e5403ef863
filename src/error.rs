//! The crate's error type: one enum, every variant documented, lower layers wrapped.

pub use crate::driver::DriverError;
use crate::dtype::DType;

/// Everything that can go wrong in pinstage. Bad input never panics: it returns one of these.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// No usable CUDA driver: library missing, `cuInit` failed, no device, disabled, or forked.
    #[error("CUDA is unavailable: {reason}")]
    CudaUnavailable {
        /// Why the probe failed.
        reason: String,
    },
    /// A CUDA driver call failed.
    #[error("CUDA driver call failed: {0}")]
    Driver(#[from] DriverError),
    /// A device ordinal that does not exist.
    #[error("CUDA device {ordinal} does not exist (the driver reports {count} device(s))")]
    NoSuchDevice {
        /// The ordinal asked for.
        ordinal: i32,
        /// How many devices the driver reports.
        count: i32,
    },
    /// The destination lives on another device than the stager or engine.
    #[error("tensor is on CUDA device {got}, but this {what} serves device {expected}")]
    WrongDevice {
        /// What refused it ("stager", "copy").
        what: &'static str,
        /// The device served.
        expected: i32,
        /// The tensor's device.
        got: i32,
    },
    /// Element type differs from the one expected.
    #[error("dtype mismatch: expected {expected}, got {got}")]
    DtypeMismatch {
        /// Expected dtype.
        expected: DType,
        /// Actual dtype.
        got: DType,
    },
    /// More values than the destination holds.
    #[error("{values} values do not fit a destination of {capacity} elements")]
    TooManyValues {
        /// Number of values given.
        values: usize,
        /// Number of elements in the destination.
        capacity: usize,
    },
    /// A destination or buffer too small for the source.
    #[error("destination holds {got} bytes but {needed} bytes are needed")]
    DestinationTooSmall {
        /// Bytes needed.
        needed: usize,
        /// Bytes available.
        got: usize,
    },
    /// A byte slice whose length is not a whole number of elements.
    #[error("{bytes} bytes is not a whole number of {itemsize}-byte elements")]
    RaggedBytes {
        /// Length in bytes.
        bytes: usize,
        /// Element size.
        itemsize: usize,
    },
    /// Writing to a tensor its producer marked read-only.
    #[error("destination tensor is read-only (its DLPack producer set the READ_ONLY flag)")]
    ReadOnly,
    /// The stream is capturing a CUDA graph; a captured copy would replay a ring buffer that has
    /// since been rewritten.
    #[error(
        "the stream is capturing a CUDA graph: a staged copy cannot be captured, because the graph \
         would replay a ring buffer that is rewritten by later copies; issue it outside the capture"
    )]
    StreamCapturing,
    /// DLPack metadata that pinstage cannot use.
    #[error(transparent)]
    Dlpack(#[from] crate::dlpack::DlpackError),
    /// A mirror already bound to another destination.
    #[error(
        "this H2DMirror mirrors another destination (0x{bound:x}); use one mirror per destination, \
         or call invalidate() first"
    )]
    MirrorReused {
        /// Address of the destination the mirror is bound to.
        bound: u64,
    },
    /// A size that overflows, or an argument out of range.
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
}

impl Error {
    pub(crate) fn unavailable(reason: impl Into<String>) -> Self {
        Error::CudaUnavailable {
            reason: reason.into(),
        }
    }
}

/// Result alias for pinstage.
pub type Result<T, E = Error> = std::result::Result<T, E>;
