//! [`BlockMover`]: moves lists of blocks between device tensors and pinned host tensors with the
//! copy engines: batched driver calls, or 2D copies across the tensors.

use std::borrow::Cow;
use std::marker::PhantomData;
use std::sync::{Arc, OnceLock};

use parking_lot::Mutex;

use super::background::Issuer;
use super::copy::{BlockCopy, Direction, InFlight, MAX_BATCH, MovePlan, Strategy};
use super::issue::{Issue, Lists, helper_streams, issue_on, share};
use super::plan::{BlockLayout, Pair, Run, Segment, segments, segments_of};
use super::staged::{CHUNK_RANGE, Staging};
use super::strides::{one_allocation, strides};
use super::tensors::Tensors;
use super::tuning::Pick;
use crate::cuda::{Current, Device, Event, Stream, StreamHandle};
use crate::dlpack::{DeviceView, MemoryKind};
use crate::driver;
use crate::error::{Error, Result};
use crate::stamps::stamp;

fn memory_name(m: MemoryKind) -> &'static str {
    match m {
        MemoryKind::Host => "host memory",
        MemoryKind::Cuda(_) => "device memory",
    }
}

/// Moves blocks between device tensors and pinned host tensors: tensor `i` of the device side
/// pairs with tensor `i` of the host side, and a move takes one list of block ids for every
/// pair (as KV caches are laid out: the same block ids in every layer's K and V tensors).
///
/// Each tensor is contiguous, with its blocks along `block_dim` (1 for `[2, num_blocks, ...]`,
/// 0 for `[num_blocks, ...]` and cross-layer `[num_blocks, layers, 2, ...]`): a block is the
/// product of the dimensions before `block_dim` parts (2: K and V) of the bytes after it. A pair
/// has one block size and one number of parts; the two sides may hold different numbers of
/// blocks.
///
/// A move checks every id before it issues anything, merges runs of ids adjacent on both sides
/// into one copy, and issues the copies on the caller's stream, copy engines only, no kernel:
/// in one `cuMemcpyBatchAsync` (several beyond [`MAX_BATCH`] copies; a batch of thousands of
/// copies from several threads at once, each on its own stream, joined back), or, when each side's
/// tensors share one layout at one stride within one allocation and 2D copies beat a batch (every
/// load; offloads unless the copies average 9-31 KiB), as one 2D copy per run and part across
/// every tensor ([`Strategy::Strided`];
/// [`BlockMover::plan`] says which and why).
pub struct BlockMover<'t> {
    /// `None`: the "device" tensors are host memory too (moves are `memcpy`s; no driver needed).
    device: Option<Device>,
    /// The tensors and how moves between them are issued (shared with the issuing threads).
    tensors: Arc<Tensors>,
    /// Where batched moves on the legacy default stream go (the batched call refuses that
    /// stream).
    side: [OnceLock<Stream>; 2],
    /// The helper streams of batches issued from several threads, per direction.
    helpers: [OnceLock<Vec<Stream>>; 2],
    /// The threads that issue moves in the background, one per direction (started at the
    /// first such move).
    background: [OnceLock<Issuer>; 2],
    /// The copy lists, reused from move to move.
    scratch: Mutex<Scratch>,
    _tensors: PhantomData<&'t ()>,
}

#[derive(Default)]
struct Scratch {
    segments: Vec<Segment>,
    lists: Lists,
}

impl std::fmt::Debug for BlockMover<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BlockMover")
            .field("device", &self.device)
            .field("tensors", &self.tensors.pairs.len())
            .field("device_blocks", &self.tensors.device_blocks)
            .field("host_blocks", &self.tensors.host_blocks)
            .finish()
    }
}

