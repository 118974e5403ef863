//! The slot ring shared by every stager: the claim protocol (CUDA-free, model-checked with
//! loom), the ring of slots with their events and data on a device (`slots`), and the host
//! writes into a slot.

#[cfg(any(feature = "testing", loom))]
pub mod protocol;
#[cfg(not(any(feature = "testing", loom)))]
pub(crate) mod protocol;
pub(crate) mod slots;
pub(crate) mod write;
