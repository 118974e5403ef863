//! When 2D copies can cross every tensor of a side at once: the tensors share one layout, sit at
//! one address stride, and lie in one driver allocation.

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
    let within = |side: fn(&Pair) -> &BlockLayout| {
        let (first, last) = (side(&pairs[0]), side(&pairs[pairs.len() - 1]));
        let end = last.base + (last.outer * last.num_blocks * last.bytes) as u64;
        driver::mem::allocation_range(first.base)
            .is_some_and(|(start, size)| first.base >= start && end <= start + size as u64)
    };
    within(|p| &p.device) && within(|p| &p.host)
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
