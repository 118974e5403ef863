//! GPU tests that stall a stream. They run in their own binary, one test at a time
//! (`--test-threads=1`): while a stream is stalled, allocations elsewhere in the process may
//! synchronize the device and wait for it.

mod common;

use common::Put;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use common::{POISON, gpu_or_skip, poisoned, read, stall, view};
use pinstage::testing::DeviceBuffer;
use pinstage::{DType, Device, Stream};
use rstest::rstest;

/// How many copies the worker staged while its stream was stalled: waits until `depth` were
/// (or 3 s passed), then 200 ms more in case one too many gets through.
fn staged_while_stalled(issued: &AtomicUsize, depth: usize) -> usize {
    let t0 = std::time::Instant::now();
    while issued.load(Ordering::SeqCst) < depth && t0.elapsed() < Duration::from_secs(3) {
        std::thread::sleep(Duration::from_millis(5));
    }
    std::thread::sleep(Duration::from_millis(200));
    issued.load(Ordering::SeqCst)
}

/// `n` destinations of 64 i64, poisoned.
fn destinations(dev: &Device, n: usize) -> Arc<Vec<DeviceBuffer>> {
    Arc::new((0..n).map(|_| poisoned(dev, DType::I64, 64)).collect())
}

/// Destination `k` of 64 i64 must hold `(k + 1) * 1000 + i` at element `i`.
fn check_destinations(bufs: &[DeviceBuffer], what: impl Fn(usize) -> String) {
    for (k, buf) in bufs.iter().enumerate() {
        let out = read(buf);
        let got: &[i64] = bytemuck::cast_slice(&out[..64 * 8]);
        for (i, &g) in got.iter().enumerate() {
            assert_eq!(
                g,
                (k as i64 + 1) * 1000 + i as i64,
                "{} element {i}",
                what(k)
            );
        }
    }
}

/// Serialises the tests that stall a stream.
static STALL_LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// 64 copies to 64 destinations through a ring of `depth` slots while the stream is stalled;
/// the caller's values are overwritten right after each `copy_` returns.
#[rstest]
#[ignore = "needs a CUDA GPU: run with --include-ignored (scripts/gpu-run does)"]
fn gpu_event_guarded_reuse_under_a_stalled_stream(#[values(1, 2, 8)] depth: usize) {
    let Some(dev) = gpu_or_skip("gpu_event_guarded_reuse") else {
        return;
    };
    let st = Arc::new(common::stager::<i64>(0, 64, depth).unwrap());
    let stream = Arc::new(Stream::new(&dev).unwrap());
    let copies = 64;
    let bufs = destinations(&dev, copies);
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
                st.put(
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
    let staged = staged_while_stalled(&issued, depth);
    go.release();
    assert_eq!(
        staged, depth,
        "while stalled, exactly depth copies may be staged"
    );
    worker.join().unwrap();
    stream.synchronize().unwrap();
    // At least the claim that found its slot still stalled waited for the event.
    assert!(st.stats().waits >= 1, "stats: {:?}", st.stats());
    check_destinations(&bufs, |k| format!("destination {k}"));
}

/// A stager dropped while its copy waits behind a stalled stream: the drop returns at once (its
/// pinned slots go to the reaper thread), the slots are freed only after the copy ran (the
/// reaper's flush waits for the stall), and the copy's bytes land.
#[test]
#[ignore = "needs a CUDA GPU: run with --include-ignored (scripts/gpu-run does)"]
fn gpu_drop_never_waits_and_frees_after_the_copy() {
    let Some(dev) = gpu_or_skip("gpu_drop_never_waits_and_frees_after_the_copy") else {
        return;
    };
    let _serial = STALL_LOCK.lock().unwrap_or_else(|e| e.into_inner());
    let stream = Stream::new(&dev).unwrap();
    let buf = poisoned(&dev, DType::U32, 1024);
    let st = common::stager::<u32>(0, 1024, 2).unwrap();
    let v: Vec<u32> = (0..1024).map(|i| i * 3 + 1).collect();
    pinstage::host::wait_for_frees();
    let go = stall(&stream);
    let released = std::time::Instant::now() + Duration::from_millis(200);
    let release = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(200));
        drop(go);
    });
    let dst = view(&buf, DType::U32, 1024);
    st.put(&dst, &v, None, None, stream.handle()).unwrap();
    let pinned = pinstage::host::live_pinned_bytes();
    let t0 = std::time::Instant::now();
    drop(st);
    let took = t0.elapsed();
    assert!(
        took < Duration::from_millis(20),
        "drop waited {took:?} for the stalled copy"
    );
    pinstage::host::wait_for_frees();
    assert!(
        std::time::Instant::now() >= released - Duration::from_millis(20),
        "the slots were freed before their copy ran"
    );
    assert!(
        pinstage::host::live_pinned_bytes() < pinned,
        "the slots were freed"
    );
    release.join().unwrap();
    stream.synchronize().unwrap();
    let out = read(&buf);
    assert_eq!(bytemuck::cast_slice::<u8, u32>(&out[..4096]), &v[..]);
}

