//! GPU tests of whole-array host-to-device copies (`copy_h2d`, the pageable bounce path) and of
//! fresh device memory (`to_device`).

mod common;

use std::sync::Mutex;
use std::sync::atomic::Ordering::Relaxed;

use common::{POISON, gpu_or_skip, values};
use pinstage::dlpack::TensorMeta;
use pinstage::host::CopyPath;
use pinstage::host::PinnedFlags;
use pinstage::testing::DeviceBuffer;
use pinstage::{DType, DeviceView, PinnedBuffer, StreamHandle, copy_d2h, copy_h2d};
use rstest::rstest;

/// Every test here takes it: the pool statistics and the pinned-bytes counter the leak tests
/// read must not see other tests' arrays, pinned buffers or bounce slots (a 129 MiB pinned
/// source of another test, still alive, once failed the leak check of 100,000 results).
static SERIAL: Mutex<()> = Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

/// A poisoned device buffer one byte longer than `bytes` (the tail must stay poisoned).
fn poisoned(dev: &pinstage::Device, bytes: usize) -> DeviceBuffer {
    let buf = DeviceBuffer::new(dev, bytes + 1).unwrap();
    buf.upload(0, &vec![POISON; bytes + 1]).unwrap();
    buf
}

fn check(buf: &DeviceBuffer, data: &[u8]) {
    let mut out = vec![0u8; data.len() + 1];
    buf.download(0, &mut out).unwrap();
    assert!(out[..data.len()] == *data, "values differ");
    assert_eq!(
        out[data.len()],
        POISON,
        "the byte past the copy was written"
    );
}

#[rstest]
#[case::one(1)]
#[case::odd(4097)]
#[case::mib(1 << 20)]
#[case::more_pieces_than_slots((20 << 20) + 12345)]
#[case::past_the_non_temporal_limit((129 << 20) + 7)]
#[ignore = "needs a CUDA GPU: run with --include-ignored (scripts/gpu-run does)"]
fn gpu_h2d_pageable_and_pinned(#[case] bytes: usize) {
    let Some(dev) = gpu_or_skip("gpu_h2d_pageable_and_pinned") else {
        return;
    };
    let _serial = serial();
    let data = values(DType::U8, bytes, bytes as u64 + 11);
    let buf = poisoned(&dev, bytes);
    let dst = buf.view_at(0, DType::U8, bytes);
    let path = copy_h2d(&dst, &data, StreamHandle::LEGACY).unwrap();
    assert_eq!(path, CopyPath::Bounced);
    check(&buf, &data);

    let other = values(DType::U8, bytes, bytes as u64 + 12);
    let mut pinned = PinnedBuffer::new(&dev, bytes, PinnedFlags::PORTABLE).unwrap();
    pinned.as_mut_slice().copy_from_slice(&other);
    let buf = poisoned(&dev, bytes);
    let dst = buf.view_at(0, DType::U8, bytes);
    let path = copy_h2d(&dst, pinned.as_slice(), StreamHandle::LEGACY).unwrap();
    assert_eq!(path, CopyPath::Pinned);
    check(&buf, &other);
}

/// Eight threads, each copying its own values through the shared bounce slots and copy
/// threads, every copy checked (a slot reused before its copy completed, or a piece lost,
/// shows as a wrong byte).
#[test]
#[ignore = "needs a CUDA GPU: run with --include-ignored (scripts/gpu-run does)"]
fn gpu_h2d_threads_share_the_bounce_slots() {
    let Some(dev) = gpu_or_skip("gpu_h2d_threads_share_the_bounce_slots") else {
        return;
    };
    let _serial = serial();
    std::thread::scope(|s| {
        for t in 0..8u64 {
            let dev = &dev;
            s.spawn(move || {
                let stream = pinstage::Stream::new(dev).unwrap();
                for i in 0..12u64 {
                    let bytes = (3 << 20) + (t as usize * 4099) + i as usize * 17;
                    let data = values(DType::U8, bytes, t * 1000 + i + 1);
                    let buf = poisoned(dev, bytes);
                    let dst = buf.view_at(0, DType::U8, bytes);
                    copy_h2d(&dst, &data, stream.handle()).unwrap();
                    check(&buf, &data);
                }
            });
        }
    });
}

