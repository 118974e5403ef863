//! The step stager: a ring of pinned slots laid out like the device arena, one commit per step.

use std::marker::PhantomData;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use super::layout::{FieldId, FieldKey, StepLayout};
use super::mem::{AlignedBytes, BlockPool, DeviceMem, HostMem, StepBlock, pinned_slots};
use super::plan::{AUTO_GAP_BATCH, AUTO_GAP_COPIES, plan};
use crate::cuda::{Current, Device, Event, StreamHandle};
use crate::driver;
use crate::error::{Error, Result};
use crate::h2d::ring::{Claim, Release, Ring, SlotOwner};
use crate::h2d::write::write_padded;
use crate::view::{DeviceView, Element, MemoryKind};
use std::cell::UnsafeCell;

/// Where committed steps go.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StepMode {
    /// One persistent arena (pinstage's device allocation, or a bound buffer): each field has a
    /// stable device address, so a CUDA graph can capture it once. A commit copies the step's
    /// used bytes into it.
    Arena,
    /// A fresh block per commit, never rewritten while its [`StepBlock`] lives (for consumers
    /// whose arrays are immutable, such as JAX).
    Fresh,
    /// No copy: consumers read the pinned slot in place over PCIe (unified addressing); the
    /// commit records the slot's event after the consumer's work.
    ZeroCopy,
}

/// Counters of a step stager (monotonic).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StepStats {
    /// Steps committed.
    pub steps: u64,
    /// `cuMemcpyHtoDAsync` calls (or host copies without a driver).
    pub copies: u64,
    /// `cuMemcpyBatchAsync` calls.
    pub batches: u64,
    /// Entries of those batches.
    pub batch_entries: u64,
    /// Bytes copied (used rows, and the gaps between them that one copy spans).
    pub bytes: u64,
    /// Written fields skipped because their values equalled the last committed ones.
    pub skipped_fields: u64,
    /// Committed steps that issued nothing (nothing written, or all of it unchanged).
    pub empty_steps: u64,
    /// Steps released without a commit (dropped, or an exception in a `with` block).
    pub aborted: u64,
    /// Claims that waited for a slot's last copy.
    pub waits: u64,
    /// `cuEventQuery` calls made to learn that a claimed slot's last copy completed.
    pub queries: u64,
    /// Fresh blocks allocated (fresh mode).
    pub blocks: u64,
}

#[derive(Default)]
struct Counters {
    steps: AtomicU64,
    copies: AtomicU64,
    batches: AtomicU64,
    batch_entries: AtomicU64,
    bytes: AtomicU64,
    skipped_fields: AtomicU64,
    empty_steps: AtomicU64,
    aborted: AtomicU64,
    waits: AtomicU64,
    queries: AtomicU64,
}

#[inline]
fn add(c: &AtomicU64, v: u64) {
    // Relaxed: statistics only.
    c.fetch_add(v, Ordering::Relaxed);
}

/// What one commit did.
#[derive(Debug)]
pub struct Committed {
    /// Driver calls issued: copies plus batches (0: nothing to send).
    pub calls: u32,
    /// Whether the used spans went as one `cuMemcpyBatchAsync`.
    pub batched: bool,
    /// Bytes copied.
    pub bytes: usize,
    /// Written fields skipped as unchanged.
    pub skipped: u32,
    /// Fresh mode: the block holding this step.
    pub block: Option<StepBlock>,
}

/// Per-slot state only the slot's owner touches.
#[derive(Default)]
struct Scratch {
    /// Rows written per field in the open step (0: not written).
    used: Vec<usize>,
    /// The rows that are sent after skipping unchanged fields.
    send: Vec<usize>,
    segs: Vec<(usize, usize)>,
    dsts: Vec<u64>,
    srcs: Vec<u64>,
    sizes: Vec<usize>,
}

struct StepSlot {
    event: Option<Event>,
    scratch: UnsafeCell<Scratch>,
}

enum Target {
    /// pinstage's device arena.
    Device(Arc<DeviceMem>),
    /// Host arena (no driver).
    Host(AlignedBytes),
    /// A caller's buffer.
    Bound {
        ptr: u64,
        host: bool,
    },
    Fresh(Arc<BlockPool>),
    ZeroCopy,
}

/// Builds a [`StepStager`].
#[must_use]
pub struct StepStagerBuilder {
    layout: StepLayout,
    device: i32,
    depth: usize,
    mode: StepMode,
    max_gap: Option<usize>,
    batch: bool,
    bound: Option<(u64, usize, MemoryKind, bool)>,
}

impl std::fmt::Debug for StepStagerBuilder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StepStagerBuilder")
            .field("device", &self.device)
            .field("depth", &self.depth)
            .field("mode", &self.mode)
            .finish()
    }
}

/// Default number of slots of a step stager: steps in flight before a claim waits.
pub const DEFAULT_STEP_DEPTH: usize = 4;

impl StepStagerBuilder {
    /// The CUDA device ordinal (default 0).
    pub fn device(mut self, ordinal: i32) -> Self {
        self.device = ordinal;
        self
    }

    /// Slots in the ring (default [`DEFAULT_STEP_DEPTH`]; 1 to [`crate::MAX_DEPTH`]).
    pub fn depth(mut self, depth: usize) -> Self {
        self.depth = depth;
        self
    }

    /// Where committed steps go (default [`StepMode::Arena`]).
    pub fn mode(mut self, mode: StepMode) -> Self {
        self.mode = mode;
        self
    }

