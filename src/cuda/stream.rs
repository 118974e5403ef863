//! Stream handles (borrowed from frameworks) and owned streams.

use std::marker::PhantomData;

use crate::driver::{self, CUstream};
use crate::error::{Error, Result, on_drop};

use super::{Current, Device};

/// A CUDA stream handle, as frameworks hand them out (`torch.cuda.Stream.cuda_stream`,
/// `cupy.cuda.Stream.ptr`). The driver dereferences a handle without validating it, so one is
/// made from an integer only through the `unsafe` [`StreamHandle::from_raw`], or borrowed from
/// a [`Stream`] this crate owns (`'s` is that borrow: the handle cannot outlive the stream), or
/// is one of the special handles.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub struct StreamHandle<'s>(usize, PhantomData<&'s Stream>);

impl StreamHandle<'static> {
    /// The legacy default stream (handle 0).
    pub const LEGACY: StreamHandle<'static> = StreamHandle(0, PhantomData);
    /// The per-thread default stream (`CU_STREAM_PER_THREAD`, handle 2).
    pub const PER_THREAD: StreamHandle<'static> = StreamHandle(2, PhantomData);

    /// A handle from its integer value.
    ///
    /// # Errors
    /// [`Error::BadStreamHandle`] for an integer that cannot be a stream: 0, 1
    /// (`CU_STREAM_LEGACY`) and 2 (`CU_STREAM_PER_THREAD`) are the special handles; any other is a
    /// heap pointer, so it is 8-byte aligned and above the first 64 KiB.
    ///
    /// # Safety
    /// 1. `handle` is 0, 1, 2, or the handle of a live stream of a context of the device it is
    ///    used with, and that stream stays alive while copies issued on it may run. A destroyed
    ///    stream's handle passes the check above and cannot be detected; the driver would
    ///    dereference it.
    #[inline]
    pub unsafe fn from_raw(handle: usize) -> Result<Self> {
        if !possible_handle(handle) {
            return Err(Error::BadStreamHandle { handle });
        }
        Ok(Self(handle, PhantomData))
    }
}

/// Whether `handle` can be a stream handle at all: 0, 1, 2 (the special ones), or a heap
/// pointer, so 8-byte aligned and above the first 64 KiB.
pub(crate) fn possible_handle(handle: usize) -> bool {
    handle <= 2 || (handle >= 0x1_0000 && handle % 8 == 0)
}

