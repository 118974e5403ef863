//! RAII over the driver: a device and its primary context ([`Device`], with [`Current`], the
//! proof that its context is current on this thread), streams and events.

mod device;
mod event;
// Used by the Python layer, which takes stream handles as integers.
#[cfg(any(feature = "python", test))]
mod handle_check;
mod pci;
mod stream;
pub(crate) mod wait;

pub use crate::driver::{DISABLE_ENV, DriverError, Probe, probe};
pub use crate::error::{DropErrors, drop_errors};
pub use device::{Current, Device, cuda_available, current_device, device_count};
pub(crate) use event::TimedEvent;
pub use event::{Event, SlotEvent};
#[cfg(feature = "python")]
pub(crate) use handle_check::{Liveness, learn_layout, liveness};
pub use stream::{Stream, StreamHandle};
