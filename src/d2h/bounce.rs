//! Device to pageable host memory through a ring of pinned bounce buffers: the copy engine
//! fills one while the CPU drains another.

use super::issue_d2h;
use crate::cuda::{Current, Event, StreamHandle};
use crate::error::Result;
use crate::host::PinnedBuffer;
use crate::host::bounce::{self, BOUNCE_CHUNK, BOUNCE_DEPTH, parallel_copy};

pub(super) fn bounce(
    cur: &Current<'_>,
    src: u64,
    dst: &mut [u8],
    stream: StreamHandle,
) -> Result<()> {
    let device = cur.device();
    let mut bufs: Vec<PinnedBuffer> = bounce::take(device)?;
    let events = (0..BOUNCE_DEPTH)
        .map(|_| Event::new_in(cur))
        .collect::<Result<Vec<_>>>()?;
    let chunks: Vec<(usize, usize)> = (0..dst.len())
        .step_by(BOUNCE_CHUNK)
        .map(|off| (off, BOUNCE_CHUNK.min(dst.len() - off)))
        .collect();
    // Chunk i goes through bounce buffer i % BOUNCE_DEPTH. Chunk i + BOUNCE_DEPTH is issued as
    // soon as chunk i was drained, so the copy engine fills buffers while the CPU drains others.
    let issue = |i: usize, bufs: &mut [PinnedBuffer]| -> Result<()> {
        let (off, len) = chunks[i];
        let k = i % BOUNCE_DEPTH;
        // SAFETY: buffer k is idle (never used, or chunk i - BOUNCE_DEPTH was drained after its
        // event completed); src + off..+len lies within the source.
        unsafe {
            issue_d2h(
                cur,
                &events[k],
                src + off as u64,
                bufs[k].as_mut_ptr(),
                len,
                stream,
            )
        }
    };
    let mut result = (0..chunks.len().min(BOUNCE_DEPTH)).try_for_each(|i| issue(i, &mut bufs));
    for (i, &(off, len)) in chunks.iter().enumerate() {
        if result.is_err() {
            break;
        }
        let k = i % BOUNCE_DEPTH;
        result = events[k].synchronize().and_then(|()| {
            parallel_copy(&mut dst[off..off + len], &bufs[k].as_slice()[..len]);
            match i + BOUNCE_DEPTH {
                next if next < chunks.len() => issue(next, &mut bufs),
                _ => Ok(()),
            }
        });
    }
    // Whatever happened, no copy may still write a buffer that goes back to the cache.
    for ev in &events {
        if let Err(crate::Error::Driver(e)) = ev.synchronize() {
            // The result reports the first failure; a later one of the same context is kept.
            crate::error::record_drop_error(e);
        }
    }
    bounce::give_back(device, bufs);
    result
}
