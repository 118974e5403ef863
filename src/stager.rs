//! The stager: a ring of persistent pinned buffers for small host-to-device copies.
//!
//! Each device copy writes values and padding into one slot's pinned buffer on the host and
//! issues exactly ONE copy from it (`cuMemcpyHtoDAsync`, or for 2-32 KiB one `cuMemcpy2DAsync`
//! of packed rows, which the driver hands to the copy engine without staging the bytes itself;
//! see [`row_shape`]), then records the slot's event. A slot is not rewritten until that event
//! completed. Slots are claimed through `src/ring.rs`'s atomics: no lock is held while waiting,
//! and a waiting thread blocks no other slot.

use std::marker::PhantomData;
use std::sync::atomic::{AtomicU64, Ordering as StatOrdering};

use crate::device::{Device, Event, StreamHandle};
use crate::dlpack::{DeviceView, MemoryKind};
use crate::driver;
use crate::dtype::{DType, Element};
use crate::error::{Error, Result};
use crate::mirror::{CopyKey, H2DMirror};
use crate::pinned::{PinnedBuffer, PinnedFlags};
use crate::ring::{Release, Ring};
use crate::sync::UnsafeCell;

/// Counters of a stager; every field is monotonic except `pinned_bytes`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StagerStats {
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

#[derive(Default)]
struct Counters {
    copies: AtomicU64,
    host_copies: AtomicU64,
    skipped: AtomicU64,
    bytes: AtomicU64,
    waits: AtomicU64,
    queries: AtomicU64,
    growths: AtomicU64,
    pinned_bytes: AtomicU64,
}

impl Counters {
    #[inline]
    fn add(c: &AtomicU64, v: u64) {
        // Relaxed: statistics only, no data is published through them.
        c.fetch_add(v, StatOrdering::Relaxed);
    }
}

struct Slot {
    buf: UnsafeCell<SlotBuf>,
    event: Event,
}

struct SlotBuf {
    /// The slot's bytes: its slice of the stager's arena, or `grown` once it outgrew that.
    ptr: *mut u8,
    cap: usize,
    /// The slot's own buffer after a copy exceeded its arena slice.
    grown: Option<PinnedBuffer>,
    /// What the buffer holds after its last write: `values_len` value bytes, then the pad
    /// element up to `total` bytes. Lets the next write skip padding that is already there.
    layout: Option<Layout>,
    /// Buffers outgrown by `grown`. They are freed with the stager, not at growth time:
    /// `cuMemFreeHost` may synchronize the whole device, which would stall a live graph.
    retired: Vec<PinnedBuffer>,
}

/// What one `copy_` did.
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

/// The untyped stager: element type chosen at run time (the Python layer uses this one).
/// [`PinnedStager`] is the typed facade.
///
/// `Sync`: the slot protocol gives each slot's buffer a single owner at a time (see
/// `src/ring.rs`); events are driver handles safe to use from any thread.
pub struct Stager {
    dtype: DType,
    ordinal: i32,
    device: Option<Device>,
    unavailable: Option<String>,
    ring: Ring,
    slots: Box<[Slot]>,
    /// One pinned allocation holding every slot's initial buffer: one `cuMemHostAlloc` per
    /// stager instead of one per slot (copies cost the driver the same from either layout,
    /// measured in `driver_costs`). Freed only after `Drop` waited for every copy in flight.
    _arena: Option<PinnedBuffer>,
    stats: Counters,
    /// Whether copies go as rows where they can ([`Stager::set_row_copies`]).
    rows: std::sync::atomic::AtomicBool,
}

// SAFETY: `Slot::buf` is only accessed by the thread that owns the slot in state WRITING (ring
// protocol) or through `&mut self`; everything else is atomics or driver handles usable from any
// thread.
unsafe impl Sync for Stager {}
// SAFETY: all fields are owned and may move between threads (see PinnedBuffer and Event).
unsafe impl Send for Stager {}

impl std::fmt::Debug for Stager {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Stager")
            .field("dtype", &self.dtype)
            .field("device", &self.ordinal)
            .field("depth", &self.ring.depth())
            .field("cuda", &self.device.is_some())
            .finish()
    }
}

