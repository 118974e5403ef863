//! The stager: a ring of persistent pinned buffers for small host-to-device copies.
//!
//! Each device copy writes values and padding into one slot's pinned buffer on the host and
//! issues exactly ONE copy from it (`cuMemcpyHtoDAsync`, or for 2-32 KiB one `cuMemcpy2DAsync`
//! of packed rows; see [`row_shape`]), then records the slot's event. A slot is not rewritten
//! until that event completed. Slots are claimed through the atomics of the slot ring's protocol: no lock
//! is held while waiting, and a waiting thread blocks no other slot.

use super::mirror::{CopyKey, H2DMirror};
use crate::cuda::{Current, Device, Event, SlotEvent, StreamHandle};
use crate::dlpack::{DType, DeviceView, MemoryKind};
use crate::driver;
use crate::error::{Error, Result};
use crate::host::{PinnedBuffer, PinnedFlags};
use crate::ring::slots::{Counter, SlotIo, SlotRing, check_args};
use crate::ring::write::{
    Layout, PARALLEL_WRITE_MIN, store_fence, write_padded, write_padded_parallel,
};

/// Counters of a stager; every field is monotonic except `pinned_bytes`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PinnedStagerStats {
    /// Device copies issued (one driver copy each).
    pub copies: u64,
    /// Copies of host destinations, written directly.
    pub host_copies: u64,
    /// Copies skipped because the mirror showed the destination already held the values.
    pub skipped: u64,
    /// Bytes copied (device and host, values and padding).
    pub bytes: u64,
    /// Claims that found the slot's last copy still running and waited for its event.
    pub waits: u64,
    /// `cuEventQuery` calls made to learn that a claimed slot's last copy completed. One query
    /// usually covers several slots (a stream's copies complete in order), so on one stream
    /// this stays well below `copies`.
    pub queries: u64,
    /// Slot buffers grown because a copy exceeded their capacity.
    pub growths: u64,
    /// Pinned bytes held by the ring now: `depth` slots of `numel * itemsize` bytes, each
    /// rounded up to 64, plus every buffer a growth allocated.
    pub pinned_bytes: u64,
}

/// The stager's own counters (waits and queries are the ring's).
#[derive(Default)]
struct Counters {
    copies: Counter,
    host_copies: Counter,
    skipped: Counter,
    bytes: Counter,
    growths: Counter,
    pinned_bytes: Counter,
}

struct SlotBuf {
    /// The slot's bytes: its slice of the stager's arena, or `grown` once it outgrew that.
    ptr: *mut u8,
    cap: usize,
    /// The slot's own buffer after a copy exceeded its arena slice.
    grown: Option<PinnedBuffer>,
    /// What the buffer holds after its last write, so the next write can skip padding that is
    /// already there.
    layout: Option<Layout>,
    /// Buffers outgrown by `grown`. They are freed with the stager, not at growth time:
    /// `cuMemFreeHost` may synchronize the whole device, which would stall a live graph.
    retired: Vec<PinnedBuffer>,
}

impl SlotBuf {
    /// A slot without memory (no driver: host destinations never use the slots).
    fn empty() -> Self {
        Self {
            ptr: std::ptr::null_mut(),
            cap: 0,
            grown: None,
            layout: None,
            retired: Vec::new(),
        }
    }
}

/// What one copy did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CopyOutcome {
    /// One device copy was issued from slot `slot`.
    Issued {
        /// The ring slot used.
        slot: usize,
    },
    /// A host destination was written directly.
    Host,
    /// The mirror showed the destination already holds these values: nothing was done.
    Skipped,
    /// Nothing to copy (0 elements).
    Empty,
}

impl CopyOutcome {
    /// Whether the destination was written (a device copy issued, or a host write).
    pub fn wrote(self) -> bool {
        matches!(self, CopyOutcome::Issued { .. } | CopyOutcome::Host)
    }
}

/// Default slot capacity in elements.
pub const DEFAULT_NUMEL: usize = 256;
/// Default ring depth: deep enough that one event query usually serves several claims (the
/// copy engine lags a few copies behind a host issuing back to back).
pub const DEFAULT_DEPTH: usize = 16;
pub use crate::ring::protocol::MAX_DEPTH;

/// A copy being configured: [`RawStager::to`], then options, then [`RawCopy::copy`].
#[must_use = "a copy does nothing until `.copy(values)`"]
pub struct RawCopy<'a> {
    pub(super) stager: &'a RawStager,
    pub(super) dst: &'a DeviceView<'a>,
    pub(super) pad: Option<&'a [u8]>,
    pub(super) mirror: Option<&'a mut H2DMirror>,
    pub(super) stream: StreamHandle<'a>,
    pub(super) wait: Option<&'a mut WaitFn<'a>>,
}

