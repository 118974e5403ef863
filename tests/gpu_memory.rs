//! GPU tests that fill the device's memory: alone in their binary (cargo runs test binaries one
//! after another), so no other test's allocation meets a full device.

mod common;

use std::time::Duration;

use common::{gpu_or_skip, stall};
use pinstage::testing::{DeviceBuffer, device_free_bytes};
use pinstage::{DType, StepLayout, StepStager, Stream};

/// Memory pinstage let go while the device is busy is back with the driver only once the reaper
/// freed it, behind the busy work: an allocation that needs it waits for that free and succeeds
/// instead of failing for memory. The device is filled first, so that the second stager's arena
/// fits only in the first one's memory (the control, checked before the drop); that the build
/// waited for the stall is checked as it returns.
#[test]
#[ignore = "needs a CUDA GPU: run with --include-ignored (scripts/gpu-run does)"]
fn gpu_memory_let_go_behind_a_busy_device_is_allocated_again() {
    let Some(dev) = gpu_or_skip("gpu_memory_let_go_behind_a_busy_device_is_allocated_again") else {
        return;
    };
    const ARENA: usize = 64 << 20;
    let busy = Stream::new(&dev).unwrap();
    let other = Stream::new(&dev).unwrap();
    let marker = pinstage::cuda::Event::new(&dev).unwrap();
    let layout = StepLayout::builder()
        .field("a", DType::U32, &[ARENA / 4])
        .build()
        .unwrap();
    let build = || StepStager::builder(&layout).depth(2).build();
    pinstage::host::wait_for_frees();
    // The most the driver gives in one piece (what it reports free, or less), less one and a
    // half arenas.
    let mut most = device_free_bytes(&dev).unwrap();
    loop {
        match DeviceBuffer::new(&dev, most) {
            Ok(b) => break drop(b),
            Err(_) if most > 1 << 30 => most -= 16 << 20,
            Err(e) => panic!("the device cannot be filled ({most} bytes): {e}"),
        }
    }
    let filler = DeviceBuffer::new(&dev, most - ARENA - ARENA / 2).unwrap();
    let first = build().unwrap();
    let left = device_free_bytes(&dev).unwrap();
    assert!(
        left < ARENA,
        "{left} bytes free beside the first arena: the second fits anyway, the test proves nothing"
    );
    let go = stall(&busy);
    marker.record(busy.handle()).unwrap();
    let release = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(100));
        drop(go);
    });
    let t0 = std::time::Instant::now();
    drop(first);
    let second = build();
    let took = t0.elapsed();
    // Built only once the reaper freed the first arena, after the stall: the wait path ran.
    let after_the_stall = marker.query().unwrap();
    release.join().unwrap();
    let second = second.unwrap_or_else(|e| {
        panic!("the arena let go was not allocated again ({took:?}, {left} bytes free): {e}")
    });
    println!("the second stager: built in {took:?} (stall of 100 ms; {left} bytes were free)");
    assert!(
        after_the_stall,
        "built in {took:?} with the stall still holding: not through the wait"
    );
    // It works: a step commits into the new arena.
    let mut s = second.step().unwrap();
    let v: Vec<u32> = (0..1024).map(|i| i * 13 + 7).collect();
    s.put("a", &v).unwrap();
    s.commit(other.handle()).unwrap();
    other.synchronize().unwrap();
    assert!(second.arena_ptr().is_some());
    drop(second);
    drop(filler);
    pinstage::host::wait_for_frees();
}
