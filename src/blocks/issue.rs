//! How a move's copies reach the driver: as 2D copies across the tensors, in batched calls, or
//! one call per copy.

use super::copy::MAX_BATCH;
use super::plan::Segment;
use crate::cuda::StreamHandle;
use crate::driver::{self, DriverError};

/// How a move's segments are issued.
#[derive(Clone, Copy, Debug)]
pub(super) enum Issue {
    /// One 2D copy per segment: `rows` rows, sources `src_pitch` and destinations `dst_pitch`
    /// bytes apart; `to_host`: device to host.
    Strided {
        src_pitch: usize,
        dst_pitch: usize,
        rows: usize,
        to_host: bool,
    },
    /// `cuMemcpyBatchAsync`, [`MAX_BATCH`] copies per call (not on the legacy stream).
    Batched,
    /// One `cuMemcpyAsync` per segment (drivers before CUDA 12.8).
    PerCopy,
}

/// The address lists of one batched call, reused.
#[derive(Default)]
pub(super) struct Lists {
    dsts: Vec<u64>,
    srcs: Vec<u64>,
    sizes: Vec<usize>,
}

/// Issues `segments` on `stream` as `how` says.
///
/// # Safety
/// 1. Every segment is a copy valid for `how` whose memory stays valid until it completed.
/// 2. `stream` is a live stream of the current context (not the legacy default stream for
///    [`Issue::Batched`]).
pub(super) unsafe fn issue(
    segments: &[Segment],
    how: Issue,
    stream: StreamHandle,
    lists: &mut Lists,
) -> std::result::Result<(), DriverError> {
    match how {
        Issue::Strided {
            src_pitch,
            dst_pitch,
            rows,
            to_host,
        } => {
            for s in segments {
                let src = driver::mem::Pitched {
                    addr: s.src,
                    pitch: src_pitch,
                    host: !to_host,
                };
                let dst = driver::mem::Pitched {
                    addr: s.dst,
                    pitch: dst_pitch,
                    host: to_host,
                };
                // SAFETY: the caller's contract; rows of `s.len <= pitch` bytes.
                unsafe { driver::mem::memcpy_2d_async(dst, src, s.len, rows, stream.raw()) }?;
            }
        }
        Issue::Batched => {
            for chunk in segments.chunks(MAX_BATCH) {
                lists.dsts.clear();
                lists.srcs.clear();
                lists.sizes.clear();
                for s in chunk {
                    lists.dsts.push(s.dst);
                    lists.srcs.push(s.src);
                    lists.sizes.push(s.len);
                }
                // SAFETY: the caller's contract, per entry; three lists of one length.
                unsafe {
                    driver::mem::memcpy_batch_async(
                        &mut lists.dsts,
                        &mut lists.srcs,
                        &mut lists.sizes,
                        stream.raw(),
                    )
                }?;
            }
        }
        Issue::PerCopy => {
            for s in segments {
                // SAFETY: the caller's contract, per segment.
                unsafe { driver::mem::memcpy_async(s.dst, s.src, s.len, stream.raw()) }?;
            }
        }
    }
    Ok(())
}
