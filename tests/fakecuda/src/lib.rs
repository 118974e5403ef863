//! A simulated CUDA driver: `libcuda.so` with the driver entry points pinstage calls
//! (`src/driver/*.rs`), acting on host memory, so that the GPU tests' logic and their mutants
//! run on a machine without a GPU (`scripts/fake-gpu`).
//!
//! It is NOT evidence of what a GPU does; it is a model of the driver's documented contract:
//! - streams run their work in order on one thread each, asynchronously to the caller
//!   (`FAKECUDA_DELAY_US` sleeps before each piece of work, widening every race window);
//! - an async copy reads a pinned source when the stream reaches it, a pageable source at the
//!   call (the driver stages it), and a copy into pageable memory returns once done;
//! - events complete when their stream reaches them (never recorded: complete); waits order
//!   one stream after another's work; host functions run on the stream's thread;
//! - device memory is host memory ("device" addresses are host addresses, filled with a
//!   pattern at allocation, as real device memory holds garbage); every copy's device range
//!   must lie in one allocation (else `CUDA_ERROR_INVALID_VALUE`, nothing queued); a device
//!   write into host memory registered read-only is a sticky `CUDA_ERROR_ILLEGAL_ADDRESS`,
//!   returned by every later call, as a real context is lost;
//! - a context must be current for the calls that need one (`CUDA_ERROR_INVALID_CONTEXT`);
//! - a capturing stream queues nothing (its work goes to the graph); querying or synchronizing
//!   it invalidates the capture; freeing or page-locking memory waits for every stream;
//! - a stream handle points at a record laid out as the driver's (its first word the stream
//!   object, which holds the handle back 40 bytes in; both cleared when it is destroyed), which
//!   pinstage's handle check reads.
//!
//! Settings: `FAKECUDA_DEVICES` (default 1), `FAKECUDA_DRIVER_VERSION` (12080),
//! `FAKECUDA_MEM_MB` (8192), `FAKECUDA_DELAY_US` (0).

#![allow(non_snake_case, clippy::missing_safety_doc)]

use std::alloc::Layout;
use std::cell::RefCell;
use std::collections::{BTreeMap, HashMap, VecDeque};
use std::ffi::{CStr, c_char, c_int, c_uint, c_void};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock};

type CUresult = c_uint;
type Ptr = *mut c_void;

const SUCCESS: CUresult = 0;
const INVALID_VALUE: CUresult = 1;
const OUT_OF_MEMORY: CUresult = 2;
const NOT_INITIALIZED: CUresult = 3;
const INVALID_DEVICE: CUresult = 101;
const INVALID_CONTEXT: CUresult = 201;
const INVALID_HANDLE: CUresult = 400;
const ILLEGAL_STATE: CUresult = 401;
const NOT_READY: CUresult = 600;
const ILLEGAL_ADDRESS: CUresult = 700;
const LAUNCH_FAILED: CUresult = 719;
const ALREADY_REGISTERED: CUresult = 712;
const NOT_REGISTERED: CUresult = 713;
const NOT_SUPPORTED: CUresult = 801;
const CAPTURE_UNSUPPORTED: CUresult = 900;
const CAPTURE_INVALIDATED: CUresult = 901;

const MEMORYTYPE_HOST: u32 = 1;
const MEMORYTYPE_DEVICE: u32 = 2;
const HOSTREGISTER_READ_ONLY: c_uint = 0x08;
const CAPTURE_MODE_GLOBAL: c_int = 0;
const CAPTURE_MODE_RELAXED: c_int = 2;

// ---------------------------------------------------------------------------------------------
// State

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Kind {
    Device,
    /// Page-locked host memory: `cuMemHostAlloc` (owned) or `cuMemHostRegister` (not owned).
    Host,
}

struct Alloc {
    len: usize,
    kind: Kind,
    /// Allocated here (freed here); `None` for registered memory.
    owned: Option<Owned>,
    read_only: bool,
    device: i32,
    pool: Option<usize>,
}

/// Capture status of a stream: none, active, invalidated.
const CAP_NONE: u32 = 0;
const CAP_ACTIVE: u32 = 1;
const CAP_INVALIDATED: u32 = 2;

type Op = Box<dyn FnOnce() + Send>;