/// How a copy waits for a busy slot's event ([`crate::h2d::StagedCopy::wait_with`]): shown as a
/// [`SlotEvent`], which can be waited for but not recorded.
pub type WaitFn<'a> = dyn FnMut(SlotEvent<'_>) -> Result<()> + 'a;

impl<'a> RawCopy<'a> {
    /// Fill the rest of the destination with this element (raw bytes of one element).
    pub fn pad(mut self, pad: &'a [u8]) -> Self {
        self.pad = Some(pad);
        self
    }

    /// Skip the copy when this mirror shows the destination already holds the values.
    pub fn mirror(mut self, mirror: &'a mut H2DMirror) -> Self {
        self.mirror = Some(mirror);
        self
    }

    /// The stream to copy on (default: the legacy default stream).
    pub fn stream(mut self, stream: StreamHandle<'a>) -> Self {
        self.stream = stream;
        self
    }

    /// How to wait when the claimed slot's last copy is still running: `wait(event)` should
    /// return once the event completed (default: `Event::synchronize`); the event is asked again
    /// after it returns (and waited for if still running), so a function that returns early
    /// costs time, not data. A panic in it leaves the slot as it was. The Python layer polls
    /// briefly, then waits with the GIL released and answers Ctrl-C.
    pub fn wait_with(mut self, wait: &'a mut WaitFn<'a>) -> Self {
        self.wait = Some(wait);
        self
    }

    /// Copies `values` (raw element bytes). See [`PinnedStager::to`] for the rules.
    ///
    /// # Errors
    /// As [`crate::h2d::StagedCopy::copy`], and [`Error::RaggedBytes`](crate::Error::RaggedBytes) / [`Error::PadSize`](crate::Error::PadSize) for bytes that are not
    /// whole elements.
    #[inline]
    pub fn copy(self, values: &[u8]) -> Result<CopyOutcome> {
        let pad = self.pad;
        self.stager.copy_bytes(self, pad, values)
    }
}

/// The untyped stager: element type chosen at run time (the Python layer uses this one).
/// [`crate::PinnedStager`] is the typed facade. Made by [`RawStager::builder`].
///
/// `Sync`: the slot protocol gives each slot's buffer a single owner at a time (see
/// the slot ring's protocol); events are driver handles safe to use from any thread.
pub struct RawStager {
    dtype: DType,
    core: SlotRing<SlotBuf>,
    /// One pinned allocation holding every slot's initial buffer. Freed only once every copy
    /// from it completed (`Drop`).
    _arena: Option<PinnedBuffer>,
    stats: Counters,
}

// SAFETY: a slot's buffer pointer leads into the stager's own pinned memory, touched only by the
// slot's owner in the ring protocol (see `SlotRing`); the rest is owned and may move between
// threads.
unsafe impl Send for SlotBuf {}

impl std::fmt::Debug for RawStager {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RawStager")
            .field("dtype", &self.dtype)
            .field("device", &self.core.ordinal())
            .field("depth", &self.core.depth())
            .field("cuda", &self.core.device().is_some())
            .finish()
    }
}

/// Builds a [`RawStager`] (or, through [`crate::PinnedStager::builder`], a typed one).
#[derive(Clone, Copy, Debug)]
#[must_use]
pub struct RawStagerBuilder {
    dtype: DType,
    device: i32,
    numel: usize,
    depth: usize,
}

impl RawStagerBuilder {
    /// The CUDA device ordinal served (default 0).
    pub fn device(mut self, ordinal: i32) -> Self {
        self.device = ordinal;
        self
    }

    /// Initial slot capacity in elements (default [`DEFAULT_NUMEL`]); a larger copy grows its
    /// slot.
    pub fn numel(mut self, numel: usize) -> Self {
        self.numel = numel;
        self
    }

    /// Number of slots (default [`DEFAULT_DEPTH`]; 1 to [`MAX_DEPTH`]).
    pub fn depth(mut self, depth: usize) -> Self {
        self.depth = depth;
        self
    }

    /// Builds the stager. Without a driver this succeeds and serves host destinations only; a
    /// device destination then gets [`Error::CudaUnavailable`].
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a depth outside 1..=[`MAX_DEPTH`] or a negative device,
    /// [`Error::OutOfMemory`] when the slots' bytes overflow, [`Error::NoSuchDevice`] for an
    /// ordinal the driver does not report, [`Error::Driver`] when pinned memory or events
    /// cannot be had. Nothing is allocated before the arguments are checked.
    pub fn build(self) -> Result<RawStager> {
        RawStager::new(self)
    }
}