    /// The largest run of unused bytes between two written fields that one copy may span:
    /// bytes in such a gap are copied too, so the device's bytes past a field's used rows are
    /// unspecified after a commit. 0 copies exactly the used rows. Default: chosen per commit
    /// from the measured costs ([`AUTO_GAP_BATCH`] when the spans can go as one batch,
    /// [`AUTO_GAP_COPIES`] when each would be a copy of its own).
    pub fn max_gap(mut self, bytes: usize) -> Self {
        self.max_gap = Some(bytes);
        self
    }

    /// Whether split spans may go as one `cuMemcpyBatchAsync` (default true, where the driver
    /// has it); false issues one copy per span (the benches compare both).
    pub fn batch(mut self, on: bool) -> Self {
        self.batch = on;
        self
    }

    /// Commits into `arena` (at least the layout's bytes, aligned to 256 bytes, writable, on
    /// this stager's device or in host memory) instead of an arena pinstage allocates.
    ///
    /// # Safety
    /// The arena's memory must stay valid for the stager's life and until its last commit
    /// completed, and nothing else may write it meanwhile.
    pub unsafe fn bind(mut self, arena: &DeviceView<'_>) -> Self {
        self.bound = Some((
            arena.ptr(),
            arena.nbytes(),
            arena.memory(),
            arena.is_read_only(),
        ));
        self
    }

    /// Builds the stager: the pinned slots and, in arena mode, the device arena. Without a
    /// driver it works against host memory (slots, arena and blocks are plain host bytes).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a depth outside 1..=65536, a negative device, a bound
    /// arena too small, misaligned, read-only or on another device, or a bound arena with a
    /// mode other than arena; [`Error::NoSuchDevice`], [`Error::OutOfMemory`],
    /// [`Error::Driver`] when memory or events cannot be had.
    pub fn build(self) -> Result<StepStager> {
        StepStager::new(self)
    }
}

/// A ring of pinned slots laid out like a [`StepLayout`]: a step claims a slot, fills fields in
/// place, and commits them with the fewest driver calls (one copy when the used bytes are
/// dense, else one batch), then records the slot's event. A slot is not rewritten before its
/// copy completed. `Sync`: threads commit steps concurrently, each in its own slot.
pub struct StepStager {
    layout: StepLayout,
    mode: StepMode,
    ordinal: i32,
    device: Option<Device>,
    unavailable: Option<String>,
    ring: Ring,
    slots: Box<[StepSlot]>,
    mem: Arc<HostMem>,
    /// Device address of the slot memory (zero-copy reads); 0 without a driver.
    mem_dev: u64,
    target: Target,
    mirror: Option<parking_lot::Mutex<Vec<Option<Vec<u8>>>>>,
    max_gap: Option<usize>,
    batch: bool,
    stats: Counters,
}

// SAFETY: each slot's scratch and bytes are touched only by the thread owning the slot (ring
// protocol); everything else is atomics, locks, or driver handles usable from any thread.
unsafe impl Sync for StepStager {}
// SAFETY: all fields are owned and movable between threads.
unsafe impl Send for StepStager {}

impl std::fmt::Debug for StepStager {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StepStager")
            .field("fields", &self.layout.len())
            .field("nbytes", &self.layout.nbytes())
            .field("mode", &self.mode)
            .field("depth", &self.ring.depth())
            .field("cuda", &self.device.is_some())
            .finish()
    }
}

impl StepStager {
    /// A builder for steps of `layout`.
    pub fn builder(layout: &StepLayout) -> StepStagerBuilder {
        StepStagerBuilder {
            layout: layout.clone(),
            device: 0,
            depth: DEFAULT_STEP_DEPTH,
            mode: StepMode::Arena,
            max_gap: None,
            batch: true,
            bound: None,
        }
    }