/// A point in a stream's work: its completion count then.
type StreamPoint = (Arc<Stream>, u64);

struct Queue {
    ops: VecDeque<Op>,
    submitted: u64,
    completed: u64,
    closed: bool,
}

struct Stream {
    id: u64,
    device: i32,
    q: Mutex<Queue>,
    work: Condvar,
    done: Condvar,
    capture: AtomicU32,
    capture_mode: AtomicU32,
}

struct Event {
    rec: Option<(Arc<Stream>, u64)>,
    /// Created without `CU_EVENT_DISABLE_TIMING`: each record stamps the time it completes.
    timed: bool,
    at: Arc<Mutex<Option<std::time::Instant>>>,
}

/// A memory pool: blocks freed into it stay reserved (and are handed out again) until trimmed.
#[derive(Default)]
struct Pool {
    /// A pool of page-locked host memory (location `HOST`, `HOST_NUMA` or `HOST_NUMA_CURRENT`):
    /// its blocks are host memory to the pointer queries and not counted as device memory.
    host: bool,
    live: u64,
    cached: u64,
    /// Freed blocks, each with the point of its stream after which it is free (another stream
    /// may take it once that stream got there; its own stream at once: stream order).
    free: Vec<(u64, Alloc, Option<StreamPoint>)>,
}

struct State {
    allocs: BTreeMap<u64, Alloc>,
    streams: HashMap<usize, Arc<Stream>>,
    legacy: Vec<Option<Arc<Stream>>>,
    per_thread: Vec<std::sync::Weak<Stream>>,
    /// Destroyed streams whose thread still runs their queued work: the driver completes it,
    /// and a context-wide wait (a free, `cuCtxSynchronize`) waits for it too.
    destroyed: Vec<std::sync::Weak<Stream>>,
    events: HashMap<usize, Event>,
    pools: HashMap<usize, Pool>,
    graphs: HashMap<usize, ()>,
    next_handle: usize,
    next_stream_id: u64,
    device_bytes: usize,
}

struct Driver {
    state: Mutex<State>,
    devices: i32,
    version: i32,
    total: usize,
    delay_us: u64,
    initialized: AtomicU32,
    sticky: AtomicU32,
}

fn env_num(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn drv() -> &'static Driver {
    static D: OnceLock<Driver> = OnceLock::new();
    D.get_or_init(|| {
        let devices = env_num("FAKECUDA_DEVICES", 1) as i32;
        Driver {
            state: Mutex::new(State {
                allocs: BTreeMap::new(),
                streams: HashMap::new(),
                legacy: (0..devices).map(|_| None).collect(),
                per_thread: Vec::new(),
                destroyed: Vec::new(),
                events: HashMap::new(),
                pools: HashMap::new(),
                graphs: HashMap::new(),
                next_handle: 0x7f00_0000,
                next_stream_id: 16,
                device_bytes: 0,
            }),
            devices,
            version: env_num("FAKECUDA_DRIVER_VERSION", 12080) as i32,
            total: (env_num("FAKECUDA_MEM_MB", 8192) as usize) << 20,
            delay_us: env_num("FAKECUDA_DELAY_US", 0),
            initialized: AtomicU32::new(0),
            sticky: AtomicU32::new(SUCCESS),
        }
    })
}

fn state() -> MutexGuard<'static, State> {
    drv().state.lock().unwrap_or_else(|e| e.into_inner())
}

impl State {
    fn handle(&mut self) -> usize {
        self.next_handle += 16;
        self.next_handle
    }

    /// The allocation holding `[addr, addr + len)` whole.
    fn find(&self, addr: u64, len: usize) -> Option<(u64, &Alloc)> {
        let (&start, a) = self.allocs.range(..=addr).next_back()?;
        let end = start + a.len as u64;
        (addr >= start && addr < end.max(start + 1) && addr + len as u64 <= end)
            .then_some((start, a))
    }
}

/// A thread's per-thread default streams (handle 2), one per device; closed when it exits.
struct PerThread(HashMap<i32, Arc<Stream>>);

impl Drop for PerThread {
    fn drop(&mut self) {
        for s in self.0.values() {
            s.q.lock().unwrap_or_else(|e| e.into_inner()).closed = true;
            s.work.notify_all();
        }
    }
}

