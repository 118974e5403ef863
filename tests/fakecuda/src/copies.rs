//! The copy entry points (the copying itself: `enqueue_copies`).

use super::*;

#[unsafe(no_mangle)]
pub extern "C" fn cuMemcpyHtoDAsync_v2(
    dst: u64,
    src: *const c_void,
    bytes: usize,
    s: Ptr,
) -> CUresult {
    called(c"cuMemcpyHtoDAsync_v2");
    copy_call(dst, src as u64, bytes, s, true, false)
}

#[unsafe(no_mangle)]
pub extern "C" fn cuMemcpyDtoHAsync_v2(
    dst: *mut c_void,
    src: u64,
    bytes: usize,
    s: Ptr,
) -> CUresult {
    called(c"cuMemcpyDtoHAsync_v2");
    copy_call(dst as u64, src, bytes, s, false, true)
}

#[unsafe(no_mangle)]
pub extern "C" fn cuMemcpyAsync(dst: u64, src: u64, bytes: usize, s: Ptr) -> CUresult {
    called(c"cuMemcpyAsync");
    if let Some(e) = injected(c"cuMemcpyAsync") {
        return e;
    }
    copy_call(dst, src, bytes, s, false, false)
}

#[unsafe(no_mangle)]
pub extern "C" fn cuMemcpyDtoH_v2(dst: *mut c_void, src: u64, bytes: usize) -> CUresult {
    called(c"cuMemcpyDtoH_v2");
    tri!(with_ctx());
    let s = tri!(stream(std::ptr::null_mut()));
    if let Err((_, e)) = enqueue_copies(
        &s,
        vec![Copy {
            dst: dst as u64,
            src,
            len: bytes,
        }],
        false,
        true,
    ) {
        return e;
    }
    s.drain();
    tri!(ready());
    SUCCESS
}

#[repr(C)]
pub struct Memcpy2D {
    src_x: usize,
    src_y: usize,
    src_type: c_uint,
    src_host: *const c_void,
    src_device: u64,
    src_array: Ptr,
    src_pitch: usize,
    dst_x: usize,
    dst_y: usize,
    dst_type: c_uint,
    dst_host: *mut c_void,
    dst_device: u64,
    dst_array: Ptr,
    dst_pitch: usize,
    width: usize,
    height: usize,
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemcpy2DAsync_v2(c: *const Memcpy2D, s: Ptr) -> CUresult {
    called(c"cuMemcpy2DAsync_v2");
    if let Some(e) = injected(c"cuMemcpy2DAsync_v2") {
        return e;
    }
    tri!(with_ctx());
    let s = tri!(stream(s));
    let c = unsafe { &*c };
    let base = |ty: c_uint, host: u64, dev: u64| -> Result<(u64, bool), CUresult> {
        match ty {
            MEMORYTYPE_HOST => Ok((host, false)),
            MEMORYTYPE_DEVICE => Ok((dev, true)),
            _ => Err(INVALID_VALUE),
        }
    };
    let (src, src_dev) = tri!(base(c.src_type, c.src_host as u64, c.src_device));
    let (dst, dst_dev) = tri!(base(c.dst_type, c.dst_host as u64, c.dst_device));
    if c.width > c.src_pitch || c.width > c.dst_pitch {
        return INVALID_VALUE;
    }
    if c.width == 0 || c.height == 0 {
        return SUCCESS;
    }
    // The whole pitched span of each side lies in one allocation (device sides).
    let span = |pitch: usize| (c.height - 1) * pitch + c.width;
    {
        let st = state();
        let s0 = src + (c.src_y * c.src_pitch + c.src_x) as u64;
        let d0 = dst + (c.dst_y * c.dst_pitch + c.dst_x) as u64;
        if src_dev && st.find(s0, span(c.src_pitch)).is_none() {
            return INVALID_VALUE;
        }
        if dst_dev && st.find(d0, span(c.dst_pitch)).is_none() {
            return INVALID_VALUE;
        }
    }
    let copies = (0..c.height)
        .map(|r| Copy {
            dst: dst + ((c.dst_y + r) * c.dst_pitch + c.dst_x) as u64,
            src: src + ((c.src_y + r) * c.src_pitch + c.src_x) as u64,
            len: c.width,
        })
        .collect();
    match enqueue_copies(&s, copies, dst_dev, src_dev) {
        Ok(()) => SUCCESS,
        Err((_, e)) => e,
    }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemcpyBatchAsync(
    dsts: *const u64,
    srcs: *const u64,
    sizes: *const usize,
    count: usize,
    _attrs: *const c_void,
    attr_idxs: *const usize,
    num_attrs: usize,
    fail_idx: *mut usize,
    s: Ptr,
) -> CUresult {
    called(c"cuMemcpyBatchAsync");
    tri!(with_ctx());
    if drv().version < 12080 {
        return NOT_SUPPORTED;
    }
    if (s as usize) <= 1 {
        // The batched call refuses the legacy stream.
        return INVALID_VALUE;
    }
    if count == 0 || num_attrs == 0 || num_attrs > count || unsafe { *attr_idxs } != 0 {
        return INVALID_VALUE;
    }
    let s = tri!(stream(s));
    let copies = (0..count)
        .map(|i| unsafe {
            Copy {
                dst: *dsts.add(i),
                src: *srcs.add(i),
                len: *sizes.add(i),
            }
        })
        .collect();
    match enqueue_copies(&s, copies, false, false) {
        Ok(()) => SUCCESS,
        Err((i, e)) => {
            if !fail_idx.is_null() {
                unsafe { *fail_idx = i };
            }
            e
        }
    }
}
