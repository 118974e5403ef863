//! # pinstage
//!
//! Moves data between host memory and CUDA device memory as fast as the PCIe link allows, through
//! the CUDA driver API alone (no kernels, fills or device-to-device copies: no SM work).
//!
//! - [`PinnedBuffer`] and [`PinnedPool`]: page-locked host memory, pooled.
//! - [`PinnedStager`] / [`Stager`]: a ring of pinned buffers for small host-to-device copies
//!   issued beside a live CUDA graph: one non-blocking copy per call, slots guarded by their own
//!   events, claimed with atomics. [`H2DMirror`] skips a copy whose values the destination holds.
//! - [`copy_d2h`] / [`copy_d2h_async`]: device-to-host into pinned memory at line rate, or into
//!   pageable memory through a pinned bounce ring.
//! - [`DeviceView`]: a validated DLPack tensor ([`dlpack::validate`]).
//!
//! libcuda is loaded at run time: the crate builds without a CUDA toolkit and, without a driver,
//! every CUDA entry returns [`Error::CudaUnavailable`].
#![warn(missing_docs)]
#![deny(unsafe_op_in_unsafe_fn)]
#![warn(clippy::undocumented_unsafe_blocks)]

mod d2h;
mod device;
pub mod dlpack;
mod driver;
mod dtype;
mod error;
mod mirror;
mod pinned;
mod pool;
mod ring;
mod stager;
mod sync;

#[cfg(feature = "python")]
mod python;

pub use d2h::{
    BOUNCE_CHUNK, BOUNCE_DEPTH, D2HPath, HostRegion, PendingCopy, copy_d2h, copy_d2h_async,
    release_bounce_buffers,
};
pub use device::{
    ContextGuard, Device, DeviceBuffer, Event, Stream, StreamHandle, cuda_available,
    current_context, device_count,
};
pub use dlpack::{DeviceView, DlpackError, MemoryKind};
pub use driver::{DISABLE_ENV, DriverError, Probe, probe};
pub use dtype::{Bool8, DType, Element};
pub use error::{Error, Result};
pub use mirror::H2DMirror;
pub use pinned::{PinnedBuffer, PinnedFlags, is_pinned, live_pinned_bytes};
pub use pool::{DEFAULT_BUDGET, PinnedPool, PoolBlock, PoolStats, size_class};
pub use stager::{CopyOutcome, DEFAULT_DEPTH, DEFAULT_NUMEL, PinnedStager, Stager, StagerStats};

/// Internals exposed for the criterion benches only; not a stable API.
#[doc(hidden)]
pub mod bench_internals {
    /// The slot-claim ring.
    pub struct Ring(crate::ring::Ring);

    impl Ring {
        /// A ring of `depth` idle slots.
        pub fn new(depth: usize) -> Self {
            Self(crate::ring::Ring::new(depth))
        }

        /// Claims a slot and releases it again (as IN_FLIGHT).
        pub fn claim_release(&self) -> usize {
            let c = self.0.claim();
            self.0.release(c.index, true);
            c.index
        }
    }

    /// Writes values then padding into `dst` (as the stager does into a slot buffer).
    pub fn write_padded(dst: &mut [u8], values: &[u8], pad: &[u8]) {
        assert!(values.len() <= dst.len() && (dst.len() - values.len()) % pad.len() == 0);
        assert!(
            512 % pad.len() == 0 && !values.as_ptr_range().contains(&(dst.as_ptr() as *const u8))
        );
        // SAFETY: checked above: dst holds `dst.len()` bytes, values fit, pad divides the rest.
        unsafe {
            crate::stager::write_padded_for_bench(dst.as_mut_ptr(), values, Some(pad), dst.len())
        }
    }
}

/// Measures the host cost of each driver call on the small-copy path (ns per call), on device 0.
#[doc(hidden)]
pub fn driver_costs(iters: usize) -> Result<Vec<(&'static str, f64)>> {
    use std::time::Instant;
    let dev = Device::new(0)?;
    let stream = Stream::new(&dev)?;
    let s = stream.handle();
    let mut wc = PinnedBuffer::new(&dev, 16384, PinnedFlags::WRITE_COMBINED)?;
    let mut plain = PinnedBuffer::new(&dev, 16384, PinnedFlags::PORTABLE)?;
    let dbuf = DeviceBuffer::new(&dev, 16384)?;
    let ev = Event::new(&dev)?;
    let _g = dev.enter()?;
    let values = vec![7u8; 1024];
    let mut out = Vec::new();
    let mut time = |name: &'static str, f: &mut dyn FnMut() -> Result<()>| -> Result<()> {
        for _ in 0..100 {
            f()?;
        }
        stream.synchronize()?;
        let t0 = Instant::now();
        for _ in 0..iters {
            f()?;
        }
        let ns = t0.elapsed().as_nanos() as f64 / iters as f64;
        stream.synchronize()?;
        out.push((name, ns));
        Ok(())
    };
    time("cuCtxGetCurrent", &mut || {
        Ok(driver::ctx_get_current().map(|_| ())?)
    })?;
    // SAFETY (all closures below): our live stream, event and buffers, context current; copies
    // read pinned buffers that outlive the final synchronize.
    time("cuStreamIsCapturing", &mut || {
        Ok(unsafe { driver::stream_is_capturing(s.raw()) }.map(|_| ())?)
    })?;
    time("cuEventQuery (complete)", &mut || ev.query().map(|_| ()))?;
    time("cuEventRecord", &mut || ev.record_entered(s))?;
    let (wp, pp) = (wc.as_mut_ptr() as usize, plain.as_mut_ptr() as usize);
    time("cuMemcpyHtoDAsync 1 KiB pinned WC", &mut || {
        Ok(unsafe { driver::memcpy_htod_async(dbuf.ptr(), wp as *const _, 1024, s.raw()) }?)
    })?;
    time("cuMemcpyHtoDAsync 16 KiB pinned WC", &mut || {
        Ok(unsafe { driver::memcpy_htod_async(dbuf.ptr(), wp as *const _, 16384, s.raw()) }?)
    })?;
    time("cuMemcpyHtoDAsync 16 KiB pinned", &mut || {
        Ok(unsafe { driver::memcpy_htod_async(dbuf.ptr(), pp as *const _, 16384, s.raw()) }?)
    })?;
    time("write 1 KiB values + 15 KiB pad into WC", &mut || {
        bench_internals::write_padded(wc.as_mut_slice(), &values, &[0xFF; 4]);
        Ok(())
    })?;
    time(
        "write 1 KiB values + 15 KiB pad into plain pinned",
        &mut || {
            bench_internals::write_padded(plain.as_mut_slice(), &values, &[0xFF; 4]);
            Ok(())
        },
    )?;
    let st = PinnedStager::<i32>::new(0, 256, 8)?;
    let view = dbuf.view(DType::I32);
    let v: Vec<i32> = (0..256).collect();
    time("PinnedStager::copy_ 256 of 4096 int32 padded", &mut || {
        st.copy_(&view, &v, Some(-1), None, s).map(|_| ())
    })?;
    Ok(out)
}
