//! Devices, their primary contexts, and the guard that proves a context is current.

use std::marker::PhantomData;
use std::sync::Arc;

use crate::driver::{self, CUcontext, CUdevice, CUevent};
use crate::error::{Error, Result, on_drop};

/// Whether a CUDA driver is loaded and initialised, with at least one device.
pub fn cuda_available() -> bool {
    driver::probe().is_ok_and(|p| p.device_count > 0)
}

/// Number of CUDA devices, or the reason there are none.
pub fn device_count() -> Result<i32> {
    driver::probe()
        .map(|p| p.device_count)
        .map_err(Error::unavailable)
}

/// The ordinal of the device whose context is current on this thread (as torch's
/// `torch.cuda.set_device`, cupy's `Device.use()` and JAX leave it), or `None` when no context
/// is current or CUDA is unavailable.
pub fn current_device() -> Option<i32> {
    let count = device_count().ok()?;
    if driver::forked() {
        return None;
    }
    let ctx = driver::ctx::ctx_get_current().ok()?;
    if ctx.is_null() {
        return None;
    }
    let dev = driver::ctx::ctx_get_device().ok()?;
    (0..count).find(|&i| driver::ctx::device_get(i).is_ok_and(|d| d == dev))
}

/// Checks the probe and that the process was not forked after CUDA was initialised.
#[inline]
pub(crate) fn ensure_usable() -> Result<()> {
    if driver::forked() {
        return Err(Error::unavailable(
            driver::probe().err().unwrap_or_default(),
        ));
    }
    Ok(())
}

pub(super) struct DeviceInner {
    ordinal: i32,
    dev: CUdevice,
    ctx: CUcontext,
    /// Recycled events (raw handles): [`Event`]s return here on drop; destroyed with the device.
    pub(super) spare_events: parking_lot::Mutex<Vec<usize>>,
    /// The host NUMA node the device hangs off, looked up once.
    numa_node: std::sync::OnceLock<Option<u32>>,
}

// SAFETY: a CUdevice is an integer and a CUcontext a handle that the driver allows to be used
// (made current, pushed, popped) from any thread; nothing here is thread-affine.
unsafe impl Send for DeviceInner {}
// SAFETY: see Send; `&DeviceInner` only hands out copies of the handles.
unsafe impl Sync for DeviceInner {}

impl Drop for DeviceInner {
    fn drop(&mut self) {
        let spare = std::mem::take(self.spare_events.get_mut());
        if !spare.is_empty() && !driver::forked() {
            // SAFETY: our context is still retained here.
            match unsafe { driver::ctx::ctx_push(self.ctx) } {
                Ok(()) => {
                    for ev in spare {
                        // SAFETY: each was created by event_create and is destroyed once, here.
                        on_drop(unsafe { driver::event::event_destroy(ev as CUevent) });
                    }
                    on_drop(driver::ctx::ctx_pop());
                }
                Err(e) => on_drop::<()>(Err(e)),
            }
        }
        // SAFETY: balances the retain in `Device::new`.
        on_drop(unsafe { driver::ctx::primary_ctx_release(self.dev) });
    }
}

/// A CUDA device and a retained reference to its primary context (the one PyTorch, JAX and
/// CuPy use). Cheap to clone; the context is released when the last clone is dropped.
#[derive(Clone)]
pub struct Device {
    pub(super) inner: Arc<DeviceInner>,
}

impl std::fmt::Debug for Device {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Device(cuda:{})", self.inner.ordinal)
    }
}

impl PartialEq for Device {
    fn eq(&self, other: &Self) -> bool {
        self.inner.ordinal == other.inner.ordinal
    }
}

impl Eq for Device {}

impl Device {
    /// The device of a view's memory (`None`: host memory, whose copies need no device).
    ///
    /// # Errors
    /// As [`Device::get`].
    pub fn of_view(view: &crate::dlpack::DeviceView<'_>) -> Result<Option<Device>> {
        match view.memory() {
            crate::dlpack::MemoryKind::Cuda(id) => Device::get(id).map(Some),
            crate::dlpack::MemoryKind::Host => Ok(None),
        }
    }

    /// The device `ordinal`, made once per process and shared after that (a clone of the
    /// first [`Device::new`] of that ordinal).
    ///
    /// # Errors
    /// As [`Device::new`].
    pub fn get(ordinal: i32) -> Result<Self> {
        static DEVICES: parking_lot::Mutex<Vec<Device>> = parking_lot::Mutex::new(Vec::new());
        if let Some(d) = DEVICES.lock().iter().find(|d| d.ordinal() == ordinal) {
            return Ok(d.clone());
        }
        let d = Self::new(ordinal)?;
        let mut all = DEVICES.lock();
        match all.iter().find(|x| x.ordinal() == ordinal) {
            Some(x) => Ok(x.clone()),
            None => {
                all.push(d.clone());
                Ok(d)
            }
        }
    }

