//! Test scaffolding (feature `testing`, never in a release build): device buffers, graph
//! capture and host functions to stall a stream, and the internals the tests in `tests/` check
//! directly (the slot ring, the host writes, the mirror key).

use std::ffi::c_void;

use crate::cuda::{Device, Stream, StreamHandle};
use crate::dlpack::{DType, DeviceView, TensorMeta};
use crate::driver::{self, CUdeviceptr};
use crate::error::{Error, Result, on_drop};

pub use crate::blocks::{panic_in_staged_task, staged_handovers};
pub use crate::d2h::{
    landing_after_spin, landing_counts, landing_free_words, landing_from_stream, landing_reset,
};
pub use crate::driver::fault;
pub use crate::h2d::mirror::CopyKey;
pub use crate::h2d::slot::row_shape;
pub use crate::h2d::upload::meanwhile::start_h2d_made_meanwhile;
pub use crate::h2d::upload::start_h2d;
pub use crate::ring::protocol as ring;
pub use crate::ring::write::PARALLEL_WRITE_MIN;
pub use crate::step::plan::{AUTO_GAP_BATCH, AUTO_GAP_COPIES, plan};

/// Deterministic distinct ids: the first `n` of a permutation of `0..range` (xorshift from
/// `seed`), as the block tests and benches draw their moves.
pub fn shuffled_ids(n: usize, range: usize, seed: u64) -> Vec<usize> {
    let mut v: Vec<usize> = (0..range).collect();
    let mut x = seed | 1;
    for i in (1..v.len()).rev() {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        v.swap(i, (x % (i as u64 + 1)) as usize);
    }
    v.truncate(n);
    v
}

/// A C-contiguous byte tensor of `shape` at `ptr`: in device `cuda`'s memory, or in host memory
/// (`None`); `read_only` as a producer would mark it.
///
/// # Panics
/// If the shape is not a valid DLPack shape.
///
/// # Safety
/// The `shape`'s bytes at `ptr` stay valid (and, unless `read_only`, writable) as long as the
/// view or anything made from it is used.
pub unsafe fn bytes_view(
    ptr: u64,
    cuda: Option<i32>,
    shape: &[i64],
    read_only: bool,
) -> DeviceView<'static> {
    let meta = crate::dlpack::validate(&crate::dlpack::TensorDesc {
        device_type: if cuda.is_some() {
            crate::dlpack::DL_CUDA
        } else {
            crate::dlpack::DL_CPU
        },
        device_id: cuda.unwrap_or(0),
        data: ptr,
        byte_offset: 0,
        code: 1,
        bits: 8,
        lanes: 1,
        shape,
        strides: None,
        read_only,
    })
    .expect("a valid byte tensor");
    // SAFETY: the caller's contract.
    unsafe { DeviceView::from_meta(meta) }
}

/// Whether a slot written with `(values_len, total, pad)` after one written with `old` keeps the
/// old padding (so only the values and the gap need writing): the stager's layout memory.
pub fn same_padding(
    old: (usize, usize, Option<&[u8]>),
    new: (usize, usize, Option<&[u8]>),
) -> bool {
    let a = crate::ring::write::Layout::new(old.0, old.1, old.2);
    let b = crate::ring::write::Layout::new(new.0, new.1, new.2);
    a.same_padding(&b)
}

/// Writes `values` then `pad` repeated up to `dst.len()` into `dst`, as the stager writes a slot.
///
/// # Panics
/// If the values do not fit, the pad does not divide the rest or 512, or the slices overlap.
pub fn write_padded(dst: &mut [u8], values: &[u8], pad: Option<&[u8]>) {
    check_write(dst, values, pad);
    // SAFETY: checked above: dst holds `dst.len()` bytes, values fit, pad divides the rest.
    unsafe { crate::ring::write::write_padded(dst.as_mut_ptr(), values, pad, dst.len(), false) }
}