/// More pieces than bounce slots into a stalled stream: every slot must wait for its last copy
/// before it is filled again; a slot refilled early shows as a wrong byte. The stall is released
/// once the call returned (a pageable `copy_h2d_async` returns once it read its whole source:
/// early only if a slot was refilled under a queued copy) or after 500 ms (a correct call waits
/// for that), so a fill that does not wait always overwrites a queued copy's slot.
#[test]
#[ignore = "needs a CUDA GPU: run with --include-ignored (scripts/gpu-run does)"]
fn gpu_h2d_slots_wait_for_their_copies() {
    let Some(dev) = gpu_or_skip("gpu_h2d_slots_wait_for_their_copies") else {
        return;
    };
    let _serial = serial();
    let stream = pinstage::Stream::new(&dev).unwrap();
    let bytes = 40 << 20;
    let data = values(DType::U8, bytes, 91);
    let buf = poisoned(&dev, bytes);
    let dst = buf.view_at(0, DType::U8, bytes);
    // Everything allocated before the stall (pinned allocations may synchronize the device).
    copy_h2d(&dst, &values(DType::U8, bytes, 92), stream.handle()).unwrap();
    buf.upload(0, &vec![POISON; bytes + 1]).unwrap();
    let gate = common::stall(&stream);
    let (returned, seen) = std::sync::mpsc::channel::<()>();
    let release = std::thread::spawn(move || {
        let early = seen
            .recv_timeout(std::time::Duration::from_millis(500))
            .is_ok();
        gate.release();
        early
    });
    let pending = pinstage::h2d::copy_h2d_async(&dst, data.clone(), stream.handle()).unwrap();
    let _ = returned.send(());
    let early = release.join().unwrap();
    pending.wait().unwrap();
    check(&buf, &data);
    assert!(
        !early,
        "the call returned while its slots' copies were held: a slot was refilled early"
    );
}

/// A pageable copy on this thread's per-thread default stream (the copy threads' own per-thread
/// streams are other streams: they must not issue its pieces): it must follow the work queued on
/// the caller's per-thread stream before it (a stall, then poison written into the destination),
/// and work queued there after it must see its bytes.
#[test]
#[ignore = "needs a CUDA GPU: run with --include-ignored (scripts/gpu-run does)"]
fn gpu_h2d_pageable_on_the_per_thread_stream_keeps_its_order() {
    let Some(dev) = gpu_or_skip("gpu_h2d_pageable_on_the_per_thread_stream_keeps_its_order") else {
        return;
    };
    let _serial = serial();
    let ptds = StreamHandle::PER_THREAD;
    let bytes = (24 << 20) + 4099;
    let data = values(DType::U8, bytes, 313);
    let buf = poisoned(&dev, bytes);
    let dst = buf.view_at(0, DType::U8, bytes);
    // Everything allocated before the stall (pinned allocations may synchronize the device).
    copy_h2d(&dst, &values(DType::U8, bytes, 314), ptds).unwrap();
    let mut poison = PinnedBuffer::new(&dev, bytes, PinnedFlags::PORTABLE).unwrap();
    poison.as_mut_slice().fill(POISON);
    let mut out = vec![0x11u8; bytes];
    copy_d2h(&dst, &mut out, ptds).unwrap(); // the D2H bounce slots, too
    out.fill(0x11);
    let gate = common::stall_handle(&dev, ptds);
    let release = std::thread::spawn(move || {
        std::thread::sleep(std::time::Duration::from_millis(100));
        gate.release();
    });
    // SAFETY: `poison` is pinned and outlives its copy (waited for below, through `out`).
    let (path, _) =
        unsafe { pinstage::testing::start_h2d(Some(&dev), &dst, poison.as_ptr(), bytes, ptds) }
            .unwrap();
    assert_eq!(path, CopyPath::Pinned);
    // SAFETY: pageable: read before the call returns.
    let (path, ev) =
        unsafe { pinstage::testing::start_h2d(Some(&dev), &dst, data.as_ptr(), bytes, ptds) }
            .unwrap();
    assert_eq!(path, CopyPath::Bounced);
    assert!(
        !ev.as_ref().unwrap().query().unwrap(),
        "the copies must wait behind the caller's stalled per-thread stream"
    );
    copy_d2h(&dst, &mut out, ptds).unwrap();
    release.join().unwrap();
    assert!(
        out == data,
        "work after the copy on the per-thread stream did not see it"
    );
    ev.unwrap().synchronize().unwrap();
    check(&buf, &data);
}

