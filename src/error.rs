//! The crate's error type: one enum, every variant documented, lower layers wrapped.

use crate::dlpack::DType;
pub use crate::driver::DriverError;

/// Everything that can go wrong in pinstage. Bad input never panics: it returns one of these.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// No usable CUDA driver: library missing, `cuInit` failed, no device, disabled, or forked.
    #[error(
        "CUDA is unavailable: {reason}; device copies and pinned memory need an NVIDIA driver and \
         GPU (numpy destinations and host-mode stagers work without)"
    )]
    CudaUnavailable {
        /// Why the probe failed.
        reason: String,
    },
    /// A CUDA driver call failed.
    #[error("CUDA driver call failed: {0}")]
    Driver(#[from] DriverError),
    /// A device ordinal that does not exist.
    #[error(
        "device must be one the driver reports ({count} device(s): 0 to {last}); got {ordinal}",
        last = count - 1
    )]
    NoSuchDevice {
        /// The ordinal asked for.
        ordinal: i32,
        /// How many devices the driver reports.
        count: i32,
    },
    /// The destination lives on another device than the stager or engine.
    #[error(
        "the tensor must be on CUDA device {expected}, which this {what} serves; got a tensor on \
         device {got}; use a {what} of device {got}"
    )]
    WrongDevice {
        /// What refused it ("stager", "copy").
        what: &'static str,
        /// The device served.
        expected: i32,
        /// The tensor's device.
        got: i32,
    },
    /// Element type differs from the one expected.
    #[error(
        "dtype must be {expected}; got {got}; convert one side first (numpy astype, torch .to)"
    )]
    DtypeMismatch {
        /// Expected dtype.
        expected: DType,
        /// Actual dtype.
        got: DType,
    },
    /// More values than the destination holds.
    #[error(
        "values must fit the destination's {capacity} elements; got {values} values; pass fewer \
         values or a larger destination"
    )]
    TooManyValues {
        /// Number of values given.
        values: usize,
        /// Number of elements in the destination.
        capacity: usize,
    },
    /// A destination or buffer too small for the source.
    #[error("the destination must hold {needed} bytes; got {got} bytes")]
    DestinationTooSmall {
        /// Bytes needed.
        needed: usize,
        /// Bytes available.
        got: usize,
    },
    /// A step stager's bound arena smaller than its layout.
    #[error("the arena must hold the layout's {needed} bytes (layout.nbytes); got {got} bytes")]
    ArenaTooSmall {
        /// The layout's bytes.
        needed: usize,
        /// The arena's bytes.
        got: usize,
    },
    /// A byte slice whose length is not a whole number of elements.
    #[error("values must be whole {itemsize}-byte elements; got {bytes} bytes")]
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
    /// An argument outside the range the call accepts.
    #[error("{param} must be {expected}; got {value}")]
    InvalidArgument {
        /// The parameter's name.
        param: &'static str,
        /// The value given, as text.
        value: String,
        /// What the call accepts.
        expected: &'static str,
    },
    /// A size whose bytes overflow the address space, or host memory that cannot be had.
    #[error("{what} of {bytes} bytes cannot be allocated")]
    OutOfMemory {
        /// What was being allocated.
        what: &'static str,
        /// Bytes asked for (saturated at `usize::MAX` when the size itself overflowed).
        bytes: usize,
    },
    /// A pad that is not exactly one element of the destination's dtype.
    #[error("the pad must be one {expected}-byte {dtype} element; got {got} bytes")]
    PadSize {
        /// Bytes given.
        got: usize,
        /// The element size.
        expected: usize,
        /// The dtype.
        dtype: DType,
    },
    /// An integer that cannot be a CUDA stream handle.
    #[error(
        "stream must be 0, 1, 2 or a live stream's handle; got 0x{handle:x}, which is no CUDA \
         stream"
    )]
    BadStreamHandle {
        /// The handle given.
        handle: usize,
    },
    /// Bytes whose address or length does not fit the requested element type.
    #[error("{bytes} bytes at 0x{addr:x} cannot be viewed as {type_name} (size or alignment)")]
    BadCast {
        /// Address of the bytes.
        addr: usize,
        /// Their length.
        bytes: usize,
        /// The element type asked for.
        type_name: &'static str,
    },
    /// A wait was interrupted by its caller (the Python layer: Ctrl-C); the copy it waited for
    /// is still guarded and nothing was written.
    #[error("interrupted while waiting for a copy to complete")]
    Interrupted,
    /// Values of a shape that the destination's shape cannot take under `dst[:n] = values`.
    #[error(
        "values must have the destination's shape past its first axis; got values of shape {} \
         for a destination of shape {}",
        py_shape(values),
        py_shape(dst)
    )]
    ShapeMismatch {
        /// The values' shape.
        values: Vec<usize>,
        /// The destination's shape.
        dst: Vec<i64>,
    },
    /// A step layout has no field of this name.
    #[error("the field must be one of the layout's ({known}); got {name:?}")]
    UnknownField {
        /// The name asked for.
        name: String,
        /// The layout's field names, comma-separated.
        known: String,
    },
    /// A pinned pool's `max_outstanding_bytes` would be passed.
    #[error(
        "the pinned pool's budget is exhausted: {requested} more bytes would pass \
         max_outstanding_bytes = {budget} ({outstanding} bytes are pinned in it, in use and cached, \
         with every cached block it could free freed); free arrays from the pool, raise the \
         budget, or use empty_host, which falls back to pageable memory"
    )]
    PoolExhausted {
        /// The pool's budget (`max_outstanding_bytes`).
        budget: usize,
        /// Pinned bytes the pool holds now (in use and cached).
        outstanding: usize,
        /// The block size asked for (its size class).
        requested: usize,
    },
    /// A step was used in a way its state forbids: after commit, twice, from another thread.
    #[error("{0}")]
    StepState(&'static str),
}