thread_local! {
    static PTDS: RefCell<PerThread> = RefCell::new(PerThread(HashMap::new()));
    static CTX: RefCell<Vec<i32>> = const { RefCell::new(Vec::new()) };
    static MODE: RefCell<c_int> = const { RefCell::new(CAPTURE_MODE_GLOBAL) };
}

const CTX_BASE: usize = 0x5c00_0000;

fn ctx_handle(dev: i32) -> Ptr {
    (CTX_BASE + 16 * dev as usize) as Ptr
}

fn ctx_device(ctx: Ptr) -> Option<i32> {
    let v = ctx as usize;
    let d = v.checked_sub(CTX_BASE)? / 16;
    (v >= CTX_BASE && (v - CTX_BASE).is_multiple_of(16) && (d as i32) < drv().devices)
        .then_some(d as i32)
}

fn current() -> Option<i32> {
    CTX.with(|c| c.borrow().last().copied())
}

/// The common prologue: initialized, no sticky error.
fn ready() -> Result<(), CUresult> {
    let d = drv();
    if d.initialized.load(Ordering::Acquire) == 0 {
        return Err(NOT_INITIALIZED);
    }
    match d.sticky.load(Ordering::Acquire) {
        SUCCESS => Ok(()),
        e => Err(e),
    }
}

fn with_ctx() -> Result<i32, CUresult> {
    ready()?;
    current().ok_or(INVALID_CONTEXT)
}

macro_rules! tri {
    ($e:expr) => {
        match $e {
            Ok(v) => v,
            Err(code) => return code,
        }
    };
}

/// A call that is "unsafe" during a stream capture (allocation, page-locking, device-wide
/// synchronization): refused, and the capture invalidated, unless this thread's mode is
/// relaxed (or every capture is relaxed).
fn capture_guard() -> Result<(), CUresult> {
    if MODE.with(|m| *m.borrow()) == CAPTURE_MODE_RELAXED {
        return Ok(());
    }
    let st = state();
    let mut hit = false;
    for s in st.streams.values() {
        if s.capture.load(Ordering::Acquire) == CAP_ACTIVE
            && s.capture_mode.load(Ordering::Acquire) != CAPTURE_MODE_RELAXED as u32
        {
            s.capture.store(CAP_INVALIDATED, Ordering::Release);
            hit = true;
        }
    }
    if hit {
        Err(CAPTURE_UNSUPPORTED)
    } else {
        Ok(())
    }
}

// ---------------------------------------------------------------------------------------------
// Call counts (`fakecuda_calls`) and the trace (`FAKECUDA_TRACE=1`: one stderr line a call)

fn counts() -> &'static Mutex<HashMap<&'static CStr, u64>> {
    static C: OnceLock<Mutex<HashMap<&'static CStr, u64>>> = OnceLock::new();
    C.get_or_init(|| Mutex::new(HashMap::new()))
}

thread_local! {
    static THREAD_COUNTS: RefCell<HashMap<&'static CStr, u64>> = RefCell::new(HashMap::new());
}

fn called(name: &'static CStr) {
    THREAD_COUNTS.with(|c| *c.borrow_mut().entry(name).or_default() += 1);
    *counts()
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .entry(name)
        .or_default() += 1;
    static TRACE: OnceLock<bool> = OnceLock::new();
    if *TRACE.get_or_init(|| std::env::var("FAKECUDA_TRACE").is_ok_and(|v| v == "1")) {
        eprintln!("fakecuda call {}", name.to_string_lossy());
    }
}

/// Failures injected by [`fakecuda_fail`]: per entry point, the calls still let through and
/// the error the next one returns.
fn failures() -> &'static Mutex<HashMap<Vec<u8>, (u64, CUresult)>> {
    static F: OnceLock<Mutex<HashMap<Vec<u8>, (u64, CUresult)>>> = OnceLock::new();
    F.get_or_init(|| Mutex::new(HashMap::new()))
}

