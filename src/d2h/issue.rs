//! One device-to-host copy and the event after it.

use crate::cuda::{Current, Event, StreamHandle};
use crate::driver;
use crate::error::Result;

/// Issues one D2H copy and records `ev` after it.
///
/// # Safety
/// 1. `dst..dst+n` host memory untouched until `ev` completed; `src` valid device memory of the
///    current device of `n` bytes.
pub(super) unsafe fn issue_d2h(
    cur: &Current<'_>,
    ev: &Event,
    src: u64,
    dst: *mut u8,
    n: usize,
    stream: StreamHandle,
) -> Result<()> {
    // SAFETY: caller's contract; context current (`cur`); the stream is a special handle, ours,
    // or vouched for by its maker.
    unsafe { driver::mem::memcpy_dtoh_async(dst.cast(), src, n, stream.raw()) }?;
    stream.drained_on_err(cur, ev.record_in(cur, stream))
}