impl RawStager {
    /// A builder for a stager of `dtype` elements.
    pub fn builder(dtype: DType) -> RawStagerBuilder {
        RawStagerBuilder {
            dtype,
            device: 0,
            numel: DEFAULT_NUMEL,
            depth: DEFAULT_DEPTH,
        }
    }

    fn new(b: RawStagerBuilder) -> Result<Self> {
        let RawStagerBuilder {
            dtype,
            device: ordinal,
            numel,
            depth,
        } = b;
        check_args(ordinal, depth)?;
        let overflow = || Error::OutOfMemory {
            what: "stager slots",
            bytes: usize::MAX,
        };
        // Slots start on 64-byte boundaries (a cache line, and a whole write-combining buffer).
        let slot_bytes = numel.checked_mul(dtype.itemsize()).ok_or_else(overflow)?;
        let stride = slot_bytes
            .checked_next_multiple_of(64)
            .ok_or_else(overflow)?;
        let arena_bytes = stride
            .checked_mul(depth)
            .filter(|&b| b <= isize::MAX as usize)
            .ok_or_else(overflow)?;
        let stats = Counters::default();
        let mut arena: Option<PinnedBuffer> = None;
        let core = SlotRing::new(ordinal, depth, |i, device| {
            let Some(device) = device else {
                // No driver: host destinations only, the slots are never written.
                return Ok(SlotBuf::empty());
            };
            if arena.is_none() {
                let a = PinnedBuffer::new(device, arena_bytes, PinnedFlags::WRITE_COMBINED)?;
                stats.pinned_bytes.add(a.len() as u64);
                arena = Some(a);
            }
            let base = arena.as_mut().expect("allocated above").as_mut_ptr();
            Ok(SlotBuf {
                // SAFETY: i * stride + slot_bytes <= arena_bytes: in bounds (a 0-byte arena is
                // only ever offset by 0).
                ptr: unsafe { base.add(i * stride) },
                cap: slot_bytes,
                grown: None,
                retired: Vec::new(),
                layout: None,
            })
        })?;
        Ok(Self {
            dtype,
            core,
            _arena: arena,
            stats,
        })
    }

    /// The element type.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// The device ordinal served.
    pub fn ordinal(&self) -> i32 {
        self.core.ordinal()
    }

    /// Number of slots.
    pub fn depth(&self) -> usize {
        self.core.depth()
    }

    /// Whether device destinations can be served (a driver and the device were found).
    pub fn has_cuda(&self) -> bool {
        self.core.device().is_some()
    }

    /// A snapshot of the counters.
    pub fn stats(&self) -> PinnedStagerStats {
        let s = &self.stats;
        PinnedStagerStats {
            copies: s.copies.get(),
            host_copies: s.host_copies.get(),
            skipped: s.skipped.get(),
            bytes: s.bytes.get(),
            waits: self.core.waits(),
            queries: self.core.queries(),
            growths: s.growths.get(),
            pinned_bytes: s.pinned_bytes.get(),
        }
    }

