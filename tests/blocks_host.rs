//! The block mover on host memory (no driver needed): every byte of every destination checked
//! after random moves against a loop of block copies, both directions, three layouts; plans;
//! refusals that write nothing.

use pinstage::blocks::{BlockMover, Direction, Strategy};
use pinstage::dlpack::{DL_CPU, TensorDesc, validate};
use pinstage::{DeviceView, Error, StreamHandle};
use rstest::rstest;

const POISON: u8 = 0xEE;

/// A u8 (`code` 1) or i8 (`code` 0) tensor of `shape` over `buf`.
fn view(buf: &mut [u8], shape: &[i64], code: u8, read_only: bool) -> DeviceView<'static> {
    let meta = validate(&TensorDesc {
        device_type: DL_CPU,
        device_id: 0,
        data: buf.as_mut_ptr() as u64,
        byte_offset: 0,
        code,
        bits: 8,
        lanes: 1,
        shape,
        strides: None,
        read_only,
    })
    .expect("a valid tensor");
    // SAFETY: every test keeps `buf` alive, and does not touch it, while the view is used.
    unsafe { DeviceView::from_meta(meta) }
}

/// Offset of (part, block) in a side.
type At = Box<dyn Fn(usize, usize) -> usize>;

/// `(shape, block_dim)` of a side of `blocks` blocks of two parts of `bytes` bytes, and the
/// offset of (part p, block b).
fn layout(kind: usize, blocks: usize, bytes: usize) -> (Vec<i64>, usize, At) {
    let (b, n) = (blocks as i64, bytes as i64);
    match kind {
        0 => (
            vec![2, b, n],
            1,
            Box::new(move |p, k| (p * blocks + k) * bytes),
        ),
        1 => (vec![b, 2, n], 0, Box::new(move |p, k| (k * 2 + p) * bytes)),
        // Parts from two dimensions before the blocks (1 x 2).
        _ => (
            vec![1, 2, b, n],
            2,
            Box::new(move |p, k| (p * blocks + k) * bytes),
        ),
    }
}

struct Lcg(u64);
impl Lcg {
    fn below(&mut self, n: usize) -> usize {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((self.0 >> 33) as usize) % n
    }
    /// `k` distinct ids below `n`, in random order.
    fn distinct(&mut self, k: usize, n: usize) -> Vec<usize> {
        let mut all: Vec<usize> = (0..n).collect();
        for i in 0..k {
            let j = i + self.below(n - i);
            all.swap(i, j);
        }
        all.truncate(k);
        all
    }
}

