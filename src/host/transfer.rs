//! What a copy between host and device hands back: how it went ([`CopyPath`]), and for a copy
//! still in flight ([`PendingCopy`]) the host memory it uses ([`HostRegion`]) until it completed.

use std::time::Duration;

use super::PinnedBuffer;
use crate::cuda::Event;
use crate::error::Result;

/// How a copy between host and device was carried out.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CopyPath {
    /// The host side is pinned: one DMA.
    Pinned,
    /// The host side is pageable: through pinstage's pinned bounce buffers.
    Bounced,
    /// The other side was host memory too: a plain memcpy.
    Host,
    /// Nothing to copy.
    Empty,
}

/// Owned host memory a copy in flight reads or writes, handed back when the copy completed.
///
/// # Safety
/// Implementors return the same stable region from every call to `region`: its address must not
/// change while the value is alive (it may be moved, the bytes may not).
pub unsafe trait HostRegion: Send + 'static {
    /// Start and length of the region.
    fn region(&mut self) -> (*mut u8, usize);
}

// SAFETY: the heap block of a PinnedBuffer does not move with the value.
unsafe impl HostRegion for PinnedBuffer {
    fn region(&mut self) -> (*mut u8, usize) {
        (self.as_mut_ptr(), self.len())
    }
}

// SAFETY: a Vec's heap block does not move with the value (we never push to it).
unsafe impl HostRegion for Vec<u8> {
    fn region(&mut self) -> (*mut u8, usize) {
        (self.as_mut_ptr(), self.len())
    }
}

/// A copy in flight and the host region it uses (`crate::d2h::copy_d2h_async`,
/// `crate::h2d::copy_h2d_async`). [`PendingCopy::wait`] hands the region back once the copy
/// completed; dropped before, the region goes to pinstage's reaper thread, which lets it go
/// once the copy completed (the drop never blocks).
pub struct PendingCopy<B: HostRegion> {
    buf: Option<B>,
    event: Option<Event>,
    path: CopyPath,
    /// About how long the copy takes once it runs (how long a wait stays busy).
    expected: Duration,
}

impl<B: HostRegion> std::fmt::Debug for PendingCopy<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PendingCopy")
            .field("path", &self.path)
            .field("done", &self.is_done())
            .finish()
    }
}

impl<B: HostRegion> PendingCopy<B> {
    /// A copy of `bytes` over `path` that completes with `event` (`None`: completed).
    pub(crate) fn new(buf: B, event: Option<Event>, path: CopyPath, bytes: usize) -> Self {
        Self {
            buf: Some(buf),
            event,
            path,
            expected: crate::cuda::wait::copy_time(bytes),
        }
    }

    /// How the copy was carried out.
    pub fn path(&self) -> CopyPath {
        self.path
    }

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
    /// handed back, since the driver did not say that the copy stopped using it.
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
        if let (Some(e), Some(buf)) = (self.event.take(), self.buf.take()) {
            super::reaper::free_after(vec![e], buf);
        }
    }
}