impl<'t> BlockMover<'t> {
    /// A mover between `device_tensors` (one device's memory) and `host_tensors` (pinned host
    /// memory), paired in order, with blocks along `block_dim`.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`]: no tensors, lists of different lengths, a pair whose block
    /// sizes or parts differ, `block_dim` not a dimension, device tensors in different kinds of
    /// memory, a host tensor in device memory or (with device tensors) in pageable memory;
    /// [`Error::DtypeMismatch`]: a pair of two dtypes; [`Error::WrongDevice`]: device tensors on
    /// different devices; [`Error::CudaUnavailable`]: device tensors without a driver.
    ///
    /// Device tensors in host memory make a mover whose moves are `memcpy`s (no driver needed).
    pub fn new(
        device_tensors: &[DeviceView<'t>],
        host_tensors: &[DeviceView<'t>],
        block_dim: usize,
    ) -> Result<Self> {
        if device_tensors.is_empty() || device_tensors.len() != host_tensors.len() {
            return Err(Error::arg(
                "tensors",
                format!(
                    "{} device and {} host tensors",
                    device_tensors.len(),
                    host_tensors.len()
                ),
                "one host tensor per device tensor, at least one",
            ));
        }
        let device = match device_tensors[0].memory() {
            MemoryKind::Cuda(ordinal) => Some(Device::get(ordinal)?),
            MemoryKind::Host => None,
        };
        let mut pairs = Vec::with_capacity(device_tensors.len());
        for (i, (d, h)) in device_tensors.iter().zip(host_tensors).enumerate() {
            match (d.memory(), &device) {
                (MemoryKind::Cuda(id), Some(dev)) if id == dev.ordinal() => {}
                (MemoryKind::Cuda(id), Some(dev)) => {
                    return Err(Error::WrongDevice {
                        what: "block mover",
                        expected: dev.ordinal(),
                        got: id,
                    });
                }
                (MemoryKind::Host, None) => {}
                (_, _) => {
                    return Err(Error::arg(
                        "device_tensors",
                        format!("tensor {i} in {}", memory_name(d.memory())),
                        "tensors all in one device's memory (or all in host memory)",
                    ));
                }
            }
            if d.dtype() != h.dtype() {
                return Err(Error::DtypeMismatch {
                    expected: d.dtype(),
                    got: h.dtype(),
                });
            }
            let host = BlockLayout::of(h.meta(), block_dim)?;
            let pinned = match (&device, h.memory()) {
                (_, MemoryKind::Cuda(_)) => false,
                (None, MemoryKind::Host) => true,
                (Some(dev), MemoryKind::Host) => {
                    dev.is_pinned_range(host.base as *const u8, h.nbytes())?
                }
            };
            if !pinned {
                return Err(Error::arg(
                    "host_tensors",
                    format!(
                        "tensor {i} in {}",
                        if matches!(h.memory(), MemoryKind::Host) {
                            "pageable host memory"
                        } else {
                            "device memory"
                        }
                    ),
                    "pinned host memory (empty_host, a PinnedPool block, or pin)",
                ));
            }
            let pair = Pair {
                device: BlockLayout::of(d.meta(), block_dim)?,
                host,
                device_read_only: d.is_read_only(),
                host_read_only: h.is_read_only(),
            };
            // The sizes of a pair are checked here once, not at every move.
            segments(&pair.device, &pair.host, &[], &mut Vec::new()).map_err(|e| match e {
                Error::InvalidArgument { value, .. } => Error::InvalidArgument {
                    param: "tensors",
                    value: format!("pair {i}: {value}"),
                    expected: "blocks of one size and one number of parts on both sides",
                },
                e => e,
            })?;
            pairs.push(pair);
        }
        let batched = device.is_some()
            && driver::probe().is_ok_and(|p| p.driver_version >= driver::mem::BATCH_MIN_DRIVER);
        let strides = match &device {
            Some(dev) => strides(&pairs).filter(|_| one_allocation(dev, &pairs)),
            None => None,
        };
        Ok(Self {
            device,
            tensors: Arc::new(Tensors::new(pairs, batched, strides)),
            side: [OnceLock::new(), OnceLock::new()],
            helpers: [OnceLock::new(), OnceLock::new()],
            background: [OnceLock::new(), OnceLock::new()],
            scratch: Mutex::new(Scratch::default()),
            _tensors: PhantomData,
        })
    }

    /// The device of the device tensors (`None`: they are host memory).
    pub fn device(&self) -> Option<&Device> {
        self.device.as_ref()
    }

    /// Blocks every device tensor holds (the fewest of any).
    pub fn device_blocks(&self) -> usize {
        self.tensors.device_blocks
    }

    /// Blocks every host tensor holds (the fewest of any).
    pub fn host_blocks(&self) -> usize {
        self.tensors.host_blocks
    }

    /// Bytes of one block summed over all tensors (every part).
    pub fn block_bytes(&self) -> usize {
        self.tensors.block_bytes
    }

    /// Sets whether moves in the background go through staging buffers ([`Staging`]; default
    /// [`Staging::Auto`]) in chunks of `chunk_bytes` ([`DEFAULT_CHUNK`](super::DEFAULT_CHUNK)): each direction's
    /// thread makes a ring of four chunks in device memory and four in pinned host memory at
    /// its first staged move (remade when the chunk size changes; without memory for it, moves
    /// go unstaged), kept until the mover goes ([`BlockMover::staging_bytes`]). Moves the
    /// threads have yet to issue, those queued included, follow the new setting.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`]: `chunk_bytes` outside [`CHUNK_RANGE`] (64 KiB to 1 GiB).
    pub fn set_staging(&self, staging: Staging, chunk_bytes: usize) -> Result<()> {
        if !CHUNK_RANGE.contains(&chunk_bytes) {
            return Err(Error::arg(
                "chunk_bytes",
                chunk_bytes.to_string(),
                "64 KiB to 1 GiB",
            ));
        }
        self.tensors.set_staging(staging, chunk_bytes);
        Ok(())
    }

    /// The staging set ([`BlockMover::set_staging`]): the mode and a chunk's bytes.
    pub fn staging(&self) -> (Staging, usize) {
        self.tensors.staging()
    }

    /// Bytes of staging memory the mover holds now, device and pinned host memory of both
    /// directions (0 until its first staged move).
    pub fn staging_bytes(&self) -> usize {
        self.tensors
            .staging_held
            .load(std::sync::atomic::Ordering::Relaxed)
    }

    /// The tensor pairs.
    pub fn len(&self) -> usize {
        self.tensors.pairs.len()
    }

    /// Never: a mover has at least one pair.
    pub fn is_empty(&self) -> bool {
        self.tensors.pairs.is_empty()
    }

    /// What a move of `src_ids[i]` into `dst_ids[i]` in `direction` would issue, checked as the
    /// move checks it (nothing is issued).
    ///
    /// # Errors
    /// As [`BlockMover::offload`], before anything is issued.
    pub fn plan(
        &self,
        direction: Direction,
        src_ids: &[usize],
        dst_ids: &[usize],
    ) -> Result<MovePlan> {
        let runs = self.tensors.check(direction, src_ids, dst_ids)?;
        let copies = runs.len() * self.tensors.parts;
        // In the device's context (where it can be entered), to take in the timings completed.
        let cur = self.device.as_ref().and_then(|d| d.enter().ok());
        let (how, pick) = self
            .tensors
            .how(direction, src_ids.len(), runs.len(), cur.as_ref());
        drop(cur);
        // A batch's copies per thread, as `issue_split` shares them out.
        let share = match how {
            Issue::Batched { threads } => share(copies, threads),
            _ => copies.max(1),
        };
        let (strategy, copies, calls, reason) = if copies == 0 {
            (Strategy::Empty, 0, 0, "no block to move")
        } else if matches!(how, Issue::Strided { .. }) {
            let copies = runs.len() * self.tensors.pairs[0].device.outer;
            (Strategy::Strided, copies, copies, pick.strided_reason())
        } else if self.device.is_none() {
            (
                Strategy::PerCopy,
                copies,
                copies,
                "host memory on both sides: one memcpy per copy",
            )
        } else if matches!(how, Issue::Batched { .. }) {
            let calls = (0..copies)
                .step_by(share)
                .map(|a| (copies - a).min(share).div_ceil(MAX_BATCH))
                .sum();
            (
                Strategy::Batched,
                copies,
                calls,
                pick.batched_reason(share < copies),
            )
        } else {
            (
                Strategy::PerCopy,
                copies,
                copies,
                "the driver predates cuMemcpyBatchAsync (CUDA 12.8): one call per copy",
            )
        };
        Ok(MovePlan {
            direction,
            strategy,
            blocks: src_ids.len(),
            runs: runs.len(),
            copies,
            calls,
            threads: if strategy == Strategy::Batched {
                copies.div_ceil(share)
            } else {
                1
            },
            bytes: src_ids.len() * self.block_bytes(),
            reason,
            choice: pick.choice(),
        })
    }

    /// What a move in the background ([`BlockMover::offload_in_background`]) of `src_ids[i]`
    /// into `dst_ids[i]` would issue: a staged move ([`Strategy::Staged`]) where [`Staging`]
    /// lets it, else as [`BlockMover::plan`] says.
    ///
    /// # Errors
    /// As [`BlockMover::plan`].
    pub fn plan_in_background(
        &self,
        direction: Direction,
        src_ids: &[usize],
        dst_ids: &[usize],
    ) -> Result<MovePlan> {
        let plan = self.plan(direction, src_ids, dst_ids)?;
        if self.device.is_none() || plan.strategy == Strategy::Empty {
            return Ok(plan);
        }
        let runs = self.tensors.runs(direction, src_ids, dst_ids)?;
        Ok(self.tensors.staged_plan(plan, &runs))
    }

    /// Starts copying device blocks `device_ids[i]` into host blocks `host_ids[i]` of every
    /// pair, on `stream` (ordered after the work queued there).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`]: lists of different lengths, an id out of range, a host id
    /// twice, a read-only host tensor (nothing issued); [`Error::StreamCapturing`];
    /// [`Error::Driver`].
    ///
    /// # Safety
    /// 1. The tensors' memory stays valid until the move completed. The returned [`BlockCopy`]
    ///    waits when dropped; forgetting it (`mem::forget`) drops that guarantee.
    /// 2. Nothing else writes the moved blocks' source or destination bytes until the move
    ///    completed, except through work ordered on `stream`.
    /// 3. `stream` is a stream of the mover's device.
    pub unsafe fn offload(
        &self,
        device_ids: &[usize],
        host_ids: &[usize],
        stream: StreamHandle,
    ) -> Result<BlockCopy<'_>> {
        // SAFETY: caller's contract.
        unsafe { self.start(Direction::Offload, device_ids, host_ids, stream, false) }
    }

    /// Starts copying host blocks `host_ids[i]` into device blocks `device_ids[i]` of every
    /// pair, on `stream`.
    ///
    /// # Errors
    /// As [`BlockMover::offload`] (a device id twice; a read-only device tensor).
    ///
    /// # Safety
    /// As [`BlockMover::offload`].
    pub unsafe fn load(
        &self,
        host_ids: &[usize],
        device_ids: &[usize],
        stream: StreamHandle,
    ) -> Result<BlockCopy<'_>> {
        // SAFETY: caller's contract.
        unsafe { self.start(Direction::Load, host_ids, device_ids, stream, false) }
    }

