//! Device to pageable host memory through a ring of pinned bounce buffers: the copy engine
//! fills one while the CPU drains another.

use parking_lot::Mutex;

use super::issue_d2h;
use crate::cuda::{Current, Event, StreamHandle};
use crate::error::Result;
use crate::host::{PinnedBuffer, PinnedFlags};

/// Bytes per bounce chunk.
pub const BOUNCE_CHUNK: usize = 8 << 20;
/// Bounce buffers in flight.
pub const BOUNCE_DEPTH: usize = 3;

/// Per-device cache of bounce buffers, so pageable copies do not pay `cuMemHostAlloc`.
static BOUNCE: Mutex<Vec<(i32, PinnedBuffer)>> = Mutex::new(Vec::new());

pub(super) fn bounce(
    cur: &Current<'_>,
    src: u64,
    dst: &mut [u8],
    stream: StreamHandle,
) -> Result<()> {
    let device = cur.device();
    let mut bufs: Vec<PinnedBuffer> = {
        let mut cache = BOUNCE.lock();
        let mut mine = Vec::with_capacity(BOUNCE_DEPTH);
        let mut i = 0;
        while i < cache.len() && mine.len() < BOUNCE_DEPTH {
            if cache[i].0 == device.ordinal() {
                mine.push(cache.swap_remove(i).1);
            } else {
                i += 1;
            }
        }
        mine
    };
    while bufs.len() < BOUNCE_DEPTH {
        bufs.push(PinnedBuffer::new(
            device,
            BOUNCE_CHUNK,
            PinnedFlags::PORTABLE,
        )?);
    }
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
    BOUNCE
        .lock()
        .extend(bufs.into_iter().map(|b| (device.ordinal(), b)));
    result
}

/// Copies `src` into `dst` with several threads: one core cannot keep up with the copy engine
/// on a fast link, several can.
fn parallel_copy(dst: &mut [u8], src: &[u8]) {
    use rayon::prelude::*;
    const PIECE: usize = 512 << 10;
    if dst.len() <= PIECE {
        dst.copy_from_slice(src);
        return;
    }
    dst.par_chunks_mut(PIECE)
        .zip(src.par_chunks(PIECE))
        .for_each(|(d, s)| d.copy_from_slice(s));
}

/// Frees the cached bounce buffers.
pub fn release_bounce_buffers() {
    BOUNCE.lock().clear();
}