    fn new(b: StepStagerBuilder) -> Result<Self> {
        if !(1..=crate::MAX_DEPTH).contains(&b.depth) {
            return Err(Error::arg("depth", b.depth, "1 to 65536"));
        }
        if b.device < 0 {
            return Err(Error::arg("device", b.device, "a CUDA device ordinal >= 0"));
        }
        let nbytes = b.layout.nbytes();
        if let Some((ptr, len, memory, read_only)) = b.bound {
            if b.mode != StepMode::Arena {
                return Err(Error::arg(
                    "arena",
                    "a bound buffer",
                    "no bound arena outside arena mode",
                ));
            }
            if len < nbytes {
                return Err(Error::DestinationTooSmall {
                    got: len,
                    needed: nbytes,
                });
            }
            if ptr % super::FIELD_ALIGN as u64 != 0 {
                return Err(Error::arg(
                    "arena",
                    format!("address {ptr:#x}"),
                    "an address aligned to 256 bytes",
                ));
            }
            if read_only {
                return Err(Error::ReadOnly);
            }
            if let MemoryKind::Cuda(id) = memory
                && id != b.device
            {
                return Err(Error::WrongDevice {
                    what: "step stager",
                    expected: b.device,
                    got: id,
                });
            }
        }
        let total = nbytes
            .checked_mul(b.depth)
            .filter(|&t| t <= isize::MAX as usize)
            .ok_or(Error::OutOfMemory {
                what: "step slots",
                bytes: usize::MAX,
            })?;
        let (device, unavailable) = match Device::new(b.device) {
            Ok(d) => (Some(d), None),
            Err(Error::CudaUnavailable { reason }) => (None, Some(reason)),
            Err(e) => return Err(e),
        };
        if let (Some((_, _, MemoryKind::Cuda(_), _)), None) = (b.bound, &device) {
            return Err(Error::unavailable(unavailable.clone().unwrap_or_default()));
        }
        let (mem, mem_dev, events) = match &device {
            Some(d) => {
                let (mem, dev) = pinned_slots(d, total)?;
                let cur = d.enter()?;
                let events = (0..b.depth)
                    .map(|_| Event::new_in(&cur).map(Some))
                    .collect::<Result<Vec<_>>>()?;
                (mem, dev, events)
            }
            None => (
                HostMem::Plain(AlignedBytes::new(total, "step slots")?),
                0,
                (0..b.depth).map(|_| None).collect(),
            ),
        };
        let target = match (b.mode, b.bound, &device) {
            (StepMode::Arena, Some((ptr, _, memory, _)), _) => Target::Bound {
                ptr,
                host: memory == MemoryKind::Host,
            },
            (StepMode::Arena, None, Some(d)) => {
                let cur = d.enter()?;
                Target::Device(Arc::new(DeviceMem::new(&cur, nbytes)?))
            }
            (StepMode::Arena, None, None) => Target::Host(AlignedBytes::new(nbytes, "step arena")?),
            (StepMode::Fresh, _, d) => Target::Fresh(Arc::new(BlockPool::new(d.clone(), nbytes))),
            (StepMode::ZeroCopy, _, _) => Target::ZeroCopy,
        };
        let nfields = b.layout.len();
        let slots = events
            .into_iter()
            .map(|event| StepSlot {
                event,
                scratch: UnsafeCell::new(Scratch {
                    used: vec![0; nfields],
                    send: vec![0; nfields],
                    ..Scratch::default()
                }),
            })
            .collect();
        let mirror = (b.layout.any_skip() && b.mode == StepMode::Arena)
            .then(|| parking_lot::Mutex::new(vec![None; nfields]));
        let batch = b.batch
            && driver::probe().is_ok_and(|p| p.driver_version >= driver::mem::BATCH_MIN_DRIVER);
        Ok(Self {
            layout: b.layout,
            mode: b.mode,
            ordinal: b.device,
            device,
            unavailable,
            ring: Ring::new(b.depth),
            slots,
            mem: Arc::new(mem),
            mem_dev,
            target,
            mirror,
            max_gap: b.max_gap,
            batch,
            stats: Counters::default(),
        })
    }

    /// The layout.
    pub fn layout(&self) -> &StepLayout {
        &self.layout
    }

    /// Where committed steps go.
    pub fn mode(&self) -> StepMode {
        self.mode
    }

    /// Number of slots.
    pub fn depth(&self) -> usize {
        self.ring.depth()
    }

    /// The device ordinal.
    pub fn ordinal(&self) -> i32 {
        self.ordinal
    }

    /// Whether a driver and the device were found (else everything lives in host memory).
    pub fn has_cuda(&self) -> bool {
        self.device.is_some()
    }

    /// The device, when there is a driver.
    pub fn device(&self) -> Option<&Device> {
        self.device.as_ref()
    }

    pub(crate) fn unavailable(&self) -> Error {
        Error::unavailable(self.unavailable.clone().unwrap_or_default())
    }

    /// Address of the arena (arena mode): a device address, or a host address without a
    /// driver (or for a bound host buffer); `None` in other modes.
    pub fn arena_ptr(&self) -> Option<u64> {
        match &self.target {
            Target::Device(d) => Some(d.ptr()),
            Target::Host(h) => Some(h.ptr() as u64),
            Target::Bound { ptr, .. } => Some(*ptr),
            Target::Fresh(_) | Target::ZeroCopy => None,
        }
    }

    /// Whether the arena (or fresh blocks) is host memory: no driver, or a bound host buffer.
    pub fn arena_is_host(&self) -> bool {
        match &self.target {
            Target::Device(_) | Target::ZeroCopy => false,
            Target::Host(_) => true,
            Target::Bound { host, .. } => *host,
            Target::Fresh(_) => self.device.is_none(),
        }
    }

    /// A snapshot of the counters.
    pub fn stats(&self) -> StepStats {
        let s = &self.stats;
        let l = |c: &AtomicU64| c.load(Ordering::Relaxed);
        StepStats {
            steps: l(&s.steps),
            copies: l(&s.copies),
            batches: l(&s.batches),
            batch_entries: l(&s.batch_entries),
            bytes: l(&s.bytes),
            skipped_fields: l(&s.skipped_fields),
            empty_steps: l(&s.empty_steps),
            aborted: l(&s.aborted),
            waits: l(&s.waits),
            queries: l(&s.queries),
            blocks: match &self.target {
                Target::Fresh(p) => p.allocated.load(Ordering::Relaxed),
                _ => 0,
            },
        }
    }