/// The error this call of `name` returns, doing nothing, if [`fakecuda_fail`] chose it (used
/// up by it). Only the entry points that call it can fail so.
fn injected(name: &'static CStr) -> Option<CUresult> {
    let mut f = failures().lock().unwrap_or_else(|e| e.into_inner());
    let (left, code) = f.get_mut(name.to_bytes())?;
    if *left > 0 {
        *left -= 1;
        return None;
    }
    let code = *code;
    f.remove(name.to_bytes());
    Some(code)
}

/// Makes the call of the entry point `name` that comes after `after` more (on any thread)
/// return `code` without doing anything, once: a driver failure on a thread a test cannot
/// reach (pinstage's own). `cuMemcpyAsync` and `cuMemcpy2DAsync_v2` only. Not a driver
/// function: tests find it with `dlsym`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn fakecuda_fail(name: *const c_char, after: u64, code: CUresult) {
    // SAFETY: the caller's NUL-terminated name.
    let name = unsafe { CStr::from_ptr(name) }.to_bytes().to_vec();
    let mut f = failures().lock().unwrap_or_else(|e| e.into_inner());
    f.insert(name, (after, code));
}

/// As [`fakecuda_calls`], for the calls made on the calling thread only.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn fakecuda_thread_calls(name: *const c_char) -> u64 {
    THREAD_COUNTS.with(|c| {
        let c = c.borrow();
        if name.is_null() {
            return c.values().sum();
        }
        // SAFETY: the caller's NUL-terminated name.
        let name = unsafe { CStr::from_ptr(name) };
        c.get(name).copied().unwrap_or(0)
    })
}

/// How many times the entry point `name` was called in this process (0 for a name never
/// called); `name` null: the calls to every entry point. Not a driver function: tests find it
/// with `dlsym` to tell the simulated driver from a real one and to count a path's calls.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn fakecuda_calls(name: *const c_char) -> u64 {
    let c = counts().lock().unwrap_or_else(|e| e.into_inner());
    if name.is_null() {
        return c.values().sum();
    }
    // SAFETY: the caller's NUL-terminated name.
    let name = unsafe { CStr::from_ptr(name) };
    c.get(name).copied().unwrap_or(0)
}

// ---------------------------------------------------------------------------------------------
// Streams

fn new_stream(st: &mut State, device: i32) -> Arc<Stream> {
    st.next_stream_id += 1;
    let s = Arc::new(Stream {
        id: st.next_stream_id,
        device,
        q: Mutex::new(Queue {
            ops: VecDeque::new(),
            submitted: 0,
            completed: 0,
            closed: false,
        }),
        work: Condvar::new(),
        done: Condvar::new(),
        capture: AtomicU32::new(CAP_NONE),
        capture_mode: AtomicU32::new(0),
    });
    let w = Arc::clone(&s);
    std::thread::Builder::new()
        .name(format!("fakecuda-stream-{}", s.id))
        .spawn(move || worker(w))
        .expect("fakecuda: a stream thread");
    s
}

fn worker(s: Arc<Stream>) {
    let delay = drv().delay_us;
    loop {
        let op = {
            let mut q = s.q.lock().unwrap_or_else(|e| e.into_inner());
            loop {
                if let Some(op) = q.ops.pop_front() {
                    break op;
                }
                if q.closed {
                    return;
                }
                q = s.work.wait(q).unwrap_or_else(|e| e.into_inner());
            }
        };
        if delay > 0 {
            std::thread::sleep(std::time::Duration::from_micros(delay));
        }
        // A panic in the simulated work (a bug here, or a host function's) is the device's
        // failure: sticky, as a real launch failure is.
        if std::panic::catch_unwind(std::panic::AssertUnwindSafe(op)).is_err() {
            drv().sticky.store(LAUNCH_FAILED, Ordering::Release);
        }
        let mut q = s.q.lock().unwrap_or_else(|e| e.into_inner());
        q.completed += 1;
        drop(q);
        s.done.notify_all();
    }
}

impl Stream {
    /// Queues `op`; its completion number (`None` while capturing: the work goes to the graph).
    fn push(&self, op: Op) -> Option<u64> {
        if self.capture.load(Ordering::Acquire) != CAP_NONE {
            return None;
        }
        let mut q = self.q.lock().unwrap_or_else(|e| e.into_inner());
        q.ops.push_back(op);
        q.submitted += 1;
        let n = q.submitted;
        drop(q);
        self.work.notify_one();
        Some(n)
    }

