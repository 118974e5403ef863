//! Driver failures injected by tests (feature `testing`, never in a release build): the calling
//! thread's next calls of one driver function fail with a chosen error, or do nothing and
//! report success. They reach the error paths a healthy GPU never takes: a stream write the
//! driver refuses, a wait refused because another thread captures a CUDA graph, a stream that
//! fails while a copy is waited for, a landing word that never comes, a slot's event record
//! that fails.
//!
//! Faults are per thread: a test injects them on the thread that will make the call (pinstage
//! waits for a `copy_d2h` on the calling thread), so tests running beside it are not touched.

use std::cell::RefCell;

use cudarc::driver::sys::CUresult;

use super::DriverError;

/// The driver functions a fault can be injected into.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Call {
    /// `cuStreamWriteValue32` (a landing word's write after a D2H copy).
    StreamWriteValue32,
    /// `cuStreamQuery` (a wait asking whether its stream went idle).
    StreamQuery,
    /// `cuMemcpyHtoDAsync` (a stager's copy, a step's span).
    MemcpyHtoDAsync,
    /// `cuEventRecord` (a slot's event after its copy).
    EventRecord,
}

/// What an injected fault does to the call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fault {
    /// `CUDA_ERROR_NOT_SUPPORTED`, the driver not called.
    NotSupported,
    /// `CUDA_ERROR_STREAM_CAPTURE_IMPLICIT` (another thread's global-mode capture refused the
    /// call), the driver not called.
    CaptureRefused,
    /// `CUDA_ERROR_UNKNOWN`, the driver not called.
    Failed,
    /// Success without calling the driver: the call's effect never happens (a stream query
    /// reports "not ready").
    Skipped,
    /// The driver called as usual (to let earlier calls through before a later one fails).
    Through,
}

impl Fault {
    /// The error the call returns, or `None` for [`Fault::Skipped`] and [`Fault::Through`].
    pub(crate) fn error(self, call: &'static str) -> Option<DriverError> {
        let code = match self {
            Fault::NotSupported => CUresult::CUDA_ERROR_NOT_SUPPORTED,
            Fault::CaptureRefused => CUresult::CUDA_ERROR_STREAM_CAPTURE_IMPLICIT,
            Fault::Failed => CUresult::CUDA_ERROR_UNKNOWN,
            Fault::Skipped | Fault::Through => return None,
        };
        Some(DriverError::new(call, code))
    }
}

thread_local! {
    /// This thread's faults: (call, fault, calls left).
    static FAULTS: RefCell<Vec<(Call, Fault, u32)>> = const { RefCell::new(Vec::new()) };
}

/// This thread's next `times` calls of `call` meet `fault` (after any injected before).
pub fn inject(call: Call, fault: Fault, times: u32) {
    FAULTS.with(|f| f.borrow_mut().push((call, fault, times)));
}

/// Removes this thread's faults; returns how many injected calls were never made.
pub fn clear() -> u32 {
    FAULTS.with(|f| f.borrow_mut().drain(..).map(|(_, _, n)| n).sum())
}

/// The fault the next call of `call` on this thread meets, if any (used up by this call);
/// [`Fault::Through`] is used up and reported as none.
pub(crate) fn take(call: Call) -> Option<Fault> {
    take_any(call).filter(|&f| f != Fault::Through)
}

fn take_any(call: Call) -> Option<Fault> {
    FAULTS.with(|f| {
        let mut f = f.borrow_mut();
        let i = f.iter().position(|&(c, _, n)| c == call && n > 0)?;
        f[i].2 -= 1;
        let fault = f[i].1;
        if f[i].2 == 0 {
            f.remove(i);
        }
        Some(fault)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn faults_are_used_up_in_order_per_call_and_stay_on_their_thread() {
        inject(Call::StreamQuery, Fault::CaptureRefused, 2);
        inject(Call::StreamQuery, Fault::Failed, 1);
        inject(Call::StreamWriteValue32, Fault::Skipped, 1);
        std::thread::spawn(|| assert_eq!(take(Call::StreamQuery), None))
            .join()
            .unwrap();
        assert_eq!(take(Call::StreamWriteValue32), Some(Fault::Skipped));
        assert_eq!(take(Call::StreamWriteValue32), None);
        assert_eq!(take(Call::StreamQuery), Some(Fault::CaptureRefused));
        assert_eq!(take(Call::StreamQuery), Some(Fault::CaptureRefused));
        assert_eq!(take(Call::StreamQuery), Some(Fault::Failed));
        assert_eq!(take(Call::StreamQuery), None);
        inject(Call::StreamQuery, Fault::NotSupported, 3);
        assert_eq!(take(Call::StreamQuery), Some(Fault::NotSupported));
        assert_eq!(clear(), 2);
        assert_eq!(take(Call::StreamQuery), None);
    }

    #[test]
    fn each_fault_reports_the_error_its_callers_tell_apart() {
        let e = Fault::NotSupported.error("x").unwrap();
        assert!(e.is_not_supported() && !e.is_capture_error());
        let e = Fault::CaptureRefused.error("x").unwrap();
        assert!(e.is_capture_error() && !e.is_not_supported());
        let e = Fault::Failed.error("x").unwrap();
        assert!(!e.is_capture_error() && !e.is_not_supported());
        assert_eq!(e.call(), "x");
        assert_eq!(Fault::Skipped.error("x"), None);
        assert_eq!(Fault::Through.error("x"), None);
        inject(Call::MemcpyHtoDAsync, Fault::Through, 1);
        inject(Call::MemcpyHtoDAsync, Fault::Failed, 1);
        assert_eq!(take(Call::MemcpyHtoDAsync), None, "let through");
        assert_eq!(take(Call::MemcpyHtoDAsync), Some(Fault::Failed));
        assert_eq!(clear(), 0);
    }
}
