//! GPU tests of the stager. They run when a driver is present, print a skip reason otherwise,
//! and fail when `PINSTAGE_REQUIRE_GPU=1` finds no GPU.

mod common;

use common::Put;

use std::sync::Arc;

use common::{POISON, check_layout, gpu_or_skip, pad, poisoned, read, values, view};
use pinstage::dlpack::TensorMeta;
use pinstage::h2d::CopyOutcome;
use pinstage::h2d::RawStager as Stager;
use pinstage::testing::{begin_capture, current_context, end_capture};
use pinstage::{DType, DeviceView, Error, H2DMirror, Stream, StreamHandle};
use rstest::rstest;

#[rstest]
#[ignore = "needs a CUDA GPU: run with --include-ignored (scripts/gpu-run does)"]
fn gpu_every_dtype_and_size(
    #[values(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14)] d: usize,
    #[values(0, 1, 2, 3, 4, 5, 6)] s: usize,
) {
    let Some(dev) = gpu_or_skip("gpu_every_dtype_and_size") else {
        return;
    };
    let dtype = common::dtypes()[d];
    let n = common::sizes()[s];
    let stager = Stager::builder(dtype)
        .device(0)
        .numel(256)
        .depth(2)
        .build()
        .unwrap();
    let stream = Stream::new(&dev).unwrap();
    for (nvals, with_pad) in [(n, false), (n / 2, true), (n / 2, false)] {
        let buf = poisoned(&dev, dtype, n);
        let vals = values(dtype, nvals, (7 * n + nvals) as u64);
        let p = pad(dtype);
        let padv = with_pad.then_some(&p[..]);
        let outcome = common::put_bytes(
            &stager,
            &view(&buf, dtype, n),
            &vals,
            padv,
            None,
            stream.handle(),
        )
        .unwrap();
        let touched = if with_pad { n } else { nvals };
        if touched == 0 {
            assert_eq!(outcome, CopyOutcome::Empty);
        } else {
            assert!(matches!(outcome, CopyOutcome::Issued { .. }));
        }
        stream.synchronize().unwrap();
        check_layout(&read(&buf), &vals, padv, n * dtype.itemsize());
    }
}

#[test]
#[ignore = "needs a CUDA GPU: run with --include-ignored (scripts/gpu-run does)"]
fn gpu_mirror_skip_is_counted() {
    let Some(dev) = gpu_or_skip("gpu_mirror_skip_is_counted") else {
        return;
    };
    let st = common::stager::<i32>(0, 256, 4).unwrap();
    let buf = poisoned(&dev, DType::I32, 4096);
    let dst = view(&buf, DType::I32, 4096);
    let mut m = H2DMirror::new();
    let v: Vec<i32> = (1..=256).collect();
    let s = StreamHandle::LEGACY;
    assert!(matches!(
        st.put(&dst, &v, Some(-1), Some(&mut m), s).unwrap(),
        CopyOutcome::Issued { .. }
    ));
    assert_eq!(
        st.put(&dst, &v, Some(-1), Some(&mut m), s).unwrap(),
        CopyOutcome::Skipped
    );
    let stats = st.stats();
    assert_eq!((stats.copies, stats.skipped_copies), (1, 1));
    assert_eq!(stats.bytes, 4096 * 4);
    let out = read(&buf);
    let got: &[i32] = bytemuck::cast_slice(&out[..4096 * 4]);
    assert_eq!(&got[..256], &v[..]);
    assert!(got[256..].iter().all(|&x| x == -1));
}

