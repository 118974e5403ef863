//! The step stager: a ring of pinned slots laid out like the device arena, one commit per step.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use super::layout::{FieldKey, StepLayout};
use super::mem::{AlignedBytes, BlockPool, HostMem, StepBlock, pinned_slots};
use crate::cuda::{Device, Event, StreamHandle};
use crate::dlpack::{DeviceView, MemoryKind};
use crate::driver;
use crate::error::{Error, Result};
use crate::host::DeviceMem;
use crate::ring::protocol::Claim;
use crate::ring::slots::{Counter, SlotRing, check_args};

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

impl StepMode {
    /// The mode as the Python API spells it: `arena`, `fresh`, `zero_copy`.
    pub fn name(self) -> &'static str {
        match self {
            StepMode::Arena => "arena",
            StepMode::Fresh => "fresh",
            StepMode::ZeroCopy => "zero_copy",
        }
    }
}

impl std::fmt::Display for StepMode {
    /// [`StepMode::name`].
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// Counters of a step stager (monotonic).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StepStagerStats {
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
    /// Steps that issued nothing (nothing written, or all of it unchanged).
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
pub(super) struct Counters {
    pub(super) steps: Counter,
    pub(super) copies: Counter,
    pub(super) batches: Counter,
    pub(super) batch_entries: Counter,
    pub(super) bytes: Counter,
    pub(super) skipped_fields: Counter,
    pub(super) empty_steps: Counter,
    pub(super) aborted: Counter,
}

/// What one commit did.
#[derive(Debug)]
pub struct CommitOutcome {
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
pub(super) struct Scratch {
    /// Rows written per field in the open step (0: not written).
    pub(super) used: Vec<usize>,
    /// The rows that are sent after skipping unchanged fields.
    pub(super) send: Vec<usize>,
    pub(super) segs: Vec<(usize, usize)>,
    pub(super) dsts: Vec<u64>,
    pub(super) srcs: Vec<u64>,
    pub(super) sizes: Vec<usize>,
}

pub(super) enum Target {
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

/// The state of an open step, for the Python layer (which holds the stager in an `Arc`).
#[derive(Debug)]
pub(crate) struct RawStep {
    pub(super) claim: Claim,
    /// Zero-copy: device views were handed out, host writes would race the consumer.
    pub(super) frozen: bool,
}

#[cfg(feature = "python")]
impl RawStep {
    pub(crate) fn slot(&self) -> usize {
        self.claim.index
    }
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