/// [`write_padded`] split over the rayon pool, as the stager writes large slots.
///
/// # Panics
/// As [`write_padded`].
pub fn write_padded_parallel(dst: &mut [u8], values: &[u8], pad: Option<&[u8]>) {
    check_write(dst, values, pad);
    // SAFETY: as in `write_padded`.
    unsafe { crate::ring::write::write_padded_parallel(dst.as_mut_ptr(), values, pad, dst.len()) }
}

fn check_write(dst: &[u8], values: &[u8], pad: Option<&[u8]>) {
    assert!(values.len() <= dst.len());
    let rest = dst.len() - values.len();
    match pad {
        Some(p) => assert!(!p.is_empty() && 512 % p.len() == 0 && rest % p.len() == 0),
        None => assert_eq!(rest, 0),
    }
    let d = dst.as_ptr_range();
    let v = values.as_ptr_range();
    assert!(v.end <= d.start || d.end <= v.start, "overlap");
}

/// The raw handle of the calling thread's current CUDA context (0 when none): lets tests check
/// that pinstage leaves a thread's context as it found it.
///
/// # Errors
/// [`Error::CudaUnavailable`] without a driver.
pub fn current_context() -> Result<usize> {
    driver::probe().map_err(Error::unavailable)?;
    Ok(driver::ctx::ctx_get_current()? as usize)
}

/// The device memory free on `device` (`cuMemGetInfo`): lets tests check that what pinstage
/// allocated on the device is given back once dropped (after [`crate::host::wait_for_frees`]).
///
/// # Errors
/// [`Error::Driver`] if the driver refuses.
pub fn device_free_bytes(device: &Device) -> Result<usize> {
    let _cur = device.enter()?;
    // SAFETY: a context is current (`_cur`).
    Ok(unsafe { driver::mem::mem_get_info() }?.0)
}

/// Starts capturing a CUDA graph on `stream` (relaxed mode).
///
/// # Errors
/// [`Error::Driver`] if the driver refuses.
pub fn begin_capture(stream: &Stream) -> Result<()> {
    let _cur = stream.device().enter()?;
    // SAFETY: our live, non-default stream; context current.
    unsafe { driver::stream::stream_begin_capture(stream.handle().raw()) }?;
    Ok(())
}

/// Ends a capture on `stream` and discards the captured graph.
///
/// # Errors
/// [`Error::Driver`] if the driver refuses.
pub fn end_capture(stream: &Stream) -> Result<()> {
    let _cur = stream.device().enter()?;
    // SAFETY: our live stream; context current.
    unsafe { driver::stream::stream_end_capture_discard(stream.handle().raw()) }?;
    Ok(())
}

/// Makes later work on `stream` wait (on the device) until `host_fn` returns; it runs on a
/// driver thread once earlier work completed. Stalls a stream without any kernel. A panic
/// inside `host_fn` aborts the process.
///
/// # Safety
/// 1. `host_fn` calls no CUDA function, directly or through anything it drops (a pinstage
///    buffer, stream, device or pending copy among them): the driver forbids it inside a host
///    function (it may deadlock, or refuse a wait that guards memory).
///
/// # Errors
/// [`Error::Driver`] if the driver refuses.
pub unsafe fn launch_host_fn<F: FnOnce() + Send + 'static>(
    stream: &Stream,
    host_fn: F,
) -> Result<()> {
    // SAFETY: the caller's contract, passed on.
    unsafe { launch_host_fn_on(stream.device(), stream.handle(), host_fn) }
}

