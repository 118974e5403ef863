//! The stager on host destinations: runs everywhere (no driver needed), dtype x size matrix.

mod common;

use common::{POISON, check_layout, pad, values};
use pinstage::{
    CopyOutcome, DType, DeviceView, Error, H2DMirror, PinnedStager, Stager, StreamHandle,
};
use rstest::rstest;

fn host_view(buf: &mut [u8], dtype: DType, numel: usize) -> DeviceView {
    assert!(buf.len() >= numel * dtype.itemsize());
    // SAFETY: buf outlives the view's uses in each test.
    unsafe { DeviceView::contiguous_host(buf.as_mut_ptr(), dtype, numel) }
}

#[rstest]
fn host_round_trip_every_dtype_and_size(
    #[values(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14)] d: usize,
    #[values(0, 1, 2, 3, 4, 5, 6)] s: usize,
) {
    let dtype = common::dtypes()[d];
    let n = common::sizes()[s];
    let item = dtype.itemsize();
    let stager = Stager::new(dtype, 0, 256, 2).expect("a stager is made with or without a driver");
    for (nvals, with_pad) in [(n, false), (n / 2, true), (n / 2, false), (0, true)] {
        let mut out = vec![POISON; n * item + 3 * item];
        let dst = host_view(&mut out, dtype, n);
        let vals = values(dtype, nvals, (n + nvals) as u64);
        let p = pad(dtype);
        let padv = with_pad.then_some(&p[..]);
        let outcome = stager
            .copy_bytes(&dst, &vals, padv, None, StreamHandle::LEGACY)
            .unwrap();
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
    let st = PinnedStager::<i32>::new(0, 16, 2).unwrap();
    let mut out = vec![POISON; 16];
    let dst = host_view(&mut out, DType::I32, 4);
    let err = st
        .copy_(&dst, &[1, 2, 3, 4, 5], None, None, StreamHandle::LEGACY)
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
        .copy_(&wrong, &[1], None, None, StreamHandle::LEGACY)
        .unwrap_err();
    assert_eq!(
        err.to_string(),
        "dtype mismatch: expected int32, got float32"
    );
    let ro = host_view(&mut out, DType::I32, 4).into_read_only();
    assert!(matches!(
        st.copy_(&ro, &[1], None, None, StreamHandle::LEGACY),
        Err(Error::ReadOnly)
    ));
    assert!(out.iter().all(|&b| b == POISON));
    let raw = st.raw();
    let dst = host_view(&mut out, DType::I32, 4);
    assert!(matches!(
        raw.copy_bytes(&dst, &[1, 2, 3], None, None, StreamHandle::LEGACY),
        Err(Error::RaggedBytes {
            bytes: 3,
            itemsize: 4
        })
    ));
    assert!(matches!(
        raw.copy_bytes(
            &dst,
            &[1, 2, 3, 4],
            Some(&[0, 0]),
            None,
            StreamHandle::LEGACY
        ),
        Err(Error::InvalidArgument(_))
    ));
    assert!(out.iter().all(|&b| b == POISON));
    assert!(matches!(
        Stager::new(DType::I32, 0, 4, 0),
        Err(Error::InvalidArgument(_))
    ));
}

#[test]
fn mirror_skips_repeats_and_binds_to_one_destination() {
    let st = PinnedStager::<i64>::new(0, 16, 2).unwrap();
    let mut a = vec![POISON; 64];
    let mut b = vec![POISON; 64];
    let da = host_view(&mut a, DType::I64, 8);
    let db = host_view(&mut b, DType::I64, 8);
    let mut m = H2DMirror::new();
    let v = [7i64, -3, 11];
    assert_eq!(
        st.copy_(&da, &v, Some(-1), Some(&mut m), StreamHandle::LEGACY)
            .unwrap(),
        CopyOutcome::Host
    );
    assert_eq!(
        st.copy_(&da, &v, Some(-1), Some(&mut m), StreamHandle::LEGACY)
            .unwrap(),
        CopyOutcome::Skipped
    );
    // a different pad is a different content
    assert_eq!(
        st.copy_(&da, &v, Some(-2), Some(&mut m), StreamHandle::LEGACY)
            .unwrap(),
        CopyOutcome::Host
    );
    assert_eq!(st.stats().skipped, 1);
    assert_eq!(st.stats().host_copies, 2);
    let err = st
        .copy_(&db, &v, Some(-1), Some(&mut m), StreamHandle::LEGACY)
        .unwrap_err();
    assert!(matches!(err, Error::MirrorReused { .. }), "{err}");
    assert!(b.iter().all(|&x| x == POISON));
    m.invalidate();
    assert_eq!(
        st.copy_(&db, &v, None, Some(&mut m), StreamHandle::LEGACY)
            .unwrap(),
        CopyOutcome::Host
    );
    let got: &[i64] = bytemuck::cast_slice(&a);
    assert_eq!(got, &[7, -3, 11, -2, -2, -2, -2, -2]);
}

#[test]
fn values_may_alias_a_host_destination() {
    let st = Stager::new(DType::U8, 0, 16, 1).unwrap();
    let mut buf: Vec<u8> = (1..=16).collect();
    let dst = host_view(&mut buf, DType::U8, 16);
    // SAFETY: test-only aliasing: values are read from the destination itself (memmove).
    let vals = unsafe { std::slice::from_raw_parts(buf.as_ptr().add(4), 8) };
    st.copy_bytes(&dst, vals, None, None, StreamHandle::LEGACY)
        .unwrap();
    assert_eq!(&buf[..8], &[5, 6, 7, 8, 9, 10, 11, 12]);
}

#[test]
fn impossible_stream_handles_are_refused() {
    use pinstage::StreamHandle;
    for ok in [0usize, 1, 2, 0x7f00_1234_5670] {
        assert_eq!(StreamHandle(ok).check().unwrap(), StreamHandle(ok));
    }
    for bad in [3usize, 4095, 0xFFFF, 0x7f00_1234_5671] {
        let err = StreamHandle(bad).check().unwrap_err();
        assert!(err.to_string().contains("is not a CUDA stream"), "{err}");
    }
}
