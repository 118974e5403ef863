//! GPU tests of device-to-host copies and the pinned pool.

mod common;

use common::{POISON, gpu_or_skip, values};
use pinstage::d2h::copy_d2h_async;
use pinstage::dlpack::TensorMeta;
use pinstage::host::CopyPath;
use pinstage::host::PinnedFlags;
use pinstage::host::PinnedPool;
use pinstage::testing::DeviceBuffer;
use pinstage::{DType, DeviceView, Error, PinnedBuffer, StreamHandle, copy_d2h};
use rstest::rstest;

fn filled(dev: &pinstage::Device, bytes: usize, seed: u64) -> (DeviceBuffer, Vec<u8>) {
    let data = values(DType::U8, bytes, seed);
    let buf = DeviceBuffer::new(dev, bytes).unwrap();
    buf.upload(0, &data).unwrap();
    (buf, data)
}

fn view(buf: &DeviceBuffer) -> DeviceView<'_> {
    buf.view(DType::U8)
}

/// Taken by every test here: one of them stalls a stream, and another test's buffer freed
/// meanwhile (on the reaper's thread, after a device synchronize that may come just before the
/// stall) would wait for the stall inside the driver and hold up the staller's calls.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

#[rstest]
#[case::one(1)]
#[case::odd(4097)]
#[case::mib(1 << 20)]
#[case::two_chunks_and_a_bit((2 * pinstage::host::BOUNCE_CHUNK) + 12345)]
#[case::many_chunks(7 * pinstage::host::BOUNCE_CHUNK + 1)]
#[ignore = "needs a CUDA GPU: run with --include-ignored (scripts/gpu-run does)"]
fn gpu_d2h_pinned_and_pageable(#[case] bytes: usize) {
    let Some(dev) = gpu_or_skip("gpu_d2h_pinned_and_pageable") else {
        return;
    };
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let (src, data) = filled(&dev, bytes, bytes as u64);
    // pinned destination, one byte longer than needed: the tail must stay poisoned
    let mut pinned = PinnedBuffer::new(&dev, bytes + 1, PinnedFlags::PORTABLE).unwrap();
    pinned.as_mut_slice().fill(POISON);
    assert!(pinstage::host::is_pinned(pinned.as_ptr()));
    let path = copy_d2h(&view(&src), pinned.as_mut_slice(), StreamHandle::LEGACY).unwrap();
    assert_eq!(path, CopyPath::Pinned);
    assert_eq!(&pinned.as_slice()[..bytes], &data[..]);
    assert_eq!(pinned.as_slice()[bytes], POISON);
    // pageable destination
    let mut pageable = vec![POISON; bytes + 1];
    assert!(!pinstage::host::is_pinned(pageable.as_ptr()));
    let path = copy_d2h(&view(&src), &mut pageable, StreamHandle::LEGACY).unwrap();
    assert_eq!(path, CopyPath::Bounced);
    assert!(pageable[..bytes] == data[..], "pageable bytes differ");
    assert_eq!(pageable[bytes], POISON);
}