/// `start_h2d` from pageable memory returns once the source was read: changing it right after
/// the call does not change what lands, with the stream stalled (the copies still queued).
#[test]
#[ignore = "needs a CUDA GPU: run with --include-ignored (scripts/gpu-run does)"]
fn gpu_h2d_pageable_source_may_change_at_once() {
    let Some(dev) = gpu_or_skip("gpu_h2d_pageable_source_may_change_at_once") else {
        return;
    };
    let _serial = serial();
    let stream = pinstage::Stream::new(&dev).unwrap();
    // Few enough pieces for the bounce slots: with the stream stalled, no slot comes free.
    let bytes = 6 << 20;
    let data = values(DType::U8, bytes, 77);
    let mut src = data.clone();
    let buf = poisoned(&dev, bytes);
    let dst = buf.view_at(0, DType::U8, bytes);
    // Everything allocated before the stall (pinned allocations may synchronize the device).
    copy_h2d(&dst, &src, stream.handle()).unwrap();
    buf.upload(0, &vec![POISON; bytes + 1]).unwrap();
    let gate = common::stall(&stream);
    // SAFETY: `src` lives until after the event completed; pageable: read before return.
    let (path, ev) = unsafe {
        pinstage::testing::start_h2d(Some(&dev), &dst, src.as_ptr(), bytes, stream.handle())
    }
    .unwrap();
    assert_eq!(path, CopyPath::Bounced);
    assert!(
        !ev.as_ref().unwrap().query().unwrap(),
        "the copies wait behind the stall"
    );
    src.fill(0x11);
    gate.release();
    ev.expect("a bounced copy's event").synchronize().unwrap();
    check(&buf, &data);
}

/// Caches every bounce slot `uploads` pageable copies of `bytes` at once take: a destination
/// made meanwhile overlaps the fill only with slots cached (a test run alone starts with none).
fn warm_slots(dev: &pinstage::Device, bytes: usize, uploads: usize) {
    let warm = values(DType::U8, bytes, 3);
    std::thread::scope(|sc| {
        for _ in 0..uploads {
            sc.spawn(|| {
                let buf = poisoned(dev, bytes);
                let stream = pinstage::Stream::new(dev).unwrap();
                copy_h2d(&buf.view_at(0, DType::U8, bytes), &warm, stream.handle()).unwrap();
            });
        }
    });
}

/// A made-meanwhile upload that made its destination: waits for its copy, returns its path.
fn landed(r: pinstage::Result<Option<(CopyPath, Option<pinstage::cuda::Event>)>>) -> CopyPath {
    let (path, ev) = r.unwrap().expect("the destination was made");
    ev.expect("a copy's event").synchronize().unwrap();
    path
}