/// Default slot capacity in elements.
pub const DEFAULT_NUMEL: usize = 256;
/// Default ring depth. Deeper than the copy engine's lag behind a host issuing copies back to
/// back (about 5 copies of 16 KiB on the H200), so one event query usually serves several
/// claims; 16 slots of 256 int32 hold 16 KiB of pinned memory.
pub const DEFAULT_DEPTH: usize = 16;

impl Stager {
    /// A stager of `depth` slots of `numel` elements of `dtype` on device `ordinal`.
    ///
    /// Without a driver this succeeds and serves host destinations only; a device destination
    /// then gets [`Error::CudaUnavailable`]. A bad ordinal with a driver present is an error.
    pub fn new(dtype: DType, ordinal: i32, numel: usize, depth: usize) -> Result<Self> {
        if depth == 0 {
            return Err(Error::InvalidArgument("depth must be at least 1".into()));
        }
        let slot_bytes = numel
            .checked_mul(dtype.itemsize())
            .ok_or_else(|| Error::InvalidArgument(format!("numel {numel} overflows")))?;
        // Slots start on 64-byte boundaries (a cache line, and a whole write-combining buffer).
        let (stride, arena_bytes) = slot_bytes
            .checked_next_multiple_of(64)
            .and_then(|s| Some((s, s.checked_mul(depth)?)))
            .ok_or_else(|| Error::InvalidArgument(format!("numel {numel} overflows")))?;
        let stats = Counters::default();
        let (device, unavailable, slots, arena) = match Device::new(ordinal) {
            Ok(device) => {
                let mut arena =
                    PinnedBuffer::new(&device, arena_bytes, PinnedFlags::WRITE_COMBINED)?;
                let base = arena.as_mut_ptr();
                let slots = (0..depth)
                    .map(|i| {
                        Ok(Slot {
                            buf: UnsafeCell::new(SlotBuf {
                                // SAFETY: i * stride + slot_bytes <= arena_bytes: in bounds
                                // (a 0-byte arena is only ever offset by 0).
                                ptr: unsafe { base.add(i * stride) },
                                cap: slot_bytes,
                                grown: None,
                                retired: Vec::new(),
                                layout: None,
                            }),
                            event: Event::new(&device)?,
                        })
                    })
                    .collect::<Result<Vec<_>>>()?;
                stats
                    .pinned_bytes
                    .store(arena.len() as u64, StatOrdering::Relaxed);
                (Some(device), None, slots, Some(arena))
            }
            Err(Error::CudaUnavailable { reason }) => (None, Some(reason), Vec::new(), None),
            Err(e) => return Err(e),
        };
        Ok(Self {
            dtype,
            ordinal,
            device,
            unavailable,
            ring: Ring::new(depth),
            slots: slots.into_boxed_slice(),
            _arena: arena,
            stats,
            rows: std::sync::atomic::AtomicBool::new(true),
        })
    }

    /// The element type.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// The device ordinal served.
    pub fn ordinal(&self) -> i32 {
        self.ordinal
    }

    /// Number of slots.
    pub fn depth(&self) -> usize {
        self.ring.depth()
    }

    /// Whether device destinations can be served (a driver and the device were found).
    pub fn has_cuda(&self) -> bool {
        self.device.is_some()
    }

    /// Chooses how a claim learns that its slot's last copy completed: through the stream's
    /// completion watermark and one query for several slots (`true`, the default), or by
    /// querying the slot's own event on every claim (`false`, as before the watermark). Both
    /// are correct; the switch exists so the benches can compare them in one process.
    #[doc(hidden)]
    pub fn set_amortized_checks(&self, on: bool) {
        self.ring.set_amortize(on);
    }

    /// Chooses how a slot's bytes are sent: as rows (`true`, the default: one
    /// `cuMemcpy2DAsync` of packed rows where the size allows, see [`row_shape`]) or always as
    /// one `cuMemcpyHtoDAsync` (`false`). Both are one copy of the same bytes; the switch exists
    /// so the benches can compare them in one process.
    #[doc(hidden)]
    pub fn set_row_copies(&self, on: bool) {
        // Relaxed: a mode switch for benches; either mode is correct.
        self.rows.store(on, StatOrdering::Relaxed);
    }

