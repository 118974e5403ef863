//! `PendingCopy`: a copy in flight, from `copy_d2h_async` or `copy_h2d_async`.

use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use pyo3::prelude::*;

use super::import::Imported;
use super::wait::parse_timeout;
use super::wait::{wait_for, wait_interruptibly};
use crate::blocks::{InFlight, Ticket};
use crate::cuda::Event;

/// A raw pointer that may cross `py.detach`: the memory behind it is kept alive by an object
/// held in the caller's frame (the imported source, the result array).
pub(crate) struct SendPtr<P>(pub(crate) P);
// SAFETY: see the type: the pointer is only used while its owner, on the caller's frame, lives.
unsafe impl<P> Send for SendPtr<P> {}

/// A copy in flight (from ``copy_d2h_async``, ``copy_h2d_async``, ``BlockMover.offload`` or
/// ``.load``): ``done()``,
/// ``wait(timeout=None)``. It keeps the source and the destination alive; dropped before the
/// copy completed, it leaves them to pinstage, which lets them go once the copy completed
/// (never blocking the drop).
#[pyclass(frozen, module = "pinstage._native")]
pub(crate) struct PendingCopy {
    /// The copy's event until a wait saw it complete. Shared, so threads waiting at once all
    /// wait on it (none may see `None` while the copy still runs).
    event: Mutex<Option<Arc<Event>>>,
    /// The result array (D2H) or the destination (H2D), handed back by `wait`.
    array: Py<PyAny>,
    /// The source, kept alive (a pinned H2D source unchanged) until the copy completed.
    src: Mutex<Option<Imported>>,
    /// About how long the copy takes once it runs: how long a wait stays busy.
    expected: Duration,
    /// A block move issued in the background: pending until the mover's thread issued it
    /// (`event` is recorded then, and captures nothing before).
    gate: Option<Arc<Ticket>>,
    /// Returned by `copy_h2d`, which completes: its `wait()` and `done()` warn (0.3 only).
    deprecated: bool,
    /// `wait()` returns `array` (else None: `array` is only kept alive).
    hands_back: bool,
}

impl PendingCopy {
    /// A copy of `src`'s bytes that completes with `event` (`None`: completed).
    pub(crate) fn new(event: Option<Event>, array: Py<PyAny>, src: Imported) -> Self {
        Self {
            event: Mutex::new(event.map(Arc::new)),
            array,
            expected: crate::cuda::wait::copy_time(src.view.nbytes()),
            src: Mutex::new(Some(src)),
            gate: None,
            deprecated: false,
            hands_back: true,
        }
    }

    /// A block move of `bytes` that completes with `inflight` (`None`: completed) and needs
    /// `held` alive until then; `wait()` returns None.
    pub(crate) fn moving(inflight: Option<InFlight>, held: Py<PyAny>, bytes: usize) -> Self {
        let (event, gate) = match inflight {
            None => (None, None),
            Some(InFlight::Event(e)) => (Some(Arc::new(e)), None),
            Some(InFlight::Background(t)) => (Some(Arc::clone(t.event())), Some(t)),
        };
        Self {
            event: Mutex::new(event),
            array: held,
            expected: crate::cuda::wait::copy_time(bytes),
            src: Mutex::new(None),
            gate,
            deprecated: false,
            hands_back: false,
        }
    }

    /// Waits (GIL released, Ctrl-C answered) until a move in the background was issued:
    /// `Ok(false)` when `deadline` passed first.
    fn wait_issued(&self, py: Python<'_>, deadline: Option<std::time::Instant>) -> PyResult<bool> {
        match &self.gate {
            Some(g) => wait_for(py, deadline, self.expected, || g.issued()),
            None => Ok(true),
        }
    }

    /// The handle `copy_h2d` returns (0.3): its `wait()` and `done()` still work, and warn.
    pub(crate) fn deprecated_handle(mut self) -> Self {
        self.deprecated = true;
        self
    }

    /// Waits for the copy (GIL released, Ctrl-C answered), for a call that completes.
    pub(crate) fn wait_quietly(&self, py: Python<'_>) -> PyResult<()> {
        self.wait_inner(py, None).map(|_| ())
    }

    fn warn_if_deprecated(&self, py: Python<'_>, call: &str) -> PyResult<()> {
        if self.deprecated {
            super::errors::deprecated(
                py,
                &format!("copy_h2d(dst, src).{call}"),
                "copy_h2d(dst, src) alone (it returns once src may change), or \
                 copy_h2d_async(dst, src) for a PendingCopy",
            )?;
        }
        Ok(())
    }

