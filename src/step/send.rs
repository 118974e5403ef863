//! The CUDA side of a commit: the copies of one step's used spans (one copy, one batch, or one
//! copy per span) and the fresh block's event, as the slot ring's [`SlotIo`].

use super::stager::Counters;
use crate::cuda::{Current, Event, StreamHandle};
use crate::driver;
use crate::error::Result;
use crate::ring::slots::SlotIo;

/// The copies of one commit.
pub(super) struct SendJob<'a> {
    pub(super) segs: &'a [(usize, usize)],
    pub(super) dsts: &'a mut Vec<u64>,
    pub(super) srcs: &'a mut Vec<u64>,
    pub(super) sizes: &'a mut Vec<usize>,
    pub(super) src: *mut u8,
    pub(super) dst: u64,
    pub(super) stream: StreamHandle<'a>,
    pub(super) zero: bool,
    pub(super) batch: bool,
    pub(super) block: Option<&'a Event>,
    pub(super) stats: &'a Counters,
    /// The device's context, current on this thread.
    pub(super) cur: &'a Current<'a>,
    pub(super) calls: u32,
    pub(super) batched: bool,
}

impl SlotIo for SendJob<'_> {
    fn fill(&mut self, _slot: usize) -> Result<()> {
        // The step wrote the slot before the commit.
        Ok(())
    }

    fn send(&mut self, _slot: usize) -> Result<()> {
        if self.zero || self.segs.is_empty() {
            return Ok(());
        }
        // Seeded bug (scripts/seeded.tsv): the commit copies nothing.
        #[cfg(pinstage_seeded_bug = "step_skip_copy")]
        return Ok(());
        crate::stamps::stamp!("send begins");
        let stream = self.stream;
        if self.segs.len() > 1 && self.batch {
            self.dsts.clear();
            self.srcs.clear();
            self.sizes.clear();
            for &(start, len) in self.segs {
                self.dsts.push(self.dst + start as u64);
                // SAFETY: within the slot.
                self.srcs.push(unsafe { self.src.add(start) } as u64);
                self.sizes.push(len);
            }
            // SAFETY: each source span is in our slot, untouched until the slot's event (recorded
            // next) completed; each destination span lies in the arena or block of this device;
            // the driver has the call (checked at build) and the stream is not the legacy one.
            unsafe {
                driver::mem::memcpy_batch_async(self.dsts, self.srcs, self.sizes, stream.raw())
            }?;
            self.stats.batches.add(1);
            self.stats.batch_entries.add(self.segs.len() as u64);
            self.calls = 1;
            self.batched = true;
            crate::stamps::stamp!("copied");
            return Ok(());
        }
        for (k, &(start, len)) in self.segs.iter().enumerate() {
            // SAFETY: as above, one span at a time.
            let r = unsafe {
                driver::mem::memcpy_htod_async(
                    self.dst + start as u64,
                    self.src.add(start).cast(),
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
            self.calls += 1;
            self.stats.copies.add(1);
        }
        crate::stamps::stamp!("copied");
        Ok(())
    }

    fn recorded(&mut self, cur: &Current<'_>, stream: StreamHandle<'_>) -> Result<()> {
        match self.block {
            Some(b) => b.record_in(cur, stream),
            None => Ok(()),
        }
    }
}