    fn submitted(&self) -> u64 {
        self.q.lock().unwrap_or_else(|e| e.into_inner()).submitted
    }

    fn reached(&self, n: u64) -> bool {
        self.q.lock().unwrap_or_else(|e| e.into_inner()).completed >= n
    }

    fn wait_for(&self, n: u64) {
        let mut q = self.q.lock().unwrap_or_else(|e| e.into_inner());
        while q.completed < n {
            q = self.done.wait(q).unwrap_or_else(|e| e.into_inner());
        }
    }

    fn drain(&self) {
        let n = self.submitted();
        self.wait_for(n);
    }
}

/// The stream named by handle `h`: 0 and 1 the current device's legacy stream, 2 this
/// thread's per-thread default stream of the current device.
fn stream(h: Ptr) -> Result<Arc<Stream>, CUresult> {
    let v = h as usize;
    if v == 2 {
        let dev = current().ok_or(INVALID_CONTEXT)?;
        if let Some(s) = PTDS.with(|p| p.borrow().0.get(&dev).cloned()) {
            return Ok(s);
        }
        let s = {
            let mut st = state();
            let s = new_stream(&mut st, dev);
            st.per_thread.retain(|w| w.strong_count() > 0);
            st.per_thread.push(Arc::downgrade(&s));
            s
        };
        PTDS.with(|p| p.borrow_mut().0.insert(dev, Arc::clone(&s)));
        return Ok(s);
    }
    if v <= 1 {
        let dev = current().ok_or(INVALID_CONTEXT)?;
        let mut st = state();
        if let Some(s) = &st.legacy[dev as usize] {
            return Ok(Arc::clone(s));
        }
        let s = new_stream(&mut st, dev);
        st.legacy[dev as usize] = Some(Arc::clone(&s));
        return Ok(s);
    }
    state().streams.get(&v).cloned().ok_or(INVALID_HANDLE)
}

fn all_streams() -> Vec<Arc<Stream>> {
    let st = state();
    st.streams
        .values()
        .cloned()
        .chain(st.legacy.iter().flatten().cloned())
        .chain(st.per_thread.iter().filter_map(std::sync::Weak::upgrade))
        .chain(st.destroyed.iter().filter_map(std::sync::Weak::upgrade))
        .collect()
}

fn sync_all() {
    for s in all_streams() {
        s.drain();
    }
}

struct SendPtr(*mut u8);
// SAFETY: the addresses are handed to a stream thread exactly as a driver hands them to a
// copy engine; the caller's contract keeps the memory valid until the work completed.
unsafe impl Send for SendPtr {}

// ---------------------------------------------------------------------------------------------
// Copies

/// One side of a copy: where, and whether the driver reads/writes it at the call (pageable).
enum Side {
    /// Page-locked or device memory: accessed when the stream reaches the copy.
    Async,
    /// Pageable host memory.
    Pageable(u64),
}

fn side(st: &State, addr: u64, len: usize, device_only: bool) -> Result<Side, CUresult> {
    // Device memory and page-locked host memory are both device-accessible (unified addresses).
    match st.find(addr, len) {
        Some(_) => Ok(Side::Async),
        None if device_only => Err(INVALID_VALUE),
        None if addr == 0 => Err(INVALID_VALUE),
        None => Ok(Side::Pageable(addr)),
    }
}

fn read_only_target(st: &State, addr: u64, len: usize) -> bool {
    st.find(addr, len).is_some_and(|(_, a)| a.read_only)
}

/// One copy as queued: destination, the source's bytes when staged at the call (pageable), the
/// source, length, and whether the destination is read-only to the device.
type Staged = (SendPtr, Option<Vec<u8>>, SendPtr, usize, bool);

struct Copy {
    dst: u64,
    src: u64,
    len: usize,
}