#[test]
#[ignore = "needs a CUDA GPU: run with --include-ignored (scripts/gpu-run does)"]
fn gpu_growth_then_correct_copy() {
    let Some(dev) = gpu_or_skip("gpu_growth_then_correct_copy") else {
        return;
    };
    let st = common::stager::<f32>(0, 4, 2).unwrap();
    let before = st.stats().pinned_bytes;
    assert_eq!(
        before,
        64 * 2,
        "two 16-byte slots, each rounded up to 64 bytes"
    );
    let n = 1 << 20;
    let buf = poisoned(&dev, DType::F32, n);
    let v: Vec<f32> = (0..n).map(|i| i as f32 * 0.5 + 1.0).collect();
    st.put(
        &view(&buf, DType::F32, n),
        &v,
        None,
        None,
        StreamHandle::LEGACY,
    )
    .unwrap();
    let stats = st.stats();
    assert_eq!(stats.growths, 1);
    assert_eq!(
        stats.pinned_bytes,
        before + (n as u64) * 4,
        "outgrown buffers are kept until drop"
    );
    let out = read(&buf);
    assert_eq!(bytemuck::cast_slice::<u8, f32>(&out[..n * 4]), &v[..]);
    assert!(out[n * 4..].iter().all(|&b| b == POISON));
}

#[test]
#[ignore = "needs a CUDA GPU: run with --include-ignored (scripts/gpu-run does)"]
fn gpu_copy_from_a_thread_without_context_leaves_it_without() {
    let Some(dev) = gpu_or_skip("gpu_copy_from_a_thread_without_context") else {
        return;
    };
    let st = Arc::new(common::stager::<u16>(0, 256, 2).unwrap());
    let buf = poisoned(&dev, DType::U16, 300);
    let dst = view(&buf, DType::U16, 300);
    let st2 = st.clone();
    std::thread::scope(|scope| {
        scope.spawn(move || {
            assert_eq!(current_context().unwrap(), 0, "fresh thread has no context");
            st2.put(&dst, &[9, 8, 7], Some(6), None, StreamHandle::LEGACY)
                .unwrap();
            assert_eq!(current_context().unwrap(), 0, "context left as found");
        });
    });
    let out = read(&buf);
    let got: &[u16] = bytemuck::cast_slice(&out[..600]);
    assert_eq!(&got[..3], &[9, 8, 7]);
    assert!(got[3..].iter().all(|&x| x == 6));
}

#[test]
#[ignore = "needs a CUDA GPU: run with --include-ignored (scripts/gpu-run does)"]
fn gpu_capturing_stream_is_refused() {
    let Some(dev) = gpu_or_skip("gpu_capturing_stream_is_refused") else {
        return;
    };
    let st = common::stager::<i32>(0, 16, 2).unwrap();
    let buf = poisoned(&dev, DType::I32, 16);
    let stream = Stream::new(&dev).unwrap();
    begin_capture(&stream).unwrap();
    let err = st
        .put(
            &view(&buf, DType::I32, 16),
            &[1, 2],
            None,
            None,
            stream.handle(),
        )
        .unwrap_err();
    end_capture(&stream).unwrap();
    assert!(matches!(err, Error::StreamCapturing), "{err}");
    assert!(err.to_string().contains("capturing a CUDA graph"));
    assert_eq!(st.stats().copies, 0);
    assert!(read(&buf).iter().all(|&b| b == POISON));
}

#[test]
#[ignore = "needs a CUDA GPU: run with --include-ignored (scripts/gpu-run does)"]
fn gpu_wrong_device_and_dtype_are_refused() {
    let Some(dev) = gpu_or_skip("gpu_wrong_device_and_dtype_are_refused") else {
        return;
    };
    let st = common::stager::<i32>(0, 16, 2).unwrap();
    let buf = poisoned(&dev, DType::I32, 16);
    // SAFETY: the view is refused before anything is written through it.
    let other = unsafe { DeviceView::from_meta(TensorMeta::cuda_1d(7, buf.ptr(), DType::I32, 16)) };
    let err = st
        .put(&other, &[1], None, None, StreamHandle::LEGACY)
        .unwrap_err();
    assert!(
        matches!(
            err,
            Error::WrongDevice {
                expected: 0,
                got: 7,
                ..
            }
        ),
        "{err}"
    );
    let err = st
        .put(
            &view(&buf, DType::U32, 16),
            &[1],
            None,
            None,
            StreamHandle::LEGACY,
        )
        .unwrap_err();
    assert!(matches!(err, Error::DtypeMismatch { .. }));
    assert!(matches!(
        common::stager::<i32>(99, 16, 2),
        Err(Error::NoSuchDevice { ordinal: 99, .. })
    ));
    assert!(read(&buf).iter().all(|&b| b == POISON));
}

