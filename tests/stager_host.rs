//! The stager on host destinations: runs everywhere (no driver needed), dtype x size matrix.

mod common;

use common::Put;

use common::{POISON, check_layout, pad, values};
use pinstage::dlpack::TensorMeta;
use pinstage::h2d::CopyOutcome;
use pinstage::h2d::RawStager as Stager;
use pinstage::{DType, DeviceView, Error, H2DMirror, StreamHandle};
use rstest::rstest;

/// A view of `buf` as `numel` elements of `dtype`; unlike `DeviceView::host_mut` it does not
/// borrow `buf`, so a test can look at the bytes between copies.
fn host_view(buf: &mut [u8], dtype: DType, numel: usize) -> DeviceView<'static> {
    assert!(buf.len() >= numel * dtype.itemsize());
    let meta = TensorMeta::host_1d(buf.as_mut_ptr() as u64, dtype, numel, false);
    // SAFETY: each test keeps `buf` alive, and reads it only between copies, while the view is
    // used.
    unsafe { DeviceView::from_meta(meta) }
}

#[rstest]
fn host_round_trip_every_dtype_and_size(
    #[values(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14)] d: usize,
    #[values(0, 1, 2, 3, 4, 5, 6)] s: usize,
) {
    let dtype = common::dtypes()[d];
    let n = common::sizes()[s];
    let item = dtype.itemsize();
    let stager = Stager::builder(dtype)
        .device(0)
        .numel(256)
        .depth(2)
        .build()
        .expect("a stager is made with or without a driver");
    for (nvals, with_pad) in [(n, false), (n / 2, true), (n / 2, false), (0, true)] {
        let mut out = vec![POISON; n * item + 3 * item];
        let dst = host_view(&mut out, dtype, n);
        let vals = values(dtype, nvals, (n + nvals) as u64);
        let p = pad(dtype);
        let padv = with_pad.then_some(&p[..]);
        let outcome =
            common::put_bytes(&stager, &dst, &vals, padv, None, StreamHandle::LEGACY).unwrap();
        let touched = if with_pad { n } else { nvals };
        assert_eq!(
            outcome,
            if touched == 0 {
                CopyOutcome::Empty
            } else {
                CopyOutcome::Host
            }
        );
        check_layout(&out, &vals, padv, n * item);
    }
}

#[test]
fn typed_stager_refusals_leave_destination_untouched() {
    let st = common::stager::<i32>(0, 16, 2).unwrap();
    let mut out = vec![POISON; 16];
    let dst = host_view(&mut out, DType::I32, 4);
    let err = st
        .put(&dst, &[1, 2, 3, 4, 5], None, None, StreamHandle::LEGACY)
        .unwrap_err();
    assert!(
        matches!(
            err,
            Error::TooManyValues {
                values: 5,
                capacity: 4
            }
        ),
        "{err}"
    );
    let wrong = host_view(&mut out, DType::F32, 4);
    let err = st
        .put(&wrong, &[1], None, None, StreamHandle::LEGACY)
        .unwrap_err();
    assert!(
        err.to_string()
            .starts_with("dtype must be int32; got float32; "),
        "{err}"
    );
    let ro = host_view(&mut out, DType::I32, 4).into_read_only();
    assert!(matches!(
        st.put(&ro, &[1], None, None, StreamHandle::LEGACY),
        Err(Error::ReadOnly)
    ));
    assert!(out.iter().all(|&b| b == POISON));
    let raw = st.raw();
    let dst = host_view(&mut out, DType::I32, 4);
    assert!(matches!(
        common::put_bytes(raw, &dst, &[1, 2, 3], None, None, StreamHandle::LEGACY),
        Err(Error::RaggedBytes {
            bytes: 3,
            itemsize: 4
        })
    ));
    assert!(matches!(
        common::put_bytes(
            raw,
            &dst,
            &[1, 2, 3, 4],
            Some(&[0, 0]),
            None,
            StreamHandle::LEGACY
        ),
        Err(Error::PadSize {
            got: 2,
            expected: 4,
            dtype: DType::I32
        })
    ));
    assert!(out.iter().all(|&b| b == POISON));
    assert!(matches!(
        Stager::builder(DType::I32)
            .device(0)
            .numel(4)
            .depth(0)
            .build(),
        Err(Error::InvalidArgument { param: "depth", .. })
    ));
}