/// `to_device`'s order for torch and cupy arrays: the destination is made by the calling thread
/// while the copy threads fill the first bounce slots (a pageable source), or first (pinned, or
/// no bounce slots cached);
/// every byte lands in it and nothing past it, and the maker runs once, on the calling thread.
#[rstest]
#[case::pageable_more_pieces_than_slots((60 << 20) + 4097, false, false)]
#[case::pageable_one_piece(4097, false, false)]
#[case::pinned(1 << 20, true, false)]
#[case::pageable_no_slots_cached((60 << 20) + 4097, false, true)]
#[ignore = "needs a CUDA GPU: run with --include-ignored (scripts/gpu-run does)"]
fn gpu_h2d_a_destination_made_meanwhile_gets_every_byte(
    #[case] bytes: usize,
    #[case] pinned: bool,
    #[case] cold: bool,
) {
    let Some(dev) = gpu_or_skip("gpu_h2d_a_destination_made_meanwhile_gets_every_byte") else {
        return;
    };
    let _serial = serial();
    let stream = pinstage::Stream::new(&dev).unwrap();
    if cold {
        // No slot cached: the array is made first, the slots allocated unlocked.
        pinstage::host::release_bounce_buffers();
    } else {
        warm_slots(&dev, bytes, 1);
    }
    let data = values(DType::U8, bytes, bytes as u64 + 31);
    let mut pin = pinned.then(|| PinnedBuffer::new(&dev, bytes, PinnedFlags::PORTABLE).unwrap());
    let src: &[u8] = match &mut pin {
        Some(p) => {
            p.as_mut_slice().copy_from_slice(&data);
            p.as_slice()
        }
        None => &data,
    };
    let me = std::thread::current().id();
    let inside = std::sync::atomic::AtomicBool::new(false);
    let (mut made, mut calls, mut on, mut unlocks) = (None, 0, None, 0);
    let mut make = || {
        calls += 1;
        on = Some(std::thread::current().id());
        assert!(!inside.load(Relaxed), "the maker ran inside `unlocked`");
        // The copy threads fill meanwhile: this maker takes its time.
        std::thread::sleep(std::time::Duration::from_millis(5));
        let buf = poisoned(&dev, bytes);
        let addr = buf.view_at(0, DType::U8, bytes).ptr();
        made = Some(buf);
        Some(addr)
    };
    let mut unlocked = |f: &mut (dyn FnMut() + Send)| {
        unlocks += 1;
        inside.store(true, Relaxed);
        f();
        inside.store(false, Relaxed);
    };
    // SAFETY: `src` lives until the event completed; the maker's address is `bytes` bytes of
    // the buffer it keeps in `made`.
    let path = landed(unsafe {
        pinstage::testing::start_h2d_made_meanwhile(
            &dev,
            src.as_ptr(),
            bytes,
            stream.handle(),
            &mut make,
            &mut unlocked,
        )
    });
    let want = if pinned {
        CopyPath::Pinned
    } else {
        CopyPath::Bounced
    };
    assert_eq!(path, want);
    assert_eq!(
        (calls, on),
        (1, Some(me)),
        "made once, on the calling thread"
    );
    // A pageable copy finishes inside `unlocked` (Python: the GIL released), a pinned one is
    // one call issued at once.
    assert_eq!(unlocks, usize::from(!pinned), "`unlocked` calls");
    check(made.as_ref().unwrap(), &data);
}

/// Two uploads at once whose makers each copy through the bounce slots themselves: no copy
/// thread waits for an address (pieces filled before it are left for the caller), so neither
/// maker's copy waits for the other upload's copy threads; all four copies land.
#[test]
#[ignore = "needs a CUDA GPU: run with --include-ignored (scripts/gpu-run does)"]
fn gpu_h2d_two_makers_copying_at_once_both_land() {
    let Some(dev) = gpu_or_skip("gpu_h2d_two_makers_copying_at_once_both_land") else {
        return;
    };
    let _serial = serial();
    let bytes = (96 << 20) + 77;
    warm_slots(&dev, bytes, 2);
    std::thread::scope(|sc| {
        for k in 0..2u64 {
            let dev = &dev;
            sc.spawn(move || {
                let stream = pinstage::Stream::new(dev).unwrap();
                let (outer, inner) = (
                    values(DType::U8, bytes, 70 + k),
                    values(DType::U8, bytes, 80 + k),
                );
                let (mut made, mut nested) = (None, None);
                let mut make = || {
                    std::thread::sleep(std::time::Duration::from_millis(20));
                    let n = poisoned(dev, bytes);
                    copy_h2d(&n.view_at(0, DType::U8, bytes), &inner, stream.handle()).unwrap();
                    nested = Some(n);
                    let buf = poisoned(dev, bytes);
                    let addr = buf.view_at(0, DType::U8, bytes).ptr();
                    made = Some(buf);
                    Some(addr)
                };
                // SAFETY: as in the tests above.
                landed(unsafe {
                    pinstage::testing::start_h2d_made_meanwhile(
                        dev,
                        outer.as_ptr(),
                        bytes,
                        stream.handle(),
                        &mut make,
                        &mut |f: &mut (dyn FnMut() + Send)| f(),
                    )
                });
                check(nested.as_ref().unwrap(), &inner);
                check(made.as_ref().unwrap(), &outer);
            });
        }
    });
}

