//! Device to pageable host memory through a ring of pinned bounce buffers: the copy engine
//! fills one while the CPU drains another.

use super::issue::issue_d2h;
use crate::cuda::{Current, StreamHandle};
use crate::error::Result;
use crate::host::bounce::{BOUNCE_CHUNK, BOUNCE_DEPTH, BounceSlot, Lent, parallel_copy};

pub(super) fn bounce(
    cur: &Current<'_>,
    src: u64,
    dst: &mut [u8],
    stream: StreamHandle,
) -> Result<()> {
    // Its many waits (one or more per chunk) swap the capture mode once.
    crate::driver::relaxed(|| bounce_relaxed(cur, src, dst, stream))
}

fn bounce_relaxed(cur: &Current<'_>, src: u64, dst: &mut [u8], stream: StreamHandle) -> Result<()> {
    // Given back to the cache however this returns, a panic included (each slot's event guards
    // its copy in flight).
    let mut lent = Lent::take(cur, BOUNCE_DEPTH, BOUNCE_CHUNK)?;
    let bufs = &mut lent.slots;
    // A cached slot may still be read by an earlier H2D copy.
    for s in bufs.iter() {
        s.busy.synchronize()?;
    }
    let chunks: Vec<(usize, usize)> = (0..dst.len())
        .step_by(BOUNCE_CHUNK)
        .map(|off| (off, BOUNCE_CHUNK.min(dst.len() - off)))
        .collect();
    // Chunk i goes through bounce buffer i % BOUNCE_DEPTH. Chunk i + BOUNCE_DEPTH is issued as
    // soon as chunk i was drained, so the copy engine fills buffers while the CPU drains others.
    let issue = |i: usize, bufs: &mut [BounceSlot]| -> Result<()> {
        let (off, len) = chunks[i];
        let slot = &mut bufs[i % BOUNCE_DEPTH];
        let to = slot.buf.as_mut_ptr();
        // SAFETY: buffer k is idle (its previous copy completed, and chunk i - BOUNCE_DEPTH was
        // drained); src + off..+len lies within the source.
        unsafe { issue_d2h(cur, &slot.busy, src + off as u64, to, len, stream) }
    };
    let mut result = (0..chunks.len().min(BOUNCE_DEPTH)).try_for_each(|i| issue(i, bufs));
    for (i, &(off, len)) in chunks.iter().enumerate() {
        if result.is_err() {
            break;
        }
        let k = i % BOUNCE_DEPTH;
        result = bufs[k].busy.synchronize().and_then(|()| {
            parallel_copy(&mut dst[off..off + len], &bufs[k].buf.as_slice()[..len]);
            match i + BOUNCE_DEPTH {
                next if next < chunks.len() => issue(next, bufs),
                _ => Ok(()),
            }
        });
    }
    // Whatever happened, no copy may still write a buffer that goes back to the cache.
    for s in bufs.iter() {
        if let Err(crate::Error::Driver(e)) = s.busy.synchronize() {
            // The result reports the first failure; a later one of the same context is kept.
            crate::error::record_drop_error(e);
        }
    }
    result
}