    /// A copy into `dst`, configured by the returned builder; `values` and `pad` are raw element
    /// bytes of the stager's dtype. See [`crate::PinnedStager::to`] for the rules.
    pub fn to<'a>(&'a self, dst: &'a DeviceView<'a>) -> RawCopy<'a> {
        RawCopy {
            stager: self,
            dst,
            pad: None,
            mirror: None,
            stream: StreamHandle::LEGACY,
            wait: None,
        }
    }

    pub(super) fn copy_bytes(
        &self,
        c: RawCopy<'_>,
        pad: Option<&[u8]>,
        values: &[u8],
    ) -> Result<CopyOutcome> {
        let RawCopy {
            dst,
            mirror,
            stream,
            wait,
            ..
        } = c;
        let device = self.check(dst, values, pad)?;
        let itemsize = self.dtype.itemsize();
        let total = if pad.is_some() {
            dst.numel() * itemsize
        } else {
            values.len()
        };
        if total == 0 {
            return Ok(CopyOutcome::Empty);
        }
        let key = CopyKey::new(dst.ptr(), dst.nbytes(), pad);
        let mut mirror = mirror;
        if let Some(m) = mirror.as_deref_mut() {
            m.bind(dst.ptr(), dst.nbytes())?;
            if m.matches(key.as_bytes(), values) {
                self.stats.skipped.add(1);
                return Ok(CopyOutcome::Skipped);
            }
        }
        let outcome = match device {
            None => {
                // SAFETY: the view's contract: `dst` is writable host memory of `numel`
                // elements (checked not read-only); `total <= numel * itemsize`.
                // `write_padded` tolerates `values` overlapping `dst` (memmove).
                unsafe { write_padded(dst.ptr() as *mut u8, values, pad, total, true) };
                self.stats.host_copies.add(1);
                CopyOutcome::Host
            }
            Some(device) => {
                let cur = stream.enter_for_copy(device)?;
                let job = Job {
                    dst: dst.ptr(),
                    values,
                    pad,
                    total,
                    stream,
                };
                let slot = match wait {
                    // The caller's function decides how to wait, not whether the copy
                    // completed: the slot is rewritten next, so the event is asked again.
                    Some(w) => self.issue(&cur, job, &mut |e: &Event| {
                        w(SlotEvent::new(e))?;
                        if !e.query()? {
                            e.synchronize()?;
                        }
                        Ok(())
                    }),
                    None => self.issue(&cur, job, &mut |e: &Event| e.synchronize()),
                }?;
                self.stats.copies.add(1);
                CopyOutcome::Issued { slot }
            }
        };
        self.stats.bytes.add(total as u64);
        if let Some(m) = mirror {
            m.record(key.as_bytes(), values);
        }
        Ok(outcome)
    }

    /// Validates a copy before any side effect; the device to use for a device destination.
    #[inline]
    fn check(
        &self,
        dst: &DeviceView<'_>,
        values: &[u8],
        pad: Option<&[u8]>,
    ) -> Result<Option<&Device>> {
        if dst.dtype() != self.dtype {
            return Err(Error::DtypeMismatch {
                expected: self.dtype,
                got: dst.dtype(),
            });
        }
        let itemsize = self.dtype.itemsize();
        if values.len() % itemsize != 0 {
            return Err(Error::RaggedBytes {
                bytes: values.len(),
                itemsize,
            });
        }
        if let Some(p) = pad
            && p.len() != itemsize
        {
            return Err(Error::PadSize {
                got: p.len(),
                expected: itemsize,
                dtype: self.dtype,
            });
        }
        let n = values.len() / itemsize;
        if n > dst.numel() {
            return Err(Error::TooManyValues {
                values: n,
                capacity: dst.numel(),
            });
        }
        if dst.is_read_only() {
            return Err(Error::ReadOnly);
        }
        match dst.memory() {
            MemoryKind::Host => Ok(None),
            MemoryKind::Cuda(id) => {
                let device = self.core.require_device()?;
                if id != self.core.ordinal() {
                    return Err(Error::WrongDevice {
                        what: "stager",
                        expected: self.core.ordinal(),
                        got: id,
                    });
                }
                Ok(Some(device))
            }
        }
    }

    /// Claims a slot, writes it and issues the one copy (the ring's `drive` with the CUDA calls
    /// of [`CopyIo`]); the slot is released whatever happens.
    fn issue(
        &self,
        cur: &Current<'_>,
        job: Job<'_>,
        wait: &mut dyn FnMut(&Event) -> Result<()>,
    ) -> Result<usize> {
        let stream = job.stream;
        let mut io = CopyIo {
            stager: self,
            cur,
            job: &job,
            src: std::ptr::null(),
        };
        self.core
            .ring()
            .drive(&mut self.core.owner(cur, stream, wait, &mut io))
    }

    /// Writes values and padding into the slot's buffer (growing it first if needed); returns
    /// where the copy reads from.
    #[inline]
    fn fill(&self, b: &mut SlotBuf, cur: &Current<'_>, job: &Job<'_>) -> Result<*const u8> {
        if b.cap < job.total {
            self.grow(b, cur, job.total)?;
        }
        // Padding already in the buffer from the last write (same pad, same total) need not be
        // written again: only [values.len(), old values_len) is.
        let new_layout = Layout::new(job.values.len(), job.total, job.pad);
        let fresh_pad_end = match (b.layout.as_ref(), job.pad) {
            (Some(old), Some(_)) if old.same_padding(&new_layout) => {
                old.values_len.max(job.values.len())
            }
            _ => job.total,
        };
        // SAFETY: `b.ptr` is valid for `b.cap >= total` bytes (arena slice or own buffer) and
        // owned by this slot; `values` is the caller's memory, not ours.
        unsafe {
            if fresh_pad_end >= PARALLEL_WRITE_MIN {
                write_padded_parallel(b.ptr, job.values, job.pad, fresh_pad_end);
            } else {
                write_padded(b.ptr, job.values, job.pad, fresh_pad_end, false);
            }
        }
        b.layout = Some(new_layout);
        Ok(b.ptr)
    }

    /// Gives a slot its own, larger buffer.
    #[cold]
    fn grow(&self, b: &mut SlotBuf, cur: &Current<'_>, total: usize) -> Result<()> {
        let cap = total.max(b.cap.saturating_mul(2));
        let mut new = PinnedBuffer::new(cur.device(), cap, PinnedFlags::WRITE_COMBINED)?;
        b.ptr = new.as_mut_ptr();
        b.cap = cap;
        if let Some(old) = b.grown.replace(new) {
            b.retired.push(old);
        }
        b.layout = None;
        self.stats.pinned_bytes.add(cap as u64);
        self.stats.growths.add(1);
        Ok(())
    }
}