    /// Claims a slot for a new step, waiting (blocking) for its last copy if it still runs.
    ///
    /// # Errors
    /// [`Error::Driver`] when the driver fails while learning that the slot's copy completed.
    pub fn step(&self) -> Result<Step<'_>> {
        let raw = self.open(None, &mut |e: &Event| e.synchronize())?;
        Ok(Step {
            stager: self,
            raw: Some(raw),
            _not_send: PhantomData,
        })
    }

    /// The claim of a new step without spinning: `None` when every slot is owned by another
    /// thread's open step (the Python layer then blocks with the GIL released).
    #[cfg(feature = "python")]
    pub(crate) fn try_claim(&self) -> Option<Claim> {
        self.ring.try_claim()
    }

    /// A claim, spinning (yielding) while every slot is in another thread's open step.
    #[cfg(feature = "python")]
    pub(crate) fn claim_blocking(&self) -> Claim {
        self.ring.claim()
    }

    /// Orders `stream` after every commit issued so far (the device waits, not the host); with
    /// `None` the host waits for them.
    ///
    /// # Errors
    /// [`Error::Driver`].
    pub fn order_after_commits(&self, stream: Option<StreamHandle<'_>>) -> Result<()> {
        for s in self.slots.iter() {
            if let Some(e) = &s.event {
                match stream {
                    Some(h) => e.wait_on(h)?,
                    None => e.synchronize()?,
                }
            }
        }
        Ok(())
    }

    /// Opens a step on `claim` (or a new blocking claim), waiting for the slot's last copy with
    /// `wait`.
    pub(crate) fn open(
        &self,
        claim: Option<Claim>,
        wait: &mut dyn FnMut(&Event) -> Result<()>,
    ) -> Result<RawStep> {
        let claim = claim.unwrap_or_else(|| self.ring.claim());
        if claim.was_in_flight() {
            let Some(device) = &self.device else {
                unreachable!("slots are only released in flight after a device copy")
            };
            let cur = match device.enter() {
                Ok(c) => c,
                Err(e) => {
                    self.ring.release(claim.index, Release::Restore(claim.prev));
                    return Err(e);
                }
            };
            self.ring.ready(
                &claim,
                &mut Owner {
                    st: self,
                    cur: &cur,
                    wait: Some(wait),
                    send: None,
                },
            )?;
        }
        // SAFETY: we own the slot (WRITING) and its last copy completed.
        unsafe { &mut *self.slots[claim.index].scratch.get() }
            .used
            .iter_mut()
            .for_each(|u| *u = 0);
        Ok(RawStep {
            claim,
            frozen: false,
        })
    }

    #[inline]
    fn slot_base(&self, slot: usize) -> *mut u8 {
        // SAFETY: slot < depth; the slot memory holds depth * nbytes bytes.
        unsafe { self.mem.ptr().add(slot * self.layout.nbytes()) }
    }

    fn check_open(&self, s: &RawStep) -> Result<()> {
        if s.frozen {
            return Err(Error::StepState(
                "the step's fields were handed to the device (zero-copy): they can no longer be \
                 written",
            ));
        }
        Ok(())
    }

    /// Writes `values` (`shape.0` rows of `shape.1` elements, raw bytes of the field's dtype)
    /// into the leading rows of field `id`; with `pad`, the rest of each of those rows and the
    /// rows up to `rows` (default: the values' rows) take `pad`. The field's used rows become
    /// `rows`. Checked before anything is written.
    pub(crate) fn put_raw(
        &self,
        s: &mut RawStep,
        id: FieldId,
        values: &[u8],
        shape: (usize, usize),
        pad: Option<&[u8]>,
        rows: Option<usize>,
    ) -> Result<()> {
        self.check_open(s)?;
        let f = &self.layout.fields()[id.0];
        let item = f.dtype().itemsize();
        let (r, c) = shape;
        let dims = || {
            if f.shape().len() == 1 {
                vec![r]
            } else {
                vec![r, c]
            }
        };
        if r.checked_mul(c).and_then(|n| n.checked_mul(item)) != Some(values.len()) {
            return Err(Error::RaggedBytes {
                bytes: values.len(),
                itemsize: item,
            });
        }
        if c > f.cols() || r > f.rows() {
            return Err(Error::ShapeMismatch {
                values: dims(),
                dst: f.shape().iter().map(|&d| d as i64).collect(),
            });
        }
        if let Some(p) = pad
            && p.len() != item
        {
            return Err(Error::PadSize {
                got: p.len(),
                expected: item,
                dtype: f.dtype(),
            });
        }
        let rows = rows.unwrap_or(r);
        if rows < r || rows > f.rows() {
            return Err(Error::arg(
                "rows",
                rows,
                "at least the values' rows and at most the field's capacity",
            ));
        }
        if pad.is_none() && (c < f.cols() || rows > r) {
            return Err(Error::arg(
                "pad_value",
                "None",
                "a pad value: the values do not fill the rows written",
            ));
        }
        let base = self.field_base(s, id);
        let row_bytes = f.row_bytes();
        // SAFETY: we own the slot; rows <= capacity so every write stays in the field; values
        // may alias the slot (a view of it), so the copies are memmoves.
        unsafe {
            if c == f.cols() {
                write_padded(base, values, pad, rows * row_bytes, true);
            } else {
                let vrow = c * item;
                for i in 0..r {
                    write_padded(
                        base.add(i * row_bytes),
                        &values[i * vrow..(i + 1) * vrow],
                        pad,
                        row_bytes,
                        true,
                    );
                }
                write_padded(
                    base.add(r * row_bytes),
                    &[],
                    pad,
                    (rows - r) * row_bytes,
                    false,
                );
            }
            self.set_used(s, id, rows);
        }
        Ok(())
    }

    #[inline]
    fn field_base(&self, s: &RawStep, id: FieldId) -> *mut u8 {
        // SAFETY: the field lies within the slot.
        unsafe {
            self.slot_base(s.claim.index)
                .add(self.layout.fields()[id.0].offset())
        }
    }

    /// # Safety
    /// The caller owns the step's slot.
    #[inline]
    unsafe fn set_used(&self, s: &RawStep, id: FieldId, rows: usize) {
        // SAFETY: the caller owns the slot.
        unsafe { (&mut *self.slots[s.claim.index].scratch.get()).used[id.0] = rows };
    }

    /// The first `rows` rows of field `id` in the step's slot, marked used: `(address, bytes)`.
    pub(crate) fn field_raw(
        &self,
        s: &mut RawStep,
        id: FieldId,
        rows: usize,
    ) -> Result<(*mut u8, usize)> {
        self.check_open(s)?;
        let f = &self.layout.fields()[id.0];
        if rows > f.rows() {
            return Err(Error::arg("rows", rows, "at most the field's capacity"));
        }
        // SAFETY: we own the slot.
        unsafe { self.set_used(s, id, rows) };
        Ok((self.field_base(s, id), rows * f.row_bytes()))
    }

    /// Rows of field `id` written in the step so far.
    pub(crate) fn used_raw(&self, s: &RawStep, id: FieldId) -> usize {
        // SAFETY: we own the slot; a read.
        unsafe { (&*self.slots[s.claim.index].scratch.get()).used[id.0] }
    }

    /// Zero-copy mode: the device address of field `id` in the step's slot; the step's fields
    /// can no longer be written from the host.
    pub(crate) fn device_ptr_raw(&self, s: &mut RawStep, id: FieldId) -> Result<u64> {
        if self.mode != StepMode::ZeroCopy {
            return Err(Error::arg(
                "mode",
                format!("{:?}", self.mode),
                "zero-copy mode for device views of a slot",
            ));
        }
        if self.device.is_none() {
            return Err(self.unavailable());
        }
        s.frozen = true;
        let off = s.claim.index * self.layout.nbytes() + self.layout.fields()[id.0].offset();
        Ok(self.mem_dev + off as u64)
    }

    /// Zero-copy mode: the device address of field `key` in slot `slot` (whatever step owns it).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] in other modes or for a slot out of range,
    /// [`Error::CudaUnavailable`], [`Error::UnknownField`].
    pub fn slot_device_ptr(&self, slot: usize, key: impl FieldKey) -> Result<u64> {
        let f = self.layout.field(key)?;
        if self.mode != StepMode::ZeroCopy {
            return Err(Error::arg(
                "mode",
                format!("{:?}", self.mode),
                "zero-copy mode for device views of a slot",
            ));
        }
        if slot >= self.depth() {
            return Err(Error::arg("slot", slot, "a slot below the depth"));
        }
        if self.device.is_none() {
            return Err(self.unavailable());
        }
        Ok(self.mem_dev + (slot * self.layout.nbytes() + f.offset()) as u64)
    }

    /// Releases a step's slot untouched.
    pub(crate) fn abort_raw(&self, s: RawStep) {
        add(&self.stats.aborted, 1);
        // The slot's last copy is known complete (open) and nothing new was issued.
        self.ring.release(s.claim.index, Release::Idle);
    }

    /// Commits a step on `stream` (see [`Step::commit`]). The slot is released in every case.
    pub(crate) fn commit_raw(&self, s: RawStep, stream: StreamHandle<'_>) -> Result<Committed> {
        let index = s.claim.index;
        // SAFETY: we own the slot until the ring releases it below; nothing else touches its
        // scratch.
        let sc = unsafe { &mut *self.slots[index].scratch.get() };
        let base = self.slot_base(index);
        sc.send.copy_from_slice(&sc.used);
        // Skip fields whose values equal the last committed ones (mirror held until updated).
        let mut mirror = self.mirror.as_ref().map(|m| m.lock());
        let mut skipped = 0u32;
        if let Some(m) = mirror.as_deref() {
            for (i, f) in self.layout.fields().iter().enumerate() {
                let n = sc.send[i] * f.row_bytes();
                if f.skip_unchanged() && n > 0 {
                    // SAFETY: the field's used bytes in our slot.
                    let now = unsafe { std::slice::from_raw_parts(base.add(f.offset()), n) };
                    if m[i].as_deref() == Some(now) {
                        sc.send[i] = 0;
                        skipped += 1;
                    }
                }
            }
        }
        if self.mode == StepMode::ZeroCopy {
            // Nothing is copied: consumers read the slot itself.
            sc.segs.clear();
        } else {
            let max_gap = self
                .max_gap
                .unwrap_or(if self.batch && stream.as_raw() > 1 {
                    AUTO_GAP_BATCH
                } else {
                    AUTO_GAP_COPIES
                });
            plan(self.layout.fields(), &sc.send, max_gap, &mut sc.segs);
        }
        let bytes: usize = sc.segs.iter().map(|&(_, n)| n).sum();
        let result = self.send(s.claim, sc, base, stream);
        let (calls, batched, block) = result?;
        if let Some(m) = mirror.as_deref_mut() {
            for (i, f) in self.layout.fields().iter().enumerate() {
                let n = sc.send[i] * f.row_bytes();
                if f.skip_unchanged() && n > 0 {
                    // SAFETY: as above; the copy reads these bytes, we only read them too.
                    let now = unsafe { std::slice::from_raw_parts(base.add(f.offset()), n) };
                    let slot = m[i].get_or_insert_with(Vec::new);
                    slot.clear();
                    slot.extend_from_slice(now);
                }
            }
        }
        drop(mirror);
        add(&self.stats.steps, 1);
        add(&self.stats.skipped_fields, u64::from(skipped));
        add(&self.stats.bytes, bytes as u64);
        if calls == 0 && block.is_none() {
            add(&self.stats.empty_steps, 1);
        }
        Ok(Committed {
            calls,
            batched,
            bytes,
            skipped,
            block,
        })
    }

    /// Issues the planned copies and records the slot's event, releasing the slot.
    fn send(
        &self,
        claim: Claim,
        sc: &mut Scratch,
        base: *mut u8,
        stream: StreamHandle<'_>,
    ) -> Result<(u32, bool, Option<StepBlock>)> {
        let release_idle = |e: Error| {
            self.ring.release(claim.index, Release::Idle);
            Err(e)
        };
        let zero = self.mode == StepMode::ZeroCopy;
        if sc.segs.is_empty() && self.mode == StepMode::Arena {
            self.ring.release(claim.index, Release::Idle);
            return Ok((0, false, None));
        }
        let host_dst = match &self.target {
            Target::Host(h) => Some(h.ptr()),
            Target::Bound { ptr, host: true } => Some(*ptr as *mut u8),
            Target::Fresh(_) if self.device.is_none() => None,
            _ => None,
        };
        let Some(device) = &self.device else {
            // No driver: host arena or host blocks, written now.
            let block = match &self.target {
                Target::Fresh(p) => match p.take(None) {
                    Ok(b) => Some(b),
                    Err(e) => return release_idle(e),
                },
                _ => None,
            };
            let dst = host_dst.unwrap_or_else(|| {
                block
                    .as_ref()
                    .map_or(std::ptr::null_mut(), |b| b.ptr() as *mut u8)
            });
            if !dst.is_null() && !zero {
                for &(start, len) in &sc.segs {
                    // SAFETY: slot and arena both hold the layout's bytes; they never overlap.
                    unsafe { std::ptr::copy_nonoverlapping(base.add(start), dst.add(start), len) };
                }
                add(&self.stats.copies, sc.segs.len() as u64);
            }
            self.ring.release(claim.index, Release::Idle);
            return Ok((if zero { 0 } else { sc.segs.len() as u32 }, false, block));
        };
        if let Some(dst) = host_dst {
            // A bound host arena with a driver: plain host copies.
            for &(start, len) in &sc.segs {
                // SAFETY: as above.
                unsafe { std::ptr::copy_nonoverlapping(base.add(start), dst.add(start), len) };
            }
            add(&self.stats.copies, sc.segs.len() as u64);
            self.ring.release(claim.index, Release::Idle);
            return Ok((sc.segs.len() as u32, false, None));
        }
        let cur = match device.enter_for_copy(stream) {
            Ok(c) => c,
            Err(e) => return release_idle(e),
        };
        let (dst, block) = match &self.target {
            Target::Device(d) => (d.ptr(), None),
            Target::Bound { ptr, .. } => (*ptr, None),
            Target::Fresh(p) => match p.take(Some(&cur)) {
                Ok(b) => (b.ptr(), Some(b)),
                Err(e) => return release_idle(e),
            },
            Target::ZeroCopy | Target::Host(_) => (0, None),
        };
        let mut send = SendJob {
            segs: &sc.segs,
            dsts: &mut sc.dsts,
            srcs: &mut sc.srcs,
            sizes: &mut sc.sizes,
            src: base,
            dst,
            stream,
            zero,
            batch: self.batch && stream.as_raw() > 1,
            block: block.as_ref().and_then(|b| b.event()),
            calls: 0,
            batched: false,
        };
        self.ring.finish(
            &claim,
            &mut Owner {
                st: self,
                cur: &cur,
                wait: None,
                send: Some(&mut send),
            },
        )?;
        Ok((send.calls, send.batched, block))
    }

    /// Copies field `key` of the arena into host memory, after every commit issued so far
    /// completed: for tests and debugging (arena mode only).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] outside arena mode; [`Error::UnknownField`];
    /// [`Error::Driver`].
    pub fn read_field(&self, key: impl FieldKey) -> Result<Vec<u8>> {
        let f = self.layout.field(key)?;
        let mut out = crate::host::zeroed_vec(f.nbytes(), "field copy")?;
        let src = self.arena_ptr().ok_or_else(|| {
            Error::arg(
                "mode",
                format!("{:?}", self.mode),
                "arena mode to read the arena",
            )
        })? + f.offset() as u64;
        for s in self.slots.iter() {
            if let Some(e) = &s.event {
                e.synchronize()?;
            }
        }
        if self.arena_is_host() {
            // SAFETY: the arena holds the layout's bytes; every commit into it completed.
            unsafe { std::ptr::copy_nonoverlapping(src as *const u8, out.as_mut_ptr(), out.len()) };
        } else {
            let device = self.device.as_ref().ok_or_else(|| self.unavailable())?;
            let _cur = device.enter()?;
            // SAFETY: device memory of the layout's bytes on this device; `out` is ours.
            unsafe { driver::mem::memcpy_dtoh(out.as_mut_ptr().cast(), src, out.len()) }?;
        }
        Ok(out)
    }
}

