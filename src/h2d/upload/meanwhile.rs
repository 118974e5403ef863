//! A pageable upload into device memory made while the copy threads already fill bounce slots
//! (`to_device`'s framework arrays).

use super::job::issue;
use super::{Dst, upload_bounced};
use crate::cuda::{Device, Event, StreamHandle};
use crate::driver;
use crate::error::Result;
use crate::host::CopyPath;

/// As [`start_h2d`](super::start_h2d) into device memory that `make_dst` makes while the
/// source is read: it runs once on the calling thread, after pinstage's copy threads began
/// filling bounce slots from a pageable source (first, for a pinned source or when bounce slots
/// must be allocated), and returns the address of `len` writable bytes of `device`'s memory that
/// stay valid until the copy completed, or `None` to give up. No copy is issued before it
/// returned, and none once it gave up: then this returns `Ok(None)` when the copy threads
/// stopped. The rest of a pageable copy (the slots' allocation, the calling thread's share of
/// the fill, the wait for the copy threads) runs inside `unlocked`, which must call its argument
/// once: Python releases the GIL there and holds it around `make_dst`, which then costs the copy
/// threads only the allocator's own time (`to_device` makes the framework's array so). No copy
/// thread waits for the address (before it, they fill only the slots' first round), so a
/// `make_dst` may run pageable copies of its own.
///
/// # Errors
/// As [`start_h2d`](super::start_h2d)'s.
///
/// # Safety
/// As [`start_h2d`](super::start_h2d)'s; and `make_dst`'s address holds `len` bytes of
/// `device`'s memory.
#[cfg_attr(not(any(feature = "python", feature = "testing")), allow(dead_code))]
pub unsafe fn start_h2d_made_meanwhile(
    device: &Device,
    src: *const u8,
    len: usize,
    stream: StreamHandle,
    make_dst: &mut dyn FnMut() -> Option<u64>,
    unlocked: &mut dyn FnMut(&mut (dyn FnMut() + Send)),
) -> Result<Option<(CopyPath, Option<Event>)>> {
    let _range = crate::nvtx::NvtxRange::new(c"pinstage.copy_h2d");
    if len == 0 {
        return Ok(make_dst().map(|_| (CopyPath::Empty, None)));
    }
    let cur = stream.enter_for_copy(device)?;
    if driver::mem::is_pinned_range(src.cast(), len) {
        let Some(dst) = make_dst() else {
            return Ok(None);
        };
        let ev = Event::new_in(&cur)?;
        // SAFETY: as in `start_h2d`; `dst` holds `len` bytes of this device (caller).
        unsafe { issue(&cur, &ev, dst, src, len, stream) }?;
        return Ok(Some((CopyPath::Pinned, Some(ev))));
    }
    // SAFETY: caller's contract: `len` readable bytes, unchanged until we return.
    let src = unsafe { std::slice::from_raw_parts(src, len) };
    let later = Dst::Later {
        make: make_dst,
        unlocked,
    };
    Ok(upload_bounced(&cur, src, later, stream)?.map(|done| (CopyPath::Bounced, Some(done))))
}