#[rstest]
fn random_moves_write_every_block_and_nothing_else(
    #[values(0, 1, 2)] kind: usize,
    #[values(1, 24)] bytes: usize,
) {
    let (tensors, nd, nh) = (3, 13, 9);
    let (dshape, dim, dat) = layout(kind, nd, bytes);
    let (hshape, _, hat) = layout(kind, nh, bytes);
    let mut rng = Lcg(kind as u64 * 31 + bytes as u64);
    let mut dev: Vec<Vec<u8>> = (0..tensors)
        .map(|t| {
            (0..2 * nd * bytes)
                .map(|i| (i * 7 + t * 13 + 1) as u8 | 1)
                .collect()
        })
        .collect();
    let mut host: Vec<Vec<u8>> = vec![vec![POISON; 2 * nh * bytes]; tensors];
    for round in 0..40 {
        let direction = if round % 2 == 0 {
            Direction::Offload
        } else {
            Direction::Load
        };
        let k = rng.below(nh.min(nd) + 1);
        let dids = rng.distinct(k, nd);
        let hids = rng.distinct(k, nh);
        // the expected state: a loop of block copies
        let (mut want_dev, mut want_host) = (dev.clone(), host.clone());
        for t in 0..tensors {
            for (&d, &h) in dids.iter().zip(&hids) {
                for p in 0..2 {
                    let (a, b) = (dat(p, d), hat(p, h));
                    match direction {
                        Direction::Offload => {
                            want_host[t][b..b + bytes].copy_from_slice(&dev[t][a..a + bytes])
                        }
                        Direction::Load => {
                            want_dev[t][a..a + bytes].copy_from_slice(&host[t][b..b + bytes])
                        }
                    }
                }
            }
        }
        let dv: Vec<_> = dev.iter_mut().map(|b| view(b, &dshape, 1, false)).collect();
        let hv: Vec<_> = host
            .iter_mut()
            .map(|b| view(b, &hshape, 1, false))
            .collect();
        let mover = BlockMover::new(&dv, &hv, dim).unwrap();
        assert_eq!(
            (mover.device_blocks(), mover.host_blocks(), mover.len()),
            (nd, nh, tensors)
        );
        assert_eq!(mover.block_bytes(), tensors * 2 * bytes);
        let plan = match direction {
            Direction::Offload => mover.plan(direction, &dids, &hids),
            Direction::Load => mover.plan(direction, &hids, &dids),
        }
        .unwrap();
        assert_eq!(plan.blocks, k);
        assert_eq!(plan.bytes, k * tensors * 2 * bytes);
        assert!(plan.runs <= k && (k == 0 || plan.runs >= 1));
        assert_eq!(
            plan.strategy,
            if k == 0 {
                Strategy::Empty
            } else {
                Strategy::PerCopy
            }
        );
        // SAFETY: host memory, alive and untouched until the move returned (it is a memcpy).
        let moved = unsafe {
            match direction {
                Direction::Offload => mover.offload(&dids, &hids, StreamHandle::LEGACY),
                Direction::Load => mover.load(&hids, &dids, StreamHandle::LEGACY),
            }
        };
        moved.unwrap().wait().unwrap();
        drop((mover, dv, hv));
        assert!(
            dev == want_dev,
            "device side after {direction:?} {dids:?} <- {hids:?}"
        );
        assert!(
            host == want_host,
            "host side after {direction:?} {dids:?} -> {hids:?}"
        );
        if round % 10 == 9 {
            host.iter_mut().for_each(|h| h.fill(POISON));
        }
    }
}

#[test]
fn adjacent_ids_merge_and_the_plan_says_so() {
    let mut d = vec![1u8; 2 * 16 * 4];
    let mut h = vec![POISON; 2 * 16 * 4];
    let dv = [view(&mut d, &[2, 16, 4], 1, false)];
    let hv = [view(&mut h, &[2, 16, 4], 1, false)];
    let mover = BlockMover::new(&dv, &hv, 1).unwrap();
    let p = mover
        .plan(Direction::Offload, &[3, 4, 5, 9], &[0, 1, 2, 7])
        .unwrap();
    assert_eq!((p.runs, p.copies, p.calls, p.bytes), (2, 4, 4, 32));
    let p = mover.plan(Direction::Load, &[], &[]).unwrap();
    assert_eq!((p.strategy, p.copies, p.calls), (Strategy::Empty, 0, 0));
}

#[rstest]
#[case::lengths(&[0, 1], &[0], "block ids")]
#[case::device_range(&[16], &[0], "device_ids")]
#[case::host_range(&[0], &[16], "host_ids")]
#[case::host_twice(&[0, 1], &[2, 2], "host_ids")]
fn bad_offloads_are_refused_and_write_nothing(
    #[case] dids: &[usize],
    #[case] hids: &[usize],
    #[case] param: &str,
) {
    let mut d: Vec<u8> = (0..2 * 16 * 4).map(|i| i as u8 | 1).collect();
    let mut h = vec![POISON; 2 * 16 * 4];
    {
        let dv = [view(&mut d, &[2, 16, 4], 1, false)];
        let hv = [view(&mut h, &[2, 16, 4], 1, false)];
        let mover = BlockMover::new(&dv, &hv, 1).unwrap();
        assert!(mover.plan(Direction::Offload, dids, hids).is_err());
        // SAFETY: host memory, alive while the mover is.
        let e = unsafe { mover.offload(dids, hids, StreamHandle::LEGACY) }.unwrap_err();
        match e {
            Error::InvalidArgument { param: p, .. } => assert_eq!(p, param, "{e}"),
            e => panic!("{e}"),
        }
    }
    assert!(h.iter().all(|&b| b == POISON), "a refused move wrote");
}