#[test]
fn mirror_skips_repeats_and_binds_to_one_destination() {
    let st = common::stager::<i64>(0, 16, 2).unwrap();
    let mut a = vec![POISON; 64];
    let mut b = vec![POISON; 64];
    let da = host_view(&mut a, DType::I64, 8);
    let db = host_view(&mut b, DType::I64, 8);
    let mut m = H2DMirror::new();
    let v = [7i64, -3, 11];
    assert_eq!(
        st.put(&da, &v, Some(-1), Some(&mut m), StreamHandle::LEGACY)
            .unwrap(),
        CopyOutcome::Host
    );
    assert_eq!(
        st.put(&da, &v, Some(-1), Some(&mut m), StreamHandle::LEGACY)
            .unwrap(),
        CopyOutcome::Skipped
    );
    // a different pad is a different content
    assert_eq!(
        st.put(&da, &v, Some(-2), Some(&mut m), StreamHandle::LEGACY)
            .unwrap(),
        CopyOutcome::Host
    );
    assert_eq!(st.stats().skipped_copies, 1);
    assert_eq!(st.stats().host_copies, 2);
    let err = st
        .put(&db, &v, Some(-1), Some(&mut m), StreamHandle::LEGACY)
        .unwrap_err();
    assert!(matches!(err, Error::MirrorReused { .. }), "{err}");
    assert!(b.iter().all(|&x| x == POISON));
    m.invalidate();
    assert_eq!(
        st.put(&db, &v, None, Some(&mut m), StreamHandle::LEGACY)
            .unwrap(),
        CopyOutcome::Host
    );
    let got: &[i64] = bytemuck::cast_slice(&a);
    assert_eq!(got, &[7, -3, 11, -2, -2, -2, -2, -2]);
}

#[test]
fn values_may_alias_a_host_destination() {
    let st = Stager::builder(DType::U8)
        .device(0)
        .numel(16)
        .depth(1)
        .build()
        .unwrap();
    let mut buf: Vec<u8> = (1..=16).collect();
    let dst = host_view(&mut buf, DType::U8, 16);
    // SAFETY: test-only aliasing: values are read from the destination itself (memmove).
    let vals = unsafe { std::slice::from_raw_parts(buf.as_ptr().add(4), 8) };
    common::put_bytes(&st, &dst, vals, None, None, StreamHandle::LEGACY).unwrap();
    assert_eq!(&buf[..8], &[5, 6, 7, 8, 9, 10, 11, 12]);
}

#[test]
fn impossible_stream_handles_are_refused() {
    for ok in [0usize, 1, 2, 0x7f00_1234_5670] {
        // SAFETY: the handle is only checked and compared, never used.
        assert_eq!(unsafe { StreamHandle::from_raw(ok) }.unwrap().as_raw(), ok);
    }
    for bad in [3usize, 4095, 0xFFFF, 0x7f00_1234_5671] {
        // SAFETY: as above.
        let err = unsafe { StreamHandle::from_raw(bad) }.unwrap_err();
        assert!(matches!(err, Error::BadStreamHandle { handle } if handle == bad));
        assert!(err.to_string().contains("which is no CUDA stream"), "{err}");
    }
}

