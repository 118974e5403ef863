//! Device memory, page-locked host memory and pointer attributes.

use super::*;

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemAlloc_v2(out: *mut u64, bytes: usize) -> CUresult {
    called(c"cuMemAlloc_v2");
    let dev = tri!(with_ctx());
    tri!(capture_guard());
    let p = tri!(alloc_device(&mut state(), bytes, dev, None));
    unsafe { *out = p };
    SUCCESS
}

#[unsafe(no_mangle)]
pub extern "C" fn cuMemFree_v2(ptr: u64) -> CUresult {
    called(c"cuMemFree_v2");
    tri!(with_ctx());
    tri!(capture_guard());
    sync_all();
    tri!(free_at(&mut state(), ptr, Kind::Device));
    SUCCESS
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemGetInfo_v2(free: *mut usize, total: *mut usize) -> CUresult {
    called(c"cuMemGetInfo_v2");
    tri!(with_ctx());
    let used = state().device_bytes;
    unsafe {
        *free = drv().total - used;
        *total = drv().total;
    }
    SUCCESS
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemHostAlloc(out: *mut Ptr, bytes: usize, _flags: c_uint) -> CUresult {
    called(c"cuMemHostAlloc");
    let dev = tri!(with_ctx());
    tri!(capture_guard());
    if bytes == 0 {
        return INVALID_VALUE;
    }
    let Some((p, owned)) = zeroed(bytes, 4096) else {
        return OUT_OF_MEMORY;
    };
    pattern(p, bytes);
    state().allocs.insert(
        p as u64,
        Alloc {
            len: bytes,
            kind: Kind::Host,
            owned: Some(owned),
            read_only: false,
            device: dev,
            pool: None,
        },
    );
    unsafe { *out = p.cast() };
    SUCCESS
}

#[unsafe(no_mangle)]
pub extern "C" fn cuMemFreeHost(p: Ptr) -> CUresult {
    called(c"cuMemFreeHost");
    tri!(with_ctx());
    tri!(capture_guard());
    // Freeing page-locked memory waits for the device's queued work, as the driver does.
    sync_all();
    tri!(free_at(&mut state(), p as u64, Kind::Host));
    SUCCESS
}

#[unsafe(no_mangle)]
pub extern "C" fn cuMemHostRegister_v2(p: Ptr, bytes: usize, flags: c_uint) -> CUresult {
    called(c"cuMemHostRegister_v2");
    let dev = tri!(with_ctx());
    tri!(capture_guard());
    if p.is_null() || bytes == 0 {
        return INVALID_VALUE;
    }
    let (a, b) = (p as u64, p as u64 + bytes as u64);
    let mut st = state();
    let overlaps = st
        .allocs
        .range(..b)
        .next_back()
        .is_some_and(|(&s, al)| s + al.len as u64 > a);
    if overlaps {
        return ALREADY_REGISTERED;
    }
    st.allocs.insert(
        a,
        Alloc {
            len: bytes,
            kind: Kind::Host,
            owned: None,
            read_only: flags & HOSTREGISTER_READ_ONLY != 0,
            device: dev,
            pool: None,
        },
    );
    SUCCESS
}

#[unsafe(no_mangle)]
pub extern "C" fn cuMemHostUnregister(p: Ptr) -> CUresult {
    called(c"cuMemHostUnregister");
    tri!(with_ctx());
    tri!(capture_guard());
    sync_all();
    let mut st = state();
    match st.allocs.get(&(p as u64)) {
        Some(a) if a.kind == Kind::Host && a.owned.is_none() => {
            st.allocs.remove(&(p as u64));
            SUCCESS
        }
        _ => NOT_REGISTERED,
    }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemHostGetDevicePointer_v2(
    out: *mut u64,
    p: Ptr,
    flags: c_uint,
) -> CUresult {
    called(c"cuMemHostGetDevicePointer_v2");
    tri!(with_ctx());
    if flags != 0 {
        return INVALID_VALUE;
    }
    match state().find(p as u64, 1) {
        Some((_, a)) if a.kind == Kind::Host => {
            unsafe { *out = p as u64 };
            SUCCESS
        }
        _ => INVALID_VALUE,
    }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuPointerGetAttributes(
    n: c_uint,
    attrs: *const c_uint,
    data: *mut *mut c_void,
    ptr: u64,
) -> CUresult {
    called(c"cuPointerGetAttributes");
    tri!(ready());
    let st = state();
    let found = st.find(ptr, 1);
    for i in 0..n as usize {
        let (attr, out) = unsafe { (*attrs.add(i), *data.add(i)) };
        unsafe {
            match attr {
                // CONTEXT
                1 => {
                    *out.cast::<Ptr>() =
                        found.map_or(std::ptr::null_mut(), |(_, a)| ctx_handle(a.device))
                }
                // MEMORY_TYPE
                2 => {
                    *out.cast::<u32>() = found.map_or(0, |(_, a)| match a.kind {
                        Kind::Device => MEMORYTYPE_DEVICE,
                        Kind::Host => MEMORYTYPE_HOST,
                    })
                }
                // DEVICE_POINTER, HOST_POINTER
                3 => *out.cast::<u64>() = found.map_or(0, |_| ptr),
                4 => {
                    *out.cast::<u64>() =
                        found.map_or(0, |(_, a)| if a.kind == Kind::Host { ptr } else { 0 })
                }
                // IS_MANAGED
                8 => *out.cast::<u32>() = 0,
                // DEVICE_ORDINAL
                9 => *out.cast::<i32>() = found.map_or(-2, |(_, a)| a.device),
                // RANGE_START_ADDR, RANGE_SIZE
                11 => *out.cast::<u64>() = found.map_or(0, |(s, _)| s),
                12 => *out.cast::<usize>() = found.map_or(0, |(_, a)| a.len),
                _ => return NOT_SUPPORTED,
            }
        }
    }
    SUCCESS
}

/// A block this driver allocated: its start and layout (the address handed out lies inside).
pub(crate) struct Owned {
    base: usize,
    layout: Layout,
}

/// `bytes` zeroed bytes aligned to `align`, and what frees them. Allocated at malloc's own
/// alignment and aligned inside (calloc hands large blocks out as fresh zero pages, untouched;
/// std's zeroed allocation at a larger alignment writes every byte: seconds for gigabytes).
pub(crate) fn zeroed(bytes: usize, align: usize) -> Option<(*mut u8, Owned)> {
    let layout = Layout::from_size_align(bytes.checked_add(align)?, 16).ok()?;
    // SAFETY: a non-zero size.
    let base = unsafe { std::alloc::alloc_zeroed(layout) };
    if base.is_null() {
        return None;
    }
    let p = base.wrapping_add(base.align_offset(align));
    Some((
        p,
        Owned {
            base: base as usize,
            layout,
        },
    ))
}

/// Frees a block of [`zeroed`].
pub(crate) fn release(o: Owned) {
    // SAFETY: allocated by `zeroed` with this layout, released once (its table entry is gone).
    unsafe { std::alloc::dealloc(o.base as *mut u8, o.layout) };
}
