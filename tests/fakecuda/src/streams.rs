//! Streams, events, host functions and captures.

use super::*;

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuStreamCreate(out: *mut Ptr, _flags: c_uint) -> CUresult {
    called(c"cuStreamCreate");
    let dev = tri!(with_ctx());
    let mut st = state();
    // Laid out as the driver's: the handle points at a record whose first word is the stream
    // object's address, and the object holds the handle back 40 bytes in (pinstage's handle
    // check learns that offset by reading them). Never freed: a destroyed stream's words are
    // cleared (as the allocator overwrites a freed record's first word).
    let obj: &'static mut [usize; 16] = Box::leak(Box::new([0x5a5a_5a5a_5a5a_5a50; 16]));
    let rec: &'static mut [usize; 3] = Box::leak(Box::new([0; 3]));
    rec[0] = obj.as_ptr() as usize;
    let h = rec.as_ptr() as usize;
    obj[5] = h;
    let s = new_stream(&mut st, dev);
    st.streams.insert(h, s);
    unsafe { *out = h as Ptr };
    SUCCESS
}

#[unsafe(no_mangle)]
pub extern "C" fn cuStreamDestroy_v2(h: Ptr) -> CUresult {
    called(c"cuStreamDestroy_v2");
    tri!(ready());
    let s = {
        let mut st = state();
        let Some(s) = st.streams.remove(&(h as usize)) else {
            return INVALID_HANDLE;
        };
        st.destroyed.retain(|w| w.strong_count() > 0);
        st.destroyed.push(Arc::downgrade(&s));
        s
    };
    // SAFETY: a live stream's record (above), never freed; its object's back-reference too.
    unsafe {
        let rec = h as *mut usize;
        let obj = *rec as *mut usize;
        *obj.add(5) = 0;
        *rec = 0;
    }
    // The work queued runs to its end; the thread then leaves.
    s.q.lock().unwrap_or_else(|e| e.into_inner()).closed = true;
    s.work.notify_all();
    SUCCESS
}

#[unsafe(no_mangle)]
pub extern "C" fn cuStreamSynchronize(h: Ptr) -> CUresult {
    called(c"cuStreamSynchronize");
    tri!(ready());
    let s = tri!(stream(h));
    if s.capture.load(Ordering::Acquire) != CAP_NONE {
        s.capture.store(CAP_INVALIDATED, Ordering::Release);
        return CAPTURE_UNSUPPORTED;
    }
    s.drain();
    tri!(ready());
    SUCCESS
}