    /// A snapshot of the counters.
    pub fn stats(&self) -> StagerStats {
        let s = &self.stats;
        let l = |c: &AtomicU64| c.load(StatOrdering::Relaxed);
        StagerStats {
            copies: l(&s.copies),
            host_copies: l(&s.host_copies),
            skipped: l(&s.skipped),
            bytes: l(&s.bytes),
            waits: l(&s.waits),
            queries: l(&s.queries),
            growths: l(&s.growths),
            pinned_bytes: l(&s.pinned_bytes),
        }
    }

    /// Writes `values` (and, with `pad`, the pad element up to the destination's length) into
    /// `dst`, on `stream` for a device destination. `values` and `pad` are raw element bytes of
    /// the stager's dtype. See [`PinnedStager::copy_`] for the rules.
    pub fn copy_bytes(
        &self,
        dst: &DeviceView,
        values: &[u8],
        pad: Option<&[u8]>,
        mirror: Option<&mut H2DMirror>,
        stream: StreamHandle,
    ) -> Result<CopyOutcome> {
        self.copy_bytes_waiting(dst, values, pad, mirror, stream, &mut |e| e.synchronize())
    }

    /// [`Stager::copy_bytes`] with a caller-supplied wait: when the claimed slot's last copy is
    /// still running, `wait(event)` must block until the event completed. The Python layer
    /// polls the event briefly and then releases the GIL there; it runs whole copies of 1 MiB or
    /// more without the GIL.
    pub fn copy_bytes_waiting(
        &self,
        dst: &DeviceView,
        values: &[u8],
        pad: Option<&[u8]>,
        mirror: Option<&mut H2DMirror>,
        stream: StreamHandle,
        wait: &mut dyn FnMut(&Event) -> Result<()>,
    ) -> Result<CopyOutcome> {
        // Validate everything before any side effect.
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
            return Err(Error::InvalidArgument(format!(
                "pad is {} bytes, expected one {}-byte {} element",
                p.len(),
                itemsize,
                self.dtype
            )));
        }
        let n = values.len() / itemsize;
        let capacity = dst.numel();
        if n > capacity {
            return Err(Error::TooManyValues {
                values: n,
                capacity,
            });
        }
        if dst.is_read_only() {
            return Err(Error::ReadOnly);
        }
        let device = match dst.memory() {
            MemoryKind::Cuda(id) => {
                let Some(device) = &self.device else {
                    return Err(Error::unavailable(
                        self.unavailable.clone().unwrap_or_default(),
                    ));
                };
                if id != self.ordinal {
                    return Err(Error::WrongDevice {
                        what: "stager",
                        expected: self.ordinal,
                        got: id,
                    });
                }
                Some(device)
            }
            MemoryKind::Host => None,
        };
        let total = if pad.is_some() {
            capacity * itemsize
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
                Counters::add(&self.stats.skipped, 1);
                return Ok(CopyOutcome::Skipped);
            }
        }
        let outcome = match device {
            None => {
                // SAFETY: the view's contract: `dst` is valid, writable host memory of
                // `capacity` elements; `total <= capacity * itemsize`. `write_padded` tolerates
                // `values` overlapping `dst` (memmove).
                unsafe { write_padded(dst.ptr() as *mut u8, values, pad, total, true) };
                Counters::add(&self.stats.host_copies, 1);
                CopyOutcome::Host
            }
            Some(device) => {
                let _g = device.enter_for_copy(stream)?;
                let job = Job {
                    dst: dst.ptr(),
                    values,
                    pad,
                    total,
                    stream,
                };
                let slot = self.issue(device, job, wait)?;
                Counters::add(&self.stats.copies, 1);
                CopyOutcome::Issued { slot }
            }
        };
        Counters::add(&self.stats.bytes, total as u64);
        if let Some(m) = mirror {
            m.record(key.as_bytes(), values);
        }
        Ok(outcome)
    }

    /// Claims a slot, writes it and issues the one copy. Context is current.
    fn issue(
        &self,
        device: &Device,
        job: Job<'_>,
        wait: &mut dyn FnMut(&Event) -> Result<()>,
    ) -> Result<usize> {
        let Job {
            dst,
            values,
            pad,
            total,
            stream,
        } = job;
        let claim = self.ring.claim();
        let slot = &self.slots[claim.index];
        // How the slot is released if an error ends this copy early.
        let mut on_error = if claim.was_in_flight() {
            OnError::Restore
        } else {
            OnError::Idle
        };
        let result = (|| -> Result<Release> {
            if claim.was_in_flight() {
                // Known complete through the stream's watermark or one query (src/ring.rs).
                let known = self.ring.check(&claim, &mut |j| {
                    Counters::add(&self.stats.queries, 1);
                    self.slots[j].event.query()
                })?;
                if !known {
                    Counters::add(&self.stats.waits, 1);
                    wait(&slot.event)?;
                }
                on_error = OnError::Idle;
            }
            // SAFETY: we own the slot (state WRITING) and its last copy completed, so nobody
            // else reads or writes the buffer until we release it.
            let src = unsafe {
                slot.buf.with_mut(|b| -> Result<*const u8> {
                    let SlotBuf {
                        ptr,
                        cap: slot_cap,
                        grown,
                        retired,
                        layout,
                    } = &mut *b;
                    if *slot_cap < total {
                        let cap = total.max(slot_cap.saturating_mul(2));
                        let mut new = PinnedBuffer::new(device, cap, PinnedFlags::WRITE_COMBINED)?;
                        *ptr = new.as_mut_ptr();
                        *slot_cap = cap;
                        if let Some(old) = grown.replace(new) {
                            retired.push(old);
                        }
                        *layout = None;
                        self.stats
                            .pinned_bytes
                            .fetch_add(cap as u64, StatOrdering::Relaxed);
                        Counters::add(&self.stats.growths, 1);
                    }
                    // Padding already in the buffer from the last write (same pad, same total)
                    // need not be written again: only [values.len(), old values_len) is.
                    let new_layout = Layout::new(values.len(), total, pad);
                    let fresh_pad_end = match (layout.as_ref(), pad) {
                        (Some(old), Some(_)) if old.same_padding(&new_layout) => {
                            old.values_len.max(values.len())
                        }
                        _ => total,
                    };
                    // SAFETY: `ptr` is valid for `slot_cap >= total` bytes (arena slice or own
                    // buffer), owned by this slot; `values` is the caller's memory, not ours.
                    if fresh_pad_end >= PARALLEL_WRITE_MIN {
                        write_padded_parallel(*ptr, values, pad, fresh_pad_end);
                    } else {
                        write_padded(*ptr, values, pad, fresh_pad_end, false);
                    }
                    *layout = Some(new_layout);
                    Ok(*ptr as *const u8)
                })
            }?;
            // The buffer is write-combined: drain the CPU's write-combining buffers before the
            // copy engine may read it.
            store_fence();
            let mark = self.ring.mark(stream.tracking_id());
            let begin = self.ring.begin(mark);
            // SAFETY: `src` holds `total` bytes and stays untouched until the event recorded
            // below completed (ring protocol); `dst` is device memory of this device (checked by
            // the caller: the view's contract covers its size); the stream is the caller's.
            unsafe {
                let rows = self.rows.load(StatOrdering::Relaxed) && dst % ROW_DST_ALIGN == 0;
                match row_shape(total).filter(|_| rows) {
                    Some((width, height)) => {
                        driver::memcpy_2d_htod_async(dst, src.cast(), width, height, stream.raw())
                    }
                    None => driver::memcpy_htod_async(dst, src.cast(), total, stream.raw()),
                }
            }?;
            if let Err(e) = slot.event.record_entered(stream) {
                // The copy cannot be tracked: wait for it before the slot is reused.
                // SAFETY: the caller's stream, context current.
                on_error = match unsafe { driver::stream_synchronize(stream.raw()) } {
                    Ok(()) => OnError::Idle,
                    Err(_) => OnError::Untracked,
                };
                return Err(e);
            }
            let done = self.ring.done(mark);
            Ok(Release::InFlight { mark, begin, done })
        })();
        match (&result, on_error) {
            (Ok(how), _) => self.ring.release(claim.index, *how),
            (Err(_), OnError::Idle) => self.ring.release(claim.index, Release::Idle),
            (Err(_), OnError::Restore) => {
                self.ring.release(claim.index, Release::Restore(claim.prev))
            }
            // A copy may still run and no event describes it (the context is failing: every
            // later call errs too): release it in flight, unmarked, so a claimer asks the driver.
            (Err(_), OnError::Untracked) => self.ring.release(
                claim.index,
                Release::InFlight {
                    mark: crate::ring::NO_MARK,
                    begin: 0,
                    done: 0,
                },
            ),
        }
        result.map(|_| claim.index)
    }
}