/// Freeing page-locked memory waits for the whole device's queued work. With one stream busy
/// for 200 ms and pinned garbage dropped meanwhile (buffers, a stager, a step stager), a copy on
/// another stream returns in under 1 ms, the stall verified to hold when it returned.
#[test]
#[ignore = "needs a CUDA GPU: run with --include-ignored (scripts/gpu-run does)"]
fn gpu_freed_pinned_memory_never_stalls_a_call() {
    let Some(dev) = gpu_or_skip("gpu_freed_pinned_memory_never_stalls_a_call") else {
        return;
    };
    let _serial = STALL_LOCK.lock().unwrap_or_else(|e| e.into_inner());
    let busy = Stream::new(&dev).unwrap();
    let other = Stream::new(&dev).unwrap();
    let buf = poisoned(&dev, DType::U32, 1024);
    let dst = view(&buf, DType::U32, 1024);
    let st = common::stager::<u32>(0, 1024, 2).unwrap();
    let v: Vec<u32> = (0..1024).map(|i| i * 7 + 5).collect();
    st.put(&dst, &v, None, None, other.handle()).unwrap();
    other.synchronize().unwrap();
    // The garbage, allocated before the stall (allocations may wait for the device).
    let garbage: Vec<pinstage::PinnedBuffer> = (0..4)
        .map(|_| {
            pinstage::PinnedBuffer::new(&dev, 1 << 20, pinstage::host::PinnedFlags::PORTABLE)
                .unwrap()
        })
        .collect();
    let dropped_stager = common::stager::<u32>(0, 4096, 4).unwrap();
    let layout = pinstage::StepLayout::builder()
        .field("a", DType::I32, &[4096])
        .build()
        .unwrap();
    let dropped_steps = pinstage::StepStager::builder(&layout).build().unwrap();
    let marker = pinstage::cuda::Event::new(&dev).unwrap();
    let go = stall(&busy);
    let release = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(200));
        drop(go);
    });
    marker.record(busy.handle()).unwrap();
    let w: Vec<u32> = (0..1024).map(|i| i * 11 + 3).collect();
    let before = ThreadSchedule::now();
    let t0 = std::time::Instant::now();
    drop(garbage);
    let t1 = t0.elapsed();
    drop(dropped_stager);
    let t2 = t0.elapsed();
    drop(dropped_steps);
    let t3 = t0.elapsed();
    st.put(&dst, &w, None, None, other.handle()).unwrap();
    let took = t0.elapsed();
    let moved = ThreadSchedule::now().since(&before);
    let held = !marker.query().unwrap();
    release.join().unwrap();
    let report = format!(
        "{took:?} (the stall still held after it: {held}; buffers dropped after {t1:?}, the \
         stager after {t2:?}, the step stager after {t3:?}; the thread meanwhile: {moved})"
    );
    println!("the call: {report}");
    assert!(
        took < Duration::from_millis(1),
        "the frees stalled the call: {report}"
    );
    // The control of a pass: the call was quick while the stall held, not after it ended.
    assert!(held, "the stall did not hold: the test proves nothing");
    other.synchronize().unwrap();
    let out = read(&buf);
    assert_eq!(bytemuck::cast_slice::<u8, u32>(&out[..4096]), &w[..]);
}

/// Pinned memory from `PinnedBuffer::alloc` (what pools, stagers and pinned arrays use) is a
/// block of a host memory pool where the driver makes one (12.6+), and dropping it hands it back
/// without waiting for the device: with a stream held 300 ms by a host function queued BEFORE
/// the drop (the case a device synchronize before the free cannot cover), every pending free
/// is done within 100 ms while the stall still holds, and a copy on another stream right after
/// returns within 5 ms. A free that waited for the device first (the seeded `pool_free_waits`)
/// takes the stall's 300 ms.
#[test]
#[ignore = "needs a CUDA GPU: run with --include-ignored (scripts/gpu-run does)"]
fn gpu_pooled_pinned_memory_is_freed_while_the_device_is_busy() {
    let Some(dev) = gpu_or_skip("gpu_pooled_pinned_memory_is_freed_while_the_device_is_busy")
    else {
        return;
    };
    let _serial = STALL_LOCK.lock().unwrap_or_else(|e| e.into_inner());
    let version = pinstage::cuda::probe().unwrap().driver_version;
    let flags = pinstage::host::PinnedFlags::PORTABLE;
    let mut blocks: Vec<pinstage::PinnedBuffer> = (0..4)
        .map(|i| pinstage::PinnedBuffer::alloc(&dev, (1 << 20) + i * 4096 + 100, flags).unwrap())
        .collect();
    if !blocks.iter().all(|b| b.is_pooled()) {
        assert!(
            version < 12060,
            "driver {version} makes host pools, yet the blocks are not pooled: {blocks:?}"
        );
        println!("SKIP-REASON: driver {version} makes no host memory pools (12.6+)");
        return;
    }
    let busy = Stream::new(&dev).unwrap();
    let other = Stream::new(&dev).unwrap();
    // The blocks carry data through the device and back before they are let go: pool memory
    // is page-locked memory the copies use as any other.
    let buf = poisoned(&dev, DType::U32, 1024);
    let dst = view(&buf, DType::U32, 1024);
    for (i, b) in blocks.iter_mut().enumerate() {
        let v: Vec<u32> = (0..1024)
            .map(|k| (k * 9 + i as u32 * 1000 + 1) | 1)
            .collect();
        b.typed_mut::<u32>().unwrap()[..1024].copy_from_slice(&v);
        let there = pinstage::copy_h2d(&dst, &b.as_slice()[..4096], other.handle()).unwrap();
        assert_eq!(there, pinstage::host::CopyPath::Pinned, "block {i}: {b:?}");
        assert_eq!(bytemuck::cast_slice::<u8, u32>(&read(&buf)[..4096]), &v[..]);
        b.as_mut_slice()[..4096].fill(POISON);
        let back = pinstage::copy_d2h(&dst, &mut b.as_mut_slice()[..4096], other.handle()).unwrap();
        assert_eq!(back, pinstage::host::CopyPath::Pinned, "block {i}: {b:?}");
        assert_eq!(&b.typed::<u32>().unwrap()[..1024], &v[..], "block {i} back");
    }
    let marker = pinstage::cuda::Event::new(&dev).unwrap();
    let go = stall(&busy);
    marker.record(busy.handle()).unwrap();
    let release = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(300));
        drop(go);
    });
    let t0 = std::time::Instant::now();
    drop(blocks);
    pinstage::host::wait_for_frees();
    let freed = t0.elapsed();
    let st = common::stager::<u32>(0, 1024, 2).unwrap();
    let w: Vec<u32> = (0..1024).map(|i| i * 11 + 3).collect();
    let t1 = std::time::Instant::now();
    st.put(&dst, &w, None, None, other.handle()).unwrap();
    let put = t1.elapsed();
    let held = !marker.query().unwrap();
    release.join().unwrap();
    println!("freed in {freed:?}, then a copy in {put:?} (the stall still held: {held})");
    assert!(held, "the stall did not hold: the test proves nothing");
    assert!(
        freed < Duration::from_millis(100),
        "the frees waited for the device: {freed:?}"
    );
    assert!(
        put < Duration::from_millis(5),
        "the copy was held up: {put:?}"
    );
    other.synchronize().unwrap();
    assert_eq!(bytemuck::cast_slice::<u8, u32>(&read(&buf)[..4096]), &w[..]);
}

