//! Devices, their primary contexts, and RAII wrappers for streams, events and device memory.

use std::ffi::c_void;
use std::sync::Arc;

use crate::driver::{self, CUcontext, CUdevice, CUdeviceptr, CUevent, CUstream};
use crate::error::{Error, Result};

/// Whether a CUDA driver is loaded and initialised, with at least one device.
pub fn cuda_available() -> bool {
    driver::probe().is_ok_and(|p| p.device_count > 0)
}

/// Number of CUDA devices, or the reason there are none.
pub fn device_count() -> Result<i32> {
    driver::probe()
        .map(|p| p.device_count)
        .map_err(Error::unavailable)
}

/// Checks the probe and that the process was not forked after CUDA was initialised.
#[inline]
pub(crate) fn ensure_usable() -> Result<()> {
    if driver::forked() {
        return Err(Error::unavailable(
            driver::probe().err().unwrap_or_default(),
        ));
    }
    Ok(())
}

struct DeviceInner {
    ordinal: i32,
    dev: CUdevice,
    ctx: CUcontext,
    /// Recycled events (raw handles) for waits on one-off copies; destroyed on drop.
    spare_events: parking_lot::Mutex<Vec<usize>>,
}

// SAFETY: a CUdevice is an integer and a CUcontext a handle that the driver allows to be used
// (made current, pushed, popped) from any thread; nothing here is thread-affine.
unsafe impl Send for DeviceInner {}
// SAFETY: see Send; `&DeviceInner` only hands out copies of the handles.
unsafe impl Sync for DeviceInner {}

impl Drop for DeviceInner {
    fn drop(&mut self) {
        let spare = std::mem::take(self.spare_events.get_mut());
        // SAFETY: our context is still retained here.
        if !spare.is_empty() && !driver::forked() && unsafe { driver::ctx_push(self.ctx) }.is_ok() {
            for ev in spare {
                // SAFETY: each was created by event_create and is destroyed once, here.
                let _ = unsafe { driver::event_destroy(ev as CUevent) };
            }
            let _ = driver::ctx_pop();
        }
        // SAFETY: balances the retain in `Device::new`. Errors are ignored: drop never panics.
        let _ = unsafe { driver::primary_ctx_release(self.dev) };
    }
}

/// A CUDA device and a retained reference to its primary context (the one PyTorch, JAX and
/// CuPy use). Cheap to clone; the context is released when the last clone is dropped.
#[derive(Clone)]
pub struct Device {
    inner: Arc<DeviceInner>,
}

impl std::fmt::Debug for Device {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Device(cuda:{})", self.inner.ordinal)
    }
}

impl Device {
    /// Retains the primary context of device `ordinal`.
    ///
    /// Errors: [`Error::CudaUnavailable`] without a driver, [`Error::NoSuchDevice`] for a bad
    /// ordinal.
    pub fn new(ordinal: i32) -> Result<Self> {
        let probe = driver::probe().map_err(Error::unavailable)?;
        if probe.device_count == 0 {
            return Err(Error::unavailable("the driver reports no CUDA device"));
        }
        if ordinal < 0 || ordinal >= probe.device_count {
            return Err(Error::NoSuchDevice {
                ordinal,
                count: probe.device_count,
            });
        }
        let dev = driver::device_get(ordinal)?;
        let ctx = driver::primary_ctx_retain(dev)?;
        Ok(Self {
            inner: Arc::new(DeviceInner {
                ordinal,
                dev,
                ctx,
                spare_events: parking_lot::Mutex::new(Vec::new()),
            }),
        })
    }

    /// The device ordinal.
    pub fn ordinal(&self) -> i32 {
        self.inner.ordinal
    }

    /// [`Device::enter`] for a copy on `stream`: refuses impossible stream handles and a stream
    /// that is capturing a CUDA graph (a captured copy would replay a buffer rewritten since).
    pub(crate) fn enter_for_copy(&self, stream: StreamHandle) -> Result<ContextGuard> {
        stream.check()?;
        let g = self.enter()?;
        // SAFETY: context current; the stream handle passed `check` and is the caller's live
        // stream (the driver does not validate handles).
        if unsafe { driver::stream_is_capturing(stream.raw()) }? {
            return Err(Error::StreamCapturing);
        }
        Ok(g)
    }