/// Once `unlocked` returns, no copy thread reads the source any more: a source changed right
/// after it does not change what lands (the caller's wait for the copy threads removed, a
/// thread still filling its last unit shows as a wrong byte). Several rounds.
#[test]
#[ignore = "needs a CUDA GPU: run with --include-ignored (scripts/gpu-run does)"]
fn gpu_h2d_the_source_is_read_when_unlocked_returns() {
    let Some(dev) = gpu_or_skip("gpu_h2d_the_source_is_read_when_unlocked_returns") else {
        return;
    };
    let _serial = serial();
    let stream = pinstage::Stream::new(&dev).unwrap();
    let bytes = 96 << 20;
    warm_slots(&dev, bytes, 1);
    for round in 0..3u64 {
        let data = values(DType::U8, bytes, 40 + round);
        let mut src = data.clone();
        let tail = src[bytes - (1 << 20)..].as_mut_ptr();
        let buf = poisoned(&dev, bytes);
        let mut make = || Some(buf.view_at(0, DType::U8, bytes).ptr());
        let mut unlocked = |f: &mut (dyn FnMut() + Send)| {
            f();
            // SAFETY: the source's last MiB, which no copy thread reads once `f` returned.
            unsafe { std::ptr::write_bytes(tail, 0x11, 1 << 20) };
        };
        // SAFETY: `src` outlives the call; the address is `bytes` bytes of `buf`.
        landed(unsafe {
            pinstage::testing::start_h2d_made_meanwhile(
                &dev,
                src.as_ptr(),
                bytes,
                stream.handle(),
                &mut make,
                &mut unlocked,
            )
        });
        check(&buf, &data);
        drop(src);
    }
}

/// A maker that starts a pageable copy of its own (Python code run by the framework's
/// allocator could) while the copy threads fill the first round of slots: no copy thread waits
/// for the address, so the maker's copy finds the pool, and both copies land.
#[test]
#[ignore = "needs a CUDA GPU: run with --include-ignored (scripts/gpu-run does)"]
fn gpu_h2d_a_maker_may_copy_through_the_bounce_slots_itself() {
    let Some(dev) = gpu_or_skip("gpu_h2d_a_maker_may_copy_through_the_bounce_slots_itself") else {
        return;
    };
    let _serial = serial();
    let stream = pinstage::Stream::new(&dev).unwrap();
    // Far more pieces than slots: the copy threads fill the first round and leave the rest.
    let bytes = (96 << 20) + 333;
    warm_slots(&dev, bytes, 1);
    let (outer, inner) = (values(DType::U8, bytes, 5), values(DType::U8, bytes, 6));
    let (mut made, mut nested) = (None, None);
    let mut make = || {
        std::thread::sleep(std::time::Duration::from_millis(20));
        let n = poisoned(&dev, bytes);
        let path = copy_h2d(&n.view_at(0, DType::U8, bytes), &inner, stream.handle()).unwrap();
        assert_eq!(path, CopyPath::Bounced);
        nested = Some(n);
        let buf = poisoned(&dev, bytes);
        let addr = buf.view_at(0, DType::U8, bytes).ptr();
        made = Some(buf);
        Some(addr)
    };
    // SAFETY: as in the test above.
    landed(unsafe {
        pinstage::testing::start_h2d_made_meanwhile(
            &dev,
            outer.as_ptr(),
            bytes,
            stream.handle(),
            &mut make,
            &mut |f: &mut (dyn FnMut() + Send)| f(),
        )
    });
    check(nested.as_ref().unwrap(), &inner);
    check(made.as_ref().unwrap(), &outer);
}

