//! Asynchronous copies into owned host regions.

use super::start_d2h;
use crate::cuda::{Device, Event, StreamHandle};
use crate::error::Result;
use crate::host::HostRegion;
use crate::view::DeviceView;

/// An asynchronous D2H copy into an owned host region. The region is handed back by
/// [`PendingCopy::wait`]; dropping a pending copy waits for it first, so the region is never
/// freed while the copy writes it.
pub struct PendingCopy<B: HostRegion> {
    buf: Option<B>,
    event: Option<Event>,
    /// About how long the copy takes once it runs (how long a wait stays busy).
    expected: std::time::Duration,
}

impl<B: HostRegion> PendingCopy<B> {
    /// Whether the copy completed (errors count as done: `wait` reports them).
    pub fn is_done(&self) -> bool {
        self.event
            .as_ref()
            .is_none_or(|e| e.query().unwrap_or(true))
    }

    /// Waits for the copy and returns the region.
    ///
    /// # Errors
    /// [`crate::Error::Driver`] if waiting failed: the region is then leaked, never freed nor
    /// handed back, since the driver did not say that the copy stopped writing it.
    pub fn wait(mut self) -> Result<B> {
        let r = match self.event.take() {
            Some(e) => e.wait_expecting(self.expected),
            None => Ok(()),
        };
        let buf = self.buf.take().expect("buffer present until wait");
        match r {
            Ok(()) => Ok(buf),
            Err(e) => {
                std::mem::forget(buf);
                Err(e)
            }
        }
    }
}

impl<B: HostRegion> Drop for PendingCopy<B> {
    fn drop(&mut self) {
        if let Some(e) = self.event.take()
            && let Err(err) = e.synchronize()
        {
            // The copy may still write the region: leaked, not freed. Drop never panics: the
            // error is recorded.
            std::mem::forget(self.buf.take());
            if let crate::Error::Driver(err) = err {
                crate::error::record_drop_error(err);
            }
        }
    }
}

/// Starts copying `src` into `dst` and returns at once. A pinned `dst` gets a truly
/// asynchronous DMA; a pageable one is filled through the bounce ring before this returns
/// (still correct, not overlapped).
///
/// # Errors
/// As [`super::copy_d2h`].
pub fn copy_d2h_async<B: HostRegion>(
    device: &Device,
    src: &DeviceView<'_>,
    mut dst: B,
    stream: StreamHandle,
) -> Result<PendingCopy<B>> {
    let (ptr, len) = dst.region();
    // SAFETY: the region is owned by `dst`, which the PendingCopy keeps (and waits for before
    // handing back or dropping); HostRegion guarantees the address is stable.
    let (_, done) = unsafe { start_d2h(device, src, ptr, len, stream, false, None) }?;
    Ok(PendingCopy {
        buf: Some(dst),
        event: done.into_event()?,
        expected: crate::cuda::wait::copy_time(src.nbytes()),
    })
}