    /// Makes this device's primary context current for the guard's lifetime, unless it already
    /// is; the thread's previous context is current again when the guard drops.
    #[inline]
    pub fn enter(&self) -> Result<ContextGuard> {
        ensure_usable()?;
        let cur = driver::ctx_get_current()?;
        if cur == self.inner.ctx {
            return Ok(ContextGuard { pushed: false });
        }
        // SAFETY: our context is kept alive by the retain held in `inner`.
        unsafe { driver::ctx_push(self.inner.ctx) }?;
        Ok(ContextGuard { pushed: true })
    }
}

impl Device {
    /// An event from the device's recycling pool (created when the pool is empty). The caller
    /// must have the context current.
    pub(crate) fn pooled_event(&self) -> Result<PooledEvent> {
        let recycled = self.inner.spare_events.lock().pop();
        let raw = match recycled {
            Some(raw) => raw as CUevent,
            // SAFETY: the caller has our context current.
            None => unsafe { driver::event_create() }?,
        };
        Ok(PooledEvent {
            device: self.clone(),
            raw,
        })
    }
}

/// An event borrowed from a [`Device`]'s pool; it goes back to the pool on drop.
pub(crate) struct PooledEvent {
    device: Device,
    raw: CUevent,
}

// SAFETY: event handles may be used from any thread.
unsafe impl Send for PooledEvent {}
// SAFETY: record/query/synchronize are thread-safe in the driver.
unsafe impl Sync for PooledEvent {}

impl PooledEvent {
    /// Records after the work queued on `stream`; context must be current.
    pub(crate) fn record_entered(&self, stream: StreamHandle) -> Result<()> {
        // SAFETY: our live event; the caller's stream of the current context.
        unsafe { driver::event_record(self.raw, stream.raw()) }?;
        Ok(())
    }

    /// `true` once the recorded work completed.
    pub(crate) fn query(&self) -> Result<bool> {
        // SAFETY: our live event.
        Ok(unsafe { driver::event_query(self.raw) }?)
    }

    /// Blocks until the recorded work completed.
    pub(crate) fn synchronize(&self) -> Result<()> {
        // SAFETY: our live event.
        unsafe { driver::event_synchronize(self.raw) }?;
        Ok(())
    }
}

impl Drop for PooledEvent {
    fn drop(&mut self) {
        self.device
            .inner
            .spare_events
            .lock()
            .push(self.raw as usize);
    }
}

/// Keeps a device's context current; see [`Device::enter`]. Not `Send`: it must drop on the
/// thread that made it.
pub struct ContextGuard {
    pushed: bool,
}

impl Drop for ContextGuard {
    fn drop(&mut self) {
        if self.pushed {
            // Errors are ignored: drop never panics, and a failed pop leaves our context current,
            // which is harmless.
            let _ = driver::ctx_pop();
        }
    }
}

/// A raw CUDA stream handle, as frameworks hand them out (`torch.cuda.Stream.cuda_stream`,
/// `cupy.cuda.Stream.ptr`). `StreamHandle::LEGACY` (0) is the legacy default stream.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub struct StreamHandle(pub usize);

impl StreamHandle {
    /// The legacy default stream (handle 0).
    pub const LEGACY: StreamHandle = StreamHandle(0);

    #[inline]
    pub(crate) fn raw(self) -> CUstream {
        self.0 as CUstream
    }

    /// The driver's ID of this stream, unique for the life of the context (handles may be
    /// reused by a new stream; IDs are not). `None` for the per-thread default stream (one handle
    /// for a different stream on every thread) and if the driver cannot tell: the stager then
    /// tracks the stream's copies slot by slot. Context current.
    #[inline]
    pub(crate) fn tracking_id(self) -> Option<u64> {
        if self.0 == 2 {
            return None;
        }
        // SAFETY: context current (callers enter the device first); the handle passed `check`
        // and is the caller's live stream or a default-stream handle.
        unsafe { driver::stream_get_id(self.raw()) }.ok()
    }

    /// Refuses handles that cannot be streams: the CUDA driver dereferences a handle without
    /// validating it, so a bad one would crash the process. 0, 1 (`CU_STREAM_LEGACY`) and 2
    /// (`CU_STREAM_PER_THREAD`) are the special handles; any other is a heap pointer, so it is
    /// 8-byte aligned and above the first 64 KiB. A destroyed stream's handle passes this check
    /// and cannot be detected: keep streams alive while copies use them.
    #[inline]
    pub fn check(self) -> Result<Self> {
        if self.0 > 2 && (self.0 < 0x1_0000 || self.0 % 8 != 0) {
            return Err(Error::InvalidArgument(format!(
                "stream handle 0x{:x} is not a CUDA stream (expected 0, 1, 2 or a live stream's \
                 handle)",
                self.0
            )));
        }
        Ok(self)
    }
}

