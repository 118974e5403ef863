//! The CUDA side of a commit: the step stager's owner of the ring protocol (waiting at open,
//! copies and events at commit).

use super::stager::{StepStager, add};
use crate::cuda::{Current, Event, StreamHandle};
use crate::driver;
use crate::error::{Error, Result};
use crate::ring::protocol::SlotOwner;

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
    pub(super) calls: u32,
    pub(super) batched: bool,
}

/// How a claimer waits for a slot's event.
pub(super) type WaitFn<'w> = dyn FnMut(&Event) -> Result<()> + 'w;

/// The step stager's side of the ring protocol: waiting at open, copies and events at commit.
pub(super) struct Owner<'a, 'c, 'd, 'w> {
    pub(super) st: &'a StepStager,
    pub(super) cur: &'c Current<'d>,
    pub(super) wait: Option<&'w mut WaitFn<'w>>,
    pub(super) send: Option<&'w mut SendJob<'a>>,
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