impl StreamHandle<'_> {
    /// The integer value of the handle.
    #[inline]
    pub fn as_raw(self) -> usize {
        self.0
    }

    #[inline]
    pub(crate) fn raw(self) -> CUstream {
        self.0 as CUstream
    }

    /// Whether the stream is capturing a CUDA graph. Every copy asks this first, so a handle
    /// the driver does not know (an integer that passed `from_raw`'s checks by lying in
    /// ordinary memory) is refused here as [`Error::BadStreamHandle`], before any copy.
    #[inline]
    pub(crate) fn is_capturing(self, _cur: &Current<'_>) -> Result<bool> {
        // SAFETY: context current (`_cur`); the handle is a special one, one of our streams, or
        // one its maker vouched for in `from_raw`.
        match unsafe { driver::stream::stream_is_capturing(self.raw()) } {
            Ok(c) => Ok(c),
            Err(e) if e.is_invalid_handle() => Err(Error::BadStreamHandle { handle: self.0 }),
            Err(e) => Err(e.into()),
        }
    }

    /// Blocks until all work queued on the stream completed.
    pub(crate) fn synchronize(self, _cur: &Current<'_>) -> Result<()> {
        // SAFETY: as in `is_capturing`.
        Ok(unsafe { driver::stream::stream_synchronize(self.raw()) }?)
    }

    /// `r`, the outcome of work that follows copies just issued on this stream (tracking them,
    /// or the rest of a copy); when it failed, the copies cannot be followed: the stream is
    /// waited for first, so no copy still touches their memory when the error returns (the
    /// stream's own error, if any, is the same failing context: the first error says it).
    pub(crate) fn drained_on_err<T>(self, cur: &Current<'_>, r: Result<T>) -> Result<T> {
        if r.is_err() {
            let _ = self.synchronize(cur);
        }
        r
    }

    /// The driver's ID of this stream, unique for the life of the context (handles may be
    /// reused by a new stream; IDs are not). `None` for the per-thread default stream (one handle
    /// for a different stream on every thread) and if the driver cannot tell: the stager then
    /// tracks the stream's copies slot by slot.
    /// [`Device::enter`] for a copy on this stream: also refuses a stream that is capturing a
    /// CUDA graph (a captured copy would replay a buffer rewritten since).
    #[inline]
    pub(crate) fn enter_for_copy(self, device: &Device) -> Result<Current<'_>> {
        let cur = device.enter()?;
        if self.is_capturing(&cur)? {
            return Err(Error::StreamCapturing);
        }
        Ok(cur)
    }

    /// The context this stream belongs to (a handle other than 0, 1, 2, checked live), as an
    /// address to compare with [`Device::ctx`]'s; `None` for the special handles, which belong
    /// to every device.
    #[cfg(feature = "python")]
    pub(crate) fn ctx(self) -> Result<Option<usize>> {
        if self.0 <= 2 {
            return Ok(None);
        }
        // SAFETY: a live stream handle (the caller checked it).
        let ctx = unsafe { driver::stream::stream_get_ctx(self.raw()) }?;
        Ok(Some(ctx as usize))
    }

    #[inline]
    pub(crate) fn tracking_id(self, _cur: &Current<'_>) -> Option<u64> {
        if self.0 == StreamHandle::PER_THREAD.0 {
            return None;
        }
        // SAFETY: as in `is_capturing`.
        unsafe { driver::stream::stream_get_id(self.raw()) }.ok()
    }
}

/// An owned non-blocking CUDA stream, destroyed on drop (the driver defers the destruction until
/// its work completed).
pub struct Stream {
    device: Device,
    raw: CUstream,
}

// SAFETY: a CUstream may be used from any thread; the driver serialises access internally.
unsafe impl Send for Stream {}
// SAFETY: see Send.
unsafe impl Sync for Stream {}

impl std::fmt::Debug for Stream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Stream(0x{:x} on {:?})", self.raw as usize, self.device)
    }
}

impl Stream {
    /// Creates a non-blocking stream on `device`.
    ///
    /// # Errors
    /// [`Error::Driver`] if the driver cannot create it.
    pub fn new(device: &Device) -> Result<Self> {
        let _cur = device.enter()?;
        // SAFETY: a context is current (guard).
        let raw = unsafe { driver::stream::stream_create() }?;
        Ok(Self {
            device: device.clone(),
            raw,
        })
    }

    /// The handle to pass to copy functions; it borrows the stream, so it cannot outlive it:
    ///
    /// ```compile_fail
    /// # fn f(dev: &pinstage::Device) -> pinstage::Result<()> {
    /// let handle = {
    ///     let stream = pinstage::Stream::new(dev)?;
    ///     stream.handle()
    /// }; // the stream is destroyed here, and the driver would dereference its handle
    /// # let _ = handle;
    /// # Ok(())
    /// # }
    /// ```
    pub fn handle(&self) -> StreamHandle<'_> {
        StreamHandle(self.raw as usize, PhantomData)
    }

    /// The device.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// Blocks until all work on the stream completed.
    ///
    /// # Errors
    /// [`Error::Driver`] if the stream's work failed.
    pub fn synchronize(&self) -> Result<()> {
        let cur = self.device.enter()?;
        self.handle().synchronize(&cur)
    }
}

impl Drop for Stream {
    fn drop(&mut self) {
        match self.device.enter() {
            // SAFETY: our stream, destroyed once.
            Ok(_cur) => on_drop(unsafe { driver::stream::stream_destroy(self.raw) }),
            Err(Error::Driver(e)) => on_drop::<()>(Err(e)),
            Err(_) => {}
        }
    }
}
