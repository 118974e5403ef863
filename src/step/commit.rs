//! Committing a step: skipping unchanged fields, planning the spans, sending them.

use super::mem::StepBlock;
use super::plan::{AUTO_GAP_BATCH, AUTO_GAP_COPIES, plan};
use super::send::SendJob;
use super::stager::RawStep;
use super::stager::{CommitOutcome, Scratch, StepMode, StepStager, Target};
use crate::cuda::StreamHandle;
use crate::error::{Error, Result};
use crate::ring::protocol::{Claim, Release};

impl StepStager {
    /// Commits a step on `stream` (see [`Step::commit`]). The slot is released in every case.
    pub(crate) fn commit_raw(&self, s: RawStep, stream: StreamHandle<'_>) -> Result<CommitOutcome> {
        let _range = crate::nvtx::NvtxRange::new(c"pinstage.step.commit");
        let index = s.claim.index;
        // SAFETY: we own the slot until the ring releases it below; nothing else touches its
        // scratch.
        let sc = unsafe { &mut *self.core.data(index) };
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
        // A zero-copy step sends nothing by design: it is empty when nothing was written.
        let nothing_written = sc.send.iter().all(|&r| r == 0);
        // The mirror learns the values sent before the send releases the slot (another thread
        // may claim and write it from then on); a failed send forgets everything it knew.
        if let Some(m) = mirror.as_deref_mut() {
            for (i, f) in self.layout.fields().iter().enumerate() {
                let n = sc.send[i] * f.row_bytes();
                if f.skip_unchanged() && n > 0 {
                    // SAFETY: as above (we still own the slot).
                    let now = unsafe { std::slice::from_raw_parts(base.add(f.offset()), n) };
                    let slot = m[i].get_or_insert_with(Vec::new);
                    slot.clear();
                    slot.extend_from_slice(now);
                }
            }
        }
        crate::stamps::stamp!("planned");
        // `sc` is the slot's scratch: not read once `send` released the slot.
        let result = self.send(s.claim, sc, base, stream);
        if result.is_err()
            && let Some(m) = mirror.as_deref_mut()
        {
            m.iter_mut().for_each(|e| *e = None);
        }
        drop(mirror);
        let (calls, batched, block) = result?;
        self.stats.steps.add(1);
        self.stats.skipped_fields.add(u64::from(skipped));
        self.stats.bytes.add(bytes as u64);
        let empty = if self.mode == StepMode::ZeroCopy {
            nothing_written
        } else {
            calls == 0 && block.is_none()
        };
        if empty {
            self.stats.empty_steps.add(1);
        }
        Ok(CommitOutcome {
            calls,
            batched,
            bytes,
            skipped,
            block,
        })
    }

    /// Ends a zero-copy step whose device addresses were handed out without a commit: the
    /// slot's event is recorded on `stream` after the work queued there (its readers), as a
    /// zero-copy commit does, and the slot is released in flight. On a capturing stream, or
    /// when the driver refuses, it is released as a failed commit's is.
    pub(super) fn release_after_readers(&self, s: RawStep, stream: StreamHandle<'_>) -> Result<()> {
        debug_assert!(self.mode == StepMode::ZeroCopy);
        let index = s.claim.index;
        // SAFETY: we own the slot until the ring releases it; nothing else touches its scratch.
        let sc = unsafe { &mut *self.core.data(index) };
        // A zero-copy send of nothing: the event recorded after the readers, the slot released.
        sc.segs.clear();
        let base = self.slot_base(index);
        self.send(s.claim, sc, base, stream).map(|_| ())
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
            self.core.ring().release(claim.index, Release::Idle);
            Err(e)
        };
        let zero = self.mode == StepMode::ZeroCopy;
        if sc.segs.is_empty() && self.mode == StepMode::Arena {
            self.core.ring().release(claim.index, Release::Idle);
            return Ok((0, false, None));
        }
        let host_dst = match &self.target {
            Target::Host(h) => Some(h.ptr()),
            Target::Bound { ptr, host: true } => Some(*ptr as *mut u8),
            _ => None,
        };
        let Some(device) = self.core.device() else {
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
                // A host arena is shared by every commit (a fresh block is this commit's own).
                let _turn = block.is_none().then(|| self.host_arena.lock());
                for &(start, len) in &sc.segs {
                    // SAFETY: slot and arena both hold the layout's bytes; they never overlap.
                    unsafe { std::ptr::copy_nonoverlapping(base.add(start), dst.add(start), len) };
                }
                self.stats.copies.add(sc.segs.len() as u64);
            }
            self.core.ring().release(claim.index, Release::Idle);
            return Ok((if zero { 0 } else { sc.segs.len() as u32 }, false, block));
        };
        if let Some(dst) = host_dst {
            // A bound host arena with a driver: plain host copies.
            let _turn = self.host_arena.lock();
            for &(start, len) in &sc.segs {
                // SAFETY: as above.
                unsafe { std::ptr::copy_nonoverlapping(base.add(start), dst.add(start), len) };
            }
            self.stats.copies.add(sc.segs.len() as u64);
            self.core.ring().release(claim.index, Release::Idle);
            return Ok((sc.segs.len() as u32, false, None));
        }
        let cur = match stream.enter_for_copy(device) {
            Ok(c) => c,
            Err(e) => return release_idle(e),
        };
        crate::stamps::stamp!("entered");
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
            stats: &self.stats,
            cur: &cur,
            calls: 0,
            batched: false,
        };
        // The slot was claimed and made ready at the step's open: nothing waits here.
        let mut no_wait = |_: &crate::cuda::Event| -> Result<()> {
            unreachable!("a commit never waits for its own slot")
        };
        self.core.ring().finish(
            &claim,
            &mut self.core.owner(&cur, stream, &mut no_wait, &mut send),
        )?;
        crate::stamps::stamp!("recorded");
        Ok((send.calls, send.batched, block))
    }
}