/// A maker that gives up, or panics, while the copy threads fill: nothing is issued, the call
/// returns (no copy thread waits for the address forever), and the next copy goes through.
#[test]
#[ignore = "needs a CUDA GPU: run with --include-ignored (scripts/gpu-run does)"]
fn gpu_h2d_a_destination_given_up_issues_nothing() {
    let Some(dev) = gpu_or_skip("gpu_h2d_a_destination_given_up_issues_nothing") else {
        return;
    };
    let _serial = serial();
    let stream = pinstage::Stream::new(&dev).unwrap();
    let bytes = (60 << 20) + 12345;
    warm_slots(&dev, bytes, 1);
    let data = values(DType::U8, bytes, 93);
    // SAFETY: `data` outlives the call; no address is given.
    let r = unsafe {
        pinstage::testing::start_h2d_made_meanwhile(
            &dev,
            data.as_ptr(),
            bytes,
            stream.handle(),
            &mut || {
                std::thread::sleep(std::time::Duration::from_millis(5));
                None
            },
            &mut |f: &mut (dyn FnMut() + Send)| f(),
        )
    }
    .unwrap();
    assert!(r.is_none(), "a copy without a destination");
    let panicked = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        // SAFETY: as above.
        unsafe {
            pinstage::testing::start_h2d_made_meanwhile(
                &dev,
                data.as_ptr(),
                bytes,
                stream.handle(),
                &mut || -> Option<u64> { panic!("the maker failed") },
                &mut |f: &mut (dyn FnMut() + Send)| f(),
            )
        }
    }));
    assert!(panicked.is_err(), "the maker's panic was lost");
    stream.synchronize().unwrap();
    let buf = poisoned(&dev, bytes);
    let dst = buf.view_at(0, DType::U8, bytes);
    assert_eq!(
        copy_h2d(&dst, &data, stream.handle()).unwrap(),
        CopyPath::Bounced
    );
    check(&buf, &data);
}

fn read_fresh(dev: &pinstage::Device, mem: &pinstage::h2d::FreshMem) -> Vec<u8> {
    mem.ready().synchronize().unwrap();
    // SAFETY: `mem` holds `len` bytes of this device, filled (ready) and alive while we read.
    let view = unsafe {
        DeviceView::from_meta(TensorMeta::cuda_1d(
            dev.ordinal(),
            mem.ptr(),
            DType::U8,
            mem.len(),
        ))
    };
    let mut out = vec![POISON; mem.len()];
    copy_d2h(&view, &mut out, StreamHandle::LEGACY).unwrap();
    out
}