impl Error {
    pub(crate) fn unavailable(reason: impl Into<String>) -> Self {
        Error::CudaUnavailable {
            reason: reason.into(),
        }
    }

    /// A refused allocation of `bytes` for `what`: [`Error::OutOfMemory`] when the driver ran
    /// out of memory, else its error.
    pub(crate) fn allocation(e: DriverError, what: &'static str, bytes: usize) -> Self {
        if e.is_out_of_memory() {
            Error::OutOfMemory { what, bytes }
        } else {
            Error::Driver(e)
        }
    }
}

impl Error {
    /// An [`Error::InvalidArgument`].
    pub(crate) fn arg(
        param: &'static str,
        value: impl std::fmt::Display,
        expected: &'static str,
    ) -> Self {
        Error::InvalidArgument {
            param,
            value: value.to_string(),
            expected,
        }
    }
}

/// Driver errors that happened where they could not be returned: in `Drop` of a pinstage
/// resource (an event, a stream, a pinned block, a context release). Drop never panics and never
/// discards such an error: it counts it here, and keeps the last one.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DropErrors {
    /// How many driver calls made during drops failed in this process.
    pub count: u64,
    /// The last of them.
    pub last: Option<DriverError>,
}

static DROP_ERRORS: parking_lot::Mutex<DropErrors> = parking_lot::Mutex::new(DropErrors {
    count: 0,
    last: None,
});

/// Records an error of a driver call made during a drop (see [`DropErrors`]).
#[cold]
pub(crate) fn record_drop_error(e: DriverError) {
    let mut g = DROP_ERRORS.lock();
    g.count += 1;
    g.last = Some(e);
}

/// Records the error of a driver call made during a drop, if it failed.
#[inline]
pub(crate) fn on_drop<T>(r: std::result::Result<T, DriverError>) {
    if let Err(e) = r {
        record_drop_error(e);
    }
}

/// The driver errors that drops of pinstage resources met in this process (see [`DropErrors`]).
pub fn drop_errors() -> DropErrors {
    *DROP_ERRORS.lock()
}

/// Result alias for pinstage.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// A shape as Python writes it: `(4, 2)`, `(3,)`, `()`.
fn py_shape<T: std::fmt::Display>(dims: &[T]) -> String {
    match dims {
        [one] => format!("({one},)"),
        _ => format!(
            "({})",
            dims.iter()
                .map(ToString::to_string)
                .collect::<Vec<_>>()
                .join(", ")
        ),
    }
}
