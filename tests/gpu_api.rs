//! The public API that the other GPU tests do not reach: the probe, contexts, events, typed
//! views of pinned blocks, the pool's budget, the bounce cache, and the driver's errors
//! (including the stager's release of a slot when the driver refuses a copy).

mod common;

use common::{POISON, Put, gpu_or_skip, poisoned, read};
use pinstage::dlpack::TensorMeta;
use pinstage::host::PinnedFlags;
use pinstage::host::PinnedPool;
use pinstage::testing::{DeviceBuffer, current_context};
use pinstage::{DType, DeviceView, Error, PinnedBuffer, Stream};

/// These tests count process-wide pinned bytes: they run one at a time.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

#[test]
#[ignore = "needs a CUDA GPU: run with --include-ignored (scripts/gpu-run does)"]
fn gpu_probe_and_device_enter() {
    let Some(dev) = gpu_or_skip("gpu_probe_and_device_enter") else {
        return;
    };
    let _serial = serial();
    let p = pinstage::cuda::probe().unwrap();
    assert!(p.device_count >= 1 && p.driver_version >= 12080, "{p:?}");
    assert_eq!(pinstage::cuda::device_count().unwrap(), p.device_count);
    assert!(pinstage::cuda::cuda_available());
    std::thread::spawn(move || {
        assert_eq!(
            current_context().unwrap(),
            0,
            "a fresh thread has no context"
        );
        {
            let cur = dev.enter().unwrap();
            assert_ne!(current_context().unwrap(), 0);
            assert_eq!(cur.device(), &dev);
            let again = dev.enter().unwrap(); // already current: nothing pushed
            drop(again);
            assert_ne!(current_context().unwrap(), 0);
        }
        assert_eq!(
            current_context().unwrap(),
            0,
            "the guard restored the thread's context"
        );
    })
    .join()
    .unwrap();
    assert!(matches!(
        pinstage::Device::new(p.device_count),
        Err(Error::NoSuchDevice { .. })
    ));
}

/// The node sysfs gives a PCI device (`domain:bus:device.function` as nvidia-smi prints it):
/// -1 (no node) reads as None.
fn sysfs_node(bus: &str) -> Option<Option<u32>> {
    let (domain, rest) = bus.trim().split_once(':')?;
    let domain = u32::from_str_radix(domain, 16).ok()?;
    let path = format!(
        "/sys/bus/pci/devices/{domain:04x}:{}/numa_node",
        rest.to_ascii_lowercase()
    );
    let node: i64 = std::fs::read_to_string(path).ok()?.trim().parse().ok()?;
    Some(u32::try_from(node).ok())
}

/// The device's NUMA node is the one sysfs gives its PCI device (-1: None). Where cuda:0 is
/// known to be nvidia-smi's GPU 0 (the only GPU, no CUDA_VISIBLE_DEVICES), exactly that
/// device's node; elsewhere (several GPUs, whose orders may differ; no nvidia-smi) one of the
/// NVIDIA devices' nodes.
#[test]
#[ignore = "needs a CUDA GPU: run with --include-ignored (scripts/gpu-run does)"]
fn gpu_numa_node_of_the_device() {
    let Some(dev) = gpu_or_skip("gpu_numa_node_of_the_device") else {
        return;
    };
    let node = dev.numa_node();
    let buses: Vec<String> = std::process::Command::new("nvidia-smi")
        .args(["--query-gpu=pci.bus_id", "--format=csv,noheader"])
        .output()
        .map(|o| {
            String::from_utf8_lossy(&o.stdout)
                .lines()
                .map(|l| l.trim().to_string())
                .filter(|l| !l.is_empty())
                .collect()
        })
        .unwrap_or_default();
    let nodes: Vec<Option<u32>> = buses.iter().filter_map(|b| sysfs_node(b)).collect();
    eprintln!("cuda:0 numa_node {node:?}; nvidia-smi's GPUs {buses:?} have nodes {nodes:?}");
    let only_one = buses.len() == 1
        && pinstage::cuda::device_count().unwrap() == 1
        && std::env::var_os("CUDA_VISIBLE_DEVICES").is_none();
    if only_one && nodes.len() == 1 {
        assert_eq!(node, nodes[0], "the device's node is not its sysfs node");
    } else if !nodes.is_empty() {
        assert!(nodes.contains(&node), "{node:?} is none of {nodes:?}");
    } else {
        // No nvidia-smi or no sysfs: the NVIDIA PCI devices sysfs lists (vendor 0x10de).
        let mut all = Vec::new();
        for e in std::fs::read_dir("/sys/bus/pci/devices")
            .into_iter()
            .flatten()
            .flatten()
        {
            let read = |f: &str| std::fs::read_to_string(e.path().join(f)).unwrap_or_default();
            if read("vendor").trim() == "0x10de" {
                all.push(u32::try_from(read("numa_node").trim().parse::<i64>().unwrap_or(-1)).ok());
            }
        }
        assert!(
            all.is_empty() || all.contains(&node),
            "{node:?} is none of {all:?}"
        );
    }
}