/// `to_device` from pageable and pinned memory; the pool's counts follow the results; memory a
/// released result held is reused for a later one, poisoned first so a copy that did not happen
/// shows.
#[test]
#[ignore = "needs a CUDA GPU: run with --include-ignored (scripts/gpu-run does)"]
fn gpu_to_device_fills_fresh_memory_and_releases_it() {
    let Some(dev) = gpu_or_skip("gpu_to_device_fills_fresh_memory_and_releases_it") else {
        return;
    };
    let _serial = serial();
    let base = pinstage::h2d::device_pool_stats(&dev).unwrap();
    for bytes in [0usize, 1, 4097, (9 << 20) + 3] {
        // Poison: a released result of the same size first, so the pool hands its memory back.
        let poison = pinstage::h2d::to_device(&vec![POISON; bytes], &dev).unwrap();
        assert_eq!(read_fresh(&dev, &poison), vec![POISON; bytes]);
        let poisoned_at = poison.ptr();
        drop(poison);
        let data = values(DType::U8, bytes, bytes as u64 + 5);
        let mem = pinstage::h2d::to_device(&data, &dev).unwrap();
        assert_eq!(mem.ptr(), poisoned_at, "the released memory is reused");
        assert_eq!(mem.len(), bytes);
        assert_eq!(mem.is_empty(), bytes == 0);
        assert!(
            format!("{mem:?}").contains(&format!("len: {bytes}")),
            "{mem:?} names its length"
        );
        assert_eq!(mem.ptr() % 256, 0, "pool memory is 256-byte aligned");
        assert!(read_fresh(&dev, &mem) == data, "pageable: values differ");
        let s = pinstage::h2d::device_pool_stats(&dev).unwrap();
        assert_eq!(s.in_use_arrays, base.in_use_arrays + 1);
        assert_eq!(s.in_use_bytes, base.in_use_bytes + bytes as u64);
        assert!(s.outstanding_bytes >= bytes as u64);

        let other = values(DType::U8, bytes, bytes as u64 + 6);
        let mut pinned = PinnedBuffer::new(&dev, bytes.max(1), PinnedFlags::PORTABLE).unwrap();
        pinned.as_mut_slice()[..bytes].copy_from_slice(&other);
        let mem2 = pinstage::h2d::to_device(&pinned.as_slice()[..bytes], &dev).unwrap();
        // A pinned source is the caller's again once `to_device` returned: its copy completed.
        pinned.as_mut_slice().fill(POISON);
        assert!(read_fresh(&dev, &mem2) == other, "pinned: values differ");
        drop((mem, mem2));
    }
    let s = pinstage::h2d::device_pool_stats(&dev).unwrap();
    assert_eq!(
        (s.in_use_arrays, s.in_use_bytes),
        (base.in_use_arrays, base.in_use_bytes)
    );
    let reserved = s.outstanding_bytes;
    assert!(
        reserved > 0,
        "the pool holds the released memory until trimmed"
    );
    pinstage::h2d::trim_device_pools().unwrap();
    let s = pinstage::h2d::device_pool_stats(&dev).unwrap();
    assert!(
        s.outstanding_bytes < reserved,
        "trim gave the memory back: {s:?}, {reserved} before"
    );
}

/// 100,000 results made and dropped: none stays counted and the pool does not grow.
#[test]
#[ignore = "needs a CUDA GPU: run with --include-ignored (scripts/gpu-run does)"]
fn gpu_to_device_many_results_leave_nothing() {
    let Some(dev) = gpu_or_skip("gpu_to_device_many_results_leave_nothing") else {
        return;
    };
    let _serial = serial();
    let base = pinstage::h2d::device_pool_stats(&dev).unwrap();
    let pinned_before = pinstage::host::live_pinned_bytes();
    let data = values(DType::U8, 1000, 3);
    let mut peak = 0;
    for i in 0..100_000u32 {
        // The checked results get values of their own: the pool hands back the same block,
        // so a copy that did nothing would still show the previous values.
        let check = i % 10_000 == 0;
        let fresh = check.then(|| values(DType::U8, 1000, u64::from(i) + 4));
        let src = fresh.as_ref().unwrap_or(&data);
        let mem = pinstage::h2d::to_device(src, &dev).unwrap();
        if check {
            assert!(read_fresh(&dev, &mem) == *src);
            peak = peak.max(
                pinstage::h2d::device_pool_stats(&dev)
                    .unwrap()
                    .outstanding_bytes,
            );
        }
    }
    let s = pinstage::h2d::device_pool_stats(&dev).unwrap();
    assert_eq!(
        (s.in_use_arrays, s.in_use_bytes),
        (base.in_use_arrays, base.in_use_bytes)
    );
    assert!(
        peak <= base.outstanding_bytes + (64 << 20),
        "the pool grew to {peak} bytes"
    );
    // The bounce slots are a cache made once; nothing else pinned stays.
    pinstage::host::release_bounce_buffers();
    assert!(pinstage::host::live_pinned_bytes() <= pinned_before);
}