    /// Slots in the ring (default [`DEFAULT_STEP_DEPTH`]; 1 to [`crate::h2d::MAX_DEPTH`]).
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
    /// from the measured costs (64 KiB when the spans can go as one batch,
    /// 256 KiB when each would be a copy of its own).
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
    pub(super) layout: StepLayout,
    pub(super) mode: StepMode,
    /// The ring of slots (events, per-slot scratch), the device, the wait counters.
    pub(super) core: SlotRing<Scratch>,
    pub(super) mem: Arc<HostMem>,
    /// Device address of the slot memory (zero-copy reads); 0 without a driver.
    pub(super) mem_dev: u64,
    pub(super) target: Target,
    pub(super) mirror: Option<parking_lot::Mutex<Vec<Option<Vec<u8>>>>>,
    pub(super) max_gap: Option<usize>,
    pub(super) batch: bool,
    pub(super) stats: Counters,
    /// Host arenas (no driver, or a bound host buffer) are written by the CPU: commits into
    /// them and `read_field` take turns.
    pub(super) host_arena: parking_lot::Mutex<()>,
}

// SAFETY: each slot's bytes (in `mem`) are touched only by the thread owning the slot (ring
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
            .field("depth", &self.core.depth())
            .field("cuda", &self.core.device().is_some())
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
        check_args(b.device, b.depth)?;
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
                return Err(Error::ArenaTooSmall {
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
        let nfields = b.layout.len();
        let core = SlotRing::new(b.device, b.depth, |_, _| {
            Ok(Scratch {
                used: vec![0; nfields],
                send: vec![0; nfields],
                ..Scratch::default()
            })
        })?;
        let device = core.device().cloned();
        if let (Some((_, _, MemoryKind::Cuda(_), _)), None) = (b.bound, &device) {
            return Err(core.unavailable());
        }
        let (mem, mem_dev) = match &device {
            Some(d) => pinned_slots(d, total)?,
            None => (HostMem::Plain(AlignedBytes::new(total, "step slots")?), 0),
        };
        let target = match (b.mode, b.bound, &device) {
            (StepMode::Arena, Some((ptr, _, memory, _)), _) => Target::Bound {
                ptr,
                host: memory == MemoryKind::Host,
            },
            (StepMode::Arena, None, Some(d)) => {
                let cur = d.enter()?;
                Target::Device(Arc::new(DeviceMem::new(&cur, nbytes, "device arena")?))
            }
            (StepMode::Arena, None, None) => Target::Host(AlignedBytes::new(nbytes, "step arena")?),
            (StepMode::Fresh, _, d) => Target::Fresh(Arc::new(BlockPool::new(d.clone(), nbytes))),
            (StepMode::ZeroCopy, _, _) => Target::ZeroCopy,
        };
        let mirror = (b.layout.any_skip() && b.mode == StepMode::Arena)
            .then(|| parking_lot::Mutex::new(vec![None; nfields]));
        let batch = b.batch
            && driver::probe().is_ok_and(|p| p.driver_version >= driver::mem::BATCH_MIN_DRIVER);
        Ok(Self {
            layout: b.layout,
            mode: b.mode,
            core,
            mem: Arc::new(mem),
            mem_dev,
            target,
            mirror,
            host_arena: parking_lot::Mutex::new(()),
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
        self.core.depth()
    }

    /// The device ordinal.
    pub fn ordinal(&self) -> i32 {
        self.core.ordinal()
    }

    /// Whether a driver and the device were found (else everything lives in host memory).
    pub fn has_cuda(&self) -> bool {
        self.core.device().is_some()
    }

    /// The device, when there is a driver.
    pub fn device(&self) -> Option<&Device> {
        self.core.device()
    }

    /// Why there is no device (`Error::CudaUnavailable`), for the Python layer.
    #[cfg(feature = "python")]
    pub(crate) fn unavailable(&self) -> Error {
        self.core.unavailable()
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
            Target::Fresh(_) => self.core.device().is_none(),
        }
    }

    /// A snapshot of the counters.
    pub fn stats(&self) -> StepStagerStats {
        let s = &self.stats;
        StepStagerStats {
            steps: s.steps.get(),
            copies: s.copies.get(),
            batches: s.batches.get(),
            batch_entries: s.batch_entries.get(),
            bytes: s.bytes.get(),
            skipped_fields: s.skipped_fields.get(),
            empty_steps: s.empty_steps.get(),
            aborted: s.aborted.get(),
            waits: self.core.waits(),
            queries: self.core.queries(),
            blocks: match &self.target {
                Target::Fresh(p) => p.allocated.load(Ordering::Relaxed),
                _ => 0,
            },
        }
    }

    /// The claim of a new step without spinning: `None` when every slot is owned by another
    /// thread's open step (the Python layer then blocks with the GIL released).
    #[cfg(feature = "python")]
    pub(crate) fn try_claim(&self) -> Option<Claim> {
        self.core.ring().try_claim()
    }

    /// A claim, spinning (yielding) while every slot is in another thread's open step, for at
    /// most `within` (`None`: none came free).
    #[cfg(feature = "python")]
    pub(crate) fn claim_within(&self, within: std::time::Duration) -> Option<Claim> {
        let t0 = std::time::Instant::now();
        loop {
            if let Some(c) = self.core.ring().try_claim() {
                return Some(c);
            }
            if t0.elapsed() >= within {
                return None;
            }
            std::thread::yield_now();
        }
    }

    /// Orders `stream` after every commit issued so far (the device waits, not the host); with
    /// `None` the host waits for them.
    ///
    /// # Errors
    /// [`Error::Driver`].
    pub fn order_after_commits(&self, stream: Option<StreamHandle<'_>>) -> Result<()> {
        self.core.order_after(stream)
    }

    /// Whether every commit issued so far completed (never blocks).
    ///
    /// # Errors
    /// [`Error::Driver`] if one failed.
    pub fn commits_done(&self) -> Result<bool> {
        self.core.all_done()
    }

    /// Opens a step on `claim` (or a new blocking claim), waiting for the slot's last copy with
    /// `wait`.
    pub(crate) fn open(
        &self,
        claim: Option<Claim>,
        wait: &mut dyn FnMut(&Event) -> Result<()>,
    ) -> Result<RawStep> {
        let claim = claim.unwrap_or_else(|| self.core.ring().claim());
        self.core.ready(&claim, wait)?;
        // SAFETY: we own the slot (WRITING) and its last copy completed.
        unsafe { &mut *self.core.data(claim.index) }
            .used
            .iter_mut()
            .for_each(|u| *u = 0);
        Ok(RawStep {
            claim,
            frozen: false,
        })
    }

    #[inline]
    pub(super) fn slot_base(&self, slot: usize) -> *mut u8 {
        // SAFETY: slot < depth; the slot memory holds depth * nbytes bytes.
        unsafe { self.mem.ptr().add(slot * self.layout.nbytes()) }
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
                self.mode.to_string(),
                "arena mode to read the arena",
            )
        })? + f.offset() as u64;
        self.core.order_after(None)?;
        if self.arena_is_host() {
            let _turn = self.host_arena.lock();
            // SAFETY: the arena holds the layout's bytes; every commit into it completed, and
            // none writes it meanwhile (`_turn`).
            unsafe { std::ptr::copy_nonoverlapping(src as *const u8, out.as_mut_ptr(), out.len()) };
        } else {
            let device = self.core.require_device()?;
            let _cur = device.enter()?;
            // SAFETY: device memory of the layout's bytes on this device; `out` is ours.
            unsafe { driver::mem::memcpy_dtoh(out.as_mut_ptr().cast(), src, out.len()) }?;
        }
        Ok(out)
    }
}

impl Drop for StepStager {
    /// The slots' memory and the arena go to the reaper thread when a copy (or a zero-copy
    /// reader) may still use them; it frees them once those completed (never here: the drop
    /// does not wait for the device). A failed wait leaks them.
    fn drop(&mut self) {
        let (mem, target) = (&self.mem, &mut self.target);
        // Parts of this `Send` stager, given up together.
        self.core.release_after_copies(|| {
            crate::host::reaper::Owned((
                Arc::clone(mem),
                std::mem::replace(target, Target::ZeroCopy),
            ))
        });
    }
}
