//! Per-device state of the Python module: the device and its pinned pools, made at the first
//! use of each device.

use std::sync::OnceLock;

use crate::Device;
use crate::error::{Error, Result};
use crate::host::PinnedPool;

/// Per-device state shared by the module: the retained device and its pinned pools.
pub(crate) struct DeviceState {
    pub(crate) device: Device,
    /// `copy_d2h`'s and `empty_host`'s results (`set_pool_budget`).
    pub(crate) pool: PinnedPool,
    /// `alloc_pinned_numpy`'s arrays without `pool=`: recycled apart from the results, so
    /// long-lived arrays never take the results' budget.
    pub(crate) arrays: PinnedPool,
}

static DEVICES: OnceLock<Vec<OnceLock<DeviceState>>> = OnceLock::new();
static POOL_BUDGET: std::sync::atomic::AtomicUsize =
    std::sync::atomic::AtomicUsize::new(crate::host::DEFAULT_BUDGET);

pub(crate) fn device_state(ordinal: i32) -> Result<&'static DeviceState> {
    let probe = crate::driver::probe().map_err(Error::unavailable)?;
    let table = DEVICES.get_or_init(|| {
        (0..probe.device_count.max(0))
            .map(|_| OnceLock::new())
            .collect()
    });
    let slot = usize::try_from(ordinal)
        .ok()
        .and_then(|i| table.get(i))
        .ok_or(Error::NoSuchDevice {
            ordinal,
            count: probe.device_count,
        })?;
    if let Some(s) = slot.get() {
        return Ok(s);
    }
    let device = Device::get(ordinal)?;
    // Int stream handles are checked against the driver's layout, learnt from two streams made
    // for it: made here, at the first use of a device, not in a copy's call.
    crate::cuda::learn_layout();
    let pool = PinnedPool::new(&device, pool_budget());
    let arrays = PinnedPool::new(&device, crate::host::DEFAULT_BUDGET);
    Ok(slot.get_or_init(|| DeviceState {
        device,
        pool,
        arrays,
    }))
}

/// Waits for all work queued on every device pinstage has used in this process (each one's
/// context synchronized), so no copy still reads or writes memory about to be unregistered.
/// Errors (a failed context) are left to the next call that meets them.
pub(crate) fn synchronize_used_devices() {
    for s in used() {
        if let Ok(cur) = s.device.enter() {
            let _ = cur.synchronize();
        }
    }
}

/// The devices used so far in this process.
pub(crate) fn used() -> impl Iterator<Item = &'static DeviceState> {
    DEVICES
        .get()
        .into_iter()
        .flatten()
        .filter_map(OnceLock::get)
}

/// The pinned byte budget of the result pools (`set_pool_budget`).
pub(crate) fn pool_budget() -> usize {
    POOL_BUDGET.load(std::sync::atomic::Ordering::Relaxed)
}

/// Sets the result pools' budget, for the devices used so far and those used later.
pub(crate) fn set_pool_budget(nbytes: usize) {
    POOL_BUDGET.store(nbytes, std::sync::atomic::Ordering::Relaxed);
    for s in used() {
        s.pool.set_budget(nbytes);
    }
}