    /// As [`BlockMover::offload`], issued in the background: the call checks the move and
    /// returns; a thread of the mover issues its copies on its own stream, after the work
    /// queued on `stream` before the call. Work queued on `stream` after the call does NOT wait
    /// for the move: join it with [`BlockCopy::stream_wait`] or [`BlockCopy::wait`]. Moves in
    /// the background of one direction run in call order; an offload and a load are not
    /// ordered against each other (join one before the other touches its blocks).
    ///
    /// # Errors
    /// As [`BlockMover::offload`]; issuing failures are reported by the returned move's waits.
    ///
    /// # Safety
    /// As [`BlockMover::offload`], with "work ordered on `stream`" meaning work queued there
    /// before the call, or after a join.
    pub unsafe fn offload_in_background(
        &self,
        device_ids: &[usize],
        host_ids: &[usize],
        stream: StreamHandle,
    ) -> Result<BlockCopy<'_>> {
        // SAFETY: caller's contract.
        unsafe { self.start(Direction::Offload, device_ids, host_ids, stream, true) }
    }

    /// As [`BlockMover::load`], issued in the background as
    /// [`BlockMover::offload_in_background`] says.
    ///
    /// # Errors
    /// As [`BlockMover::load`].
    ///
    /// # Safety
    /// As [`BlockMover::offload_in_background`].
    pub unsafe fn load_in_background(
        &self,
        host_ids: &[usize],
        device_ids: &[usize],
        stream: StreamHandle,
    ) -> Result<BlockCopy<'_>> {
        // SAFETY: caller's contract.
        unsafe { self.start(Direction::Load, host_ids, device_ids, stream, true) }
    }

    /// A move from `src_ids` to `dst_ids`, checked whole, then issued (`background`: by a
    /// thread of the mover).
    ///
    /// # Safety
    /// As [`BlockMover::offload`] (`background`: [`BlockMover::offload_in_background`]).
    pub(crate) unsafe fn start<'i>(
        &self,
        direction: Direction,
        src_ids: impl Into<Cow<'i, [usize]>>,
        dst_ids: impl Into<Cow<'i, [usize]>>,
        stream: StreamHandle,
        background: bool,
    ) -> Result<BlockCopy<'_>> {
        let (src_ids, dst_ids) = (src_ids.into(), dst_ids.into());
        let bytes = src_ids.len() * self.block_bytes();
        if let (true, Some(device)) = (background, &self.device) {
            // The ids are checked here, merged into runs on the issuing thread.
            self.tensors.check_unmerged(direction, &src_ids, &dst_ids)?;
            stamp!("checked");
            if src_ids.is_empty() {
                return Ok(BlockCopy::done());
            }
            let cur = stream.enter_for_copy(device)?;
            stamp!("entered");
            let issuer = match self.background[direction as usize].get() {
                Some(i) => i,
                None => {
                    let i = Issuer::start(device, Arc::clone(&self.tensors))?;
                    let _ = self.background[direction as usize].set(i);
                    self.background[direction as usize]
                        .get()
                        .expect("set above")
                }
            };
            let (src_ids, dst_ids) = (src_ids.into_owned(), dst_ids.into_owned());
            stamp!("owned");
            // SAFETY: checked ids of this mover's tensors (`check_unmerged`); the caller's
            // contracts 1-3 (the BlockCopy borrows the mover and waits when dropped).
            let ticket = unsafe { issuer.send(&cur, direction, src_ids, dst_ids, stream) }?;
            return Ok(BlockCopy {
                inflight: Some(InFlight::Background(ticket)),
                expected: crate::cuda::wait::copy_time(bytes),
                _mover: PhantomData,
            });
        }
        let runs = self.tensors.check(direction, &src_ids, &dst_ids)?;
        if runs.is_empty() {
            return Ok(BlockCopy::done());
        }
        let cur = match &self.device {
            Some(device) => Some(stream.enter_for_copy(device)?),
            None => None,
        };
        let (how, pick) = self
            .tensors
            .how(direction, src_ids.len(), runs.len(), cur.as_ref());
        let mut guard = self.scratch.try_lock();
        let mut own = Scratch::default();
        let scratch = guard.as_deref_mut().unwrap_or(&mut own);
        scratch.segments.clear();
        self.segments(direction, &runs, how, &mut scratch.segments)?;
        let Some(cur) = cur else {
            for s in &scratch.segments {
                // SAFETY: host memory on both sides (`new`), within the tensors (checked runs),
                // valid and not used elsewhere (the caller's contracts 1 and 2); `copy` allows
                // a source and destination that overlap.
                unsafe { std::ptr::copy(s.src as *const u8, s.dst as *mut u8, s.len) };
            }
            return Ok(BlockCopy::done());
        };
        let event = Event::new_in(&cur)?;
        let timing = (pick, src_ids.len(), runs.len());
        // SAFETY: caller's contracts 1-3; the segments lie within the tensors (checked runs).
        let mut issued =
            unsafe { self.issue_here(&cur, direction, (how, timing), scratch, stream, &event) };
        if issued.is_err() {
            // Copies queued before the failure cannot be followed: wait for them (on the
            // caller's stream and the side streams) so none still touches the tensors when
            // the error returns and the borrow ends.
            for side in self.side.iter().filter_map(OnceLock::get) {
                let _ = side.handle().synchronize(&cur);
            }
            issued = stream.drained_on_err(&cur, issued);
        }
        issued?;
        Ok(BlockCopy {
            inflight: Some(InFlight::Event(event)),
            expected: crate::cuda::wait::copy_time(bytes),
            _mover: PhantomData,
        })
    }

    fn segments(
        &self,
        direction: Direction,
        runs: &[Run],
        how: Issue,
        out: &mut Vec<Segment>,
    ) -> Result<()> {
        segments_of(
            &self.tensors.pairs,
            direction,
            runs,
            matches!(how, Issue::Strided { .. }),
            out,
        )
    }

    /// Issues `scratch.segments` as `how` says, on `stream` (a batched move on the legacy
    /// stream: on a side stream joined both ways), timed on the GPU where `timing` (the pick,
    /// blocks and runs of [`Tensors::how`]) says so, and records `event` after them (and after
    /// the timing's end: a move waited for has its timing complete).
    ///
    /// # Safety
    /// As [`BlockMover::offload`]; every segment lies within the mover's tensors and suits
    /// `how`.
    unsafe fn issue_here(
        &self,
        cur: &Current<'_>,
        direction: Direction,
        (how, (pick, blocks, runs)): (Issue, (Pick, usize, usize)),
        scratch: &mut Scratch,
        stream: StreamHandle,
        event: &Event,
    ) -> Result<()> {
        let Scratch { segments, lists } = scratch;
        let helpers = &self.helpers[direction as usize];
        if let Issue::Batched { threads: 2.. } = how {
            helper_streams(cur, helpers)?;
        }
        let timed = |s: StreamHandle, lists: &mut Lists| {
            let shape = (blocks, runs);
            self.tensors
                .issue_timed(cur, s, direction, shape, pick, || {
                    // SAFETY: as this function's; `s` runs after the caller's work.
                    unsafe { issue_on(cur, segments, how, s, helpers, lists) }
                })
        };
        if matches!(how, Issue::Batched { .. }) && stream.as_raw() <= 1 {
            // The batched call refuses the legacy stream: fork onto a side stream and join.
            let side = match self.side[direction as usize].get() {
                Some(s) => s,
                None => {
                    let s = Stream::new(cur.device())?;
                    let _ = self.side[direction as usize].set(s);
                    self.side[direction as usize].get().expect("set above")
                }
            };
            let fork = Event::new_in(cur)?;
            fork.record_in(cur, stream)?;
            fork.wait_on(side.handle())?;
            timed(side.handle(), lists)?;
            event.record_in(cur, side.handle())?;
            return event.wait_on(stream);
        }
        timed(stream, lists)?;
        event.record_in(cur, stream)
    }
}