#[test]
#[ignore = "needs a CUDA GPU: run with --include-ignored (scripts/gpu-run does)"]
fn gpu_events_query_and_wait_on() {
    let Some(dev) = gpu_or_skip("gpu_events_query_and_wait_on") else {
        return;
    };
    let _serial = serial();
    // Everything is allocated before the stall: an allocation (or a free on pinstage's reaper)
    // may wait for the whole device, and the stall waits for this thread. `common::stall` also
    // waits for the reaper's frees first and bounds the stall (a failure, not a hang).
    let a = Stream::new(&dev).unwrap();
    let b = Stream::new(&dev).unwrap();
    let ev = pinstage::cuda::Event::new(&dev).unwrap();
    let done = pinstage::cuda::Event::new(&dev).unwrap();
    let buf = poisoned(&dev, DType::U8, 64);
    let st = common::stager::<u8>(0, 64, 2).unwrap();
    assert!(ev.query().unwrap(), "never recorded: complete");
    let stall = common::stall(&a);
    ev.record(a.handle()).unwrap();
    assert!(!ev.query().unwrap(), "recorded behind a stalled stream");
    // b waits for the event on the device: a copy on b lands only after a is released.
    ev.wait_on(b.handle()).unwrap();
    st.put(
        &buf.view_at(0, DType::U8, 64),
        &[9; 64],
        None,
        None,
        b.handle(),
    )
    .unwrap();
    done.record(b.handle()).unwrap();
    std::thread::sleep(std::time::Duration::from_millis(50));
    assert!(!done.query().unwrap(), "b's copy waits for a's event");
    stall.release();
    done.synchronize().unwrap();
    assert!(ev.query().unwrap());
    assert!(read(&buf)[..64].iter().all(|&x| x == 9));
}

#[test]
#[ignore = "needs a CUDA GPU: run with --include-ignored (scripts/gpu-run does)"]
fn gpu_pinned_typed_views_pool_budget_and_bounce_cache() {
    let Some(dev) = gpu_or_skip("gpu_pinned_typed_views_pool_budget_and_bounce_cache") else {
        return;
    };
    let _serial = serial();
    // Memory the tests before this one let go leaves the count on pinstage's reaper thread.
    pinstage::host::wait_for_frees();
    let before = pinstage::host::live_pinned_bytes();
    let mut b = PinnedBuffer::new(&dev, 4096, PinnedFlags::PORTABLE).unwrap();
    assert!(pinstage::host::live_pinned_bytes() >= before + 4096);
    assert!(pinstage::host::is_pinned(b.as_ptr()));
    assert!(!pinstage::host::is_pinned(vec![0u8; 64].as_ptr()));
    b.typed_mut::<u32>().unwrap()[5] = 0xABCD_1234;
    assert_eq!(b.typed::<u32>().unwrap()[5], 0xABCD_1234);
    assert_eq!(b.typed::<u64>().unwrap().len(), 512);
    let mut odd = PinnedBuffer::new(&dev, 6, PinnedFlags::PORTABLE).unwrap();
    assert!(matches!(
        odd.typed::<u32>(),
        Err(Error::BadCast { bytes: 6, .. })
    ));
    assert!(matches!(odd.typed_mut::<u64>(), Err(Error::BadCast { .. })));
    drop((b, odd));
    assert_eq!(pinstage::host::live_pinned_bytes(), before);

    let pool = PinnedPool::new(&dev, 1 << 20);
    let blocks: Vec<_> = (0..3).map(|_| pool.acquire(200 << 10).unwrap()).collect();
    drop(blocks);
    let cached = pool.stats().pooled_bytes;
    assert!(cached > 0);
    pool.set_budget(pinstage::host::size_class(200 << 10)); // room for one cached block
    assert_eq!(
        pool.stats().pooled_bytes,
        pinstage::host::size_class(200 << 10)
    );
    assert!(pool.stats().evictions >= 2);
    pool.set_budget(0);
    assert_eq!(pool.stats().pooled_bytes, 0);
    assert!(
        !pool.acquire(10).unwrap().is_pinned(),
        "past a budget of 0: pageable"
    );

    // A pageable D2H fills the bounce cache; releasing it frees the pinned bounce buffers.
    pinstage::host::release_bounce_buffers();
    let src = DeviceBuffer::new(&dev, 1 << 20).unwrap();
    src.upload(0, &vec![3u8; 1 << 20]).unwrap();
    let mut out = vec![0u8; 1 << 20];
    let path = pinstage::copy_d2h(
        &src.view(DType::U8),
        &mut out,
        pinstage::StreamHandle::LEGACY,
    )
    .unwrap();
    assert_eq!(path, pinstage::host::CopyPath::Bounced);
    assert!(out.iter().all(|&x| x == 3));
    pinstage::host::wait_for_frees();
    let with_cache = pinstage::host::live_pinned_bytes();
    pinstage::host::release_bounce_buffers();
    // The bounce buffers are freed by the reaper thread: wait for it before counting.
    pinstage::host::wait_for_frees();
    assert_eq!(
        with_cache - pinstage::host::live_pinned_bytes(),
        pinstage::host::BOUNCE_DEPTH * pinstage::host::BOUNCE_CHUNK
    );
}