/// The calling thread's context switches (voluntary: it blocked in the kernel; involuntary: it
/// was preempted) and the CPU it runs on, for a failure's report. The driver's own waits may
/// spin: the seeded free on the caller's thread waited 202 ms with no voluntary switch.
struct ThreadSchedule {
    voluntary: i64,
    involuntary: i64,
    cpu: i32,
}

impl ThreadSchedule {
    fn now() -> Self {
        // SAFETY: getrusage fills the zeroed rusage it is given; RUSAGE_THREAD is the calling
        // thread (Linux); sched_getcpu takes nothing.
        let (ru, cpu) = unsafe {
            let mut ru: libc::rusage = std::mem::zeroed();
            libc::getrusage(libc::RUSAGE_THREAD, &mut ru);
            (ru, libc::sched_getcpu())
        };
        Self {
            voluntary: ru.ru_nvcsw,
            involuntary: ru.ru_nivcsw,
            cpu,
        }
    }

    fn since(&self, before: &Self) -> String {
        format!(
            "{} voluntary and {} involuntary context switches, CPU {} -> {}",
            self.voluntary - before.voluntary,
            self.involuntary - before.involuntary,
            before.cpu,
            self.cpu
        )
    }
}

/// `PendingCopy::wait` behind a stalled stream returns only once the copy completed: the
/// destination (poisoned) holds every byte when it returns, and the stall's 100 ms passed.
#[test]
#[ignore = "needs a CUDA GPU: run with --include-ignored (scripts/gpu-run does)"]
fn gpu_pending_copy_waits_for_its_copy() {
    let Some(dev) = gpu_or_skip("gpu_pending_copy_waits_for_its_copy") else {
        return;
    };
    let _serial = STALL_LOCK.lock().unwrap_or_else(|e| e.into_inner());
    let stream = Stream::new(&dev).unwrap();
    for bytes in [1024usize, 64 << 10, 4 << 20] {
        let data = common::values(DType::U8, bytes, bytes as u64 + 11);
        let src = DeviceBuffer::new(&dev, bytes).unwrap();
        src.upload(0, &data).unwrap();
        let mut dst =
            pinstage::PinnedBuffer::new(&dev, bytes, pinstage::host::PinnedFlags::PORTABLE)
                .unwrap();
        dst.as_mut_slice().fill(POISON);
        let go = stall(&stream);
        let released = std::time::Instant::now() + Duration::from_millis(100);
        let release = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(100));
            drop(go);
        });
        let pending =
            pinstage::d2h::copy_d2h_async(&src.view(DType::U8), dst, stream.handle()).unwrap();
        assert!(!pending.is_done(), "{bytes} bytes: done behind the stall");
        let dst = pending.wait().unwrap();
        assert!(
            std::time::Instant::now() >= released,
            "{bytes} bytes: returned early"
        );
        assert_eq!(dst.as_slice(), &data[..], "{bytes} bytes");
        release.join().unwrap();
    }
}

