//! A GPU test that needs a process of its own: it lets go of every `Device`, so that no other
//! test's handle keeps the device's primary context alive.

mod common;

use common::{POISON, gpu_or_skip, poisoned, read, view};
use pinstage::host::{CopyPath, PinnedFlags};
use pinstage::{DType, Device, PinnedBuffer, Stream};

/// A device's host pool outlives the `Device` handles that made it: with every handle dropped
/// (the primary context released but for what the pool keeps), a new handle's `alloc` still
/// gets a pool block, and a copy through it lands. Without the pool keeping its context, the
/// pool's stream died with the context (run 2026-12-06-h100-f: a segfault at that allocation).
#[test]
#[ignore = "needs a CUDA GPU: run with --include-ignored (scripts/gpu-run does)"]
fn gpu_a_host_pool_outlives_the_device_handles_that_made_it() {
    let Some(dev) = gpu_or_skip("gpu_a_host_pool_outlives_the_device_handles_that_made_it") else {
        return;
    };
    let first = PinnedBuffer::alloc(&dev, 4 << 20, PinnedFlags::PORTABLE).unwrap();
    if !first.is_pooled() {
        let version = pinstage::cuda::probe().unwrap().driver_version;
        assert!(
            version < 12060,
            "driver {version} makes host pools, yet: {first:?}"
        );
        println!("SKIP-REASON: driver {version} makes no host memory pools (12.6+)");
        return;
    }
    drop(first);
    pinstage::host::wait_for_frees();
    drop(dev);
    // No handle left here: the context lives on only if the pool keeps it.
    let dev = Device::new(0).unwrap();
    let mut block = PinnedBuffer::alloc(&dev, 4 << 20, PinnedFlags::PORTABLE).unwrap();
    assert!(block.is_pooled(), "{block:?}");
    let stream = Stream::new(&dev).unwrap();
    let buf = poisoned(&dev, DType::U32, 1024);
    let dst = view(&buf, DType::U32, 1024);
    let v: Vec<u32> = (0..1024).map(|k| (k * 7 + 3) | 1).collect();
    block.typed_mut::<u32>().unwrap()[..1024].copy_from_slice(&v);
    let path = pinstage::copy_h2d(&dst, &block.as_slice()[..4096], stream.handle()).unwrap();
    assert_eq!(path, CopyPath::Pinned);
    assert_eq!(bytemuck::cast_slice::<u8, u32>(&read(&buf)[..4096]), &v[..]);
    block.as_mut_slice()[..4096].fill(POISON);
    let back = pinstage::copy_d2h(&dst, &mut block.as_mut_slice()[..4096], stream.handle());
    assert_eq!(back.unwrap(), CopyPath::Pinned);
    assert_eq!(&block.typed::<u32>().unwrap()[..1024], &v[..]);
}
