//! The driver's errors, and the thread-local capture mode around waits.

use std::ffi::CStr;
use std::fmt;

use cudarc::driver::sys;

/// A failed CUDA driver call: the call's name and the `CUresult` it returned.
///
/// `Display` names the error through `cuGetErrorName` / `cuGetErrorString`, e.g.
/// `cuMemcpyHtoDAsync_v2: CUDA_ERROR_INVALID_VALUE (invalid argument)`.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct DriverError {
    pub(super) call: &'static str,
    pub(super) code: sys::CUresult,
}

impl DriverError {
    /// An error of `call` with `code`, for a failure pinstage reports as the driver's.
    pub(crate) fn new(call: &'static str, code: sys::CUresult) -> Self {
        Self { call, code }
    }

    /// The driver function that failed.
    pub fn call(&self) -> &'static str {
        self.call
    }

    /// The raw `CUresult` value.
    pub fn code(&self) -> u32 {
        self.code as u32
    }

    /// Whether the memory was already registered (`CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED`).
    pub fn is_already_registered(&self) -> bool {
        self.code == sys::CUresult::CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED
    }

    /// Whether the driver refused a handle (`CUDA_ERROR_INVALID_HANDLE`, or
    /// `CUDA_ERROR_INVALID_RESOURCE_TYPE` for a handle of another kind).
    pub fn is_invalid_handle(&self) -> bool {
        matches!(
            self.code,
            sys::CUresult::CUDA_ERROR_INVALID_HANDLE
                | sys::CUresult::CUDA_ERROR_INVALID_RESOURCE_TYPE
        )
    }

    /// Whether the error is about a CUDA graph being captured (codes 900-908: a capture in
    /// another thread's global mode refuses some calls here, while queued work still runs).
    pub fn is_capture_error(&self) -> bool {
        (900..=908).contains(&(self.code as u32))
    }

    /// Whether the driver does not offer the operation here (`CUDA_ERROR_NOT_SUPPORTED`).
    pub fn is_not_supported(&self) -> bool {
        self.code == sys::CUresult::CUDA_ERROR_NOT_SUPPORTED
    }

    /// Whether the driver calls an argument invalid (`CUDA_ERROR_INVALID_VALUE`).
    pub(crate) fn is_invalid_value(&self) -> bool {
        self.code == sys::CUresult::CUDA_ERROR_INVALID_VALUE
    }

    /// Whether the driver ran out of memory (`CUDA_ERROR_OUT_OF_MEMORY`).
    pub fn is_out_of_memory(&self) -> bool {
        self.code == sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY
    }

    /// The symbolic name of the error, e.g. `CUDA_ERROR_INVALID_VALUE`.
    pub fn name(&self) -> String {
        let mut ptr: *const std::ffi::c_char = std::ptr::null();
        // SAFETY: a DriverError only exists after the library was loaded by `probe`; the
        // out-pointer is valid; on success it points to a static NUL-terminated string.
        let ok = unsafe { sys::cuGetErrorName(self.code, &mut ptr) } == sys::CUresult::CUDA_SUCCESS;
        if ok && !ptr.is_null() {
            // SAFETY: see above: static C string owned by the driver.
            unsafe { CStr::from_ptr(ptr) }
                .to_string_lossy()
                .into_owned()
        } else {
            format!("CUresult({})", self.code as u32)
        }
    }

    /// The driver's description of the error.
    pub fn description(&self) -> String {
        let mut ptr: *const std::ffi::c_char = std::ptr::null();
        // SAFETY: as in `name`.
        let ok =
            unsafe { sys::cuGetErrorString(self.code, &mut ptr) } == sys::CUresult::CUDA_SUCCESS;
        if ok && !ptr.is_null() {
            // SAFETY: static C string owned by the driver.
            unsafe { CStr::from_ptr(ptr) }
                .to_string_lossy()
                .into_owned()
        } else {
            "unknown error".to_owned()
        }
    }
}

impl fmt::Display for DriverError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {} ({})", self.call, self.name(), self.description())
    }
}

impl fmt::Debug for DriverError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

impl std::error::Error for DriverError {}

/// Result of one driver call.
pub(crate) type DResult<T> = Result<T, DriverError>;

#[inline]
pub(crate) fn check(call: &'static str, code: sys::CUresult) -> DResult<()> {
    if code == sys::CUresult::CUDA_SUCCESS {
        Ok(())
    } else {
        Err(DriverError { call, code })
    }
}

/// Runs `f` with this thread's stream-capture mode relaxed, then restores the mode.
///
/// While a thread captures a CUDA graph in global mode (torch's default), the driver refuses
/// "potentially unsafe" calls such as `cuEventSynchronize` and `cuEventQuery` on every other
/// thread (codes 900-908) and invalidates that capture; the work queued before still runs. A
/// wait that guards memory must not fail then (its caller would free or reuse memory a copy
/// still reads or writes), and must not break a capture it has nothing to do with: waiting for
/// work queued outside the capture is safe. So every query and wait of pinstage's runs relaxed:
/// two thread-local mode swaps around the outermost [`relaxed`] scope, so a wait that asks many
/// times swaps once. pinstage never waits on a capturing stream (its copies refuse them).
pub(crate) fn capture_relaxed<T>(f: impl FnOnce() -> DResult<T>) -> DResult<T> {
    relaxed(f)
}

thread_local! {
    /// How many [`relaxed`] scopes this thread is in: inner ones swap nothing.
    static RELAXED_DEPTH: std::cell::Cell<u32> = const { std::cell::Cell::new(0) };
}

/// Runs `f` with this thread's capture mode relaxed (see [`capture_relaxed`]): two mode swaps
/// around the outermost scope, none inside it, so a wait that asks the driver many times swaps
/// once.
pub(crate) fn relaxed<T>(f: impl FnOnce() -> T) -> T {
    // The seeded bug (`capture_strict`, scripts/seeded.tsv): the thread's mode left as it is.
    if cfg!(pinstage_seeded_bug = "capture_strict") || RELAXED_DEPTH.with(|d| d.get()) > 0 {
        return f();
    }
    let mut mode = sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED;
    // SAFETY: a valid in/out pointer; the call only swaps this thread's mode.
    let swapped = unsafe { sys::cuThreadExchangeStreamCaptureMode(&mut mode) };
    /// Leaves the scope (mode and depth) also when `f` unwinds.
    struct Restore {
        swapped: bool,
        mode: sys::CUstreamCaptureMode,
    }
    impl Drop for Restore {
        fn drop(&mut self) {
            RELAXED_DEPTH.with(|d| d.set(d.get() - 1));
            if self.swapped {
                // SAFETY: as above; `mode` holds the thread's previous mode.
                unsafe { sys::cuThreadExchangeStreamCaptureMode(&mut self.mode) };
            }
        }
    }
    RELAXED_DEPTH.with(|d| d.set(d.get() + 1));
    let _restore = Restore {
        swapped: swapped == sys::CUresult::CUDA_SUCCESS,
        mode,
    };
    f()
}