/// 8 threads share one stager (a ring of 8) and issue many copies each (50,000 by default, or
/// `PINSTAGE_STRESS_COPIES`) with random lengths, pads and streams, while a background thread
/// stalls streams for random short times. Every copy goes to its own slice of its thread's
/// poisoned buffer, so afterwards EVERY copy is checked: its values, then its pad (or the poison
/// where it wrote nothing): 0 mismatches.
#[test]
#[ignore = "needs a CUDA GPU: run with --include-ignored (scripts/gpu-run does)"]
fn gpu_stress_eight_threads_random_copies() {
    let Some(dev) = gpu_or_skip("gpu_stress_eight_threads_random_copies") else {
        return;
    };
    let copies: usize = std::env::var("PINSTAGE_STRESS_COPIES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(50_000);
    const THREADS: usize = 8;
    const CAP: usize = 512;
    let st = Arc::new(common::stager::<u32>(0, 128, 8).unwrap());
    let streams: Arc<Vec<Stream>> = Arc::new((0..4).map(|_| Stream::new(&dev).unwrap()).collect());
    let bufs: Arc<Vec<DeviceBuffer>> = Arc::new(
        (0..THREADS)
            .map(|_| poisoned(&dev, DType::U32, CAP * copies))
            .collect(),
    );
    let _serial = STALL_LOCK.lock().unwrap_or_else(|e| e.into_inner());
    let stop = Arc::new(AtomicBool::new(false));
    let staller = {
        let (streams, stop) = (streams.clone(), stop.clone());
        std::thread::spawn(move || {
            let mut x = 12345u64;
            while !stop.load(Ordering::Relaxed) {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                let s = &streams[(x % 4) as usize];
                let go = stall(s);
                std::thread::sleep(Duration::from_micros(200 + x % 1500));
                drop(go);
                std::thread::sleep(Duration::from_micros(x % 3000));
            }
        })
    };
    let workers: Vec<_> = (0..THREADS)
        .map(|t| {
            let (st, streams, bufs) = (st.clone(), streams.clone(), bufs.clone());
            std::thread::spawn(move || {
                let mut x = 0x9E37_79B9u64 + t as u64;
                let mut next = || {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    x
                };
                // (values, pad) of every copy, in order.
                let mut sent: Vec<(usize, Option<u32>)> = Vec::with_capacity(copies);
                let mut vals = Vec::with_capacity(CAP);
                let mut issued = 0usize;
                for i in 0..copies {
                    let len = (next() % (CAP as u64 + 1)) as usize;
                    let pad = (next() % 3 != 0).then_some(0xFF00_0000 | (i as u32 & 0xFFFF));
                    let stream = &streams[(next() % 4) as usize];
                    vals.clear();
                    vals.extend((0..len).map(|k| value(t, i, k)));
                    let dst = bufs[t].view_at(i * CAP * 4, DType::U32, CAP);
                    st.put(&dst, &vals, pad, None, stream.handle()).unwrap();
                    sent.push((len, pad));
                    issued += usize::from(len > 0 || pad.is_some());
                    vals.iter_mut().for_each(|v| *v = 0xBAD); // caller reuses its buffer at once
                }
                (t, sent, issued)
            })
        })
        .collect();
    let results: Vec<_> = workers.into_iter().map(|w| w.join().unwrap()).collect();
    stop.store(true, Ordering::Relaxed);
    staller.join().unwrap();
    streams.iter().for_each(|s| s.synchronize().unwrap());
    let mut mismatches = 0usize;
    let issued: usize = results.iter().map(|r| r.2).sum();
    for (t, sent, _) in results {
        let out = read(&bufs[t]);
        let got: &[u32] = bytemuck::cast_slice(&out[..copies * CAP * 4]);
        for (i, &(len, pad)) in sent.iter().enumerate() {
            let d = &got[i * CAP..(i + 1) * CAP];
            mismatches += (0..len).filter(|&k| d[k] != value(t, i, k)).count();
            let rest = match pad {
                Some(p) => p,
                None => u32::from_le_bytes([POISON; 4]),
            };
            mismatches += d[len..].iter().filter(|&&x| x != rest).count();
        }
        mismatches += out[copies * CAP * 4..]
            .iter()
            .filter(|&&b| b != POISON)
            .count();
    }
    let s = st.stats();
    eprintln!(
        "stress: {} threads x {copies} copies, every copy checked, stats {s:?}, mismatches {mismatches}",
        THREADS
    );
    assert_eq!(mismatches, 0);
    assert_eq!(
        s.copies as usize, issued,
        "every non-empty copy issued exactly one DMA"
    );
}

/// The value element `k` of copy `i` of thread `t` carries.
fn value(t: usize, i: usize, k: usize) -> u32 {
    ((t as u32) << 28) ^ ((i as u32) << 9) ^ k as u32 ^ 0x5000_0000
}

/// One ring of 8 shared by a stalled stream and a free one: each turn of the ring sends slots 0-3
/// to the stalled stream and 4-7 to the free one (synchronized). Claiming slot 0 again asks about
/// slot 4, half a ring ahead, whose copy completed: that must not free slot 0, whose copy waits
/// on the other, stalled stream. Every destination ends with exactly its copy's values.
#[test]
#[ignore = "needs a CUDA GPU: run with --include-ignored (scripts/gpu-run does)"]
fn gpu_a_free_stream_never_frees_a_stalled_streams_slots() {
    let Some(dev) = gpu_or_skip("gpu_a_free_stream_never_frees_a_stalled_streams_slots") else {
        return;
    };
    let depth = 8;
    let st = Arc::new(common::stager::<i64>(0, 64, depth).unwrap());
    let stalled = Arc::new(Stream::new(&dev).unwrap());
    let free = Arc::new(Stream::new(&dev).unwrap());
    let copies = 64;
    let bufs = destinations(&dev, copies);
    let _serial = STALL_LOCK.lock().unwrap_or_else(|e| e.into_inner());
    let go = stall(&stalled);
    let issued = Arc::new(AtomicUsize::new(0));
    let worker = {
        let (st, stalled, free, bufs, issued) = (
            st.clone(),
            stalled.clone(),
            free.clone(),
            bufs.clone(),
            issued.clone(),
        );
        std::thread::spawn(move || {
            let mut vals = vec![0i64; 64];
            for (k, buf) in bufs.iter().enumerate() {
                for (i, v) in vals.iter_mut().enumerate() {
                    *v = (k as i64 + 1) * 1000 + i as i64;
                }
                let on_stalled = k % depth < depth / 2;
                let s = if on_stalled { &stalled } else { &free };
                st.put(&view(buf, DType::I64, 64), &vals, None, None, s.handle())
                    .unwrap();
                vals.iter_mut().for_each(|v| *v = -7);
                if !on_stalled {
                    free.synchronize().unwrap();
                }
                issued.fetch_add(1, Ordering::SeqCst);
            }
        })
    };
    let staged = staged_while_stalled(&issued, depth);
    go.release();
    worker.join().unwrap();
    stalled.synchronize().unwrap();
    free.synchronize().unwrap();
    // The ninth copy claims slot 0, whose copy is still stalled: it must wait there.
    assert_eq!(
        staged, depth,
        "copies staged while slot 0's copy was stalled"
    );
    assert!(st.stats().waits >= 1, "stats: {:?}", st.stats());
    check_destinations(&bufs, |k| {
        let which = if k % depth < depth / 2 {
            "stalled"
        } else {
            "free"
        };
        format!("destination {k} (stream {which})")
    });
}

/// `copy_d2h` into pinned memory learns that its copy landed from a word the stream writes after
/// it (no event). Behind a stalled stream the wait passes its flat-out spin (200 µs) and waits
/// on: it must not return, nor the destination change, before the stall is released; then every
/// byte is there.
#[test]
#[ignore = "needs a CUDA GPU: run with --include-ignored (scripts/gpu-run does)"]
fn gpu_copy_d2h_waits_for_its_copy_behind_a_stalled_stream() {
    let Some(dev) = gpu_or_skip("gpu_copy_d2h_waits_for_its_copy_behind_a_stalled_stream") else {
        return;
    };
    let _serial = STALL_LOCK.lock().unwrap_or_else(|e| e.into_inner());
    let stream = Stream::new(&dev).unwrap();
    warm_landing(&dev);
    let (landed_before, _) = pinstage::testing::landing_counts();
    let after_spin_before = pinstage::testing::landing_after_spin();
    for bytes in [1024usize, 64 << 10] {
        let data = common::values(DType::U8, bytes, bytes as u64 + 7);
        let src = DeviceBuffer::new(&dev, bytes).unwrap();
        src.upload(0, &data).unwrap();
        let mut dst =
            pinstage::PinnedBuffer::new(&dev, bytes + 1, pinstage::host::PinnedFlags::PORTABLE)
                .unwrap();
        dst.as_mut_slice().fill(POISON);
        let addr = dst.as_mut_ptr() as usize;
        let go = stall(&stream);
        let returned = AtomicBool::new(false);
        let (path, dst) = std::thread::scope(|scope| {
            let copier = scope.spawn(|| {
                let path =
                    pinstage::copy_d2h(&src.view(DType::U8), dst.as_mut_slice(), stream.handle());
                returned.store(true, Ordering::Release);
                (path, dst)
            });
            std::thread::sleep(Duration::from_millis(30));
            let early = returned.load(Ordering::Acquire);
            // SAFETY: the pinned buffer is alive (owned by the copier until it returns it) and
            // nothing writes it while the stream is stalled; a volatile read of one byte.
            let first = unsafe { std::ptr::read_volatile(addr as *const u8) };
            go.release();
            let out = copier.join().unwrap();
            assert!(!early, "copy_d2h returned before its copy ran");
            assert_eq!(first, POISON, "the destination changed before the copy ran");
            out
        });
        assert_eq!(path.unwrap(), pinstage::host::CopyPath::Pinned);
        assert_eq!(&dst.as_slice()[..bytes], &data[..], "{bytes} bytes");
        assert_eq!(dst.as_slice()[bytes], POISON, "past the end");
    }
    let (landed, _) = pinstage::testing::landing_counts();
    assert!(
        landed > landed_before,
        "no wait learned of its copy from a landing word"
    );
    // Behind a 30 ms stall, a landed wait saw its word only after its spin.
    assert!(
        pinstage::testing::landing_after_spin() > after_spin_before,
        "no wait behind the stall counted as landing after its spin"
    );
}

/// One `copy_d2h` into pinned memory before any stall: the device's landing words (pinned
/// memory, whose allocation may synchronize the device) exist before the streams stall.
fn warm_landing(dev: &Device) {
    let src = DeviceBuffer::new(dev, 64).unwrap();
    src.upload(0, &[1u8; 64]).unwrap();
    let mut dst =
        pinstage::PinnedBuffer::new(dev, 64, pinstage::host::PinnedFlags::PORTABLE).unwrap();
    pinstage::copy_d2h(
        &src.view(DType::U8),
        dst.as_mut_slice(),
        pinstage::StreamHandle::LEGACY,
    )
    .unwrap();
    assert_eq!(dst.as_slice(), &[1u8; 64]);
}

/// 96 threads copy with `copy_d2h` into their own pinned destinations at once, each behind its
/// own stalled stream, so all 96 wait together: 64 on the device's landing words, the rest
/// through events. After the stalls are released every copy is checked (destinations poisoned
/// first): a wait that returned for another thread's word, or early, shows as poison.
#[test]
#[ignore = "needs a CUDA GPU: run with --include-ignored (scripts/gpu-run does)"]
fn gpu_copy_d2h_more_waits_than_landing_words() {
    let Some(dev) = gpu_or_skip("gpu_copy_d2h_more_waits_than_landing_words") else {
        return;
    };
    let _serial = STALL_LOCK.lock().unwrap_or_else(|e| e.into_inner());
    warm_landing(&dev);
    let threads = 96usize;
    let sizes = [4usize, 1024, 4097, 64 << 10];
    let mut jobs: Vec<_> = (0..threads)
        .map(|t| {
            let n = sizes[t % sizes.len()];
            let data = common::values(DType::U8, n, 1000 + t as u64);
            let src = DeviceBuffer::new(&dev, n).unwrap();
            src.upload(0, &data).unwrap();
            let mut dst =
                pinstage::PinnedBuffer::new(&dev, n + 1, pinstage::host::PinnedFlags::PORTABLE)
                    .unwrap();
            dst.as_mut_slice().fill(POISON);
            (Stream::new(&dev).unwrap(), src, dst, data)
        })
        .collect();
    let (landed_before, evented_before) = pinstage::testing::landing_counts();
    let from_stream_before = pinstage::testing::landing_from_stream();
    let stalls: Vec<_> = jobs.iter().map(|(s, ..)| stall(s)).collect();
    let returned = AtomicUsize::new(0);
    std::thread::scope(|scope| {
        let copiers: Vec<_> = jobs
            .iter_mut()
            .map(|(stream, src, dst, _)| {
                let returned = &returned;
                scope.spawn(move || {
                    let path = pinstage::copy_d2h(
                        &src.view(DType::U8),
                        dst.as_mut_slice(),
                        stream.handle(),
                    );
                    returned.fetch_add(1, Ordering::AcqRel);
                    path
                })
            })
            .collect();
        std::thread::sleep(Duration::from_millis(100));
        let early = returned.load(Ordering::Acquire);
        for s in &stalls {
            s.release();
        }
        for c in copiers {
            assert_eq!(c.join().unwrap().unwrap(), pinstage::host::CopyPath::Pinned);
        }
        assert_eq!(
            early, 0,
            "{early} copy_d2h calls returned before their copies ran"
        );
    });
    for (t, (_, _, dst, data)) in jobs.iter().enumerate() {
        let n = data.len();
        assert!(dst.as_slice()[..n] == data[..], "thread {t}: wrong bytes");
        assert_eq!(dst.as_slice()[n], POISON, "thread {t}: past the end");
    }
    assert_eq!(
        pinstage::testing::landing_free_words(&dev),
        Some(64),
        "every wait gave its landing word back"
    );
    let (landed, evented) = pinstage::testing::landing_counts();
    assert!(
        evented - evented_before >= (threads - 64) as u64,
        "only {} waits took an event with {threads} waiting at once",
        evented - evented_before
    );
    assert!(
        landed > landed_before,
        "no wait learned of its copy from a landing word"
    );
    // Up to 64 words in use at once, each written by its own stream: a wait that read another
    // word than its own would never see its value there (or see it early, above) and learn of
    // its copy from the idle stream instead.
    assert_eq!(
        (landed - landed_before) + (evented - evented_before),
        threads as u64,
        "every wait saw its own word or took an event"
    );
    assert_eq!(
        pinstage::testing::landing_from_stream(),
        from_stream_before,
        "waits learned of their copies from their streams, their words never seen"
    );
}

/// A pinned source and destination pair for the landing-word tests: `bytes` of distinct values
/// on the device, a pinned destination one byte longer, poisoned.
fn landing_pair(
    dev: &Device,
    bytes: usize,
    seed: u64,
) -> (DeviceBuffer, pinstage::PinnedBuffer, Vec<u8>) {
    let data = common::values(DType::U8, bytes, seed);
    let src = DeviceBuffer::new(dev, bytes).unwrap();
    src.upload(0, &data).unwrap();
    let mut dst =
        pinstage::PinnedBuffer::new(dev, bytes + 1, pinstage::host::PinnedFlags::PORTABLE).unwrap();
    dst.as_mut_slice().fill(POISON);
    (src, dst, data)
}

/// Checks a landing-word test's destination: the bytes copied, the byte past them untouched.
fn check_landed(dst: &pinstage::PinnedBuffer, data: &[u8], what: &str) {
    assert!(
        dst.as_slice()[..data.len()] == data[..],
        "{what}: wrong bytes"
    );
    assert_eq!(dst.as_slice()[data.len()], POISON, "{what}: past the end");
}

/// Runs `work` on its own thread while `stream` is stalled, releasing the stall after 60 ms.
/// Returns what `work` returned and whether it had returned before the release (a call whose
/// copies are queued behind the stall may not: its memory is used until they ran).
fn behind_a_stall<R: Send>(stream: &Stream, work: impl FnOnce() -> R + Send) -> (R, bool) {
    let go = stall(stream);
    let returned = AtomicBool::new(false);
    std::thread::scope(|scope| {
        let worker = scope.spawn(|| {
            let r = work();
            returned.store(true, Ordering::Release);
            r
        });
        std::thread::sleep(Duration::from_millis(60));
        let early = returned.load(Ordering::Acquire);
        go.release();
        (worker.join().unwrap(), early)
    })
}

/// `copy_d2h` behind a stalled stream ([`behind_a_stall`]), with `faults` injected on its
/// thread first. Returns the copy's result, whether it returned early, and the injected calls
/// never made.
fn copy_d2h_behind_a_stall(
    stream: &Stream,
    src: &DeviceBuffer,
    dst: &mut pinstage::PinnedBuffer,
    faults: &[(
        pinstage::testing::fault::Call,
        pinstage::testing::fault::Fault,
        u32,
    )],
) -> (pinstage::Result<pinstage::host::CopyPath>, bool, u32) {
    use pinstage::testing::fault;
    let ((r, left), early) = behind_a_stall(stream, || {
        for &(c, f, n) in faults {
            fault::inject(c, f, n);
        }
        let r = pinstage::copy_d2h(&src.view(DType::U8), dst.as_mut_slice(), stream.handle());
        (r, fault::clear())
    });
    (r, early, left)
}

/// Where the driver refuses stream writes (`CUDA_ERROR_NOT_SUPPORTED`, injected), `copy_d2h`
/// waits through an event instead, right away and for every later copy on the device; an
/// injected failure of another kind is reported, not taken for a refusal.
#[test]
#[ignore = "needs a CUDA GPU: run with --include-ignored (scripts/gpu-run does)"]
fn gpu_copy_d2h_takes_an_event_where_stream_writes_are_refused() {
    use pinstage::testing::fault::{self, Call, Fault};
    let Some(dev) = gpu_or_skip("gpu_copy_d2h_takes_an_event_where_stream_writes_are_refused")
    else {
        return;
    };
    let _serial = STALL_LOCK.lock().unwrap_or_else(|e| e.into_inner());
    warm_landing(&dev);
    let stream = Stream::new(&dev).unwrap();
    let copy = |seed: u64, what: &str| {
        let (src, mut dst, data) = landing_pair(&dev, 64 << 10, seed);
        let r = pinstage::copy_d2h(&src.view(DType::U8), dst.as_mut_slice(), stream.handle());
        if r.is_ok() {
            check_landed(&dst, &data, what);
        }
        r
    };
    // A failure that is no refusal: reported (after the stream drained), the words still used.
    fault::inject(Call::StreamWriteValue32, Fault::Failed, 1);
    let err = copy(11, "failed write").expect_err("an injected stream-write failure was lost");
    assert_eq!(fault::clear(), 0);
    match err {
        pinstage::Error::Driver(e) => assert_eq!(e.call(), "cuStreamWriteValue32"),
        other => panic!("expected the driver's error, got {other:?}"),
    }
    let (landed0, evented0) = pinstage::testing::landing_counts();
    assert_eq!(
        copy(12, "after a failed write").unwrap(),
        pinstage::host::CopyPath::Pinned
    );
    let (landed1, evented1) = pinstage::testing::landing_counts();
    assert_eq!(
        (landed1 - landed0, evented1 - evented0),
        (1, 0),
        "a failure turned the words off"
    );
    // A refusal: this copy and the next take events.
    fault::inject(Call::StreamWriteValue32, Fault::NotSupported, 1);
    let refused = copy(13, "refused write");
    assert_eq!(fault::clear(), 0, "the copy made no stream write");
    assert_eq!(
        refused.expect("a refused stream write failed the copy"),
        pinstage::host::CopyPath::Pinned
    );
    assert_eq!(
        copy(14, "after a refusal").unwrap(),
        pinstage::host::CopyPath::Pinned
    );
    let (landed2, evented2) = pinstage::testing::landing_counts();
    pinstage::testing::landing_reset(&dev);
    assert_eq!(
        (landed2 - landed1, evented2 - evented1),
        (0, 2),
        "landed, evented after a refusal"
    );
    assert_eq!(
        copy(15, "after the reset").unwrap(),
        pinstage::host::CopyPath::Pinned
    );
    assert_eq!(pinstage::testing::landing_counts().0 - landed2, 1);
}

/// A `copy_d2h` wait that asks its stream while another thread captures a graph in global mode
/// is refused (injected here, three times); that is no failure: it waits on and returns once the
/// copy ran. Another error while it waits is reported, but only once the copy completed (its
/// destination is written until then).
#[test]
#[ignore = "needs a CUDA GPU: run with --include-ignored (scripts/gpu-run does)"]
fn gpu_copy_d2h_waits_through_a_capture_refusal_and_reports_a_failing_stream() {
    use pinstage::testing::fault::{Call, Fault};
    let Some(dev) =
        gpu_or_skip("gpu_copy_d2h_waits_through_a_capture_refusal_and_reports_a_failing_stream")
    else {
        return;
    };
    let _serial = STALL_LOCK.lock().unwrap_or_else(|e| e.into_inner());
    warm_landing(&dev);
    let stream = Stream::new(&dev).unwrap();
    let (src, mut dst, data) = landing_pair(&dev, 64 << 10, 21);
    let (r, early, left) = copy_d2h_behind_a_stall(
        &stream,
        &src,
        &mut dst,
        &[(Call::StreamQuery, Fault::CaptureRefused, 3)],
    );
    assert!(!early, "returned before its copy ran");
    assert_eq!(
        left, 0,
        "the wait asked its stream fewer than 3 times in 60 ms"
    );
    assert_eq!(
        r.expect("a capture refusal failed the wait"),
        pinstage::host::CopyPath::Pinned
    );
    check_landed(&dst, &data, "through a capture refusal");

    let (src, mut dst, data) = landing_pair(&dev, 64 << 10, 22);
    let (r, early, left) = copy_d2h_behind_a_stall(
        &stream,
        &src,
        &mut dst,
        &[(Call::StreamQuery, Fault::Failed, 1)],
    );
    assert_eq!(left, 0);
    assert!(!early, "returned its error before its copy ran");
    match r {
        Err(pinstage::Error::Driver(e)) => assert_eq!(e.call(), "cuStreamQuery"),
        other => panic!("a failing stream was not reported: {other:?}"),
    }
    check_landed(&dst, &data, "a failed wait's copy");
}

/// A landing word that never comes (its write skipped, injected): the wait learns from the
/// stream that the copy completed, after its spin.
#[test]
#[ignore = "needs a CUDA GPU: run with --include-ignored (scripts/gpu-run does)"]
fn gpu_copy_d2h_learns_from_its_stream_when_the_word_never_comes() {
    use pinstage::testing::fault::{self, Call, Fault};
    let Some(dev) = gpu_or_skip("gpu_copy_d2h_learns_from_its_stream_when_the_word_never_comes")
    else {
        return;
    };
    let _serial = STALL_LOCK.lock().unwrap_or_else(|e| e.into_inner());
    warm_landing(&dev);
    let stream = Stream::new(&dev).unwrap();
    let (src, mut dst, data) = landing_pair(&dev, 4 << 10, 31);
    let (landed0, _) = pinstage::testing::landing_counts();
    let from_stream0 = pinstage::testing::landing_from_stream();
    fault::inject(Call::StreamWriteValue32, Fault::Skipped, 1);
    let path = pinstage::copy_d2h(&src.view(DType::U8), dst.as_mut_slice(), stream.handle());
    assert_eq!(fault::clear(), 0);
    assert_eq!(path.unwrap(), pinstage::host::CopyPath::Pinned);
    check_landed(&dst, &data, "without its word");
    assert_eq!(
        pinstage::testing::landing_counts().0,
        landed0,
        "a word that was never written"
    );
    assert_eq!(
        pinstage::testing::landing_from_stream(),
        from_stream0 + 1,
        "the wait learned of its copy from its stream"
    );
}

/// Small copies on an idle device land while their wait spins flat out (no driver call, no
/// pause): of 200 copies of 4 KiB, at least half. The other half allows for a loaded machine.
#[test]
#[ignore = "needs a CUDA GPU: run with --include-ignored (scripts/gpu-run does)"]
fn gpu_small_copy_d2h_waits_land_within_their_spin() {
    let Some(dev) = gpu_or_skip("gpu_small_copy_d2h_waits_land_within_their_spin") else {
        return;
    };
    let _serial = STALL_LOCK.lock().unwrap_or_else(|e| e.into_inner());
    warm_landing(&dev);
    let stream = Stream::new(&dev).unwrap();
    let (src, mut dst, _) = landing_pair(&dev, 4 << 10, 41);
    let (landed0, _) = pinstage::testing::landing_counts();
    let after0 = pinstage::testing::landing_after_spin();
    for k in 0..200u64 {
        let data = common::values(DType::U8, 4 << 10, 100 + k);
        src.upload(0, &data).unwrap();
        dst.as_mut_slice().fill(POISON);
        pinstage::copy_d2h(
            &src.view(DType::U8),
            &mut dst.as_mut_slice()[..4 << 10],
            stream.handle(),
        )
        .unwrap();
        check_landed(&dst, &data, &format!("copy {k}"));
    }
    let landed = pinstage::testing::landing_counts().0 - landed0;
    let after = pinstage::testing::landing_after_spin() - after0;
    assert_eq!(landed, 200, "every wait took a landing word");
    assert!(
        after <= 100,
        "{after} of 200 waits saw their word only after the spin"
    );
}

/// A `wait_with` function that returns before the slot's last copy completed costs time, not
/// data: behind a stalled stream, a second copy through a one-slot ring waits for the first to
/// run (the event is asked again and waited for) instead of rewriting the slot under it. Both
/// destinations end with their own values; the stager's getters report what it was built with.
#[test]
#[ignore = "needs a CUDA GPU: run with --include-ignored (scripts/gpu-run does)"]
fn gpu_an_early_returning_wait_function_costs_time_not_data() {
    let Some(dev) = gpu_or_skip("gpu_an_early_returning_wait_function_costs_time_not_data") else {
        return;
    };
    let _serial = STALL_LOCK.lock().unwrap_or_else(|e| e.into_inner());
    let st = pinstage::h2d::RawStager::builder(DType::U8)
        .device(0)
        .numel(4096)
        .depth(1)
        .build()
        .unwrap();
    assert!(st.has_cuda(), "a stager on a GPU machine serves devices");
    assert_eq!((st.ordinal(), st.depth()), (0, 1));
    let stream = Stream::new(&dev).unwrap();
    let (a, b) = (
        poisoned(&dev, DType::U8, 4096),
        poisoned(&dev, DType::U8, 4096),
    );
    let (va, vb) = (
        common::values(DType::U8, 4096, 51),
        common::values(DType::U8, 4096, 52),
    );
    let (calls_a, calls_b) = (AtomicUsize::new(0), AtomicUsize::new(0));
    let ((), early) = behind_a_stall(&stream, || {
        let mut early_a = |_: pinstage::cuda::SlotEvent<'_>| {
            calls_a.fetch_add(1, Ordering::Relaxed);
            Ok(())
        };
        let da = view(&a, DType::U8, 4096);
        st.to(&da)
            .stream(stream.handle())
            .wait_with(&mut early_a)
            .copy(&va)
            .unwrap();
        let mut early_b = |_: pinstage::cuda::SlotEvent<'_>| {
            calls_b.fetch_add(1, Ordering::Relaxed);
            Ok(())
        };
        let db = view(&b, DType::U8, 4096);
        st.to(&db)
            .stream(stream.handle())
            .wait_with(&mut early_b)
            .copy(&vb)
            .unwrap();
    });
    assert!(
        !early,
        "the second copy rewrote the only slot while its copy was stalled"
    );
    stream.synchronize().unwrap();
    assert_eq!(
        calls_b.load(Ordering::Relaxed),
        1,
        "the busy slot's wait was asked"
    );
    common::check_layout(&read(&a), &va, None, 4096);
    common::check_layout(&read(&b), &vb, None, 4096);
}