#[test]
#[ignore = "needs a CUDA GPU: run with --include-ignored (scripts/gpu-run does)"]
fn gpu_padding_reuse_keeps_every_layout_right() {
    let Some(dev) = gpu_or_skip("gpu_padding_reuse_keeps_every_layout_right") else {
        return;
    };
    // depth 1: every copy reuses the one slot, whose padding may be partly skipped.
    let st = common::stager::<i32>(0, 256, 1).unwrap();
    let buf = poisoned(&dev, DType::I32, 256);
    let dst = view(&buf, DType::I32, 256);
    let s = StreamHandle::LEGACY;
    for (k, &(n, pad)) in [
        (200, -1),
        (10, -1),
        (150, -1),
        (256, -1),
        (0, -1),
        (30, -2),
        (40, -2),
        (5, -1),
    ]
    .iter()
    .enumerate()
    {
        let v: Vec<i32> = (0..n).map(|i| (k as i32 + 1) * 10_000 + i).collect();
        // Poisoned before every copy: padding the slot skips rewriting must still be copied.
        buf.upload(0, &vec![POISON; buf.len()]).unwrap();
        st.put(&dst, &v, Some(pad), None, s).unwrap();
        let out = read(&buf);
        let got: &[i32] = bytemuck::cast_slice(&out[..1024]);
        assert_eq!(&got[..n as usize], &v[..], "copy {k}: values");
        assert!(
            got[n as usize..].iter().all(|&x| x == pad),
            "copy {k}: padding"
        );
    }
}

/// Every slot of a depth-2 ring reused 1,500 times, each copy with new values and lengths, to
/// three destinations in turn: each destination ends with exactly its last copy.
#[test]
#[ignore = "needs a CUDA GPU: run with --include-ignored (scripts/gpu-run does)"]
fn gpu_many_reuses_of_a_small_ring() {
    let Some(dev) = gpu_or_skip("gpu_many_reuses_of_a_small_ring") else {
        return;
    };
    // 3000 copies through a ring of 2, each into its own poisoned 64-element slice: every copy
    // is checked, not only the last one into each destination.
    let st = common::stager::<i32>(0, 64, 2).unwrap();
    let stream = Stream::new(&dev).unwrap();
    let copies = 3000usize;
    let buf = poisoned(&dev, DType::I32, 64 * copies);
    let mut sent = Vec::with_capacity(copies);
    for i in 0..copies as i32 {
        let v: Vec<i32> = (0..(1 + i % 64)).map(|j| i * 100 + j + 1).collect();
        let dst = buf.view_at(i as usize * 64 * 4, DType::I32, 64);
        st.put(&dst, &v, Some(-7 - i), None, stream.handle())
            .unwrap();
        sent.push(v);
    }
    stream.synchronize().unwrap();
    let out = read(&buf);
    for (i, v) in sent.iter().enumerate() {
        let slice = &out[i * 256..(i + 1) * 256];
        let pad = (-7 - i as i32).to_le_bytes();
        let mut expect: Vec<u8> = bytemuck::cast_slice(v).to_vec();
        while expect.len() < 256 {
            expect.extend_from_slice(&pad);
        }
        assert!(slice == &expect[..], "copy {i}");
    }
    assert!(
        out[copies * 256..].iter().all(|&b| b == POISON),
        "guard band"
    );
    assert_eq!(st.stats().copies, 3000);
}

