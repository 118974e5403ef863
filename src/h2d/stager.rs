//! The stager: a ring of persistent pinned buffers for small host-to-device copies.
//!
//! Each device copy writes values and padding into one slot's pinned buffer on the host and
//! issues exactly ONE copy from it (`cuMemcpyHtoDAsync`, or for 2-32 KiB one `cuMemcpy2DAsync`
//! of packed rows; see [`row_shape`]), then records the slot's event. A slot is not rewritten
//! until that event completed. Slots are claimed through the atomics of the slot ring's protocol: no lock
//! is held while waiting, and a waiting thread blocks no other slot.

use super::mirror::{CopyKey, H2DMirror};
use super::slot::{CopyIo, Grew, Job, SlotBuf};
use crate::cuda::{Current, Device, Event, SlotEvent, StreamHandle};
use crate::dlpack::{DType, DeviceView, MemoryKind};
use crate::error::{Error, Result};
use crate::host::{PinnedBuffer, PinnedFlags};
use crate::ring::slots::{Counter, SlotRing, check_args};
use crate::ring::write::write_padded;

/// Counters of a stager; every field is monotonic except `pinned_bytes`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PinnedStagerStats {
    /// Device copies issued (one driver copy each).
    pub copies: u64,
    /// Copies of host destinations, written directly.
    pub host_copies: u64,
    /// Copies skipped because the mirror showed the destination already held the values.
    pub skipped_copies: u64,
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
    #[cfg_attr(not(any(feature = "testing", feature = "python")), allow(dead_code))]
    pub(super) pad: Option<&'a [u8]>,
    pub(super) mirror: Option<&'a mut H2DMirror>,
    pub(super) stream: StreamHandle<'a>,
    pub(super) wait: Option<&'a mut WaitFn<'a>>,
}

/// How a copy waits for a busy slot's event ([`crate::h2d::StagedCopy::wait_with`]): shown as a
/// [`SlotEvent`], which can be waited for but not recorded.
pub type WaitFn<'a> = dyn FnMut(SlotEvent<'_>) -> Result<()> + 'a;

// The raw copy's own options are public through `RawStager` (the `testing` feature) and used
// by the Python skin; the typed stager sets the same fields itself.
#[cfg_attr(not(any(feature = "testing", feature = "python")), allow(dead_code))]
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
            // SAFETY: i * stride + slot_bytes <= arena_bytes: in bounds (a 0-byte arena is only
            // ever offset by 0).
            Ok(SlotBuf::new(unsafe { base.add(i * stride) }, slot_bytes))
        })?;
        Ok(Self {
            dtype,
            core,
            _arena: arena,
            stats,
        })
    }

    /// The element type.
    #[cfg(feature = "testing")]
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
            skipped_copies: s.skipped.get(),
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
            core: &self.core,
            grew: Grew {
                growths: &self.stats.growths,
                pinned_bytes: &self.stats.pinned_bytes,
            },
            cur,
            job: &job,
            src: std::ptr::null(),
        };
        self.core
            .ring()
            .drive(&mut self.core.owner(cur, stream, wait, &mut io))
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