#[test]
fn bad_tensors_are_refused() {
    let mut d = vec![1u8; 64];
    let mut h = vec![0u8; 64];
    let mut h5 = vec![0u8; 80];
    let dv = [view(&mut d, &[2, 8, 4], 1, false)];
    let hv = [view(&mut h, &[2, 8, 4], 1, false)];
    assert!(matches!(
        BlockMover::new(&dv, &[], 1),
        Err(Error::InvalidArgument {
            param: "tensors",
            ..
        })
    ));
    assert!(
        BlockMover::new(&dv, &hv, 3).is_err(),
        "block_dim past the shape"
    );
    let h5v = [view(&mut h5, &[2, 8, 5], 1, false)];
    assert!(matches!(
        BlockMover::new(&dv, &h5v, 1),
        Err(Error::InvalidArgument {
            param: "tensors",
            ..
        })
    ));
    drop(h5v);
    let hi8 = [view(&mut h, &[2, 8, 4], 0, false)];
    assert!(matches!(
        BlockMover::new(&dv, &hi8, 1),
        Err(Error::DtypeMismatch { .. })
    ));
    drop(hi8);
    let ro = [view(&mut h, &[2, 8, 4], 1, true)];
    let mover = BlockMover::new(&dv, &ro, 1).unwrap();
    // SAFETY: host memory, alive while the mover is.
    let e = unsafe { mover.offload(&[0], &[0], StreamHandle::LEGACY) }.unwrap_err();
    assert!(
        matches!(
            e,
            Error::InvalidArgument {
                param: "host_tensors",
                ..
            }
        ),
        "{e}"
    );
    // loading from a read-only host tensor is fine
    // SAFETY: as above.
    unsafe { mover.load(&[0], &[1], StreamHandle::LEGACY) }
        .unwrap()
        .wait()
        .unwrap();
}

/// A read-only destination anywhere among the pairs refuses the direction that writes it, names
/// that tensor and writes nothing; the other direction moves: a read-only device tensor (the
/// third pair) refuses loads, a read-only host tensor (the second) refuses offloads.
#[test]
fn a_read_only_destination_in_any_pair_refuses_its_direction_only() {
    let shape = [2i64, 8, 4];
    let mut d: Vec<Vec<u8>> = (0..3u8)
        .map(|t| (0..64).map(|i| i + 64 * t + 1).collect())
        .collect();
    let mut h: Vec<Vec<u8>> = (0..3).map(|_| vec![POISON; 64]).collect();
    let dv: Vec<_> = d
        .iter_mut()
        .enumerate()
        .map(|(t, b)| view(b, &shape, 1, t == 2))
        .collect();
    let hv: Vec<_> = h
        .iter_mut()
        .enumerate()
        .map(|(t, b)| view(b, &shape, 1, t == 1))
        .collect();
    let mover = BlockMover::new(&dv, &hv, 1).unwrap();
    // SAFETY: host memory, alive while the mover is; nothing else touches it meanwhile.
    let off = unsafe { mover.offload(&[3], &[5], StreamHandle::LEGACY) }.unwrap_err();
    assert!(
        matches!(&off, Error::InvalidArgument { param: "host_tensors", value, .. } if value.contains("tensor 1")),
        "{off}"
    );
    // SAFETY: as above.
    let load = unsafe { mover.load(&[5], &[3], StreamHandle::LEGACY) }.unwrap_err();
    assert!(
        matches!(&load, Error::InvalidArgument { param: "device_tensors", value, .. } if value.contains("tensor 2")),
        "{load}"
    );
    drop((dv, hv));
    assert!(
        h.iter().all(|b| b.iter().all(|&x| x == POISON)),
        "a refused move wrote"
    );
    // A mover whose only read-only tensor is on the device side offloads.
    let dv: Vec<_> = d
        .iter_mut()
        .enumerate()
        .map(|(t, b)| view(b, &shape, 1, t == 2))
        .collect();
    let hv: Vec<_> = h.iter_mut().map(|b| view(b, &shape, 1, false)).collect();
    let mover = BlockMover::new(&dv, &hv, 1).unwrap();
    // SAFETY: as above.
    unsafe { mover.offload(&[3], &[5], StreamHandle::LEGACY) }
        .unwrap()
        .wait()
        .unwrap();
    drop((mover, dv, hv));
    for (t, b) in h.iter().enumerate() {
        for part in 0..2 {
            // Block 5 of each part (4 bytes at part * 32 + 5 * 4) holds block 3 of the source.
            let at = part * 32 + 5 * 4;
            let want: Vec<u8> = (0..4)
                .map(|i| (part * 32 + 3 * 4 + i) as u8 + 64 * t as u8 + 1)
                .collect();
            assert_eq!(&b[at..at + 4], &want[..], "tensor {t} part {part}");
        }
    }
}