    /// Retains the primary context of device `ordinal`.
    ///
    /// # Errors
    /// [`Error::CudaUnavailable`] without a driver, [`Error::NoSuchDevice`] for an ordinal the
    /// driver does not report, [`Error::Driver`] if the context cannot be retained.
    pub fn new(ordinal: i32) -> Result<Self> {
        let probe = driver::probe().map_err(Error::unavailable)?;
        if probe.device_count == 0 {
            return Err(Error::unavailable("the driver reports no CUDA device"));
        }
        if ordinal < 0 || ordinal >= probe.device_count {
            return Err(Error::NoSuchDevice {
                ordinal,
                count: probe.device_count,
            });
        }
        let dev = driver::ctx::device_get(ordinal)?;
        let ctx = driver::ctx::primary_ctx_retain(dev)?;
        Ok(Self {
            inner: Arc::new(DeviceInner {
                ordinal,
                dev,
                ctx,
                spare_events: parking_lot::Mutex::new(Vec::new()),
                numa_node: std::sync::OnceLock::new(),
            }),
        })
    }

    /// The device's primary context (for the Python layer's check of a stream's device).
    #[cfg(feature = "python")]
    pub(crate) fn ctx(&self) -> CUcontext {
        self.inner.ctx
    }

    /// The device ordinal.
    pub fn ordinal(&self) -> i32 {
        self.inner.ordinal
    }

    /// Whether `ptr` lies in page-locked host memory known to the driver (asked in this
    /// device's context).
    ///
    /// # Errors
    /// As [`Device::enter`].
    pub(crate) fn is_pinned_host(&self, ptr: *const u8) -> Result<bool> {
        let _cur = self.enter()?;
        Ok(driver::mem::is_pinned_host(ptr.cast()))
    }

    /// Whether `ptr..ptr+len` is pinned host memory (its first and last bytes).
    pub(crate) fn is_pinned_range(&self, ptr: *const u8, len: usize) -> Result<bool> {
        let _cur = self.enter()?;
        Ok(driver::mem::is_pinned_range(ptr.cast(), len))
    }

    /// The host NUMA node the device hangs off (its PCI device's `numa_node` in sysfs), where
    /// pinned memory for it is best placed; `None` where the system does not say (one node,
    /// no sysfs, the driver cannot name the PCI address).
    pub fn numa_node(&self) -> Option<u32> {
        *self.inner.numa_node.get_or_init(|| {
            let bus = driver::ctx::device_pci_bus_id(self.inner.dev).ok()?;
            super::pci::pci_numa_node(&bus)
        })
    }

    /// Makes this device's primary context current for the guard's lifetime, unless it already
    /// is; the thread's previous context is current again when the guard drops.
    ///
    /// # Errors
    /// [`Error::CudaUnavailable`] in a forked child, [`Error::Driver`] if the context cannot be
    /// made current.
    #[inline]
    pub fn enter(&self) -> Result<Current<'_>> {
        ensure_usable()?;
        let cur = driver::ctx::ctx_get_current()?;
        if cur == self.inner.ctx {
            return Ok(Current::new(self, false));
        }
        // SAFETY: our context is kept alive by the retain held in `inner`.
        unsafe { driver::ctx::ctx_push(self.inner.ctx) }?;
        Ok(Current::new(self, true))
    }
}

/// Proof that a [`Device`]'s primary context is current on this thread, from
/// [`Device::enter`]. Functions that need a current context take `&Current`, so the type system
/// carries the rule. Not `Send`: it must drop on the thread that made it, which restores the
/// thread's previous context.
pub struct Current<'d> {
    device: &'d Device,
    pushed: bool,
    _not_send: PhantomData<*const ()>,
}

impl<'d> Current<'d> {
    fn new(device: &'d Device, pushed: bool) -> Self {
        Self {
            device,
            pushed,
            _not_send: PhantomData,
        }
    }

    /// The device whose context is current.
    pub fn device(&self) -> &'d Device {
        self.device
    }

    /// Blocks until all work queued in the context, on every stream, completed.
    pub(crate) fn synchronize(&self) -> Result<()> {
        Ok(driver::ctx::ctx_synchronize()?)
    }
}

impl std::fmt::Debug for Current<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Current(cuda:{})", self.device.ordinal())
    }
}

impl Drop for Current<'_> {
    fn drop(&mut self) {
        if self.pushed {
            on_drop(driver::ctx::ctx_pop());
        }
    }
}