/// [`launch_host_fn`] on any stream handle of `device`, a special one included (the legacy or
/// this thread's per-thread default stream).
///
/// # Safety
/// As [`launch_host_fn`].
///
/// # Errors
/// [`Error::Driver`] if the driver refuses.
pub unsafe fn launch_host_fn_on<F: FnOnce() + Send + 'static>(
    device: &Device,
    stream: StreamHandle<'_>,
    host_fn: F,
) -> Result<()> {
    unsafe extern "C" fn trampoline<F: FnOnce()>(data: *mut c_void) {
        // SAFETY: `data` is the Box leaked below, consumed exactly once here.
        let f = unsafe { Box::from_raw(data.cast::<F>()) };
        if std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).is_err() {
            std::process::abort();
        }
    }
    let _cur = device.enter()?;
    let data = Box::into_raw(Box::new(host_fn)).cast::<c_void>();
    let handle = stream.raw();
    // SAFETY: a special handle or a live stream (its borrow); the trampoline never unwinds;
    // data lives until it runs.
    let launched = unsafe { driver::stream::launch_host_func(handle, trampoline::<F>, data) };
    if let Err(e) = launched {
        // SAFETY: not launched, so still ours to free.
        drop(unsafe { Box::from_raw(data.cast::<F>()) });
        return Err(e.into());
    }
    Ok(())
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
    ///
    /// # Errors
    /// [`Error::Driver`] when the device is out of memory.
    pub fn new(device: &Device, len: usize) -> Result<Self> {
        let _cur = device.enter()?;
        // SAFETY: context current.
        let ptr = unsafe { driver::mem::mem_alloc(len.max(1)) }?;
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

    /// A contiguous 1-D view of the whole buffer as elements of `dtype`.
    pub fn view(&self, dtype: DType) -> DeviceView<'_> {
        self.view_at(0, dtype, self.len / dtype.itemsize())
    }

    /// A contiguous 1-D view of `numel` elements of `dtype` from byte `offset`.
    ///
    /// # Panics
    /// If the view does not lie within the buffer.
    pub fn view_at(&self, offset: usize, dtype: DType, numel: usize) -> DeviceView<'_> {
        let end = numel
            .checked_mul(dtype.itemsize())
            .and_then(|n| n.checked_add(offset));
        assert!(
            end.is_some_and(|e| e <= self.len),
            "view outside the buffer"
        );
        let meta = TensorMeta::cuda_1d(
            self.device.ordinal(),
            self.ptr + offset as u64,
            dtype,
            numel,
        );
        // SAFETY: the range lies within our allocation (checked), which lives as long as the
        // borrow of `self` the view carries; device memory of our device.
        unsafe { DeviceView::from_meta(meta) }
    }

    /// Copies `src` into the buffer at `offset` and waits (legacy stream).
    ///
    /// # Errors
    /// [`Error::DestinationTooSmall`] outside the buffer, [`Error::Driver`].
    pub fn upload(&self, offset: usize, src: &[u8]) -> Result<()> {
        self.check_range(offset, src.len())?;
        let _cur = self.device.enter()?;
        // SAFETY: range checked; we synchronize before returning, so `src` outlives the copy.
        unsafe {
            driver::mem::memcpy_htod_async(
                self.ptr + offset as u64,
                src.as_ptr().cast(),
                src.len(),
                std::ptr::null_mut(),
            )?;
            driver::stream::stream_synchronize(std::ptr::null_mut())?;
        }
        Ok(())
    }

    /// Copies the buffer at `offset` into `dst` and waits (legacy stream).
    ///
    /// # Errors
    /// [`Error::DestinationTooSmall`] outside the buffer, [`Error::Driver`].
    pub fn download(&self, offset: usize, dst: &mut [u8]) -> Result<()> {
        self.check_range(offset, dst.len())?;
        let _cur = self.device.enter()?;
        // SAFETY: range checked; we wait before returning, so `dst` outlives the copy.
        unsafe {
            driver::mem::memcpy_dtoh_async(
                dst.as_mut_ptr().cast(),
                self.ptr + offset as u64,
                dst.len(),
                std::ptr::null_mut(),
            )?;
            driver::stream::stream_synchronize(std::ptr::null_mut())?;
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
        match self.device.enter() {
            // Copies queued through views of the buffer may still write it: the context's work
            // completes first (a failed wait leaks the buffer instead of freeing it).
            Ok(cur) => match cur.synchronize() {
                // SAFETY: ours, freed once, no work queued on it any longer.
                Ok(()) => on_drop(unsafe { driver::mem::mem_free(self.ptr) }),
                Err(Error::Driver(e)) => on_drop::<()>(Err(e)),
                Err(_) => {}
            },
            Err(Error::Driver(e)) => on_drop::<()>(Err(e)),
            Err(_) => {}
        }
    }
}
