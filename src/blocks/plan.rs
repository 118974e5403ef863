//! Planning a block move: which bytes go where, in as few copies as the block ids allow. Pure:
//! numbers in, copy segments out; nothing is read or written behind the addresses.

use super::copy::Direction;
use crate::dlpack::TensorMeta;
use crate::error::{Error, Result};

/// Where a contiguous tensor keeps its blocks along dimension `block_dim`: each block is `outer`
/// parts (the product of the dimensions before `block_dim`: 2 for K and V of a
/// `[2, num_blocks, ...]` tensor, 1 for `[num_blocks, ...]`), each `bytes` long (the dimensions
/// after `block_dim`); part `j` of block `b` lies at `base + (j * num_blocks + b) * bytes`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct BlockLayout {
    pub(crate) base: u64,
    pub(crate) num_blocks: usize,
    pub(crate) bytes: usize,
    pub(crate) outer: usize,
}

impl BlockLayout {
    /// The layout of `meta` with its blocks along `block_dim`.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when `block_dim` is not a dimension of the tensor or the tensor
    /// holds no block or no byte per block.
    pub(crate) fn of(meta: &TensorMeta, block_dim: usize) -> Result<Self> {
        let shape = meta.shape();
        let Some(&num_blocks) = shape.get(block_dim) else {
            return Err(Error::arg(
                "block_dim",
                format!("{block_dim} (the tensor has {} dimensions)", shape.len()),
                "a dimension of the tensor",
            ));
        };
        let dims = |d: &[i64]| d.iter().map(|&x| x as usize).product::<usize>();
        let outer = dims(&shape[..block_dim]);
        let bytes = dims(&shape[block_dim + 1..]) * meta.dtype().itemsize();
        if num_blocks == 0 || bytes == 0 || outer == 0 {
            return Err(Error::arg(
                "tensor",
                format!("shape {shape:?} with blocks along dimension {block_dim}"),
                "at least one block of at least one byte",
            ));
        }
        Ok(Self {
            base: meta.ptr(),
            num_blocks: num_blocks as usize,
            bytes,
            outer,
        })
    }

    /// Address of part `part` of block `block`.
    fn addr(&self, part: usize, block: usize) -> u64 {
        self.base + ((part * self.num_blocks + block) * self.bytes) as u64
    }
}

/// One device tensor and its host counterpart.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Pair {
    pub(crate) device: BlockLayout,
    pub(crate) host: BlockLayout,
    pub(crate) device_read_only: bool,
    pub(crate) host_read_only: bool,
}

/// One copy: `len` bytes from `src` to `dst`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Segment {
    pub(crate) src: u64,
    pub(crate) dst: u64,
    pub(crate) len: usize,
}

/// A run of blocks moved as one copy per part: `len` blocks from source block `src` on, into
/// destination block `dst` on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Run {
    pub(crate) src: usize,
    pub(crate) dst: usize,
    pub(crate) len: usize,
}

