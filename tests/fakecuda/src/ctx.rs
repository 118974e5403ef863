//! Initialization, devices, contexts and error texts.

use super::*;

#[unsafe(no_mangle)]
pub extern "C" fn cuInit(_flags: c_uint) -> CUresult {
    called(c"cuInit");
    drv().initialized.store(1, Ordering::Release);
    SUCCESS
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDriverGetVersion(v: *mut c_int) -> CUresult {
    called(c"cuDriverGetVersion");
    if v.is_null() {
        return INVALID_VALUE;
    }
    unsafe { *v = drv().version };
    SUCCESS
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDeviceGetCount(n: *mut c_int) -> CUresult {
    called(c"cuDeviceGetCount");
    tri!(ready());
    unsafe { *n = drv().devices };
    SUCCESS
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDeviceGet(dev: *mut c_int, ordinal: c_int) -> CUresult {
    called(c"cuDeviceGet");
    tri!(ready());
    if ordinal < 0 || ordinal >= drv().devices {
        return INVALID_DEVICE;
    }
    unsafe { *dev = ordinal };
    SUCCESS
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDeviceGetPCIBusId(buf: *mut c_char, len: c_int, dev: c_int) -> CUresult {
    called(c"cuDeviceGetPCIBusId");
    tri!(ready());
    if dev < 0 || dev >= drv().devices {
        return INVALID_DEVICE;
    }
    let s = format!("00000000:{:02X}:00.0\0", 0x18 + dev);
    if (len as usize) < s.len() {
        return INVALID_VALUE;
    }
    unsafe { std::ptr::copy_nonoverlapping(s.as_ptr() as *const c_char, buf, s.len()) };
    SUCCESS
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDeviceCanAccessPeer(
    can: *mut c_int,
    dev: c_int,
    peer: c_int,
) -> CUresult {
    called(c"cuDeviceCanAccessPeer");
    tri!(ready());
    let n = drv().devices;
    if dev < 0 || dev >= n || peer < 0 || peer >= n {
        return INVALID_DEVICE;
    }
    unsafe { *can = (dev != peer) as c_int };
    SUCCESS
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDevicePrimaryCtxRetain(ctx: *mut Ptr, dev: c_int) -> CUresult {
    called(c"cuDevicePrimaryCtxRetain");
    tri!(ready());
    if dev < 0 || dev >= drv().devices {
        return INVALID_DEVICE;
    }
    unsafe { *ctx = ctx_handle(dev) };
    SUCCESS
}

#[unsafe(no_mangle)]
pub extern "C" fn cuDevicePrimaryCtxRelease_v2(dev: c_int) -> CUresult {
    called(c"cuDevicePrimaryCtxRelease_v2");
    tri!(ready());
    if dev < 0 || dev >= drv().devices {
        return INVALID_DEVICE;
    }
    SUCCESS
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuCtxGetCurrent(ctx: *mut Ptr) -> CUresult {
    called(c"cuCtxGetCurrent");
    tri!(ready());
    unsafe { *ctx = current().map_or(std::ptr::null_mut(), ctx_handle) };
    SUCCESS
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuCtxGetDevice(dev: *mut c_int) -> CUresult {
    called(c"cuCtxGetDevice");
    let d = tri!(with_ctx());
    unsafe { *dev = d };
    SUCCESS
}

#[unsafe(no_mangle)]
pub extern "C" fn cuCtxPushCurrent_v2(ctx: Ptr) -> CUresult {
    called(c"cuCtxPushCurrent_v2");
    tri!(ready());
    let Some(d) = ctx_device(ctx) else {
        return INVALID_CONTEXT;
    };
    CTX.with(|c| c.borrow_mut().push(d));
    SUCCESS
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuCtxPopCurrent_v2(ctx: *mut Ptr) -> CUresult {
    called(c"cuCtxPopCurrent_v2");
    tri!(ready());
    match CTX.with(|c| c.borrow_mut().pop()) {
        Some(d) => {
            if !ctx.is_null() {
                unsafe { *ctx = ctx_handle(d) };
            }
            SUCCESS
        }
        None => INVALID_CONTEXT,
    }
}

#[unsafe(no_mangle)]
pub extern "C" fn cuCtxSetCurrent(ctx: Ptr) -> CUresult {
    called(c"cuCtxSetCurrent");
    tri!(ready());
    if ctx.is_null() {
        CTX.with(|c| {
            c.borrow_mut().pop();
        });
        return SUCCESS;
    }
    let Some(d) = ctx_device(ctx) else {
        return INVALID_CONTEXT;
    };
    CTX.with(|c| {
        let mut c = c.borrow_mut();
        c.pop();
        c.push(d);
    });
    SUCCESS
}

#[unsafe(no_mangle)]
pub extern "C" fn cuCtxSynchronize() -> CUresult {
    called(c"cuCtxSynchronize");
    tri!(with_ctx());
    tri!(capture_guard());
    sync_all();
    tri!(ready());
    SUCCESS
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuThreadExchangeStreamCaptureMode(mode: *mut c_int) -> CUresult {
    called(c"cuThreadExchangeStreamCaptureMode");
    if mode.is_null() {
        return INVALID_VALUE;
    }
    MODE.with(|m| {
        let mut m = m.borrow_mut();
        let old = *m;
        *m = unsafe { *mode };
        unsafe { *mode = old };
    });
    SUCCESS
}

// ---------------------------------------------------------------------------------------------
// Errors

fn error_texts(code: CUresult) -> Option<(&'static CStr, &'static CStr)> {
    Some(match code {
        SUCCESS => (c"CUDA_SUCCESS", c"no error"),
        INVALID_VALUE => (c"CUDA_ERROR_INVALID_VALUE", c"invalid argument"),
        OUT_OF_MEMORY => (c"CUDA_ERROR_OUT_OF_MEMORY", c"out of memory"),
        NOT_INITIALIZED => (c"CUDA_ERROR_NOT_INITIALIZED", c"initialization error"),
        INVALID_DEVICE => (c"CUDA_ERROR_INVALID_DEVICE", c"invalid device ordinal"),
        INVALID_CONTEXT => (c"CUDA_ERROR_INVALID_CONTEXT", c"invalid device context"),
        INVALID_HANDLE => (c"CUDA_ERROR_INVALID_HANDLE", c"invalid resource handle"),
        ILLEGAL_STATE => (
            c"CUDA_ERROR_ILLEGAL_STATE",
            c"the operation cannot be performed in the present state",
        ),
        NOT_READY => (c"CUDA_ERROR_NOT_READY", c"device not ready"),
        ILLEGAL_ADDRESS => (
            c"CUDA_ERROR_ILLEGAL_ADDRESS",
            c"an illegal memory access was encountered",
        ),
        LAUNCH_FAILED => (c"CUDA_ERROR_LAUNCH_FAILED", c"unspecified launch failure"),
        ALREADY_REGISTERED => (
            c"CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED",
            c"part or all of the requested memory range is already mapped",
        ),
        NOT_REGISTERED => (
            c"CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED",
            c"pointer does not correspond to a registered memory region",
        ),
        NOT_SUPPORTED => (c"CUDA_ERROR_NOT_SUPPORTED", c"operation not supported"),
        CAPTURE_UNSUPPORTED => (
            c"CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED",
            c"operation not permitted when stream is capturing",
        ),
        CAPTURE_INVALIDATED => (
            c"CUDA_ERROR_STREAM_CAPTURE_INVALIDATED",
            c"operation failed due to a previous error during capture",
        ),
        _ => return None,
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuGetErrorName(code: CUresult, out: *mut *const c_char) -> CUresult {
    called(c"cuGetErrorName");
    match error_texts(code) {
        Some((n, _)) => {
            unsafe { *out = n.as_ptr() };
            SUCCESS
        }
        None => INVALID_VALUE,
    }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuGetErrorString(code: CUresult, out: *mut *const c_char) -> CUresult {
    called(c"cuGetErrorString");
    match error_texts(code) {
        Some((_, s)) => {
            unsafe { *out = s.as_ptr() };
            SUCCESS
        }
        None => INVALID_VALUE,
    }
}