/// A step whose second span the driver refuses (injected, after the first was let through):
/// the commit reports the error, but only once the first span, already queued behind a stall,
/// has run, since the slot it reads is released for the next step to rewrite.
#[test]
#[ignore = "needs a CUDA GPU: run with --include-ignored (scripts/gpu-run does)"]
fn gpu_a_step_failing_after_issued_spans_waits_for_them() {
    use pinstage::testing::fault::{self, Call, Fault};
    let Some(dev) = gpu_or_skip("gpu_a_step_failing_after_issued_spans_waits_for_them") else {
        return;
    };
    let _serial = STALL_LOCK.lock().unwrap_or_else(|e| e.into_inner());
    let layout = pinstage::StepLayout::builder()
        .field("a", DType::I32, &[1024])
        .field("b", DType::I32, &[1024])
        .build()
        .unwrap();
    // No merging, no batch: one cuMemcpyHtoDAsync per field.
    let st = pinstage::StepStager::builder(&layout)
        .depth(1)
        .max_gap(0)
        .batch(false)
        .build()
        .unwrap();
    let stream = Stream::new(&dev).unwrap();
    let va: Vec<i32> = (0..100).map(|i| 7 + 3 * i).collect();
    let vb: Vec<i32> = (0..100).map(|i| -5 - 2 * i).collect();
    let ((r, left), early) = behind_a_stall(&stream, || {
        fault::inject(Call::MemcpyHtoDAsync, Fault::Through, 1);
        fault::inject(Call::MemcpyHtoDAsync, Fault::Failed, 1);
        let mut s = st.step().unwrap();
        s.put("a", &va).unwrap();
        s.put("b", &vb).unwrap();
        let r = s.commit(stream.handle()).map(|c| c.calls);
        (r, fault::clear())
    });
    assert_eq!(left, 0, "the commit made fewer than two span copies");
    match r {
        Err(pinstage::Error::Driver(e)) => assert_eq!(e.call(), "cuMemcpyHtoDAsync"),
        other => panic!("the refused span was not reported: {other:?}"),
    }
    assert!(
        !early,
        "the failed commit released its slot while its first span was still queued"
    );
    stream.synchronize().unwrap();
    let a: Vec<i32> = bytemuck::cast_slice(&st.read_field("a").unwrap()).to_vec();
    assert_eq!(a[..100], va[..], "the first span's copy");
}