#[unsafe(no_mangle)]
pub extern "C" fn cuStreamQuery(h: Ptr) -> CUresult {
    called(c"cuStreamQuery");
    tri!(ready());
    let s = tri!(stream(h));
    if s.capture.load(Ordering::Acquire) != CAP_NONE {
        s.capture.store(CAP_INVALIDATED, Ordering::Release);
        return CAPTURE_UNSUPPORTED;
    }
    let q = s.q.lock().unwrap_or_else(|e| e.into_inner());
    if q.completed >= q.submitted {
        SUCCESS
    } else {
        NOT_READY
    }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuStreamIsCapturing(h: Ptr, status: *mut c_uint) -> CUresult {
    called(c"cuStreamIsCapturing");
    tri!(ready());
    let s = tri!(stream(h));
    unsafe { *status = s.capture.load(Ordering::Acquire) };
    SUCCESS
}

#[unsafe(no_mangle)]
pub extern "C" fn cuStreamBeginCapture_v2(h: Ptr, mode: c_int) -> CUresult {
    called(c"cuStreamBeginCapture_v2");
    tri!(ready());
    if (h as usize) <= 2 {
        return CAPTURE_UNSUPPORTED;
    }
    let s = tri!(stream(h));
    if s.capture.load(Ordering::Acquire) != CAP_NONE {
        return ILLEGAL_STATE;
    }
    s.capture_mode.store(mode as u32, Ordering::Release);
    s.capture.store(CAP_ACTIVE, Ordering::Release);
    SUCCESS
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuStreamEndCapture(h: Ptr, graph: *mut Ptr) -> CUresult {
    called(c"cuStreamEndCapture");
    tri!(ready());
    let s = tri!(stream(h));
    unsafe { *graph = std::ptr::null_mut() };
    match s.capture.swap(CAP_NONE, Ordering::AcqRel) {
        CAP_NONE => ILLEGAL_STATE,
        CAP_INVALIDATED => CAPTURE_INVALIDATED,
        _ => {
            let mut st = state();
            let g = st.handle();
            st.graphs.insert(g, ());
            unsafe { *graph = g as Ptr };
            SUCCESS
        }
    }
}

#[unsafe(no_mangle)]
pub extern "C" fn cuGraphDestroy(g: Ptr) -> CUresult {
    called(c"cuGraphDestroy");
    tri!(ready());
    match state().graphs.remove(&(g as usize)) {
        Some(()) => SUCCESS,
        None => INVALID_HANDLE,
    }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuStreamGetId(h: Ptr, id: *mut u64) -> CUresult {
    called(c"cuStreamGetId");
    tri!(ready());
    let s = tri!(stream(h));
    unsafe { *id = s.id };
    SUCCESS
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuStreamGetCtx(h: Ptr, ctx: *mut Ptr) -> CUresult {
    called(c"cuStreamGetCtx");
    tri!(ready());
    let s = tri!(stream(h));
    unsafe { *ctx = ctx_handle(s.device) };
    SUCCESS
}

#[unsafe(no_mangle)]
pub extern "C" fn cuStreamWaitEvent(h: Ptr, ev: Ptr, _flags: c_uint) -> CUresult {
    called(c"cuStreamWaitEvent");
    tri!(ready());
    let s = tri!(stream(h));
    let rec = match state().events.get(&(ev as usize)) {
        Some(e) => e.rec.clone(),
        None => return INVALID_HANDLE,
    };
    if let Some((es, n)) = rec {
        s.push(Box::new(move || es.wait_for(n)));
    }
    SUCCESS
}

struct HostFn(unsafe extern "C" fn(*mut c_void), SendPtr);

#[unsafe(no_mangle)]
pub extern "C" fn cuLaunchHostFunc(
    h: Ptr,
    f: Option<unsafe extern "C" fn(*mut c_void)>,
    data: *mut c_void,
) -> CUresult {
    called(c"cuLaunchHostFunc");
    tri!(ready());
    let s = tri!(stream(h));
    let Some(f) = f else {
        return INVALID_VALUE;
    };
    let call = HostFn(f, SendPtr(data.cast()));
    s.push(Box::new(move || {
        let call = call;
        // SAFETY: the caller's host function with its own data, as the driver calls it.
        unsafe { (call.0)(call.1.0.cast()) }
    }));
    SUCCESS
}

#[unsafe(no_mangle)]
pub extern "C" fn cuStreamWriteValue32_v2(
    h: Ptr,
    addr: u64,
    value: c_uint,
    _flags: c_uint,
) -> CUresult {
    called(c"cuStreamWriteValue32_v2");
    tri!(ready());
    let s = tri!(stream(h));
    {
        let st = state();
        if st.find(addr, 4).is_none() || !addr.is_multiple_of(4) {
            return INVALID_VALUE;
        }
    }
    let p = SendPtr(addr as *mut u8);
    s.push(Box::new(move || {
        let p = p;
        // SAFETY: a 4-byte aligned word inside a live allocation (checked at the call).
        unsafe { AtomicU32::from_ptr(p.0.cast()) }.store(value, Ordering::SeqCst);
    }));
    SUCCESS
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuEventCreate(out: *mut Ptr, flags: c_uint) -> CUresult {
    called(c"cuEventCreate");
    tri!(with_ctx());
    let mut st = state();
    let h = st.handle();
    let event = Event {
        rec: None,
        timed: flags & 2 == 0, // CU_EVENT_DISABLE_TIMING
        at: Arc::default(),
    };
    st.events.insert(h, event);
    unsafe { *out = h as Ptr };
    SUCCESS
}

#[unsafe(no_mangle)]
pub extern "C" fn cuEventDestroy_v2(ev: Ptr) -> CUresult {
    called(c"cuEventDestroy_v2");
    tri!(ready());
    match state().events.remove(&(ev as usize)) {
        Some(_) => SUCCESS,
        None => INVALID_HANDLE,
    }
}

#[unsafe(no_mangle)]
pub extern "C" fn cuEventRecord(ev: Ptr, h: Ptr) -> CUresult {
    called(c"cuEventRecord");
    tri!(ready());
    let s = tri!(stream(h));
    let mut st = state();
    let Some(e) = st.events.get_mut(&(ev as usize)) else {
        return INVALID_HANDLE;
    };
    if s.capture.load(Ordering::Acquire) == CAP_NONE {
        let n = if e.timed {
            // The time the stream reaches the record, stamped by the stream's thread.
            let at = Arc::clone(&e.at);
            *at.lock().unwrap_or_else(|e| e.into_inner()) = None;
            s.push(Box::new(move || {
                *at.lock().unwrap_or_else(|e| e.into_inner()) = Some(std::time::Instant::now());
            }))
            .unwrap_or_else(|| s.submitted())
        } else {
            s.submitted()
        };
        e.rec = Some((s, n));
    }
    SUCCESS
}

/// The milliseconds between two timed events' completions: `NOT_READY` while either is
/// pending; `INVALID_HANDLE` for an event unknown, made without timing, or never recorded.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuEventElapsedTime(ms: *mut f32, start: Ptr, end: Ptr) -> CUresult {
    called(c"cuEventElapsedTime");
    tri!(with_ctx()); // as the driver: CUDA_ERROR_INVALID_CONTEXT without a current context
    let stamp = |ev: Ptr| -> Result<Option<std::time::Instant>, CUresult> {
        let st = state();
        let e = st.events.get(&(ev as usize)).ok_or(INVALID_HANDLE)?;
        let Some((s, n)) = e.rec.clone().filter(|_| e.timed) else {
            return Err(INVALID_HANDLE);
        };
        let at = Arc::clone(&e.at);
        drop(st);
        Ok(if s.reached(n) {
            *at.lock().unwrap_or_else(|e| e.into_inner())
        } else {
            None
        })
    };
    let (a, b) = (tri!(stamp(start)), tri!(stamp(end)));
    match (a, b) {
        (Some(a), Some(b)) => {
            let d = if b >= a {
                (b - a).as_secs_f64()
            } else {
                -(a - b).as_secs_f64()
            };
            // SAFETY: the caller's out-pointer.
            unsafe { *ms = (d * 1e3) as f32 };
            SUCCESS
        }
        _ => NOT_READY,
    }
}

fn event_rec(ev: Ptr) -> Result<Option<(Arc<Stream>, u64)>, CUresult> {
    match state().events.get(&(ev as usize)) {
        Some(e) => Ok(e.rec.clone()),
        None => Err(INVALID_HANDLE),
    }
}

#[unsafe(no_mangle)]
pub extern "C" fn cuEventQuery(ev: Ptr) -> CUresult {
    called(c"cuEventQuery");
    tri!(ready());
    match tri!(event_rec(ev)) {
        Some((s, n)) if !s.reached(n) => NOT_READY,
        _ => SUCCESS,
    }
}

#[unsafe(no_mangle)]
pub extern "C" fn cuEventSynchronize(ev: Ptr) -> CUresult {
    called(c"cuEventSynchronize");
    tri!(ready());
    if let Some((s, n)) = tri!(event_rec(ev)) {
        s.wait_for(n);
    }
    tri!(ready());
    SUCCESS
}