#[test]
#[ignore = "needs a CUDA GPU: run with --include-ignored (scripts/gpu-run does)"]
fn gpu_d2h_async_and_pool() {
    let Some(dev) = gpu_or_skip("gpu_d2h_async_and_pool") else {
        return;
    };
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let bytes = 3 << 20;
    let (src, data) = filled(&dev, bytes, 99);
    let pool = PinnedPool::new(&dev, 16 << 20);
    let mut block = pool.acquire(bytes).unwrap();
    assert!(block.is_pinned());
    block.as_mut_slice().fill(POISON);
    let pending = copy_d2h_async(&view(&src), block, StreamHandle::LEGACY).unwrap();
    let block = pending.wait().unwrap();
    assert!(block.as_slice() == &data[..]);
    drop(block);
    let s = pool.stats();
    assert_eq!((s.misses, s.hits, s.in_use_bytes), (1, 0, 0));
    assert_eq!(s.pooled_bytes, pinstage::host::size_class(bytes));
    let again = pool.acquire(bytes - 5).unwrap();
    assert_eq!(pool.stats().hits, 1, "same class reused");
    // budget: a block that does not fit falls back to pageable memory
    let big = pool.acquire(15 << 20).unwrap();
    assert!(!big.is_pinned());
    assert_eq!(pool.stats().pageable_fallbacks, 1);
    assert!(pool.stats().in_use_bytes + pool.stats().pooled_bytes <= 16 << 20);
    drop((again, big));
    pool.empty_cache();
    assert_eq!(pool.stats().pooled_bytes, 0);
    // Every block let go so far (here and by the tests before) is freed before the stall: a
    // free whose synchronize came just before the stall was queued waits for the stall inside
    // the driver and holds up this thread's calls meanwhile (the copy below took 20 s to
    // issue, the stall's bound, on an H200, 4 test threads).
    pinstage::host::wait_for_frees();
    // Dropping a pending copy never blocks, and its block stays out of the pool until the copy
    // completed (the reaper thread lets it go then): with the stream stalled for 300 ms by a
    // host function, the drop returns at once, the block is still in use during the stall, and
    // back in the pool once the stall ended.
    let stream = pinstage::Stream::new(&dev).unwrap();
    let block = pool.acquire(bytes).unwrap();
    let class = pinstage::host::size_class(bytes);
    let go = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let g = go.clone();
    // SAFETY: the host function calls no CUDA function and drops only an Arc<AtomicBool>.
    unsafe {
        pinstage::testing::launch_host_fn(&stream, move || {
            // Bounded: never hold the stream longer than 20 s even if the test thread died.
            let t0 = std::time::Instant::now();
            while !g.load(std::sync::atomic::Ordering::Acquire)
                && t0.elapsed() < std::time::Duration::from_secs(20)
            {
                std::thread::sleep(std::time::Duration::from_micros(200));
            }
        })
    }
    .unwrap();
    let t_issue = std::time::Instant::now();
    let pending = copy_d2h_async(&view(&src), block, stream.handle()).unwrap();
    let issued_in = t_issue.elapsed();
    // The message says which path the copy took and how long issuing it took (a bounce would
    // wait for the stall, and so would a call held up by a free waiting for it).
    assert!(
        !pending.is_done(),
        "the copy waits behind the stalled stream: {pending:?}, issued in {issued_in:?}"
    );
    let t0 = std::time::Instant::now();
    drop(pending);
    let waited = t0.elapsed();
    std::thread::sleep(std::time::Duration::from_millis(100));
    let during = pool.stats().in_use_bytes;
    go.store(true, std::sync::atomic::Ordering::Release);
    stream.synchronize().unwrap();
    pinstage::host::wait_for_frees();
    assert!(
        waited < std::time::Duration::from_millis(50),
        "dropping a pending copy blocked for {waited:?}"
    );
    assert_eq!(
        during, class,
        "the block went back to the pool while its copy was queued"
    );
    assert_eq!(pool.stats().in_use_bytes, 0);
    assert_eq!(pinstage::cuda::drop_errors().count, 0);
}

#[test]
#[ignore = "needs a CUDA GPU: run with --include-ignored (scripts/gpu-run does)"]
fn gpu_d2h_refusals() {
    let Some(dev) = gpu_or_skip("gpu_d2h_refusals") else {
        return;
    };
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let (src, _) = filled(&dev, 64, 1);
    let mut small = vec![POISON; 63];
    let err = copy_d2h(&view(&src), &mut small, StreamHandle::LEGACY).unwrap_err();
    assert!(
        matches!(
            err,
            Error::DestinationTooSmall {
                needed: 64,
                got: 63
            }
        ),
        "{err}"
    );
    // SAFETY: the view is refused before anything reads through it.
    let other = unsafe { DeviceView::from_meta(TensorMeta::cuda_1d(5, src.ptr(), DType::U8, 64)) };
    let mut out = vec![POISON; 64];
    let err = copy_d2h(&other, &mut out, StreamHandle::LEGACY).unwrap_err();
    assert!(
        matches!(err, Error::NoSuchDevice { ordinal: 5, .. }),
        "{err}"
    );
    assert!(out.iter().all(|&b| b == POISON), "nothing written");
    assert!(small.iter().chain(&out).all(|&b| b == POISON));
}
