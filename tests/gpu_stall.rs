//! GPU tests that stall a stream. They run in their own binary, one test at a time
//! (`--test-threads=1`): while a stream is stalled, allocations elsewhere in the process may
//! synchronize the device and wait for it.

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use common::{POISON, gpu_or_skip};
use pinstage::{DType, DeviceBuffer, DeviceView, PinnedStager, Stream};
use rstest::rstest;

fn poisoned(dev: &pinstage::Device, dtype: DType, numel: usize) -> DeviceBuffer {
    let bytes = (numel + 3) * dtype.itemsize();
    let buf = DeviceBuffer::new(dev, bytes).unwrap();
    buf.upload(0, &vec![POISON; bytes]).unwrap();
    buf
}

fn read(buf: &DeviceBuffer) -> Vec<u8> {
    let mut out = vec![0u8; buf.len()];
    buf.download(0, &mut out).unwrap();
    out
}

fn view(buf: &DeviceBuffer, dtype: DType, numel: usize) -> DeviceView {
    DeviceView::contiguous_device(buf.device().ordinal(), buf.ptr(), dtype, numel)
}

/// Releases a stalled stream when dropped, so a failing assertion cannot leave the stream (and
/// every allocation that synchronizes the device) blocked forever.
struct Stall(Arc<AtomicBool>);

impl Stall {
    fn release(&self) {
        self.0.store(true, Ordering::Release);
    }
}

impl Drop for Stall {
    fn drop(&mut self) {
        self.release();
    }
}

/// Stalls `stream` through a host function (no kernel) until the returned guard is released or
/// dropped. Allocate everything the test needs BEFORE stalling: pinned and device allocations may
/// synchronize the whole device, and would wait for the stall.
fn stall(stream: &Stream) -> Stall {
    let go = Arc::new(AtomicBool::new(false));
    let g = go.clone();
    stream
        .launch_host_fn(move || {
            let t0 = std::time::Instant::now();
            // Bounded: never hold a stream longer than 20 s even if the test thread died.
            while !g.load(Ordering::Acquire) && t0.elapsed() < Duration::from_secs(20) {
                std::thread::sleep(Duration::from_micros(200));
            }
        })
        .unwrap();
    Stall(go)
}

/// Serialises the tests that stall a stream.
static STALL_LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());

#[rstest]
fn gpu_event_guarded_reuse_under_a_stalled_stream(#[values(1, 2, 8)] depth: usize) {
    let Some(dev) = gpu_or_skip("gpu_event_guarded_reuse") else {
        return;
    };
    let st = Arc::new(PinnedStager::<i64>::new(0, 64, depth).unwrap());
    let stream = Arc::new(Stream::new(&dev).unwrap());
    let copies = depth + 4;
    let bufs: Arc<Vec<DeviceBuffer>> = Arc::new(
        (0..copies)
            .map(|_| poisoned(&dev, DType::I64, 64))
            .collect(),
    );
    let _serial = STALL_LOCK.lock().unwrap_or_else(|e| e.into_inner());
    let go = stall(&stream);
    let issued = Arc::new(AtomicUsize::new(0));
    let worker = {
        let (st, stream, bufs, issued) = (st.clone(), stream.clone(), bufs.clone(), issued.clone());
        std::thread::spawn(move || {
            let mut vals = vec![0i64; 64];
            for (k, buf) in bufs.iter().enumerate() {
                for (i, v) in vals.iter_mut().enumerate() {
                    *v = (k as i64 + 1) * 1000 + i as i64;
                }
                st.copy_(
                    &view(buf, DType::I64, 64),
                    &vals,
                    None,
                    None,
                    stream.handle(),
                )
                .unwrap();
                // The caller's values may change as soon as copy_ returns.
                vals.iter_mut().for_each(|v| *v = -7);
                issued.fetch_add(1, Ordering::SeqCst);
            }
        })
    };
    // With the stream stalled, at most `depth` copies can be staged; the next waits on an event.
    let t0 = std::time::Instant::now();
    while issued.load(Ordering::SeqCst) < depth && t0.elapsed() < Duration::from_secs(3) {
        std::thread::sleep(Duration::from_millis(5));
    }
    std::thread::sleep(Duration::from_millis(200));
    let staged = issued.load(Ordering::SeqCst);
    go.release();
    assert_eq!(
        staged, depth,
        "while stalled, exactly depth copies may be staged"
    );
    worker.join().unwrap();
    stream.synchronize().unwrap();
    // At least the claim that found its slot still stalled waited for the event.
    assert!(st.stats().waits >= 1, "stats: {:?}", st.stats());
    for (k, buf) in bufs.iter().enumerate() {
        let out = read(buf);
        let got: &[i64] = bytemuck::cast_slice(&out[..64 * 8]);
        for (i, &g) in got.iter().enumerate() {
            assert_eq!(
                g,
                (k as i64 + 1) * 1000 + i as i64,
                "destination {k} element {i}"
            );
        }
    }
}

#[test]
fn gpu_drop_waits_for_in_flight_copies() {
    let Some(dev) = gpu_or_skip("gpu_drop_waits_for_in_flight_copies") else {
        return;
    };
    let _serial = STALL_LOCK.lock().unwrap_or_else(|e| e.into_inner());
    let stream = Stream::new(&dev).unwrap();
    let buf = poisoned(&dev, DType::U32, 1024);
    let st = PinnedStager::<u32>::new(0, 1024, 2).unwrap();
    let v: Vec<u32> = (0..1024).map(|i| i * 3 + 1).collect();
    let go = stall(&stream);
    let release = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(200));
        drop(go);
    });
    let dst = view(&buf, DType::U32, 1024);
    st.copy_(&dst, &v, None, None, stream.handle()).unwrap();
    let t0 = std::time::Instant::now();
    drop(st); // must wait for the stalled copy before freeing its pinned buffer
    assert!(
        t0.elapsed() >= Duration::from_millis(100),
        "drop returned before the copy ran"
    );
    release.join().unwrap();
    stream.synchronize().unwrap();
    let out = read(&buf);
    assert_eq!(bytemuck::cast_slice::<u8, u32>(&out[..4096]), &v[..]);
}