impl Drop for StepStager {
    fn drop(&mut self) {
        for i in 0..self.slots.len() {
            if self.ring.is_in_flight(i)
                && let Some(e) = &self.slots[i].event
                && let Err(Error::Driver(err)) = e.synchronize()
            {
                // Never free memory a copy still reads; drop never panics: record the error.
                crate::error::record_drop_error(err);
            }
        }
    }
}

/// An open step: a slot owned by this step until it is committed or dropped (dropping releases
/// it untouched). Not `Send`: a step belongs to the thread that opened it.
pub struct Step<'s> {
    stager: &'s StepStager,
    raw: Option<RawStep>,
    _not_send: PhantomData<*const ()>,
}

impl std::fmt::Debug for Step<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Step")
            .field("slot", &self.raw.as_ref().map(|r| r.claim.index))
            .finish()
    }
}

/// The state of an open step, for the Python layer (which holds the stager in an `Arc`).
#[derive(Debug)]
pub(crate) struct RawStep {
    claim: Claim,
    /// Zero-copy: device views were handed out, host writes would race the consumer.
    frozen: bool,
}

#[cfg(feature = "python")]
impl RawStep {
    pub(crate) fn slot(&self) -> usize {
        self.claim.index
    }
}

impl<'s> Step<'s> {
    fn raw(&mut self) -> &mut RawStep {
        self.raw.as_mut().expect("present until commit")
    }

