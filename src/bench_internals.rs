//! Internals exposed for the benches only; not a stable API.

use crate::{
    DType, Device, DeviceBuffer, Event, PinnedBuffer, PinnedFlags, PinnedStager, Result, Stream,
    driver,
};

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
    assert!(512 % pad.len() == 0 && !values.as_ptr_range().contains(&dst.as_ptr()));
    // SAFETY: checked above: dst holds `dst.len()` bytes, values fit, pad divides the rest.
    unsafe { crate::stager::write_padded_for_bench(dst.as_mut_ptr(), values, Some(pad), dst.len()) }
}

/// Measures the host cost of each driver call on the small-copy path (ns per call), on device 0.
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
    time("cuStreamIsCapturing", &mut || {
        // SAFETY: our live stream; context current (guard above).
        Ok(unsafe { driver::stream_is_capturing(s.raw()) }.map(|_| ())?)
    })?;
    time("cuEventQuery (complete)", &mut || ev.query().map(|_| ()))?;
    time("cuEventRecord", &mut || ev.record_entered(s))?;
    let (wp, pp) = (wc.as_mut_ptr() as usize, plain.as_mut_ptr() as usize);
    let htod = |src: usize, n: usize| -> Result<()> {
        // SAFETY: `src` is one of our 16 KiB pinned buffers and `dbuf` holds 16 KiB; both outlive
        // the stream synchronize that ends each timing loop; context current.
        Ok(unsafe { driver::memcpy_htod_async(dbuf.ptr(), src as *const _, n, s.raw()) }?)
    };
    time("cuMemcpyHtoDAsync 1 KiB pinned WC", &mut || htod(wp, 1024))?;
    time("cuMemcpyHtoDAsync 16 KiB pinned WC", &mut || {
        htod(wp, 16384)
    })?;
    time("cuMemcpyHtoDAsync 16 KiB pinned", &mut || htod(pp, 16384))?;
    time("write 1 KiB values + 15 KiB pad into WC", &mut || {
        write_padded(wc.as_mut_slice(), &values, &[0xFF; 4]);
        Ok(())
    })?;
    time(
        "write 1 KiB values + 15 KiB pad into plain pinned",
        &mut || {
            write_padded(plain.as_mut_slice(), &values, &[0xFF; 4]);
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
