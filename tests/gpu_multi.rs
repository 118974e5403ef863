//! Two GPUs: stagers on devices 0 and 1 used concurrently from several threads, D2H from both,
//! a destination on the wrong device refused. Skipped (with the reason) on fewer than two GPUs;
//! fails when `PINSTAGE_REQUIRE_GPUS=2` finds fewer.

mod common;

use common::Put;

use std::sync::Arc;

use common::POISON;
use pinstage::testing::DeviceBuffer;
use pinstage::{DType, Device, Error, PinnedStager, Stream, StreamHandle, copy_d2h};

fn two_devices() -> Option<(Device, Device)> {
    let count = pinstage::cuda::device_count().unwrap_or(0);
    if count < 2 {
        let required = std::env::var("PINSTAGE_REQUIRE_GPUS").is_ok_and(|v| v == "2")
            || std::env::var("PINSTAGE_REQUIRE_GPU").is_ok_and(|v| v == "1");
        if required {
            panic!(
                "a two-GPU test was asked to run (PINSTAGE_REQUIRE_GPU[S]) but {count} GPU(s) found"
            );
        }
        eprintln!("SKIP gpu_multi: {count} GPU(s), need 2");
        return None;
    }
    Some((Device::new(0).unwrap(), Device::new(1).unwrap()))
}

#[test]
#[ignore = "needs 2 CUDA GPUs: run with --include-ignored (scripts/gpu-run multi does)"]
fn gpu_two_devices_concurrently() {
    let Some((d0, d1)) = two_devices() else {
        return;
    };
    let devs = [d0, d1];
    let stagers: Vec<Arc<PinnedStager<u32>>> = (0..2)
        .map(|i| Arc::new(common::stager::<u32>(i, 128, 4).unwrap()))
        .collect();
    let n = 1000;
    let mut handles = Vec::new();
    for (di, dev) in devs.iter().enumerate() {
        for t in 0..4u32 {
            let st = stagers[di].clone();
            let dev = dev.clone();
            handles.push(std::thread::spawn(move || {
                // Every copy into its own slice of one poisoned buffer: all 3000 checked.
                let copies = 3000usize;
                let buf = DeviceBuffer::new(&dev, copies * n * 4).unwrap();
                buf.upload(0, &vec![POISON; copies * n * 4]).unwrap();
                let stream = Stream::new(&dev).unwrap();
                let mut sent = Vec::with_capacity(copies);
                for i in 0..copies as u32 {
                    let len = (i as usize * 7 + t as usize) % n;
                    let v: Vec<u32> = (0..len as u32)
                        .map(|k| k ^ (i << 8) ^ (t << 24) ^ (di as u32) << 30)
                        .collect();
                    let dst = buf.view_at(i as usize * n * 4, DType::U32, n);
                    st.put(&dst, &v, Some(0xDEAD_0000 + t), None, stream.handle())
                        .unwrap();
                    sent.push(v);
                }
                stream.synchronize().unwrap();
                let mut out = vec![0u8; copies * n * 4];
                let whole = buf.view(DType::U8);
                let path = copy_d2h(&whole, &mut out, StreamHandle::LEGACY).unwrap();
                assert_eq!(path, pinstage::host::CopyPath::Bounced);
                let got: &[u32] = bytemuck::cast_slice(&out);
                for (i, v) in sent.iter().enumerate() {
                    let d = &got[i * n..(i + 1) * n];
                    assert_eq!(&d[..v.len()], &v[..], "device {di} thread {t} copy {i}");
                    assert!(d[v.len()..].iter().all(|&x| x == 0xDEAD_0000 + t));
                }
            }));
        }
    }
    for h in handles {
        h.join().unwrap();
    }
    let buf1 = DeviceBuffer::new(&devs[1], 64).unwrap();
    let err = stagers[0]
        .put(
            &buf1.view(DType::U32),
            &[1],
            None,
            None,
            StreamHandle::LEGACY,
        )
        .unwrap_err();
    assert!(
        matches!(
            err,
            Error::WrongDevice {
                expected: 0,
                got: 1,
                ..
            }
        ),
        "{err}"
    );
    // A copy takes its device from the view: device 1's buffer is read on device 1.
    buf1.upload(0, &[7u8; 64]).unwrap();
    let mut out = vec![0u8; 64];
    copy_d2h(&buf1.view(DType::U8), &mut out, StreamHandle::LEGACY).unwrap();
    assert_eq!(out, [7u8; 64]);
}
