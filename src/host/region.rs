//! Owned host memory a copy in flight may write: what an asynchronous copy holds until it
//! completed.

use super::PinnedBuffer;

/// Host memory a pending copy ([`crate::d2h::PendingCopy`]) writes into and hands back when done.
///
/// # Safety
/// Implementors return the same stable region from every call to `region`: its address must not
/// change while the value is alive (it may be moved, the bytes may not).
pub unsafe trait HostRegion: Send {
    /// Start and length of the writable region.
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
