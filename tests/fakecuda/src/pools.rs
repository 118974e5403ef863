//! Memory pools: stream-ordered allocation, freed blocks reused and trimmed.

use super::*;

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemPoolCreate(out: *mut Ptr, props: *const c_void) -> CUresult {
    called(c"cuMemPoolCreate");
    tri!(ready());
    if props.is_null() {
        return INVALID_VALUE;
    }
    // CUmemPoolProps: allocType, handleTypes, then the location's type (u32 each).
    let location = unsafe { *props.cast::<u32>().add(2) };
    let mut st = state();
    let h = st.handle();
    st.pools.insert(
        h,
        Pool {
            host: (2..=4).contains(&location),
            ..Pool::default()
        },
    );
    unsafe { *out = h as Ptr };
    SUCCESS
}

#[unsafe(no_mangle)]
pub extern "C" fn cuMemPoolDestroy(p: Ptr) -> CUresult {
    called(c"cuMemPoolDestroy");
    tri!(ready());
    match state().pools.remove(&(p as usize)) {
        Some(_) => SUCCESS,
        None => INVALID_HANDLE,
    }
}

#[unsafe(no_mangle)]
pub extern "C" fn cuMemPoolSetAttribute(p: Ptr, _attr: c_uint, _value: *mut c_void) -> CUresult {
    called(c"cuMemPoolSetAttribute");
    tri!(ready());
    known(p)
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemPoolGetAttribute(
    p: Ptr,
    attr: c_uint,
    value: *mut c_void,
) -> CUresult {
    called(c"cuMemPoolGetAttribute");
    tri!(ready());
    let st = state();
    let Some(pool) = st.pools.get(&(p as usize)) else {
        return INVALID_HANDLE;
    };
    let v = match attr {
        // RESERVED_MEM_CURRENT, USED_MEM_CURRENT
        5 => pool.live + pool.cached,
        7 => pool.live,
        _ => return NOT_SUPPORTED,
    };
    unsafe { *value.cast::<u64>() = v };
    SUCCESS
}

#[unsafe(no_mangle)]
pub extern "C" fn cuMemPoolSetAccess(p: Ptr, _descs: *const c_void, _count: usize) -> CUresult {
    called(c"cuMemPoolSetAccess");
    tri!(ready());
    known(p)
}

/// Success for a live pool's handle (a setting the model does not keep).
fn known(p: Ptr) -> CUresult {
    if state().pools.contains_key(&(p as usize)) {
        SUCCESS
    } else {
        INVALID_HANDLE
    }
}

#[unsafe(no_mangle)]
pub extern "C" fn cuMemPoolTrimTo(p: Ptr, keep: usize) -> CUresult {
    called(c"cuMemPoolTrimTo");
    tri!(ready());
    let mut st = state();
    let Some(pool) = st.pools.get_mut(&(p as usize)) else {
        return INVALID_HANDLE;
    };
    let mut gone = Vec::new();
    while pool.live + pool.cached > keep as u64 {
        let Some((_, a, _)) = pool.free.pop() else {
            break;
        };
        pool.cached -= a.len as u64;
        gone.push(a);
    }
    for a in gone {
        if a.kind == Kind::Device {
            st.device_bytes -= a.len;
        }
        release(a.owned.expect("pool blocks are owned"));
    }
    SUCCESS
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemAllocFromPoolAsync(
    out: *mut u64,
    bytes: usize,
    p: Ptr,
    s: Ptr,
) -> CUresult {
    called(c"cuMemAllocFromPoolAsync");
    let dev = tri!(with_ctx());
    let s = tri!(stream(s));
    let mut st = state();
    let Some(pool) = st.pools.get_mut(&(p as usize)) else {
        return INVALID_HANDLE;
    };
    // The block freed last that is free for `s` and holds `bytes` (of that size if one is),
    // else a new one.
    let usable = |f: &(u64, Alloc, Option<StreamPoint>)| match &f.2 {
        Some((fs, n)) => Arc::ptr_eq(fs, &s) || fs.reached(*n),
        None => true,
    };
    let best = (pool
        .free
        .iter()
        .rposition(|f| f.1.len == bytes && usable(f)))
    .or_else(|| {
        pool.free
            .iter()
            .rposition(|f| f.1.len >= bytes && usable(f))
    });
    if let Some(i) = best {
        let (ptr, a, _) = pool.free.remove(i);
        pool.cached -= a.len as u64;
        pool.live += a.len as u64;
        st.allocs.insert(ptr, a);
        unsafe { *out = ptr };
        return SUCCESS;
    }
    if bytes == 0 {
        return INVALID_VALUE;
    }
    if pool.host {
        let Some((h, owned)) = zeroed(bytes, 4096) else {
            return OUT_OF_MEMORY;
        };
        pattern(h, bytes);
        pool.live += bytes as u64;
        st.allocs.insert(
            h as u64,
            Alloc {
                len: bytes,
                kind: Kind::Host,
                owned: Some(owned),
                read_only: false,
                device: dev,
                pool: Some(p as usize),
            },
        );
        unsafe { *out = h as u64 };
        return SUCCESS;
    }
    match alloc_device(&mut st, bytes, dev, Some(p as usize)) {
        Ok(ptr) => {
            st.pools.get_mut(&(p as usize)).expect("above").live += bytes as u64;
            unsafe { *out = ptr };
            SUCCESS
        }
        Err(e) => e,
    }
}

#[unsafe(no_mangle)]
pub extern "C" fn cuMemFreeAsync(ptr: u64, s: Ptr) -> CUresult {
    called(c"cuMemFreeAsync");
    tri!(with_ctx());
    let s = tri!(stream(s));
    let mut st = state();
    let pool = match st.allocs.get(&ptr) {
        Some(a) if a.kind == Kind::Device || a.pool.is_some() => a.pool,
        _ => return INVALID_VALUE,
    };
    if let Some(p) = pool {
        // Back to its pool now, free once the stream got here.
        let a = st.allocs.remove(&ptr).expect("above");
        let at = s.submitted();
        if let Some(pool) = st.pools.get_mut(&p) {
            pool.live -= a.len as u64;
            pool.cached += a.len as u64;
            pool.free.push((ptr, a, Some((Arc::clone(&s), at))));
        }
        return SUCCESS;
    }
    drop(st);
    s.push(Box::new(move || {
        let _ = free_at(&mut state(), ptr, Kind::Device);
    }));
    SUCCESS
}
