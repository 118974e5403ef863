//! NVTX ranges for Nsight: `libnvToolsExt` is looked up once at run time (it ships with the
//! CUDA toolkit; a profiler injects itself through it); without it every call is a no-op.

use std::ffi::{CStr, c_char, c_int};
use std::sync::OnceLock;

type PushFn = unsafe extern "C" fn(*const c_char) -> c_int;
type PopFn = unsafe extern "C" fn() -> c_int;

struct Api {
    push: PushFn,
    pop: PopFn,
}

fn api() -> Option<&'static Api> {
    static API: OnceLock<Option<Api>> = OnceLock::new();
    API.get_or_init(|| {
        for name in [c"libnvToolsExt.so.1", c"libnvToolsExt.so"] {
            // SAFETY: dlopen of a library name; the handle is kept for the process's life.
            let h = unsafe { libc::dlopen(name.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
            if h.is_null() {
                continue;
            }
            // SAFETY: symbol lookups in a live handle.
            let (push, pop) = unsafe {
                (
                    libc::dlsym(h, c"nvtxRangePushA".as_ptr()),
                    libc::dlsym(h, c"nvtxRangePop".as_ptr()),
                )
            };
            if push.is_null() || pop.is_null() {
                continue;
            }
            // SAFETY: NVTX's documented signatures: `int nvtxRangePushA(const char*)`,
            // `int nvtxRangePop(void)`.
            return Some(unsafe {
                Api {
                    push: std::mem::transmute::<*mut libc::c_void, PushFn>(push),
                    pop: std::mem::transmute::<*mut libc::c_void, PopFn>(pop),
                }
            });
        }
        None
    })
    .as_ref()
}

/// Whether the NVTX library was found (ranges then reach a profiler when one is attached).
#[cfg(feature = "python")]
pub(crate) fn nvtx_available() -> bool {
    api().is_some()
}

/// Opens a range on this thread; `true` when a range was pushed (close it with [`pop`]).
pub(crate) fn push(name: &CStr) -> bool {
    match api() {
        Some(a) => {
            // SAFETY: a valid C string; NVTX copies it.
            let depth = unsafe { (a.push)(name.as_ptr()) };
            depth >= 0
        }
        None => false,
    }
}

/// Closes this thread's innermost range.
pub(crate) fn pop() {
    if let Some(a) = api() {
        // SAFETY: NVTX tolerates a pop without a push (it returns an error code).
        unsafe { (a.pop)() };
    }
}

/// An NVTX range, open until dropped (nested ranges close in reverse order, per thread).
#[must_use = "the range closes when this guard is dropped"]
pub struct NvtxRange {
    open: bool,
    _not_send: std::marker::PhantomData<*const ()>,
}

impl NvtxRange {
    /// Opens a range named `name` on this thread (a no-op without the NVTX library).
    pub fn new(name: &CStr) -> Self {
        let open = push(name);
        Self {
            open,
            _not_send: std::marker::PhantomData,
        }
    }
}

impl Drop for NvtxRange {
    fn drop(&mut self) {
        if self.open {
            // The range this guard opened, on the same thread (the guard is not Send).
            pop();
        }
    }
}
