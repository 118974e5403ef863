//! How a move's copies reach the driver: as 2D copies across the tensors, in batched calls (from
//! one thread, or from several at once, each on its own stream), or one call per copy.

use std::sync::OnceLock;

use super::copy::MAX_BATCH;
use super::plan::Segment;
use crate::cuda::{Current, Event, Stream, StreamHandle};
use crate::driver::{self, DriverError};
use crate::error::{Error, Result};

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
    /// `cuMemcpyBatchAsync`, [`MAX_BATCH`] copies per call (not on the legacy stream), from
    /// `threads` threads at once ([`issue_split`]).
    Batched { threads: usize },
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
///    [`Issue::Batched`]). A batch is issued from this thread alone (see [`issue_split`]).
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
        Issue::Batched { .. } => {
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

/// The helper streams a split batch issues on, made at the first call (before a timed move's
/// start is recorded, so that making them is not timed as part of a move).
pub(super) fn helper_streams<'h>(
    cur: &Current<'_>,
    helpers: &'h OnceLock<Vec<Stream>>,
) -> Result<&'h [Stream]> {
    if let Some(h) = helpers.get() {
        return Ok(h);
    }
    let made = (1..MAX_THREADS)
        .map(|_| Stream::new(cur.device()))
        .collect::<Result<Vec<_>>>()?;
    let _ = helpers.set(made);
    Ok(helpers.get().expect("set above"))
}

/// Issues a batched move's `segments` from `threads` threads at once, each share on its own
/// stream: the first share on `stream` from this thread, the others on helper streams (made
/// once, kept in `helpers`) after a fork from `stream`, which then waits for them. The driver
/// takes a batch of small copies only as fast as the GPU drains one queue, and holds the
/// issuing thread meanwhile: several queues filled at once move more (lab/c/blocks2d.c).
///
/// # Errors
/// [`Error::Driver`]: a call refused; everything issued on the helper streams has then
/// completed (the caller drains `stream`).
///
/// # Safety
/// As [`issue`], for a batch.
pub(super) unsafe fn issue_split(
    cur: &Current<'_>,
    segments: &[Segment],
    threads: usize,
    stream: StreamHandle,
    helpers: &OnceLock<Vec<Stream>>,
    lists: &mut Lists,
) -> Result<()> {
    let mut parts = segments.chunks(share(segments.len(), threads));
    let first = parts.next().unwrap_or(&[]);
    let rest: Vec<&[Segment]> = parts.collect();
    if rest.is_empty() {
        // SAFETY: the caller's contract.
        return Ok(unsafe { issue(first, Issue::Batched { threads: 1 }, stream, lists) }?);
    }
    let helpers = helper_streams(cur, helpers)?;
    let fork = Event::new_in(cur)?;
    fork.record_in(cur, stream)?;
    for h in &helpers[..rest.len()] {
        fork.wait_on_in(cur, h.handle())?;
    }
    let device = cur.device();
    let (mine, theirs): (std::result::Result<(), DriverError>, Vec<Result<()>>) =
        std::thread::scope(|sc| {
            let handles: Vec<_> = rest
                .iter()
                .zip(helpers)
                .map(|(part, h)| {
                    sc.spawn(move || -> Result<()> {
                        let _cur = device.enter()?;
                        // SAFETY: the caller's contract; `h` is a live stream of this context,
                        // after the fork.
                        let issued = driver::capture_relaxed(|| unsafe {
                            issue(
                                part,
                                Issue::Batched { threads: 1 },
                                h.handle(),
                                &mut Lists::default(),
                            )
                        });
                        Ok(issued?)
                    })
                })
                .collect();
            // SAFETY: the caller's contract.
            let mine = unsafe { issue(first, Issue::Batched { threads: 1 }, stream, lists) };
            let theirs = handles
                .into_iter()
                .map(|h| {
                    h.join().unwrap_or_else(|_| {
                        Err(Error::unavailable("a thread issuing block copies panicked"))
                    })
                })
                .collect();
            (mine, theirs)
        });
    let failed = theirs.into_iter().find_map(Result::err);
    let joined = match (mine, failed) {
        (Err(e), _) => Err(Error::from(e)),
        (Ok(()), Some(e)) => Err(e),
        (Ok(()), None) => helpers[..rest.len()].iter().try_for_each(|h| {
            let join = Event::new_in(cur)?;
            join.record_in(cur, h.handle())?;
            join.wait_on_in(cur, stream)
        }),
    };
    if joined.is_err() {
        // What the helpers issued cannot be followed: drained before the error returns.
        for h in &helpers[..rest.len()] {
            let _ = h.handle().synchronize(cur);
        }
    }
    joined
}

/// The most threads (and streams) one batched move is issued from.
const MAX_THREADS: usize = 4;

/// Copies per thread when `copies` are issued from `threads` threads ([`issue_split`]): equal
/// shares but the last.
pub(super) fn share(copies: usize, threads: usize) -> usize {
    copies.div_ceil(threads.clamp(1, MAX_THREADS)).max(1)
}

/// Issues `segments` on `stream` as `how` says: a batch for several threads through
/// [`issue_split`] (with `helpers`' streams), anything else on this thread.
///
/// # Safety
/// As [`issue`].
pub(super) unsafe fn issue_on(
    cur: &Current<'_>,
    segments: &[Segment],
    how: Issue,
    stream: StreamHandle,
    helpers: &OnceLock<Vec<Stream>>,
    lists: &mut Lists,
) -> Result<()> {
    match how {
        // SAFETY: the caller's contract.
        Issue::Batched { threads } if threads > 1 => unsafe {
            issue_split(cur, segments, threads, stream, helpers, lists)
        },
        // SAFETY: the caller's contract.
        _ => Ok(unsafe { issue(segments, how, stream, lists) }?),
    }
}