    /// The slot this step owns.
    pub fn slot(&self) -> usize {
        self.raw.as_ref().map_or(0, |r| r.claim.index)
    }

    /// The first `rows` rows of field `key` in the slot, to write in place; the field's used
    /// rows become `rows` (what the commit sends).
    ///
    /// # Errors
    /// [`Error::UnknownField`], [`Error::DtypeMismatch`] when `T` is not the field's dtype,
    /// [`Error::InvalidArgument`] for rows beyond the capacity, [`Error::StepState`] after
    /// zero-copy device addresses were taken.
    pub fn field_mut<T: Element>(&mut self, key: impl FieldKey, rows: usize) -> Result<&mut [T]> {
        let st = self.stager;
        let id = key.id_in(&st.layout)?;
        let f = &st.layout.fields()[id.0];
        if f.dtype() != T::DTYPE {
            return Err(Error::DtypeMismatch {
                expected: f.dtype(),
                got: T::DTYPE,
            });
        }
        let (ptr, bytes) = st.field_raw(self.raw(), id, rows)?;
        // SAFETY: the slot is ours until commit or drop, which need `self` (the borrow ends
        // first); fields are aligned to 256 bytes; `bytes` is a whole number of elements.
        Ok(unsafe { std::slice::from_raw_parts_mut(ptr.cast::<T>(), bytes / size_of::<T>()) })
    }