#[test]
fn copy_h2d_into_host_destinations_and_refusals() {
    let src: Vec<i32> = (0..1001).map(|i| i * 7 - 3).collect();
    let mut out = vec![POISON; 1001 * 4 + 8];
    let dst = host_view(&mut out, DType::I32, 1001);
    let path = pinstage::copy_h2d(&dst, bytemuck::cast_slice(&src), StreamHandle::LEGACY).unwrap();
    assert_eq!(path, pinstage::host::CopyPath::Host);
    assert_eq!(&out[..1001 * 4], bytemuck::cast_slice::<i32, u8>(&src));
    assert!(out[1001 * 4..].iter().all(|&b| b == POISON));
    let mut small = vec![POISON; 64];
    let dst = host_view(&mut small, DType::I32, 16);
    let err = pinstage::copy_h2d(&dst, &[1u8; 60], StreamHandle::LEGACY).unwrap_err();
    assert!(
        matches!(
            err,
            Error::DestinationTooSmall {
                needed: 60,
                got: 64
            }
        ),
        "{err}"
    );
    let ro = host_view(&mut small, DType::I32, 16).into_read_only();
    let err = pinstage::copy_h2d(&ro, &[1u8; 64], StreamHandle::LEGACY).unwrap_err();
    assert!(matches!(err, Error::ReadOnly));
    assert!(small.iter().all(|&b| b == POISON));
    // SAFETY: refused before anything is written through it.
    let cuda = unsafe { DeviceView::from_meta(TensorMeta::cuda_1d(0, 0x1000, DType::U8, 4)) };
    let err = pinstage::copy_h2d(&cuda, &[1u8; 4], StreamHandle::LEGACY).unwrap_err();
    if pinstage::cuda::cuda_available() {
        // No device memory there: the driver refuses the copy (nothing is written).
        assert!(matches!(err, Error::Driver(_)), "{err}");
    } else {
        assert!(matches!(err, Error::CudaUnavailable { .. }), "{err}");
    }
}

/// `numel * itemsize` past `isize::MAX` cannot describe memory: refused when the metadata is
/// made, before any copy trusts its `nbytes()` (it wrapped in release builds).
#[rstest]
#[should_panic(expected = "span more bytes than any memory holds")]
fn one_dimensional_metadata_past_any_memory_panics(#[values(false, true)] cuda: bool) {
    let numel = usize::MAX / 4 + 2; // * 4 wraps to a few bytes
    if cuda {
        let _ = TensorMeta::cuda_1d(0, 4096, DType::I32, numel);
    } else {
        let _ = TensorMeta::host_1d(4096, DType::I32, numel, false);
    }
}

#[test]
fn one_dimensional_metadata_up_to_isize_bytes_is_made() {
    let numel = isize::MAX as usize / 4;
    let meta = TensorMeta::host_1d(4096, DType::I32, numel, true);
    assert_eq!(meta.nbytes(), numel * 4);
}

/// The getters and `Debug` report what the stager was built with; outcomes say whether they
/// wrote. Without a driver a stager for any ordinal is made (host destinations only).
#[test]
fn getters_and_outcomes_report_what_was_built_and_done() {
    match Stager::builder(DType::F32).device(3).depth(5).build() {
        Ok(st) => {
            assert_eq!((st.ordinal(), st.depth()), (3, 5));
            let dbg = format!("{st:?}");
            assert!(dbg.starts_with("RawStager"), "{dbg}");
            assert!(
                dbg.contains("device: 3") && dbg.contains("depth: 5"),
                "{dbg}"
            );
            if pinstage::Device::get(3).is_err() {
                assert!(!st.has_cuda(), "no device 3, yet devices are served");
                assert!(dbg.contains("cuda: false"), "{dbg}");
            }
        }
        // A driver without a fourth device refuses the ordinal.
        Err(e) => assert!(matches!(e, Error::NoSuchDevice { .. }), "{e:?}"),
    }
    // With a driver (a GPU, or the simulated one), device 0's stager serves devices.
    if pinstage::Device::get(0).is_ok() {
        let st = Stager::builder(DType::F32)
            .device(0)
            .depth(5)
            .build()
            .unwrap();
        assert_eq!((st.ordinal(), st.depth()), (0, 5));
        assert!(st.has_cuda(), "device 0 exists, yet no device is served");
        let dbg = format!("{st:?}");
        assert!(
            dbg.contains("device: 0") && dbg.contains("depth: 5") && dbg.contains("cuda: true"),
            "{dbg}"
        );
    }
    assert!(CopyOutcome::Issued { slot: 2 }.wrote());
    assert!(CopyOutcome::Host.wrote());
    assert!(!CopyOutcome::Skipped.wrote());
    assert!(!CopyOutcome::Empty.wrote());
}