/// On one stream whose copies complete (synchronized every 4 copies), one query serves several
/// claims: far fewer queries than copies. Every one of the 800 destinations is checked.
#[test]
#[ignore = "needs a CUDA GPU: run with --include-ignored (scripts/gpu-run does)"]
fn gpu_one_query_serves_several_claims() {
    let Some(dev) = gpu_or_skip("gpu_one_query_serves_several_claims") else {
        return;
    };
    let depth = 8;
    let st = common::stager::<i32>(0, 32, depth).unwrap();
    let stream = Stream::new(&dev).unwrap();
    let copies = 800usize;
    let buf = poisoned(&dev, DType::I32, 64 * copies);
    for k in 0..copies {
        let dst = buf.view_at(k * 64 * 4, DType::I32, 64);
        let v: Vec<i32> = (0..32).map(|i| (k as i32 + 1) * 100 + i).collect();
        st.put(&dst, &v, Some(-(k as i32) - 1), None, stream.handle())
            .unwrap();
        if k % 4 == 3 {
            stream.synchronize().unwrap();
        }
    }
    stream.synchronize().unwrap();
    let out = read(&buf);
    let got: &[i32] = bytemuck::cast_slice(&out[..copies * 64 * 4]);
    for k in 0..copies {
        let d = &got[k * 64..(k + 1) * 64];
        for (i, &g) in d.iter().enumerate() {
            let want = if i < 32 {
                (k as i32 + 1) * 100 + i as i32
            } else {
                -(k as i32) - 1
            };
            assert_eq!(g, want, "destination {k} element {i}");
        }
    }
    let s = st.stats();
    assert_eq!(s.copies, copies as u64);
    assert_eq!(
        s.waits, 0,
        "every copy was complete before its slot came round"
    );
    let checks = (copies - depth) as u64;
    assert!(
        s.queries <= checks / 3,
        "{} queries for {checks} checks (a query per claim would make {checks})",
        s.queries
    );
}

/// Destinations at every kind of offset (odd, 4-, 64- and 256-byte aligned) and of sizes on both
/// sides of the 2-D path's range, so both copy paths run (rows for 256-byte aligned destinations
/// of 2-32 KiB, one 1-D copy otherwise): each byte of the destination ends as values or pad,
/// every byte around it keeps its poison.
#[rstest]
#[ignore = "needs a CUDA GPU: run with --include-ignored (scripts/gpu-run does)"]
fn gpu_row_and_flat_copies_at_any_offset(
    #[values(0, 1, 3, 4, 64, 255, 256, 4096)] offset: usize,
    #[values(1000, 2048, 2560, 4096, 16384, 32768, 40000)] n: usize,
) {
    let Some(dev) = gpu_or_skip("gpu_row_and_flat_copies_at_any_offset") else {
        return;
    };
    let st = Stager::builder(DType::U8)
        .device(0)
        .numel(64)
        .depth(4)
        .build()
        .unwrap();
    let buf = poisoned(&dev, DType::U8, offset + n + 64);
    let dst = buf.view_at(offset, DType::U8, n);
    let vals: Vec<u8> = (0..n / 3).map(|i| (i % 251) as u8 + 1).collect();
    let stream = Stream::new(&dev).unwrap();
    common::put_bytes(&st, &dst, &vals, Some(&[0xEE]), None, stream.handle()).unwrap();
    stream.synchronize().unwrap();
    let out = read(&buf);
    assert!(
        out[..offset].iter().all(|&b| b == POISON),
        "bytes before the destination"
    );
    assert_eq!(&out[offset..offset + vals.len()], &vals[..], "values");
    assert!(
        out[offset + vals.len()..offset + n]
            .iter()
            .all(|&b| b == 0xEE),
        "padding"
    );
    assert!(
        out[offset + n..].iter().all(|&b| b == POISON),
        "bytes after the destination"
    );
}