/// Queues `copies` on `s` (checked first, nothing queued on a bad one: its index in `Err`); a
/// copy into pageable memory returns once done, as the driver's does.
fn enqueue_copies(
    s: &Stream,
    copies: Vec<Copy>,
    dst_device: bool,
    src_device: bool,
) -> Result<(), (usize, CUresult)> {
    let mut staged: Vec<Staged> = Vec::new();
    let mut wait = false;
    {
        let st = state();
        for (i, c) in copies.iter().enumerate() {
            if c.len == 0 {
                continue;
            }
            let d = side(&st, c.dst, c.len, dst_device).map_err(|e| (i, e))?;
            let sr = side(&st, c.src, c.len, src_device).map_err(|e| (i, e))?;
            let bad = read_only_target(&st, c.dst, c.len);
            let data = match sr {
                // SAFETY: the caller's source, readable for `len` bytes at the call.
                Side::Pageable(a) => {
                    Some(unsafe { std::slice::from_raw_parts(a as *const u8, c.len) }.to_vec())
                }
                Side::Async => None,
            };
            if matches!(d, Side::Pageable(_)) {
                wait = true;
            }
            staged.push((
                SendPtr(c.dst as *mut u8),
                data,
                SendPtr(c.src as *mut u8),
                c.len,
                bad,
            ));
        }
    }
    if staged.is_empty() {
        return Ok(());
    }
    let n = s.push(Box::new(move || {
        for (dst, data, src, len, bad) in staged {
            if bad {
                drv().sticky.store(ILLEGAL_ADDRESS, Ordering::Release);
                continue;
            }
            // SAFETY: checked ranges (device memory in one allocation; host memory the caller's,
            // valid until the copy completed by the driver's contract).
            unsafe {
                match data {
                    Some(v) => std::ptr::copy_nonoverlapping(v.as_ptr(), dst.0, len),
                    None => std::ptr::copy(src.0 as *const u8, dst.0, len),
                }
            }
        }
    }));
    if let (true, Some(n)) = (wait, n) {
        s.wait_for(n);
    }
    Ok(())
}

fn copy_call(
    dst: u64,
    src: u64,
    len: usize,
    s: Ptr,
    dst_device: bool,
    src_device: bool,
) -> CUresult {
    tri!(with_ctx());
    let s = tri!(stream(s));
    match enqueue_copies(&s, vec![Copy { dst, src, len }], dst_device, src_device) {
        Ok(()) => SUCCESS,
        Err((_, e)) => e,
    }
}

// ---------------------------------------------------------------------------------------------
// Allocation

fn pattern(p: *mut u8, len: usize) {
    // Device memory holds whatever was there: a pattern, never zeros (large ones stay zero pages).
    if len <= 64 << 20 {
        // SAFETY: a fresh allocation of `len` bytes.
        let s = unsafe { std::slice::from_raw_parts_mut(p, len) };
        for (i, b) in s.iter_mut().enumerate() {
            *b = (i as u32).wrapping_mul(2_654_435_761).rotate_right(13) as u8 | 1;
        }
    }
}

fn alloc_device(
    st: &mut State,
    bytes: usize,
    dev: i32,
    pool: Option<usize>,
) -> Result<u64, CUresult> {
    if bytes == 0 {
        return Err(INVALID_VALUE);
    }
    if st.device_bytes + bytes > drv().total {
        return Err(OUT_OF_MEMORY);
    }
    let (p, owned) = zeroed(bytes, 512).ok_or(OUT_OF_MEMORY)?;
    pattern(p, bytes);
    st.device_bytes += bytes;
    st.allocs.insert(
        p as u64,
        Alloc {
            len: bytes,
            kind: Kind::Device,
            owned: Some(owned),
            read_only: false,
            device: dev,
            pool,
        },
    );
    Ok(p as u64)
}

fn free_at(st: &mut State, ptr: u64, kind: Kind) -> Result<(), CUresult> {
    match st.allocs.get(&ptr) {
        Some(a) if a.kind == kind && a.owned.is_some() => {}
        _ => return Err(INVALID_VALUE),
    }
    let a = st.allocs.remove(&ptr).expect("checked");
    if let Some(p) = a.pool.and_then(|p| st.pools.get_mut(&p)) {
        p.live -= a.len as u64;
        p.cached += a.len as u64;
        p.free.push((ptr, a, None));
        return Ok(());
    }
    if kind == Kind::Device {
        st.device_bytes -= a.len;
    }
    release(a.owned.expect("checked"));
    Ok(())
}

mod copies;
mod ctx;
mod memory;
use memory::{Owned, release, zeroed};
mod pools;
mod streams;
