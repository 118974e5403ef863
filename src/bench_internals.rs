//! Internals exposed for the benches only; not a stable API.

use crate::{
    DType, Device, DeviceBuffer, Event, PinnedBuffer, PinnedFlags, PinnedStager, Result, Stream,
    StreamHandle, driver,
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
    // The loops above issue back to back, so once the stream's queue is full each call also
    // waits for the copy engine: they measure max(host cost, GPU time per copy). A burst of a
    // few calls after a synchronize measures the host cost alone (the queue never fills).
    let mut burst = |name: &'static str,
                     stream_raw: StreamHandle,
                     f: &mut dyn FnMut(StreamHandle) -> Result<()>|
     -> Result<()> {
        const BURST: usize = 8;
        let reps = (iters / BURST).max(10);
        let mut per_call = Vec::with_capacity(reps);
        for _ in 0..reps {
            // SAFETY: our stream or the legacy stream; context current.
            unsafe { driver::stream_synchronize(stream_raw.raw()) }?;
            let t0 = Instant::now();
            for _ in 0..BURST {
                f(stream_raw)?;
            }
            per_call.push(t0.elapsed().as_nanos() as f64 / BURST as f64);
        }
        // SAFETY: as above.
        unsafe { driver::stream_synchronize(stream_raw.raw()) }?;
        per_call.sort_by(f64::total_cmp);
        out.push((name, per_call[per_call.len() / 2]));
        Ok(())
    };
    // Eight separate 16 KiB buffers (as the stager's slots were) and one 128 KiB buffer carved
    // into eight: does the driver's lookup of the source allocation cost more when consecutive
    // copies come from different allocations?
    let separate = (0..8)
        .map(|_| PinnedBuffer::new(&dev, 16384, PinnedFlags::WRITE_COMBINED))
        .collect::<Result<Vec<_>>>()?;
    let arena = PinnedBuffer::new(&dev, 8 * 16384, PinnedFlags::WRITE_COMBINED)?;
    let sep: Vec<usize> = separate.iter().map(|b| b.as_ptr() as usize).collect();
    let slices: Vec<usize> = (0..8).map(|i| arena.as_ptr() as usize + i * 16384).collect();
    let events = (0..8).map(|_| Event::new(&dev)).collect::<Result<Vec<_>>>()?;
    let copy = |src: usize, h: StreamHandle| -> Result<()> {
        // SAFETY: `src` is 16 KiB of one of our pinned buffers and `dbuf` holds 16 KiB; both
        // outlive the synchronize that ends each burst; `h` is ours or the legacy stream.
        Ok(unsafe { driver::memcpy_htod_async(dbuf.ptr(), src as *const _, 16384, h.raw()) }?)
    };
    let generic = |src: usize, h: StreamHandle| -> Result<()> {
        // SAFETY: as `copy`.
        Ok(unsafe { driver::memcpy_async(dbuf.ptr(), src as u64, 16384, h.raw()) }?)
    };
    let mut i = 0usize;
    let mut next = move || {
        i = (i + 1) % 8;
        i
    };
    let leg = StreamHandle::LEGACY;
    burst("burst of 8: cuMemcpyHtoDAsync 16 KiB, one buffer", s, &mut |h| copy(wp, h))?;
    burst("burst of 8: ... one buffer, legacy stream", leg, &mut |h| copy(wp, h))?;
    burst("burst of 8: ... 8 separate buffers in turn", s, &mut |h| copy(sep[next()], h))?;
    burst("burst of 8: ... 8 slices of one buffer in turn", s, &mut |h| {
        copy(slices[next()], h)
    })?;
    burst("burst of 8: cuMemcpyAsync (generic) 16 KiB, one buffer", s, &mut |h| {
        generic(wp, h)
    })?;
    burst("burst of 8: cuEventRecord", s, &mut |h| ev.record_entered(h))?;
    burst("burst of 8: cuEventRecord, legacy stream", leg, &mut |h| ev.record_entered(h))?;
    burst("burst of 8: cuStreamIsCapturing, legacy stream", leg, &mut |h| {
        // SAFETY: the legacy stream; context current.
        Ok(unsafe { driver::stream_is_capturing(h.raw()) }.map(|_| ())?)
    })?;
    burst("burst of 8: copy + cuEventRecord (8 events), one buffer", s, &mut |h| {
        let k = next();
        copy(wp, h)?;
        events[k].record_entered(h)
    })?;
    burst("burst of 8: copy + record, one buffer, legacy stream", leg, &mut |h| {
        let k = next();
        copy(wp, h)?;
        events[k].record_entered(h)
    })?;
    burst("burst of 8: query + copy + record, 8 slices", s, &mut |h| {
        let k = next();
        events[k].query()?;
        copy(slices[k], h)?;
        events[k].record_entered(h)
    })?;
    burst("burst of 8: query + copy + record, 8 separate", s, &mut |h| {
        let k = next();
        events[k].query()?;
        copy(sep[k], h)?;
        events[k].record_entered(h)
    })?;
    burst("burst of 8: query after query (complete)", s, &mut |_| {
        let k = next();
        events[k].query().map(|_| ())
    })?;
    // Does a copy run without a query or a synchronize submitting it? Issue one, leave the
    // driver alone for 30 us (ample for a 16 KiB copy), then ask: the share ready, in percent.
    let mut ready = 0usize;
    let trials = 200;
    for _ in 0..trials {
        stream.synchronize()?;
        copy(wp, s)?;
        ev.record_entered(s)?;
        let t0 = Instant::now();
        while t0.elapsed() < std::time::Duration::from_micros(30) {
            std::hint::spin_loop();
        }
        ready += usize::from(ev.query()?);
    }
    stream.synchronize()?;
    let done_share = 100.0 * ready as f64 / trials as f64;
    burst("burst of 8: PinnedStager::copy_", s, &mut |h| {
        st.copy_(&view, &v, Some(-1), None, h).map(|_| ())
    })?;
    burst("burst of 8: PinnedStager::copy_, legacy stream", leg, &mut |h| {
        st.copy_(&view, &v, Some(-1), None, h).map(|_| ())
    })?;
    out.push((
        "copies done 30 us after issue, no query between (%)",
        done_share,
    ));
    Ok(out)
}
