//! Pinned bounce buffers shared by both directions' pageable paths (a per-device cache, so a
//! pageable copy does not pay `cuMemHostAlloc`), and the multi-threaded host copy that fills or
//! drains them.

use parking_lot::Mutex;

use super::{PinnedBuffer, PinnedFlags};
use crate::cuda::Device;
use crate::error::Result;

/// Bytes per bounce chunk.
pub const BOUNCE_CHUNK: usize = 8 << 20;
/// Bounce buffers in flight.
pub const BOUNCE_DEPTH: usize = 3;

static BOUNCE: Mutex<Vec<(i32, PinnedBuffer)>> = Mutex::new(Vec::new());

/// [`BOUNCE_DEPTH`] buffers of [`BOUNCE_CHUNK`] bytes for `device`, from the cache or new; owned
/// by the caller until [`give_back`].
pub(crate) fn take(device: &Device) -> Result<Vec<PinnedBuffer>> {
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
        match PinnedBuffer::new(device, BOUNCE_CHUNK, PinnedFlags::PORTABLE) {
            Ok(b) => bufs.push(b),
            Err(e) => {
                give_back(device, bufs);
                return Err(e);
            }
        }
    }
    Ok(bufs)
}

/// Returns buffers to the cache. The caller has waited for every copy that used them.
pub(crate) fn give_back(device: &Device, bufs: Vec<PinnedBuffer>) {
    BOUNCE
        .lock()
        .extend(bufs.into_iter().map(|b| (device.ordinal(), b)));
}

/// Frees the cached bounce buffers.
pub fn release_bounce_buffers() {
    BOUNCE.lock().clear();
}

/// Copies `src` into `dst` with several threads: one core cannot keep up with the copy engine
/// on a fast link, several can.
pub(crate) fn parallel_copy(dst: &mut [u8], src: &[u8]) {
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