    fn wait_inner(
        &self,
        py: Python<'_>,
        timeout: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Py<PyAny>> {
        let (timeout, deadline) = parse_timeout(timeout)?;
        let timed_out = || {
            pyo3::exceptions::PyTimeoutError::new_err(format!(
                "the copy did not complete within {} s",
                timeout.unwrap_or_default()
            ))
        };
        let ev = self.event.lock().clone();
        if ev.is_some() && !self.wait_issued(py, deadline)? {
            return Err(timed_out());
        }
        if let Some(ev) = ev {
            let done = wait_interruptibly(py, &ev, deadline, self.expected);
            if !matches!(done, Ok(true)) {
                done?;
                return Err(timed_out());
            }
            // Completed: every waiter may let the event go.
            *self.event.lock() = None;
        }
        drop(self.src.lock().take());
        Ok(if self.hands_back {
            self.array.clone_ref(py)
        } else {
            py.None()
        })
    }

    /// Whether the copy completed (never blocks).
    pub(crate) fn is_done(&self) -> crate::Result<bool> {
        if let Some(g) = &self.gate
            && !g.issued()?
        {
            return Ok(false);
        }
        match &*self.event.lock() {
            Some(ev) => ev.query(),
            None => Ok(true),
        }
    }
}

#[pymethods]
impl PendingCopy {
    /// Whether the copy completed (never blocks).
    ///
    /// Raises:
    ///     CudaDriverError: the copy failed.
    fn done(&self, py: Python<'_>) -> PyResult<bool> {
        self.warn_if_deprecated(py, "done()")?;
        Ok(self.is_done()?)
    }

    /// Waits for the copy with the GIL released and returns the result array.
    ///
    /// Parameters:
    ///     timeout (float, optional): seconds to wait at most; None waits for as long as it takes.
    ///
    /// Returns:
    ///     the result array (``copy_d2h_async``), the destination (``copy_h2d_async``), or None
    ///     (a ``BlockMover`` move).
    ///
    /// Raises:
    ///     TimeoutError: not complete within ``timeout``. KeyboardInterrupt: Ctrl-C (answered within
    ///     about 20 ms). Either way the copy stays pending and guarded, and ``wait()`` may be called
    ///     again. PinstageValueError: a negative, NaN or infinite timeout. CudaDriverError: the copy
    ///     failed.
    #[pyo3(signature = (timeout=None))]
    fn wait(&self, py: Python<'_>, timeout: Option<&Bound<'_, PyAny>>) -> PyResult<Py<PyAny>> {
        self.warn_if_deprecated(py, "wait()")?;
        self.wait_inner(py, timeout)
    }

    /// Makes later work on ``stream`` wait for the copy on the device; the host does not wait
    /// (for a ``BlockMover`` move in the background, until the mover's thread issued it; so
    /// ``stream`` must not wait for anything the caller does after this call).
    /// A framework's stream can then use the copied data (and the copy's destination keeps
    /// being held by this handle until the copy completed).
    ///
    /// Parameters:
    ///     stream: a torch or cupy stream, a ``__cuda_stream__`` object or an int handle of the
    ///         copy's device.
    ///
    /// Raises:
    ///     PinstageTypeError: ``stream`` is not a stream. CudaDriverError: the driver refused it.
    fn stream_wait(&self, py: Python<'_>, stream: &Bound<'_, PyAny>) -> PyResult<()> {
        let Some(handle) = super::stream::parse_stream(Some(stream))? else {
            return Err(super::errors::type_err(
                "stream_wait(stream): stream must be a torch or cupy stream, a __cuda_stream__ \
                 object or an int, got None",
            ));
        };
        let ev = self.event.lock().clone();
        if let Some(ev) = ev {
            self.wait_issued(py, None)?;
            ev.wait_on(handle)?;
        }
        Ok(())
    }

    fn __repr__(&self) -> PyResult<String> {
        Ok(format!(
            "PendingCopy(done={})",
            super::args::py_bool(self.is_done()?)
        ))
    }
}

impl Drop for PendingCopy {
    fn drop(&mut self) {
        crate::stamps::stamp!("pending dropped");
        // Never release the source (or let the destination die) while the copy runs: they
        // linger until it completed, without blocking here.
        if let Some(ev) = self.event.get_mut().take() {
            // A pyclass drops with the GIL held (attach only confirms it).
            let array = Python::attach(|py| std::mem::replace(&mut self.array, py.None()));
            let until = match self.gate.take() {
                Some(g) => super::linger::Until::Move(g),
                None => super::linger::Until::Event(ev),
            };
            super::linger::linger(super::linger::Lingering {
                until,
                array: Some(array),
                src: self.src.get_mut().take(),
            });
        }
    }
}