/// What one copy does with its claimed slot: write the values and padding, copy them.
struct CopyIo<'s, 'c, 'd, 'j> {
    stager: &'s RawStager,
    cur: &'c Current<'d>,
    job: &'j Job<'j>,
    /// Where the copy reads from, once `fill` wrote the slot.
    src: *const u8,
}

impl SlotIo for CopyIo<'_, '_, '_, '_> {
    #[inline]
    fn fill(&mut self, slot: usize) -> Result<()> {
        // SAFETY: we own the slot (state WRITING) and its last copy completed (`drive`), so
        // nobody else reads or writes the buffer until we release it.
        let b = unsafe { &mut *self.stager.core.data(slot) };
        self.src = self.stager.fill(b, self.cur, self.job)?;
        // The buffer is write-combined: drain the CPU's write-combining buffers before the copy
        // engine may read it.
        store_fence();
        Ok(())
    }

    #[inline]
    fn send(&mut self, _slot: usize) -> Result<()> {
        let (job, src) = (self.job, self.src);
        let stream = job.stream;
        // SAFETY: `src` holds `total` bytes and stays untouched until the event recorded next
        // completed (ring protocol); `dst` is device memory of this device of at least `total`
        // bytes (the view's contract, size and device checked); the stream is a special handle,
        // ours, or vouched for by its maker; the context is current (`cur`).
        #[cfg(not(pinstage_seeded_bug = "skip_copy"))]
        let sent = unsafe {
            match row_shape(job.total).filter(|_| job.dst % ROW_DST_ALIGN == 0) {
                Some((width, height)) => driver::mem::memcpy_2d_htod_async(
                    job.dst,
                    src.cast(),
                    width,
                    height,
                    stream.raw(),
                ),
                None => {
                    driver::mem::memcpy_htod_async(job.dst, src.cast(), job.total, stream.raw())
                }
            }
        };
        // The seeded-bug harness's "the stager skips the copy" (`scripts/gpu-run broken`): the
        // slot is written and its event recorded, but nothing reaches the device.
        #[cfg(pinstage_seeded_bug = "skip_copy")]
        let sent: std::result::Result<(), crate::cuda::DriverError> = {
            let _ = (src, stream);
            Ok(())
        };
        Ok(sent?)
    }
}

impl Drop for RawStager {
    /// Slots whose last copies may still run go to the reaper thread with the arena, which
    /// frees them once those copies completed (never here: the drop does not wait for the
    /// device).
    fn drop(&mut self) {
        let arena = &mut self._arena;
        self.core.release_after_copies(|| arena.take());
    }
}

/// Destinations whose address is a multiple of this take the 2-D path ([`row_shape`]).
pub(crate) const ROW_DST_ALIGN: u64 = 256;

/// Copies from 2 KiB up to 32 KiB go as one 2-D copy of packed 1 KiB rows (or 512- or 256-byte
/// rows when the size is not a multiple of 1 KiB): `Some((row bytes, rows))`. The driver stages a
/// small `cuMemcpyHtoDAsync` through its own command buffer, copying the bytes on the host; a 2-D
/// copy of several rows is handed to the copy engine as is (benches/RESULTS.md has the costs).
/// Either way it is ONE copy of the same contiguous bytes. Only for destinations aligned to
/// 256 bytes.
pub fn row_shape(total: usize) -> Option<(usize, usize)> {
    if !(2048..=32768).contains(&total) {
        return None;
    }
    [1024usize, 512, 256]
        .into_iter()
        .find(|w| total % w == 0)
        .map(|w| (w, total / w))
}

/// One device copy: destination address, values, pad, bytes in all, stream.
struct Job<'a> {
    dst: u64,
    values: &'a [u8],
    pad: Option<&'a [u8]>,
    total: usize,
    stream: StreamHandle<'a>,
}
