//! Host memory given back: a counting global allocator (this binary only, one test, so nothing
//! else allocates meanwhile) sees every byte a step stager took on the host returned when it is
//! dropped. Without a driver its slots and arena are plain host memory (`AlignedBytes`); with
//! one, the slots are pinned (freed by the reaper thread) and only bookkeeping is counted here.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicIsize, Ordering};

use pinstage::{DType, StepLayout, StepStager};

/// Net bytes allocated through the global allocator.
static NET: AtomicIsize = AtomicIsize::new(0);

struct Counting;

// SAFETY: forwards to `System`, counting sizes.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        NET.fetch_add(layout.size() as isize, Ordering::Relaxed);
        // SAFETY: the caller's contract.
        unsafe { System.alloc(layout) }
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        NET.fetch_add(layout.size() as isize, Ordering::Relaxed);
        // SAFETY: the caller's contract.
        unsafe { System.alloc_zeroed(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        NET.fetch_sub(layout.size() as isize, Ordering::Relaxed);
        // SAFETY: the caller's contract.
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        NET.fetch_add(
            new_size as isize - layout.size() as isize,
            Ordering::Relaxed,
        );
        // SAFETY: the caller's contract.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

/// 20 step stagers of ~1.1 MiB of slots and arena each, made, used and dropped: the host bytes
/// in use afterwards are those of before (within 64 KiB of lazily made statics).
#[test]
fn dropped_step_stagers_give_their_host_memory_back() {
    let layout = StepLayout::builder()
        .field("ids", DType::I32, &[16384])
        .field("table", DType::I32, &[256, 64])
        .build()
        .unwrap();
    let cycle = || {
        let st = StepStager::builder(&layout).depth(4).build().unwrap();
        let mut s = st.step().unwrap();
        s.put("ids", &[7i32; 100]).unwrap();
        s.commit(pinstage::StreamHandle::LEGACY).unwrap();
        drop(st);
        pinstage::host::wait_for_frees();
    };
    cycle(); // statics made on first use (the driver's loader, the reaper thread)
    let before = NET.load(Ordering::Relaxed);
    for _ in 0..20 {
        cycle();
    }
    let grew = NET.load(Ordering::Relaxed) - before;
    assert!(
        grew < 64 << 10,
        "{grew} bytes of host memory still held after 20 stagers were dropped"
    );
}