    /// Writes `values` into field `key`'s leading rows (whole rows: for a 2-D field
    /// `values.len()` is a multiple of its columns); used rows become the values' rows.
    ///
    /// # Errors
    /// As [`Step::put_padded`].
    pub fn put<T: Element>(&mut self, key: impl FieldKey, values: &[T]) -> Result<()> {
        let st = self.stager;
        let id = key.id_in(&st.layout)?;
        let cols = st.layout.fields()[id.0].cols();
        if values.len() % cols != 0 {
            return Err(Error::ShapeMismatch {
                values: vec![values.len()],
                dst: st.layout.fields()[id.0]
                    .shape()
                    .iter()
                    .map(|&d| d as i64)
                    .collect(),
            });
        }
        self.put_padded(id, values, (values.len() / cols, cols), None, None)
    }

    /// Writes `values` (`shape.0` rows of `shape.1` elements) into field `key`'s leading rows;
    /// `pad` fills the rest of those rows and the rows up to `rows` (default: the values' rows),
    /// which become the field's used rows.
    ///
    /// # Errors
    /// [`Error::UnknownField`], [`Error::DtypeMismatch`], [`Error::ShapeMismatch`] for values
    /// larger than the capacity, [`Error::RaggedBytes`] when `values` is not `shape`,
    /// [`Error::InvalidArgument`] for `rows` out of range or a missing pad,
    /// [`Error::StepState`] after zero-copy device addresses were taken. Nothing is written.
    pub fn put_padded<T: Element>(
        &mut self,
        key: impl FieldKey,
        values: &[T],
        shape: (usize, usize),
        pad: Option<T>,
        rows: Option<usize>,
    ) -> Result<()> {
        let st = self.stager;
        let id = key.id_in(&st.layout)?;
        let f = &st.layout.fields()[id.0];
        if f.dtype() != T::DTYPE {
            return Err(Error::DtypeMismatch {
                expected: f.dtype(),
                got: T::DTYPE,
            });
        }
        let pad = pad.as_ref().map(bytemuck::bytes_of);
        st.put_raw(
            self.raw(),
            id,
            bytemuck::cast_slice(values),
            shape,
            pad,
            rows,
        )
    }

    /// Rows of field `key` written in this step so far (0: not written; the commit leaves its
    /// device bytes as they are).
    ///
    /// # Errors
    /// [`Error::UnknownField`].
    pub fn used_rows(&self, key: impl FieldKey) -> Result<usize> {
        let id = key.id_in(&self.stager.layout)?;
        Ok(self
            .stager
            .used_raw(self.raw.as_ref().expect("present until commit"), id))
    }

    /// Zero-copy mode: the device address of field `key` in this step's slot, for a kernel to
    /// read in place; from then on the step's fields can no longer be written from the host.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] in other modes, [`Error::CudaUnavailable`] without a driver,
    /// [`Error::UnknownField`].
    pub fn device_ptr(&mut self, key: impl FieldKey) -> Result<u64> {
        let id = key.id_in(&self.stager.layout)?;
        let st = self.stager;
        st.device_ptr_raw(self.raw(), id)
    }