/// Checks that a move of blocks `src_ids[i]` (of a side holding `src_blocks`) into blocks
/// `dst_ids[i]` (of a side holding `dst_blocks`) names one destination per source and only blocks
/// in range (errors name the lists `src_name` and `dst_name`).
fn check_lengths_and_ranges(
    (src_ids, src_name): (&[usize], &'static str),
    (dst_ids, dst_name): (&[usize], &'static str),
    src_blocks: usize,
    dst_blocks: usize,
) -> Result<()> {
    if src_ids.len() != dst_ids.len() {
        return Err(Error::arg(
            "block ids",
            format!(
                "{} source and {} destination ids",
                src_ids.len(),
                dst_ids.len()
            ),
            "one destination id per source id",
        ));
    }
    let in_range = |ids: &[usize], n: usize, what: &'static str| -> Result<()> {
        // Every id is below `n` when their bitwise OR is (a loop of ORs vectorizes on any x86,
        // where a 64-bit compare does not before SSE4.2); else the first past `n`, if any, is
        // the error (an OR of ids below `n` may reach past it when `n` is no power of two).
        if ids.iter().fold(0, |m, &b| m | b) < n {
            return Ok(());
        }
        let Some(&b) = ids.iter().find(|&&b| b >= n) else {
            return Ok(());
        };
        Err(Error::arg(
            what,
            format!("{b} (the tensor holds {n} blocks)"),
            "block ids below the tensor's block count",
        ))
    };
    in_range(src_ids, src_blocks, src_name)?;
    in_range(dst_ids, dst_blocks, dst_name)
}

/// The error for a destination named twice: the smallest such id of `dst_ids` (`found` if none,
/// which cannot happen when one was found).
fn named_twice(dst_ids: &[usize], dst_name: &'static str, found: usize) -> Error {
    let mut sorted = dst_ids.to_vec();
    sorted.sort_unstable();
    let b = sorted
        .windows(2)
        .find(|w| w[0] == w[1])
        .map_or(found, |w| w[0]);
    twice(dst_name, b)
}

fn twice(dst_name: &'static str, b: usize) -> Error {
    Error::arg(
        dst_name,
        format!("{b} twice"),
        "each destination block once (two blocks would be written to one place)",
    )
}

/// Checks a move as [`runs`] does, without merging it: the errors of [`runs`] in the same order,
/// for a caller that merges later (a move in the background, merged on the mover's thread).
/// `seen` is scratch, all zeros on entry (an empty vector is) and left so.
///
/// # Errors
/// As [`runs`].
pub(crate) fn check_ids(
    src: (&[usize], &'static str),
    dst: (&[usize], &'static str),
    src_blocks: usize,
    dst_blocks: usize,
    seen: &mut Vec<u64>,
) -> Result<()> {
    check_lengths_and_ranges(src, dst, src_blocks, dst_blocks)?;
    let (dst_ids, dst_name) = dst;
    // One bit per destination block: 1 KiB for 8192 blocks, where a table of sources is 32.
    let words = dst_blocks.div_ceil(64);
    seen.resize(words.max(seen.len()), 0);
    for &d in dst_ids {
        let (w, bit) = (d / 64, 1u64 << (d % 64));
        if seen[w] & bit != 0 {
            seen.fill(0);
            return Err(named_twice(dst_ids, dst_name, d));
        }
        seen[w] |= bit;
    }
    // Cleared as set: no more work than the marking, however many blocks the side holds.
    for &d in dst_ids {
        seen[d / 64] = 0;
    }
    Ok(())
}

/// Checks a move of blocks `src_ids[i]` (of a side holding `src_blocks`) into blocks
/// `dst_ids[i]` (of a side holding `dst_blocks`; errors name the lists `src_name` and
/// `dst_name`) and merges it into runs of ids consecutive on both sides, in destination order
/// (sources may repeat, destinations may not). As a destination names at most one source, each
/// pair has at most one pair it can follow in a run: the runs are the fewest possible.
///
/// # Errors
/// [`Error::InvalidArgument`] when the id lists differ in length, an id is out of range, or a
/// destination id appears twice (two blocks would be written to one place; the smallest such
/// id is named).
pub(crate) fn runs(
    (src_ids, src_name): (&[usize], &'static str),
    (dst_ids, dst_name): (&[usize], &'static str),
    src_blocks: usize,
    dst_blocks: usize,
) -> Result<Vec<Run>> {
    check_lengths_and_ranges(
        (src_ids, src_name),
        (dst_ids, dst_name),
        src_blocks,
        dst_blocks,
    )?;
    let twice = |b: usize| twice(dst_name, b);
    // Sorting by destination puts a destination named twice beside itself and lines up the
    // pairs a run can merge. Ids below 2^32 (every real tensor's) sort as one word each, the
    // destination in the high half: a third of the time of sorting pairs.
    // At most one run per id: no growth while merging.
    let mut runs: Vec<Run> = Vec::with_capacity(src_ids.len());
    let mut push = |s: usize, d: usize| -> Result<()> {
        match runs.last_mut() {
            Some(r) if r.dst + r.len - 1 == d => return Err(twice(d)),
            Some(r) if r.src + r.len == s && r.dst + r.len == d => r.len += 1,
            _ => runs.push(Run {
                src: s,
                dst: d,
                len: 1,
            }),
        }
        Ok(())
    };
    if dst_blocks <= 8 * src_ids.len() && src_blocks < u32::MAX as usize {
        // Few destination blocks for the ids: a table by destination (source + 1, 0 for none)
        // orders them without a sort.
        let mut table = vec![0u32; dst_blocks];
        for (&s, &d) in src_ids.iter().zip(dst_ids) {
            if std::mem::replace(&mut table[d], s as u32 + 1) != 0 {
                // Named as the sorting paths name it: the smallest id given twice.
                return Err(named_twice(dst_ids, dst_name, d));
            }
        }
        for (d, &s) in table.iter().enumerate() {
            if s != 0 {
                push(s as usize - 1, d)?;
            }
        }
    } else if src_blocks <= 1 << 32 && dst_blocks <= 1 << 32 {
        let mut keys: Vec<u64> = src_ids
            .iter()
            .zip(dst_ids)
            .map(|(&s, &d)| ((d as u64) << 32) | s as u64)
            .collect();
        keys.sort_unstable();
        for k in keys {
            push((k & 0xFFFF_FFFF) as usize, (k >> 32) as usize)?;
        }
    } else {
        let mut pairs: Vec<(usize, usize)> = dst_ids
            .iter()
            .copied()
            .zip(src_ids.iter().copied())
            .collect();
        pairs.sort_unstable();
        for (d, s) in pairs {
            push(s, d)?;
        }
    }
    Ok(runs)
}

/// Appends the copies of `runs` from `src` into `dst` to `out`: one per part and run.
///
/// # Errors
/// [`Error::InvalidArgument`] when the two tensors' blocks differ in size or parts, or a run
/// reaches past either tensor's last block; `out` is then unchanged.
pub(crate) fn segments(
    src: &BlockLayout,
    dst: &BlockLayout,
    runs: &[Run],
    out: &mut Vec<Segment>,
) -> Result<()> {
    if (src.bytes, src.outer) != (dst.bytes, dst.outer) {
        return Err(Error::arg(
            "tensors",
            format!(
                "blocks of {} bytes in {} parts and of {} bytes in {} parts",
                src.bytes, src.outer, dst.bytes, dst.outer
            ),
            "blocks of one size and one number of parts on both sides",
        ));
    }
    if let Some(r) = runs
        .iter()
        .find(|r| r.src + r.len > src.num_blocks || r.dst + r.len > dst.num_blocks)
    {
        return Err(Error::arg(
            "block ids",
            format!(
                "a run of {} blocks from {} into {} (the tensors hold {} and {})",
                r.len, r.src, r.dst, src.num_blocks, dst.num_blocks
            ),
            "block ids below each tensor's block count",
        ));
    }
    for part in 0..src.outer {
        for r in runs {
            out.push(Segment {
                src: src.addr(part, r.src),
                dst: dst.addr(part, r.dst),
                len: r.len * src.bytes,
            });
        }
    }
    Ok(())
}

/// Checks a move of blocks `src_ids[i]` of `src` into blocks `dst_ids[i]` of `dst`, and appends
/// its copies to `out` ([`runs`], then [`segments`]). On error `out` is unchanged.
///
/// # Errors
/// As [`runs`] and [`segments`].
#[cfg(test)]
pub(crate) fn plan(
    src: &BlockLayout,
    dst: &BlockLayout,
    src_ids: &[usize],
    dst_ids: &[usize],
    out: &mut Vec<Segment>,
) -> Result<()> {
    let runs = runs(
        (src_ids, "source block ids"),
        (dst_ids, "destination block ids"),
        src.num_blocks,
        dst.num_blocks,
    )?;
    segments(src, dst, &runs, out)
}

/// The copies of a move of `runs` in `direction` between the tensors of `pairs` into `out`: for
/// a `strided` move the first pair's (each becomes one 2D copy across every pair), else every
/// pair's.
pub(crate) fn segments_of(
    pairs: &[Pair],
    direction: Direction,
    runs: &[Run],
    strided: bool,
    out: &mut Vec<Segment>,
) -> Result<()> {
    let pairs = if strided { &pairs[..1] } else { pairs };
    for p in pairs {
        let (src, dst) = match direction {
            Direction::Offload => (&p.device, &p.host),
            Direction::Load => (&p.host, &p.device),
        };
        segments(src, dst, runs, out)?;
    }
    #[cfg(pinstage_seeded_bug = "blocks_skip_run")]
    out.pop();
    Ok(())
}