/// A stager copy whose event record fails (injected) behind a stalled stream: the call reports
/// the record's error only once the stream was waited for (its copy ran), so the slot it frees
/// is not rewritten under that copy: the next copy through the one slot lands, and so did the
/// first.
#[test]
#[ignore = "needs a CUDA GPU: run with --include-ignored (scripts/gpu-run does)"]
fn gpu_a_failed_event_record_frees_its_slot_only_after_the_copy() {
    use pinstage::testing::fault::{self, Call, Fault};
    let Some(dev) = gpu_or_skip("gpu_a_failed_event_record_frees_its_slot_only_after_the_copy")
    else {
        return;
    };
    let _serial = STALL_LOCK.lock().unwrap_or_else(|e| e.into_inner());
    let stream = Stream::new(&dev).unwrap();
    let st = common::stager::<u32>(0, 1024, 1).unwrap();
    let (a, b) = (
        poisoned(&dev, DType::U32, 1024),
        poisoned(&dev, DType::U32, 1024),
    );
    let va: Vec<u32> = (0..1024).map(|i| i * 7 + 3).collect();
    let vb: Vec<u32> = (0..1024).map(|i| i * 5 + 100_001).collect();
    pinstage::host::wait_for_frees();
    let go = stall(&stream);
    let release = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(100));
        drop(go);
    });
    fault::inject(Call::EventRecord, Fault::Failed, 1);
    let failed = st.put(
        &view(&a, DType::U32, 1024),
        &va,
        None,
        None,
        stream.handle(),
    );
    assert_eq!(fault::clear(), 0, "the record was made");
    match failed {
        Err(pinstage::Error::Driver(e)) => assert_eq!(e.call(), "cuEventRecord"),
        other => panic!("the failed record was not reported: {other:?}"),
    }
    st.put(
        &view(&b, DType::U32, 1024),
        &vb,
        None,
        None,
        stream.handle(),
    )
    .unwrap();
    release.join().unwrap();
    stream.synchronize().unwrap();
    assert_eq!(
        bytemuck::cast_slice::<u8, u32>(&read(&a)[..4096]),
        &va[..],
        "first copy"
    );
    assert_eq!(
        bytemuck::cast_slice::<u8, u32>(&read(&b)[..4096]),
        &vb[..],
        "second copy"
    );
}
