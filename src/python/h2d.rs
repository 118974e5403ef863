//! `copy_h2d`: a whole host array into a device tensor, at line rate.

use pyo3::prelude::*;

use super::errors::value_err;
use super::import::import_host_source;
use super::import::{Imported, import_destination};
use super::pending::{PendingCopy, SendPtr};
use super::stream::parse_stream;
use crate::Error;
use crate::cuda::StreamHandle;
use crate::dlpack::MemoryKind;
use crate::host::CopyPath;

/// Copies a whole host array into a device tensor of the same dtype and size, and returns once
/// ``src`` may change: a PINNED ``src`` goes as one DMA, waited for (GIL released, Ctrl-C
/// answered); a PAGEABLE one is read completely by pinstage's copy threads, which fill pinned
/// bounce slots while the copy engine drains them, and the last pieces may still be on their
/// way to ``dst``, ordered on ``stream`` (work queued there after the call sees every byte).
///
/// Parameters:
///     dst: a writable, C-contiguous DLPack tensor (torch, cupy; never a JAX array, which is
///         immutable) of ``src``'s dtype and number of elements (shapes may differ). A host
///         (numpy) ``dst`` gets a plain memcpy, with or without a driver.
///     src: a C-contiguous host array: numpy, a torch CPU tensor, anything with DLPack on the
///         CPU, pinned or pageable.
///     stream: the stream the copy is ordered on; None: ``dst``'s producer's current stream
///         (torch), else the legacy default stream.
///
/// Returns:
///     PendingCopy: complete as far as ``src`` is concerned. Its ``wait()`` and ``done()`` are
///     deprecated (they warn: ``copy_h2d`` will return ``dst`` in 0.4); for a copy to wait on
///     later, call ``copy_h2d_async``.
///
/// Raises:
///     PinstageTypeError: dtypes differ, ``src`` is not a host array, not a DLPack producer.
///     PinstageValueError: sizes differ, a read-only, JAX, non-contiguous or other-device
///         ``dst``, an impossible stream. StreamCaptureError: the stream is capturing a graph.
///     CudaUnavailableError: a CUDA ``dst`` without a driver. CudaDriverError: the copy failed.
///     KeyboardInterrupt: Ctrl-C while waiting for a pinned source's DMA (the copy stays
///     guarded). Nothing is written when a call raises before the copy.
///
/// Example:
///     >>> dst = torch.empty(1 << 20, dtype=torch.float32, device="cuda")
///     >>> pinstage.copy_h2d(dst, numpy.ones(1 << 20, numpy.float32))
#[pyfunction]
#[pyo3(signature = (dst, src, *, stream=None))]
fn copy_h2d(
    py: Python<'_>,
    dst: &Bound<'_, PyAny>,
    src: &Bound<'_, PyAny>,
    stream: Option<&Bound<'_, PyAny>>,
) -> PyResult<PendingCopy> {
    let (path, pending) = issue(py, dst, src, stream)?;
    if path == CopyPath::Pinned {
        pending.wait_quietly(py)?;
    }
    Ok(pending.deprecated_handle())
}

/// Starts copying a whole host array into a device tensor of the same dtype and size, and
/// returns a ``PendingCopy`` at once (``copy_h2d``, without the wait).
///
/// Parameters and errors as ``copy_h2d``.
///
/// Returns:
///     PendingCopy: ``wait()`` waits for the device copy and returns ``dst``; ``done()``. A
///     PAGEABLE ``src`` was read completely before this returned and may change at once; a
///     PINNED ``src`` goes as one DMA: change it only once ``done()`` is True or ``wait()``
///     returned. The handle keeps ``src`` alive (dropped early, it leaves ``src`` to pinstage
///     until the copy completed, without blocking).
///
/// Raises:
///     As ``copy_h2d``, less the wait's KeyboardInterrupt.
///
/// Example:
///     >>> p = pinstage.copy_h2d_async(dst, pinned_batch)
///     >>> p.wait() is dst
///     True
#[pyfunction]
#[pyo3(signature = (dst, src, *, stream=None))]
fn copy_h2d_async(
    py: Python<'_>,
    dst: &Bound<'_, PyAny>,
    src: &Bound<'_, PyAny>,
    stream: Option<&Bound<'_, PyAny>>,
) -> PyResult<PendingCopy> {
    Ok(issue(py, dst, src, stream)?.1)
}

/// The copy of both forms: how it went, and its handle.
fn issue(
    py: Python<'_>,
    dst: &Bound<'_, PyAny>,
    src: &Bound<'_, PyAny>,
    stream: Option<&Bound<'_, PyAny>>,
) -> PyResult<(CopyPath, PendingCopy)> {
    crate::stamps::stamp!(">h2d");
    super::linger::reap(py);
    crate::stamps::stamp!("reaped");
    let s = parse_stream(stream)?;
    let to = import_destination(dst, s)?;
    crate::stamps::stamp!("dst imported");
    let from = import_host_source(src)?;
    crate::stamps::stamp!("src imported");
    check_match(&from, &to)?;
    let stream = s.unwrap_or(to.stream);
    let (path, event) = start(py, &from, &to, stream)?;
    crate::stamps::stamp!("gil back");
    drop(to);
    let pending = PendingCopy::new(event, dst.clone().unbind(), from);
    crate::stamps::stamp!("pending made");
    Ok((path, pending))
}

/// Refuses a source and a destination of different dtypes or sizes.
fn check_match(from: &Imported, to: &Imported) -> PyResult<()> {
    if from.view.dtype() != to.view.dtype() {
        return Err(Error::DtypeMismatch {
            expected: to.view.dtype(),
            got: from.view.dtype(),
        }
        .into());
    }
    if from.view.numel() != to.view.numel() {
        return Err(value_err(format!(
            "src has {} elements (shape {:?}) but dst has {} (shape {:?}): copy_h2d copies whole \
             arrays of one size",
            from.view.numel(),
            from.view.shape(),
            to.view.numel(),
            to.view.shape()
        )));
    }
    Ok(())
}

/// Starts the copy of `from` into `to` on `stream` with the GIL released.
pub(super) fn start(
    py: Python<'_>,
    from: &Imported,
    to: &Imported,
    stream: StreamHandle<'static>,
) -> PyResult<(CopyPath, Option<crate::cuda::Event>)> {
    let device = match to.view.memory() {
        MemoryKind::Cuda(id) => Some(&super::device::device_state(id)?.device),
        MemoryKind::Host => None,
    };
    let (ptr, len) = (SendPtr(from.view.ptr() as *const u8), from.view.nbytes());
    let view = &to.view;
    // A pageable source of any size is copied with the GIL released (pinstage's copy threads
    // fill bounce slots while the copy engine drains them).
    let (path, event) = py.detach(move || {
        let ptr = ptr;
        // SAFETY: the source is host memory of `len` bytes kept alive by `from` (and, when
        // pinned, by the caller until the event completed); the caller promises not to change
        // a pinned source before then (documented).
        unsafe { crate::h2d::start_h2d(device, view, ptr.0, len, stream) }
    })?;
    debug_assert!(event.is_some() == matches!(path, CopyPath::Pinned | CopyPath::Bounced));
    Ok((path, event))
}

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(copy_h2d, m)?)?;
    m.add_function(wrap_pyfunction!(copy_h2d_async, m)?)?;
    Ok(())
}