    /// Commits the step on `stream`: the written fields' used rows go to the arena (or a fresh
    /// block) in one copy when they are dense (gaps up to the stager's `max_gap`), else in one
    /// `cuMemcpyBatchAsync` (one copy per span where the driver has no batch or the stream is
    /// the legacy default stream); then the slot's event is recorded. A step with nothing to
    /// send issues nothing. Zero-copy: only the event, recorded after the consumer's work
    /// already queued on `stream`.
    ///
    /// # Errors
    /// [`Error::StreamCapturing`] on a capturing stream, [`Error::Driver`]; the slot is
    /// released either way.
    pub fn commit(mut self, stream: StreamHandle<'_>) -> Result<Committed> {
        let raw = self.raw.take().expect("present until commit");
        self.stager.commit_raw(raw, stream)
    }
}

impl Drop for Step<'_> {
    fn drop(&mut self) {
        if let Some(raw) = self.raw.take() {
            self.stager.abort_raw(raw);
        }
    }
}

/// The copies of one commit.
struct SendJob<'a> {
    segs: &'a [(usize, usize)],
    dsts: &'a mut Vec<u64>,
    srcs: &'a mut Vec<u64>,
    sizes: &'a mut Vec<usize>,
    src: *mut u8,
    dst: u64,
    stream: StreamHandle<'a>,
    zero: bool,
    batch: bool,
    block: Option<&'a Event>,
    calls: u32,
    batched: bool,
}

/// How a claimer waits for a slot's event.
type WaitFn<'w> = dyn FnMut(&Event) -> Result<()> + 'w;

/// The step stager's side of the ring protocol: waiting at open, copies and events at commit.
struct Owner<'a, 'c, 'd, 'w> {
    st: &'a StepStager,
    cur: &'c Current<'d>,
    wait: Option<&'w mut WaitFn<'w>>,
    send: Option<&'w mut SendJob<'a>>,
}

impl Owner<'_, '_, '_, '_> {
    fn event(&self, slot: usize) -> &Event {
        self.st.slots[slot]
            .event
            .as_ref()
            .expect("slots have events with a driver")
    }
}

impl SlotOwner for Owner<'_, '_, '_, '_> {
    type Error = Error;

    fn query(&mut self, slot: usize) -> Result<bool> {
        add(&self.st.stats.queries, 1);
        self.event(slot).query()
    }

    #[cold]
    fn wait(&mut self, slot: usize) -> Result<()> {
        add(&self.st.stats.waits, 1);
        let ev = self.st.slots[slot]
            .event
            .as_ref()
            .expect("events with a driver");
        match self.wait.as_mut() {
            Some(w) => w(ev),
            None => ev.synchronize(),
        }
    }

    fn fill(&mut self, _slot: usize) -> Result<()> {
        // The step wrote the slot before the commit.
        Ok(())
    }

    fn stream_id(&mut self) -> Option<u64> {
        self.send
            .as_ref()
            .and_then(|j| j.stream.tracking_id(self.cur))
    }

    fn send(&mut self, _slot: usize) -> Result<()> {
        let Some(j) = self.send.as_deref_mut() else {
            return Ok(());
        };
        if j.zero || j.segs.is_empty() {
            return Ok(());
        }
        let stream = j.stream;
        let st = self.st;
        if j.segs.len() > 1 && j.batch {
            j.dsts.clear();
            j.srcs.clear();
            j.sizes.clear();
            for &(start, len) in j.segs {
                j.dsts.push(j.dst + start as u64);
                // SAFETY: within the slot.
                j.srcs.push(unsafe { j.src.add(start) } as u64);
                j.sizes.push(len);
            }
            // SAFETY: each source span is in our slot, untouched until the slot's event (recorded
            // next) completed; each destination span lies in the arena or block of this device;
            // the driver has the call (checked at build) and the stream is not the legacy one.
            unsafe { driver::mem::memcpy_batch_htod_async(j.dsts, j.srcs, j.sizes, stream.raw()) }?;
            add(&st.stats.batches, 1);
            add(&st.stats.batch_entries, j.segs.len() as u64);
            j.calls = 1;
            j.batched = true;
            return Ok(());
        }
        for (k, &(start, len)) in j.segs.iter().enumerate() {
            // SAFETY: as above, one span at a time.
            let r = unsafe {
                driver::mem::memcpy_htod_async(
                    j.dst + start as u64,
                    j.src.add(start).cast(),
                    len,
                    stream.raw(),
                )
            };
            if let Err(e) = r {
                if k > 0 {
                    // Earlier spans were issued: they must finish before the slot is reused
                    // (released idle on this error).
                    let _ = stream.synchronize(self.cur);
                }
                return Err(e.into());
            }
            j.calls += 1;
            add(&st.stats.copies, 1);
        }
        Ok(())
    }

    fn record(&mut self, slot: usize) -> Result<()> {
        let stream = self
            .send
            .as_ref()
            .map_or(StreamHandle::LEGACY, |j| j.stream);
        self.event(slot).record_in(self.cur, stream)?;
        if let Some(b) = self.send.as_ref().and_then(|j| j.block) {
            b.record_in(self.cur, stream)?;
        }
        Ok(())
    }

    #[cold]
    fn settle(&mut self) -> bool {
        let stream = self
            .send
            .as_ref()
            .map_or(StreamHandle::LEGACY, |j| j.stream);
        stream.synchronize(self.cur).is_ok()
    }
}