/// The driver's refusals come back as `Error::Driver` naming the call; a stager whose copy the
/// driver refuses releases the slot (a ring of 1 still works) and writes nothing.
#[test]
#[ignore = "needs a CUDA GPU: run with --include-ignored (scripts/gpu-run does)"]
fn gpu_driver_errors_are_typed_and_release_the_slot() {
    let Some(dev) = gpu_or_skip("gpu_driver_errors_are_typed_and_release_the_slot") else {
        return;
    };
    let _serial = serial();
    match DeviceBuffer::new(&dev, 1 << 50) {
        Err(Error::Driver(e)) => {
            assert_eq!(e.call(), "cuMemAlloc");
            assert!(e.name().contains("OUT_OF_MEMORY"), "{e}");
        }
        other => panic!("a 1 PiB device allocation: {:?}", other.map(|b| b.len())),
    }
    let st = common::stager::<u32>(0, 64, 1).unwrap();
    // SAFETY: an address no allocation holds; the driver refuses the copy before any DMA.
    let bogus = unsafe { DeviceView::from_meta(TensorMeta::cuda_1d(0, 0x10, DType::U32, 64)) };
    let err = st
        .put(&bogus, &[1; 64], None, None, pinstage::StreamHandle::LEGACY)
        .unwrap_err();
    assert!(matches!(err, Error::Driver(_)), "{err}");
    assert_eq!(st.stats().copies, 0);
    // The one slot was released: the next copy claims it and lands.
    let buf = std::sync::Arc::new(poisoned(&dev, DType::U32, 64));
    let (tx, rx) = std::sync::mpsc::channel();
    let st = std::sync::Arc::new(st);
    let (st2, buf2) = (st.clone(), buf.clone());
    // Detached: if the slot were left claimed, this copy would spin forever and the test must
    // fail, not hang.
    std::thread::spawn(move || {
        let dst = buf2.view_at(0, DType::U32, 64);
        let r = st2.put(
            &dst,
            &[7; 10],
            Some(8),
            None,
            pinstage::StreamHandle::LEGACY,
        );
        tx.send(r.is_ok()).unwrap();
    });
    let ok = rx
        .recv_timeout(std::time::Duration::from_secs(10))
        .expect("the slot was left claimed: the next copy hangs");
    assert!(ok);
    let out = read(&buf);
    let got: &[u32] = bytemuck::cast_slice(&out[..256]);
    assert!(got[..10].iter().all(|&x| x == 7) && got[10..].iter().all(|&x| x == 8));
    assert!(out[256..].iter().all(|&b| b == POISON));
}