/// An owned non-blocking CUDA stream.
pub struct Stream {
    device: Device,
    raw: CUstream,
}

// SAFETY: a CUstream may be used from any thread; the driver serialises access internally.
unsafe impl Send for Stream {}
// SAFETY: see Send.
unsafe impl Sync for Stream {}

impl Stream {
    /// Creates a non-blocking stream on `device`.
    pub fn new(device: &Device) -> Result<Self> {
        let _g = device.enter()?;
        // SAFETY: a context is current (guard).
        let raw = unsafe { driver::stream_create() }?;
        Ok(Self {
            device: device.clone(),
            raw,
        })
    }

    /// The handle to pass to copy functions.
    pub fn handle(&self) -> StreamHandle {
        StreamHandle(self.raw as usize)
    }

    /// Blocks until all work on the stream completed.
    pub fn synchronize(&self) -> Result<()> {
        let _g = self.device.enter()?;
        // SAFETY: our live stream; context current.
        unsafe { driver::stream_synchronize(self.raw) }?;
        Ok(())
    }

    /// Starts capturing a CUDA graph on this stream (relaxed mode); used to test that staged
    /// copies refuse capturing streams.
    pub fn begin_capture(&self) -> Result<()> {
        let _g = self.device.enter()?;
        // SAFETY: our live, non-default stream.
        unsafe { driver::stream_begin_capture(self.raw) }?;
        Ok(())
    }

    /// Ends a capture and discards the captured graph.
    pub fn end_capture(&self) -> Result<()> {
        let _g = self.device.enter()?;
        // SAFETY: our live stream.
        unsafe { driver::stream_end_capture_discard(self.raw) }?;
        Ok(())
    }

    /// Makes later work on this stream wait (on the device) until `host_fn` returns; it runs on
    /// a driver thread once earlier work completed. Used to stall a stream in tests without any
    /// kernel. `host_fn` must not call CUDA; a panic inside it aborts the process.
    pub fn launch_host_fn<F: FnOnce() + Send + 'static>(&self, host_fn: F) -> Result<()> {
        unsafe extern "C" fn trampoline<F: FnOnce()>(data: *mut c_void) {
            // SAFETY: `data` is the Box leaked below, consumed exactly once here.
            let f = unsafe { Box::from_raw(data.cast::<F>()) };
            if std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).is_err() {
                std::process::abort();
            }
        }
        let _g = self.device.enter()?;
        let data = Box::into_raw(Box::new(host_fn)).cast::<c_void>();
        // SAFETY: our live stream; the trampoline never unwinds; data lives until it runs.
        if let Err(e) = unsafe { driver::launch_host_func(self.raw, trampoline::<F>, data) } {
            // SAFETY: not launched, so still ours to free.
            drop(unsafe { Box::from_raw(data.cast::<F>()) });
            return Err(e.into());
        }
        Ok(())
    }
}

impl Drop for Stream {
    fn drop(&mut self) {
        if let Ok(_g) = self.device.enter() {
            // SAFETY: our stream, destroyed once; the driver defers destruction until its work
            // completed.
            let _ = unsafe { driver::stream_destroy(self.raw) };
        }
    }
}

/// An RAII CUDA event with timing disabled.
pub struct Event {
    device: Device,
    raw: CUevent,
}

// SAFETY: CUevent handles may be used from any thread.
unsafe impl Send for Event {}
// SAFETY: record/query/synchronize are thread-safe in the driver.
unsafe impl Sync for Event {}

impl Event {
    /// Creates an event on `device`.
    pub fn new(device: &Device) -> Result<Self> {
        let _g = device.enter()?;
        // SAFETY: a context is current.
        let raw = unsafe { driver::event_create() }?;
        Ok(Self {
            device: device.clone(),
            raw,
        })
    }

    /// Records the event after all work currently queued on `stream`.
    /// The caller must have the device's context current ([`Device::enter`]).
    #[inline]
    pub(crate) fn record_entered(&self, stream: StreamHandle) -> Result<()> {
        // SAFETY: our live event; the stream is the caller's, of this context.
        unsafe { driver::event_record(self.raw, stream.raw()) }?;
        Ok(())
    }

    /// Records the event after all work currently queued on `stream`.
    pub fn record(&self, stream: StreamHandle) -> Result<()> {
        let _g = self.device.enter()?;
        self.record_entered(stream)
    }