impl Drop for Stager {
    fn drop(&mut self) {
        for i in 0..self.slots.len() {
            if self.ring.is_in_flight(i) {
                // Never free a buffer a copy still reads. Errors are ignored: drop never panics.
                let _ = self.slots[i].event.synchronize();
            }
        }
    }
}

/// Destinations whose address is a multiple of this take the 2-D path ([`row_shape`]).
pub(crate) const ROW_DST_ALIGN: u64 = 256;

/// Copies from 2 KiB up to 32 KiB go as one 2-D copy of packed 1 KiB rows (or 512- or 256-byte
/// rows when the size is not a multiple of 1 KiB): `Some((row bytes, rows))`. The driver stages a
/// small `cuMemcpyHtoDAsync` through its own command buffer, copying the bytes on the host, which
/// costs about 2 µs more for 16 KiB than for 4 B; a 2-D copy of several rows is handed to the
/// copy engine as is (paced on the H200: 16 KiB as 16 rows 2.0-3.0 µs with its event record, as
/// one `cuMemcpyHtoDAsync` 3.5-4.6 µs; from 32 KiB up the driver already does so for 1-D copies).
/// Either way it is ONE copy of the same contiguous bytes.
///
/// Only for destinations aligned to [`ROW_DST_ALIGN`]: the 2-D path has been run on the H200 for
/// those (allocations and slices at multiples of 256 bytes); other destinations keep the 1-D copy
/// until it has been run on them too.
pub(crate) fn row_shape(total: usize) -> Option<(usize, usize)> {
    if !(2048..=32768).contains(&total) {
        return None;
    }
    [1024usize, 512, 256]
        .into_iter()
        .find(|w| total % w == 0)
        .map(|w| (w, total / w))
}

