//! RAII over the driver: a device and its primary context ([`Device`], with [`Current`], the
//! proof that its context is current on this thread), streams and events.

mod device;
mod event;
mod stream;

pub use device::{Current, Device, cuda_available, device_count};
pub use event::Event;
pub use stream::{Stream, StreamHandle};