    /// `true` once the work captured by the last record completed (or if never recorded).
    #[inline]
    pub fn query(&self) -> Result<bool> {
        // SAFETY: our live event. cuEventQuery needs no current context.
        Ok(unsafe { driver::event_query(self.raw) }?)
    }

    /// Blocks until the work captured by the last record completed.
    #[inline]
    pub fn synchronize(&self) -> Result<()> {
        // SAFETY: our live event.
        unsafe { driver::event_synchronize(self.raw) }?;
        Ok(())
    }

    /// Makes later work on `stream` wait for this event on the device.
    pub fn wait_on(&self, stream: StreamHandle) -> Result<()> {
        let _g = self.device.enter()?;
        // SAFETY: our live event; the caller's stream.
        unsafe { driver::stream_wait_event(stream.raw(), self.raw) }?;
        Ok(())
    }
}

impl Drop for Event {
    fn drop(&mut self) {
        if let Ok(_g) = self.device.enter() {
            // SAFETY: our event, destroyed once. Errors ignored: drop never panics.
            let _ = unsafe { driver::event_destroy(self.raw) };
        }
    }
}

/// Device memory from `cuMemAlloc`, for tests, examples and benches.
pub struct DeviceBuffer {
    device: Device,
    ptr: CUdeviceptr,
    len: usize,
}

// SAFETY: a device address is plain data; the allocation is owned.
unsafe impl Send for DeviceBuffer {}
// SAFETY: `&DeviceBuffer` only exposes the address.
unsafe impl Sync for DeviceBuffer {}

impl DeviceBuffer {
    /// Allocates `len` bytes (at least 1) on `device`.
    pub fn new(device: &Device, len: usize) -> Result<Self> {
        let _g = device.enter()?;
        // SAFETY: context current.
        let ptr = unsafe { driver::mem_alloc(len.max(1)) }?;
        Ok(Self {
            device: device.clone(),
            ptr,
            len,
        })
    }

    /// Device address.
    pub fn ptr(&self) -> u64 {
        self.ptr
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the buffer is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The device.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// A contiguous 1-D view of the whole buffer as `numel` elements of `dtype`.
    pub fn view(&self, dtype: crate::DType) -> crate::DeviceView {
        let numel = self.len / dtype.itemsize();
        crate::DeviceView::contiguous_device(self.device.ordinal(), self.ptr, dtype, numel)
    }

    /// Copies `src` into the buffer at `offset` and waits (legacy stream).
    pub fn upload(&self, offset: usize, src: &[u8]) -> Result<()> {
        self.check_range(offset, src.len())?;
        let _g = self.device.enter()?;
        // SAFETY: range checked; pageable source is copied synchronously by the driver before
        // the call returns when followed by a stream sync; we sync below.
        unsafe {
            driver::memcpy_htod_async(
                self.ptr + offset as u64,
                src.as_ptr().cast(),
                src.len(),
                std::ptr::null_mut(),
            )?;
            driver::stream_synchronize(std::ptr::null_mut())?;
        }
        Ok(())
    }

    /// Copies the buffer at `offset` into `dst` and waits (legacy stream).
    pub fn download(&self, offset: usize, dst: &mut [u8]) -> Result<()> {
        self.check_range(offset, dst.len())?;
        let _g = self.device.enter()?;
        // SAFETY: range checked; we wait before returning, so `dst` outlives the copy.
        unsafe {
            driver::memcpy_dtoh_async(
                dst.as_mut_ptr().cast(),
                self.ptr + offset as u64,
                dst.len(),
                std::ptr::null_mut(),
            )?;
            driver::stream_synchronize(std::ptr::null_mut())?;
        }
        Ok(())
    }

    fn check_range(&self, offset: usize, len: usize) -> Result<()> {
        match offset.checked_add(len) {
            Some(end) if end <= self.len => Ok(()),
            _ => Err(Error::DestinationTooSmall {
                needed: offset.saturating_add(len),
                got: self.len,
            }),
        }
    }
}

impl Drop for DeviceBuffer {
    fn drop(&mut self) {
        if let Ok(_g) = self.device.enter() {
            // SAFETY: ours, freed once; owners synchronize the work that uses the buffer
            // before dropping it (tests, examples and benches do).
            let _ = unsafe { driver::mem_free(self.ptr) };
        }
    }
}

/// The raw handle of the calling thread's current CUDA context (0 when none): lets tests check
/// that pinstage leaves a thread's context as it found it.
#[doc(hidden)]
pub fn current_context() -> Result<usize> {
    driver::probe().map_err(Error::unavailable)?;
    Ok(driver::ctx_get_current()? as usize)
}