/// How [`Stager::issue`] gives its slot back when an error ends the copy early.
#[derive(Clone, Copy)]
enum OnError {
    /// Nothing from the buffer is pending.
    Idle,
    /// The slot's previous copy may still run: its old word still describes it.
    Restore,
    /// A copy was issued but its event could not be recorded nor the stream synchronized.
    Untracked,
}

/// One device copy: destination address, values, pad, bytes in all, stream.
struct Job<'a> {
    dst: u64,
    values: &'a [u8],
    pad: Option<&'a [u8]>,
    total: usize,
    stream: StreamHandle,
}

/// The content of a slot buffer after a write.
#[derive(Clone, Copy, PartialEq, Eq)]
struct Layout {
    values_len: usize,
    total: usize,
    pad: [u8; 16],
    pad_len: usize,
}

impl Layout {
    fn new(values_len: usize, total: usize, pad: Option<&[u8]>) -> Self {
        let mut p = [0u8; 16];
        let pad_len = pad.map_or(0, |x| {
            p[..x.len()].copy_from_slice(x);
            x.len()
        });
        Self {
            values_len,
            total,
            pad: p,
            pad_len,
        }
    }

    fn same_padding(&self, other: &Layout) -> bool {
        self.pad_len > 0
            && self.total == other.total
            && self.pad == other.pad
            && self.pad_len == other.pad_len
    }
}

#[inline]
fn store_fence() {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: sfence has no preconditions on x86_64.
    unsafe {
        std::arch::x86_64::_mm_sfence()
    };
    #[cfg(not(target_arch = "x86_64"))]
    std::sync::atomic::fence(std::sync::atomic::Ordering::SeqCst);
}

