//! When 2D copies can cross every tensor of a side at once (the tensors share one layout, sit at
//! one address stride, and lie in one driver allocation) and beat a batch; from how many threads
//! a batch is issued.

use super::Direction;
use super::plan::{BlockLayout, Pair};
use crate::cuda::Device;
use crate::driver;

/// The largest pitch a 2D copy takes (`CU_DEVICE_ATTRIBUTE_MAX_PITCH` of current GPUs).
const MAX_PITCH: usize = i32::MAX as usize;

/// Device-to-host copy sizes (bytes per copy, on average over a move) at which a batch beats 2D
/// copies, as measured on the H200 (benches/RESULTS.md, KV-cache blocks: the 2D peer against the
/// batch peer); host-to-device, 2D copies won at every size measured.
const OFFLOAD_BATCHED: std::ops::Range<usize> = (8 << 10) + 1..32 << 10;

/// Whether a move of `blocks` blocks of `part_bytes` per part, merged into `runs` runs, is
/// faster as 2D copies across the tensors than as a batch ([`OFFLOAD_BATCHED`]).
pub(super) fn two_d_wins(
    direction: Direction,
    blocks: usize,
    part_bytes: usize,
    runs: usize,
) -> bool {
    runs > 0
        && match direction {
            Direction::Load => true,
            Direction::Offload => !OFFLOAD_BATCHED.contains(&(blocks * part_bytes / runs)),
        }
}

/// Whether each side's tensors lie in one driver allocation (a 2D copy may not cross from one
/// allocation into another, even at a regular stride).
pub(super) fn one_allocation(device: &Device, pairs: &[Pair]) -> bool {
    let Ok(_cur) = device.enter() else {
        return false;
    };
    let within = |side: fn(&Pair) -> &BlockLayout, host: bool| {
        let (first, last) = (side(&pairs[0]), side(&pairs[pairs.len() - 1]));
        let end = last.base + (last.outer * last.num_blocks * last.bytes) as u64;
        // pinstage's own host pool blocks first: the driver does not answer for them.
        host.then(|| crate::host::host_pool::block_holding(first.base))
            .flatten()
            .or_else(|| driver::mem::allocation_range(first.base))
            .is_some_and(|(start, size)| first.base >= start && end <= start + size as u64)
    };
    within(|p| &p.device, false) && within(|p| &p.host, true)
}

/// The address strides (device, host) between consecutive pairs when there are several pairs,
/// every side's tensors share one layout, and they sit at one positive stride no shorter than a
/// tensor and within [`MAX_PITCH`]: then row `i` of a 2D copy is pair `i`'s bytes.
pub(super) fn strides(pairs: &[Pair]) -> Option<(usize, usize)> {
    let stride = |side: fn(&Pair) -> &BlockLayout| -> Option<usize> {
        let first = side(&pairs[0]);
        let extent = first.outer * first.num_blocks * first.bytes;
        let step = side(pairs.get(1)?).base.checked_sub(first.base)? as usize;
        let regular = pairs.iter().enumerate().all(|(i, p)| {
            let l = side(p);
            (l.num_blocks, l.bytes, l.outer) == (first.num_blocks, first.bytes, first.outer)
                && Some(l.base)
                    == (step as u64)
                        .checked_mul(i as u64)
                        .and_then(|o| first.base.checked_add(o))
        });
        (regular && step >= extent && step <= MAX_PITCH).then_some(step)
    };
    Some((stride(|p| &p.device)?, stride(|p| &p.host)?))
}

/// Copies a batched move needs before it is issued from several threads (fewer take less time to
/// issue than a thread takes to start).
const SPLIT_MIN: usize = 4096;

/// How many threads issue a batched move of `copies` copies of `copy_bytes` on average, as
/// measured on the H200 (lab/c/blocks2d.c, 64 tensors, 2048 random blocks, GB/s with 1 / 2 / 4
/// threads): host-to-device 4 KiB 2.4 / 3.6 / 6.4, 16 KiB 3.3 / 5.9 / 12.6, 64 KiB 44 / 46 /
/// 47; device-to-host 4 KiB 9.7 / 8.4 / 9.1, 16 KiB 28 / 36 / 33, 64 KiB 43 / 46 / 46.
pub(super) fn batch_threads(direction: Direction, copies: usize, copy_bytes: usize) -> usize {
    if copies < SPLIT_MIN {
        return 1;
    }
    match direction {
        Direction::Load => 4,
        Direction::Offload if copy_bytes > 8 << 10 => 2,
        Direction::Offload => 1,
    }
}