#[test]
fn handles_and_names_say_what_they_hold() {
    assert_eq!(
        (Direction::Offload.name(), Direction::Load.name()),
        ("offload", "load")
    );
    assert_eq!(pinstage::blocks::MAX_BATCH, 65536);
    let mut d: Vec<u8> = (1..=64).collect();
    let mut h = vec![0u8; 64];
    let dv = [view(&mut d, &[2, 8, 4], 1, false)];
    let hv = [view(&mut h, &[2, 8, 4], 1, false)];
    let mover = BlockMover::new(&dv, &hv, 1).unwrap();
    assert!(!mover.is_empty() && mover.device().is_none());
    let shown = format!("{mover:?}");
    assert!(
        shown.contains("tensors: 1") && shown.contains("device_blocks: 8"),
        "{shown}"
    );
    // SAFETY: host memory, alive while the mover is.
    let c = unsafe { mover.offload(&[1], &[2], StreamHandle::LEGACY) }.unwrap();
    // A host move is a memcpy: done when the call returns, with nothing for a stream to wait
    // on (no driver is asked).
    assert!(c.is_done() && c.stream_wait(StreamHandle::LEGACY).is_ok());
    assert!(format!("{c:?}").contains("pending: false"));
    c.wait().unwrap();
    assert_eq!(
        (&h[8..12], &h[40..44]),
        (&[5, 6, 7, 8][..], &[37, 38, 39, 40][..])
    );
    // In the background too: no thread to hand it to, moved by the call.
    // SAFETY: as above.
    let c = unsafe { mover.offload_in_background(&[3], &[5], StreamHandle::LEGACY) }.unwrap();
    assert!(c.is_done() && format!("{c:?}").contains("pending: false"));
    c.wait().unwrap();
    assert_eq!(
        (&h[20..24], &h[52..56]),
        (&[13, 14, 15, 16][..], &[45, 46, 47, 48][..])
    );
}

#[test]
fn device_tensors_in_two_kinds_of_memory_are_refused() {
    let mut d = vec![1u8; 64];
    let mut h = [0u8; 128];
    let host_dev = view(&mut d, &[2, 8, 4], 1, false);
    // A CUDA tensor's description (never dereferenced: the mover refuses the mix first).
    let meta = validate(&TensorDesc {
        device_type: pinstage::dlpack::DL_CUDA,
        device_id: 0,
        data: 0x7000_0000,
        byte_offset: 0,
        code: 1,
        bits: 8,
        lanes: 1,
        shape: &[2, 8, 4],
        strides: None,
        read_only: false,
    })
    .unwrap();
    // SAFETY: never read or written (refused before any copy).
    let cuda = unsafe { DeviceView::from_meta(meta) };
    let hv = [
        view(&mut h[..64], &[2, 8, 4], 1, false),
        view(&mut h[64..], &[2, 8, 4], 1, false),
    ];
    let e = BlockMover::new(&[host_dev, cuda], &hv, 1).unwrap_err();
    assert!(
        matches!(&e, Error::InvalidArgument { param: "device_tensors", value, .. }
            if value == "tensor 1 in device memory"),
        "{e}"
    );
}