/// Writes `values` then the `pad` element repeated up to `total` bytes at `dst`, never reading
/// `dst` (it may be write-combined).
///
/// # Safety
/// 1. `dst` is valid for writes of `total` bytes, and `values.len() <= total`.
/// 2. `pad` is `Some` when `values.len() < total`; `total - values.len()` is a multiple of its
///    length, which divides 512.
/// 3. Without `may_overlap`, `values` does not overlap `dst..dst+total`.
#[inline]
unsafe fn write_padded(
    dst: *mut u8,
    values: &[u8],
    pad: Option<&[u8]>,
    total: usize,
    may_overlap: bool,
) {
    // SAFETY: contract 1 and 3 (memmove when overlap is possible).
    unsafe {
        if may_overlap {
            std::ptr::copy(values.as_ptr(), dst, values.len());
        } else {
            std::ptr::copy_nonoverlapping(values.as_ptr(), dst, values.len());
        }
    }
    let rest = total - values.len();
    if rest == 0 {
        return;
    }
    let Some(p) = pad else { return };
    let mut chunk = [0u8; 512];
    for (i, b) in chunk.iter_mut().enumerate() {
        *b = p[i % p.len()];
    }
    // SAFETY: contract 1: we write exactly `rest` bytes after the values.
    unsafe {
        let mut out = dst.add(values.len());
        let mut left = rest;
        while left >= chunk.len() {
            std::ptr::copy_nonoverlapping(chunk.as_ptr(), out, chunk.len());
            out = out.add(chunk.len());
            left -= chunk.len();
        }
        std::ptr::copy_nonoverlapping(chunk.as_ptr(), out, left);
    }
}

/// From this many bytes on, a slot write is split over the rayon pool: one core writes
/// write-combined memory at about 7 GB/s (a 16 MiB stager copy ran at 6.8 GB/s on the H200
/// host), several keep up with the copy engine.
pub(crate) const PARALLEL_WRITE_MIN: usize = 1 << 20;

/// [`write_padded`] (no overlap) by several threads, in pieces of 256 KiB.
///
/// # Safety
/// As [`write_padded`] with `may_overlap = false`.
unsafe fn write_padded_parallel(dst: *mut u8, values: &[u8], pad: Option<&[u8]>, total: usize) {
    use rayon::prelude::*;
    // A multiple of 512, so every pad piece starts on an element boundary.
    const PIECE: usize = 256 << 10;
    // SAFETY: contract 1: `dst` is valid for writes of `total` bytes and nothing else uses them;
    // the slice is only written, never read (the memory may be write-combined).
    let out = unsafe { std::slice::from_raw_parts_mut(dst, total) };
    let (head, tail) = out.split_at_mut(values.len());
    head.par_chunks_mut(PIECE)
        .zip(values.par_chunks(PIECE))
        .for_each(|(d, s)| d.copy_from_slice(s));
    if let Some(p) = pad
        && !tail.is_empty()
    {
        tail.par_chunks_mut(PIECE).for_each(|d| {
            // SAFETY: `d` is ours, `d.len()` bytes, a whole number of pad elements (contract 2:
            // the pad length divides 512, so it divides PIECE and the whole tail).
            unsafe { write_padded(d.as_mut_ptr(), &[], Some(p), d.len(), false) }
        });
    }
}

/// Typed facade over [`Stager`]: `PinnedStager::<i32>::new(0, 256, 8)`.
pub struct PinnedStager<T: Element> {
    raw: Stager,
    _t: PhantomData<fn() -> T>,
}

impl<T: Element> std::fmt::Debug for PinnedStager<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.raw.fmt(f)
    }
}

impl<T: Element> PinnedStager<T> {
    /// A ring of `depth` pinned slots of `numel` elements on device `ordinal` (defaults:
    /// [`DEFAULT_NUMEL`], [`DEFAULT_DEPTH`]). Succeeds without a driver (host destinations
    /// only).
    pub fn new(ordinal: i32, numel: usize, depth: usize) -> Result<Self> {
        Ok(Self {
            raw: Stager::new(T::DTYPE, ordinal, numel, depth)?,
            _t: PhantomData,
        })
    }

    /// `dst[..values.len()] = values` and, with `pad`, the rest of `dst` = `pad`, as ONE
    /// non-blocking host-to-device copy on `stream` from a pinned ring slot.
    ///
    /// - Without `pad` only `values.len()` elements change; more values than `dst` holds is
    ///   [`Error::TooManyValues`]; a 0-element copy issues nothing.
    /// - `dst` must be of `T`'s dtype ([`Error::DtypeMismatch`]), writable, on this stager's
    ///   device ([`Error::WrongDevice`]). A host destination is written directly, padding too.
    /// - A stream capturing a CUDA graph is refused ([`Error::StreamCapturing`]).
    /// - With a `mirror` that already records these values for `dst`, nothing is copied.
    /// - `values` may be overwritten as soon as this returns.
    pub fn copy_(
        &self,
        dst: &DeviceView,
        values: &[T],
        pad: Option<T>,
        mirror: Option<&mut H2DMirror>,
        stream: StreamHandle,
    ) -> Result<CopyOutcome> {
        let pad_bytes = pad.as_ref().map(bytemuck::bytes_of);
        self.raw
            .copy_bytes(dst, bytemuck::cast_slice(values), pad_bytes, mirror, stream)
    }

    /// Counters.
    pub fn stats(&self) -> StagerStats {
        self.raw.stats()
    }

    /// The untyped stager.
    pub fn raw(&self) -> &Stager {
        &self.raw
    }
}

/// [`store_fence`], for the benches.
pub(crate) fn store_fence_for_bench() {
    store_fence();
}

/// [`write_padded`] without overlap, for the benches.
///
/// # Safety
/// As [`write_padded`] with `may_overlap = false`.
pub(crate) unsafe fn write_padded_for_bench(
    dst: *mut u8,
    values: &[u8],
    pad: Option<&[u8]>,
    total: usize,
) {
    // SAFETY: forwarded contract.
    unsafe { write_padded(dst, values, pad, total, false) }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn row_shapes_cover_the_bytes_exactly() {
        assert_eq!(row_shape(16384), Some((1024, 16)));
        assert_eq!(row_shape(2048), Some((1024, 2)));
        assert_eq!(row_shape(32768), Some((1024, 32)));
        assert_eq!(row_shape(2560), Some((512, 5)));
        assert_eq!(row_shape(2304), Some((256, 9)));
        for total in [0usize, 4, 1024, 2047, 2050, 4100, 32769, 65536, 1 << 20] {
            assert_eq!(row_shape(total), None, "{total}");
        }
        for total in 0..70_000usize {
            if let Some((w, h)) = row_shape(total) {
                assert_eq!(w * h, total);
                assert!(h >= 2 && w >= 256);
            }
        }
    }

    #[test]
    fn parallel_write_matches_serial() {
        if cfg!(miri) {
            return;
        }
        for itemsize in [1usize, 2, 4, 8, 16] {
            for (n, total_elems) in [
                (0usize, 300_000usize),
                (100_000, 300_000),
                (300_000, 300_000),
            ] {
                let total = total_elems * itemsize;
                let values: Vec<u8> = (0..n * itemsize).map(|i| (i % 253) as u8 + 1).collect();
                let pad: Vec<u8> = (0..itemsize).map(|i| 0xC0 + i as u8).collect();
                let mut a = vec![0xEEu8; total];
                let mut b = vec![0x11u8; total];
                // SAFETY: both hold `total` bytes; values do not overlap them.
                unsafe {
                    write_padded(a.as_mut_ptr(), &values, Some(&pad), total, false);
                    write_padded_parallel(b.as_mut_ptr(), &values, Some(&pad), total);
                }
                assert!(a == b, "itemsize {itemsize}, {n} of {total_elems}");
            }
        }
    }

    #[test]
    fn write_padded_layout() {
        for itemsize in [1usize, 2, 4, 8, 16] {
            for total_elems in [0usize, 1, 3, 255, 256, 257, 1000] {
                if cfg!(miri) && total_elems > 257 {
                    continue;
                }
                for n in [0usize, 1, total_elems / 2, total_elems] {
                    if n > total_elems {
                        continue;
                    }
                    let values: Vec<u8> = (0..n * itemsize).map(|i| (i % 251) as u8 + 1).collect();
                    let pad: Vec<u8> = (0..itemsize).map(|i| 0xA0 + i as u8).collect();
                    let mut out = vec![0xEEu8; total_elems * itemsize + 7];
                    // SAFETY: out holds total + 7 bytes; values do not overlap.
                    unsafe {
                        write_padded(
                            out.as_mut_ptr(),
                            &values,
                            Some(&pad),
                            total_elems * itemsize,
                            false,
                        )
                    };
                    assert_eq!(&out[..values.len()], &values[..]);
                    for e in n..total_elems {
                        assert_eq!(&out[e * itemsize..(e + 1) * itemsize], &pad[..]);
                    }
                    assert!(out[total_elems * itemsize..].iter().all(|&b| b == 0xEE));
                }
            }
        }
    }
}
