//! The laboratory (feature `lab`, never in a release wheel): the driver-cost and slot-check
//! experiments behind `benches/` and `scripts/gpu-run costs`. The library keeps no switch for
//! them: where they compare against an older path, that path is written out here.

use crate::driver::mem::memcpy_htod_async;
use crate::driver::stream::{stream_is_capturing, stream_write_value32};
use crate::host::PinnedFlags;
use crate::ring::protocol::{NO_MARK, Release};
use crate::ring::write::store_fence;
use crate::testing::DeviceBuffer;
use crate::{DType, Device, PinnedBuffer, PinnedStager, Result, Stream, StreamHandle};

#[cfg(feature = "python")]
pub(crate) mod python;

/// The slot-claim ring.
pub struct Ring(crate::ring::protocol::Ring);

impl Ring {
    /// A ring of `depth` idle slots.
    pub fn new(depth: usize) -> Self {
        Self(crate::ring::protocol::Ring::new(depth))
    }

    /// One copy's ring bookkeeping as the stager did it before the completion watermark: claim,
    /// a query of the claimed slot's own event whenever it was in flight, release (untracked).
    pub fn claim_query_release(&self, queries: &mut u64) -> usize {
        let c = self.0.claim();
        if c.was_in_flight() {
            *queries += 1;
        }
        self.0.release(
            c.index,
            Release::InFlight {
                mark: NO_MARK,
                begin: 0,
                done: 0,
            },
        );
        c.index
    }

    /// One copy's ring bookkeeping on a tracked stream, as the stager does it: find the stream's
    /// mark, claim, learn that the slot's last copy completed (every "event" answers complete;
    /// `queries` counts how many were asked), take the tickets, release in flight.
    pub fn claim_check_release(&self, queries: &mut u64) -> usize {
        let r = &self.0;
        let mark = r.mark(Some(7));
        let c = r.claim();
        if c.was_in_flight() {
            let _ = r.check::<()>(&c, &mut |_| {
                *queries += 1;
                Ok(true)
            });
        }
        let begin = r.begin(mark);
        let done = r.done(mark);
        r.release(c.index, Release::InFlight { mark, begin, done });
        c.index
    }

    /// Claims a slot and releases it again (as IN_FLIGHT).
    pub fn claim_release(&self) -> usize {
        let c = self.0.claim();
        self.0.release(
            c.index,
            Release::InFlight {
                mark: NO_MARK,
                begin: 0,
                done: 0,
            },
        );
        c.index
    }
}

/// Writes values then padding into `dst` (as the stager does into a slot buffer).
pub fn write_padded(dst: &mut [u8], values: &[u8], pad: &[u8]) {
    crate::testing::write_padded(dst, values, Some(pad));
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
    let ev = crate::cuda::Event::new(&dev)?;
    let cur = dev.enter()?;
    let cur = &cur;
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
        Ok(crate::driver::ctx::ctx_get_current().map(|_| ())?)
    })?;
    time("cuStreamIsCapturing", &mut || {
        // SAFETY: our live stream; context current (guard above).
        Ok(unsafe { stream_is_capturing(s.raw()) }.map(|_| ())?)
    })?;
    time("cuEventQuery (complete)", &mut || ev.query().map(|_| ()))?;
    // What every query and wait now adds: the thread's capture mode relaxed around it.
    time("capture mode relaxed and restored (2 calls)", &mut || {
        Ok(crate::driver::capture_relaxed(|| Ok(()))?)
    })?;
    time("cuEventRecord", &mut || ev.record_in(cur, s))?;
    let word = DeviceBuffer::new(&dev, 64)?;
    let mut wv = 0u32;
    time("cuStreamWriteValue32", &mut || {
        wv = wv.wrapping_add(1);
        // SAFETY: a word of our device buffer, alive past the synchronize ending the loop; our
        // stream; context current.
        Ok(unsafe { stream_write_value32(s.raw(), word.ptr(), wv) }?)
    })?;
    let (wp, pp) = (wc.as_mut_ptr() as usize, plain.as_mut_ptr() as usize);
    let htod = |src: usize, n: usize| -> Result<()> {
        // SAFETY: `src` is one of our 16 KiB pinned buffers and `dbuf` holds 16 KiB; both outlive
        // the stream synchronize that ends each timing loop; context current.
        Ok(unsafe { memcpy_htod_async(dbuf.ptr(), src as *const _, n, s.raw()) }?)
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
    let st = PinnedStager::<i32>::builder().build()?;
    let view = dbuf.view(DType::I32);
    let v: Vec<i32> = (0..256).collect();
    time("PinnedStager::copy_ 256 of 4096 int32 padded", &mut || {
        st.to(&view).pad(-1).stream(s).copy(&v).map(|_| ())
    })?;
    // The loops above issue back to back, so once the stream's queue is full each call also
    // waits for the copy engine: they measure max(host cost, GPU time per copy). "Paced" calls
    // are issued 10 us apart (the GPU finishes each copy in between), as an engine issues a
    // step's few copies among other work; only the calls are timed. Reported: the median over
    // groups of 8 consecutive calls of the group's mean, so that work done once per ring cycle
    // is counted, shared among the calls it serves.
    let mut paced = |name: &'static str,
                     h: StreamHandle,
                     f: &mut dyn FnMut(StreamHandle) -> Result<()>|
     -> Result<()> {
        const GROUP: usize = 8;
        let groups = (iters / GROUP).clamp(10, 2000);
        let mut per_call = Vec::with_capacity(groups);
        for _ in 0..GROUP {
            f(h)?;
        }
        for _ in 0..groups {
            let mut ns = 0u128;
            for _ in 0..GROUP {
                let t = Instant::now();
                while t.elapsed() < std::time::Duration::from_micros(10) {
                    std::hint::spin_loop();
                }
                let t0 = Instant::now();
                f(h)?;
                ns += t0.elapsed().as_nanos();
            }
            per_call.push(ns as f64 / GROUP as f64);
        }
        // SAFETY: our stream or the legacy stream; context current.
        h.synchronize(cur)?;
        per_call.sort_by(f64::total_cmp);
        out.push((name, per_call[per_call.len() / 2]));
        Ok(())
    };
    // Eight separate 16 KiB buffers (as the stager's slots once were) and one 128 KiB buffer
    // carved into eight (as they are now).
    let separate = (0..8)
        .map(|_| PinnedBuffer::new(&dev, 16384, PinnedFlags::WRITE_COMBINED))
        .collect::<Result<Vec<_>>>()?;
    let arena = PinnedBuffer::new(&dev, 8 * 16384, PinnedFlags::WRITE_COMBINED)?;
    let sep: Vec<usize> = separate.iter().map(|b| b.as_ptr() as usize).collect();
    let slices: Vec<usize> = (0..8)
        .map(|i| arena.as_ptr() as usize + i * 16384)
        .collect();
    let events = (0..8)
        .map(|_| crate::cuda::Event::new(&dev))
        .collect::<Result<Vec<_>>>()?;
    let copy = |src: usize, h: StreamHandle| -> Result<()> {
        // SAFETY: `src` is 16 KiB of one of our pinned buffers and `dbuf` holds 16 KiB; both
        // outlive the synchronize that ends each measurement; `h` is ours or the legacy stream.
        Ok(unsafe { memcpy_htod_async(dbuf.ptr(), src as *const _, 16384, h.raw()) }?)
    };
    let capturing = |h: StreamHandle| -> Result<()> {
        // SAFETY: ours or the legacy stream; context current.
        Ok(unsafe { stream_is_capturing(h.raw()) }.map(|_| ())?)
    };
    let write_values = |dst: usize| {
        // SAFETY: `dst` is the start of one of our 16 KiB slices and 1 KiB is written; the
        // values are not in the arena. (A copy issued from the slice 8 calls earlier may in
        // principle still read it: that could only change what lands in `dbuf`, never checked.)
        unsafe {
            std::ptr::copy_nonoverlapping(values.as_ptr(), dst as *mut u8, values.len());
        }
        store_fence();
    };
    let mut i = 0usize;
    let mut next = move || {
        i = (i + 1) % 8;
        i
    };
    let leg = StreamHandle::LEGACY;
    paced("paced: cuMemcpyHtoDAsync 16 KiB, one buffer", s, &mut |h| {
        copy(wp, h)
    })?;
    paced("paced: ... one buffer, legacy stream", leg, &mut |h| {
        copy(wp, h)
    })?;
    paced("paced: ... 8 separate buffers in turn", s, &mut |h| {
        copy(sep[next()], h)
    })?;
    paced("paced: ... 8 slices of one buffer in turn", s, &mut |h| {
        copy(slices[next()], h)
    })?;
    paced("paced: cuEventRecord", s, &mut |h| ev.record_in(cur, h))?;
    paced("paced: cuEventRecord, legacy stream", leg, &mut |h| {
        ev.record_in(cur, h)
    })?;
    paced("paced: cuEventQuery (complete)", s, &mut |_| {
        ev.query().map(|_| ())
    })?;
    paced("paced: A copy + record (8 slices, 8 events)", s, &mut |h| {
        let k = next();
        copy(slices[k], h)?;
        events[k].record_in(cur, h)
    })?;
    paced("paced: A on the legacy stream", leg, &mut |h| {
        let k = next();
        copy(slices[k], h)?;
        events[k].record_in(cur, h)
    })?;
    paced("paced: B = A + cuStreamIsCapturing", s, &mut |h| {
        let k = next();
        capturing(h)?;
        copy(slices[k], h)?;
        events[k].record_in(cur, h)
    })?;
    paced("paced: C = A + write 1 KiB into WC + sfence", s, &mut |h| {
        let k = next();
        write_values(slices[k]);
        copy(slices[k], h)?;
        events[k].record_in(cur, h)
    })?;
    paced("paced: D = A + query own event first", s, &mut |h| {
        let k = next();
        events[k].query()?;
        copy(slices[k], h)?;
        events[k].record_in(cur, h)
    })?;
    paced("paced: E = D + B + C (the stager, no sweep)", s, &mut |h| {
        let k = next();
        capturing(h)?;
        events[k].query()?;
        write_values(slices[k]);
        copy(slices[k], h)?;
        events[k].record_in(cur, h)
    })?;
    let words = DeviceBuffer::new(&dev, 64)?;
    let write_value = |h: StreamHandle, v: u32| -> Result<()> {
        // SAFETY: a word of our device buffer, alive until the synchronize that ends each
        // measurement; `h` ours or the legacy stream; context current.
        Ok(unsafe { stream_write_value32(h.raw(), words.ptr(), v) }?)
    };
    let mut val = 0u32;
    paced("paced: cuStreamWriteValue32", s, &mut |h| {
        val = val.wrapping_add(1);
        write_value(h, val)
    })?;
    paced(
        "paced: F = A + cuStreamWriteValue32 (no query)",
        s,
        &mut |h| {
            let k = next();
            val = val.wrapping_add(1);
            copy(slices[k], h)?;
            write_value(h, val)?;
            events[k].record_in(cur, h)
        },
    )?;
    paced("paced: PinnedStager::copy_", s, &mut |h| {
        st.to(&view).pad(-1).stream(h).copy(&v).map(|_| ())
    })?;
    paced("paced: PinnedStager::copy_, legacy stream", leg, &mut |h| {
        st.to(&view).pad(-1).stream(h).copy(&v).map(|_| ())
    })?;
    // Does a copy run without a query or a synchronize submitting it? Issue one, leave the
    // driver alone for 30 us (ample for a 16 KiB copy), then ask: the share ready, in percent.
    let mut ready = 0usize;
    let trials = 200;
    for _ in 0..trials {
        stream.synchronize()?;
        copy(wp, s)?;
        ev.record_in(cur, s)?;
        let t0 = Instant::now();
        while t0.elapsed() < std::time::Duration::from_micros(30) {
            std::hint::spin_loop();
        }
        ready += usize::from(ev.query()?);
    }
    stream.synchronize()?;
    out.push((
        "copies done 30 us after issue, no query between (%)",
        100.0 * ready as f64 / trials as f64,
    ));
    // The bounce rings' host side: how fast several threads copy a chunk between pageable and
    // pinned memory, each way (GB/s; `copy_h2d` fills, `copy_d2h` drains).
    let mut pinned = PinnedBuffer::new(&dev, crate::host::BOUNCE_CHUNK, PinnedFlags::PORTABLE)?;
    let mut pageable = vec![7u8; crate::host::BOUNCE_CHUNK];
    let gbs = |t: Instant, reps: usize| {
        (reps * crate::host::BOUNCE_CHUNK) as f64 / t.elapsed().as_secs_f64() / 1e9
    };
    let reps = 200;
    let t = Instant::now();
    for _ in 0..reps {
        crate::host::bounce::parallel_copy(pinned.as_mut_slice(), &pageable);
    }
    out.push(("bounce fill pageable -> pinned, 8 MiB (GB/s)", gbs(t, reps)));
    let t = Instant::now();
    for _ in 0..reps {
        crate::host::bounce::parallel_copy(&mut pageable, pinned.as_slice());
    }
    out.push((
        "bounce drain pinned -> pageable, 8 MiB (GB/s)",
        gbs(t, reps),
    ));
    Ok(out)
}

mod slot_checks;
pub use slot_checks::slot_check_costs;

/// A pinned source of `bytes` (not zeros) and a device destination, for the driver floors.
struct FloorRig {
    src: PinnedBuffer,
    dst: DeviceBuffer,
    ev: crate::cuda::Event,
}

impl FloorRig {
    fn new(dev: &Device, bytes: usize) -> Result<Self> {
        let mut src = PinnedBuffer::new(dev, bytes.max(1), PinnedFlags::PORTABLE)?;
        src.as_mut_slice().fill(7);
        Ok(Self {
            src,
            dst: DeviceBuffer::new(dev, bytes.max(1))?,
            ev: crate::cuda::Event::new(dev)?,
        })
    }

    /// One `cuMemcpyHtoDAsync` of `n` bytes at offset `off` (within the rig's bytes).
    fn copy(
        &self,
        _cur: &crate::cuda::Current<'_>,
        h: StreamHandle<'_>,
        off: usize,
        n: usize,
    ) -> Result<()> {
        assert!(off + n <= self.src.len());
        // SAFETY: pinned source and device destination of at least `off + n` bytes (checked);
        // the source is never rewritten; the context is current (`_cur`).
        unsafe {
            memcpy_htod_async(
                self.dst.ptr() + off as u64,
                self.src.as_ptr().add(off).cast(),
                n,
                h.raw(),
            )
        }?;
        Ok(())
    }
}

/// The driver's floor for one step: host ns per `cuMemcpyHtoDAsync` of `bytes` from pinned
/// memory + `cuEventRecord`, `iters` back to back on `stream` (median of `rounds`), and the
/// same with `k` copies of `bytes / k` each (what a step pays with one copy per field).
///
/// # Errors
/// Driver errors.
pub fn step_floor(
    dev: &Device,
    stream: &Stream,
    bytes: usize,
    k: usize,
    iters: usize,
    rounds: usize,
) -> Result<(f64, f64)> {
    let rig = FloorRig::new(dev, bytes)?;
    let cur = dev.enter()?;
    let h = stream.handle();
    let mut one = Vec::new();
    let mut many = Vec::new();
    let per = bytes / k.max(1);
    for _ in 0..rounds {
        let t0 = std::time::Instant::now();
        for _ in 0..iters {
            rig.copy(&cur, h, 0, bytes)?;
            rig.ev.record_in(&cur, h)?;
        }
        one.push(t0.elapsed().as_nanos() as f64 / iters as f64);
        stream.synchronize()?;
        let t0 = std::time::Instant::now();
        for _ in 0..iters {
            for j in 0..k {
                rig.copy(&cur, h, j * per, per)?;
            }
            rig.ev.record_in(&cur, h)?;
        }
        many.push(t0.elapsed().as_nanos() as f64 / iters as f64);
        stream.synchronize()?;
    }
    Ok((median_mean(one).0, median_mean(many).0))
}

/// The driver's floor for one step, paced: the host ns of one `cuMemcpyHtoDAsync` of `bytes`
/// from pinned memory + `cuEventRecord` issued while `stream` is idle (it is synchronized before
/// each, outside the timing), as a step arrives while an engine's GPU is busy elsewhere: the
/// median and the mean over `iters` steps.
///
/// # Errors
/// Driver errors.
pub fn step_floor_paced(
    dev: &Device,
    stream: &Stream,
    bytes: usize,
    iters: usize,
) -> Result<(f64, f64)> {
    // The same loop with nothing written (the source keeps the rig's pattern).
    Ok(step_floor_paced_filled(dev, stream, bytes, iters, &mut |_, _| {})?.0)
}

/// The driver's floor for one step doing the step's whole work, paced: `fill` writes the step's
/// values into the pinned source (as a planner writes them), then one `cuMemcpyHtoDAsync` of
/// `bytes` + `cuEventRecord`, issued while `stream` is idle (synchronized before each step,
/// outside the timing). Returns the median and the mean host ns over `iters` steps, and the
/// destination's bytes after the last step (for the caller to check against its last fill).
///
/// # Errors
/// Driver errors.
pub fn step_floor_paced_filled(
    dev: &Device,
    stream: &Stream,
    bytes: usize,
    iters: usize,
    fill: &mut dyn FnMut(&mut [u8], usize),
) -> Result<((f64, f64), Vec<u8>)> {
    let mut rig = FloorRig::new(dev, bytes)?;
    rig.dst.upload(0, &vec![0xEE; bytes])?;
    let cur = dev.enter()?;
    let h = stream.handle();
    let mut ns = Vec::with_capacity(iters);
    for i in 0..iters {
        stream.synchronize()?;
        let t0 = std::time::Instant::now();
        // The stream is idle: the last copy from the source completed.
        fill(&mut rig.src.as_mut_slice()[..bytes], i);
        rig.copy(&cur, h, 0, bytes)?;
        rig.ev.record_in(&cur, h)?;
        ns.push(t0.elapsed().as_nanos() as f64);
    }
    stream.synchronize()?;
    let mut out = vec![0u8; bytes];
    rig.dst.download(0, &mut out)?;
    Ok((median_mean(ns), out))
}

/// Where a paced commit's host time goes, call by call, after `fill` wrote the step's values
/// into the pinned source (as a step's puts do): `dev.enter()` (`cuCtxGetCurrent`),
/// `cuStreamIsCapturing`, `cuStreamGetId`, one `cuMemcpyHtoDAsync` of `bytes`, `cuEventRecord`.
/// The stream is synchronized before each step, outside the timing. Returns the median ns of
/// each call, in that order, and of the fill; the destination after the last step is checked
/// against it.
///
/// # Errors
/// Driver errors.
pub fn commit_parts_paced(
    dev: &Device,
    stream: &Stream,
    bytes: usize,
    iters: usize,
    fill: &mut dyn FnMut(&mut [u8], usize),
) -> Result<[f64; 6]> {
    use crate::driver::stream::stream_get_id;
    let mut rig = FloorRig::new(dev, bytes)?;
    rig.dst.upload(0, &vec![0xEE; bytes])?;
    let h = stream.handle();
    let mut parts: [Vec<f64>; 6] = Default::default();
    let mut last = vec![0u8; bytes];
    for i in 0..iters {
        stream.synchronize()?;
        let t0 = std::time::Instant::now();
        fill(&mut rig.src.as_mut_slice()[..bytes], i);
        let t1 = std::time::Instant::now();
        let cur = dev.enter()?;
        let t2 = std::time::Instant::now();
        // SAFETY: our live stream; the context is current (`cur`).
        let capturing = unsafe { stream_is_capturing(h.raw()) }?;
        assert!(!capturing);
        let t3 = std::time::Instant::now();
        // SAFETY: as above.
        let _id = unsafe { stream_get_id(h.raw()) }?;
        let t4 = std::time::Instant::now();
        rig.copy(&cur, h, 0, bytes)?;
        let t5 = std::time::Instant::now();
        rig.ev.record_in(&cur, h)?;
        let t6 = std::time::Instant::now();
        drop(cur);
        for (k, (a, b)) in [(t1, t2), (t2, t3), (t3, t4), (t4, t5), (t5, t6), (t0, t1)]
            .into_iter()
            .enumerate()
        {
            parts[k].push((b - a).as_nanos() as f64);
        }
        if i + 1 == iters {
            last.copy_from_slice(&rig.src.as_slice()[..bytes]);
        }
    }
    stream.synchronize()?;
    let mut out = vec![0u8; bytes];
    rig.dst.download(0, &mut out)?;
    assert_eq!(out, last, "commit_parts_paced: the last step's bytes");
    Ok(parts.map(|v| median_mean(v).0))
}

/// The median and the mean of `v` (not empty).
pub fn median_mean(mut v: Vec<f64>) -> (f64, f64) {
    let mean = v.iter().sum::<f64>() / v.len() as f64;
    v.sort_by(f64::total_cmp);
    (v[v.len() / 2], mean)
}

/// What pinned memory costs to get and give back, per size in `sizes` (bytes): `cuMemHostAlloc`
/// and `cuMemFreeHost`; pinstage's registered pages split into mapping + populating (several
/// threads), `cuMemHostRegister`, `cuMemHostUnregister` and unmapping. Milliseconds, one
/// round each (after one warm-up round of the smallest size).
///
/// # Errors
/// Driver errors.
pub fn pinned_costs(sizes: &[usize]) -> Result<Vec<(String, f64)>> {
    use crate::host::mapped::MappedPages;
    use std::time::Instant;
    let dev = Device::new(0)?;
    let cur = dev.enter()?;
    let ms = |t: Instant| t.elapsed().as_secs_f64() * 1e3;
    // Our own mapping, the context current (`cur`): registered once, unregistered before it is
    // unmapped, and no copy uses it.
    let register = |p: &MappedPages| {
        // SAFETY: the above.
        unsafe { crate::driver::mem::mem_host_register(p.as_ptr().cast(), p.len(), false, false) }
    };
    let unregister = |p: &MappedPages| {
        // SAFETY: the above; `p` was registered.
        unsafe { crate::driver::mem::mem_host_unregister(p.as_ptr().cast()) }
    };
    let mut out = Vec::new();
    // Start pinstage's copy threads first (once per process; it would land on whichever size
    // first populates on them) and say what that costs.
    let t = Instant::now();
    let _ = crate::host::workers::workers();
    out.push(("copy threads started ms".to_string(), ms(t)));
    const REPS: usize = 3;
    let warm = sizes.iter().copied().min().unwrap_or(4096);
    drop(PinnedBuffer::new(&dev, warm, PinnedFlags::PORTABLE)?);
    drop(PinnedBuffer::new_registered(
        &dev,
        warm,
        PinnedFlags::PORTABLE,
    )?);
    for &n in sizes {
        let mut reps: Vec<Vec<(String, f64)>> = Vec::new();
        for _ in 0..REPS {
            let mut out = Vec::new();
            let mib = n as f64 / (1 << 20) as f64;
            let t = Instant::now();
            let b = PinnedBuffer::new(&dev, n, PinnedFlags::PORTABLE)?;
            out.push((format!("{mib} MiB cuMemHostAlloc ms"), ms(t)));
            let t = Instant::now();
            drop(b);
            out.push((format!("{mib} MiB cuMemFreeHost ms"), ms(t)));
            let t = Instant::now();
            let pages = MappedPages::new(n)?;
            out.push((format!("{mib} MiB map + populate ms"), ms(t)));
            let t = Instant::now();
            register(&pages)?;
            out.push((format!("{mib} MiB cuMemHostRegister ms"), ms(t)));
            let t = Instant::now();
            unregister(&pages)?;
            out.push((format!("{mib} MiB cuMemHostUnregister ms"), ms(t)));
            let t = Instant::now();
            drop(pages);
            out.push((format!("{mib} MiB unmap ms"), ms(t)));
            let t = Instant::now();
            let b = PinnedBuffer::new_registered(&dev, n, PinnedFlags::PORTABLE)?;
            out.push((format!("{mib} MiB registered pages, all ms"), ms(t)));
            drop(b);
            // The driver faulting the pages in itself, one thread.
            let t = Instant::now();
            let pages = MappedPages::new_untouched(n)?;
            register(&pages)?;
            out.push((
                format!("{mib} MiB untouched map + cuMemHostRegister ms"),
                ms(t),
            ));
            unregister(&pages)?;
            drop(pages);
            // A block of the device's host pool, fresh (the pool trimmed) and then freed the
            // way a drop frees it (cuMemFreeAsync, a synchronize of the pool's own stream, trim).
            if let Some(pool) = crate::host::host_pool::HostPool::of(&dev) {
                pool.trim();
                let t = Instant::now();
                let (p, _) = pool.alloc(&dev, n)?;
                out.push((format!("{mib} MiB host pool block, fresh ms"), ms(t)));
                let t = Instant::now();
                pool.free(&dev, p);
                out.push((format!("{mib} MiB host pool free ms"), ms(t)));
                // What the pool kept serves the next block (up to its KEEP of 64 MiB beyond the
                // blocks in use: a larger block is fresh again).
                let t = Instant::now();
                let (p, _) = pool.alloc(&dev, n)?;
                out.push((format!("{mib} MiB host pool block, after a free ms"), ms(t)));
                pool.free(&dev, p);
                let t = Instant::now();
                pool.trim();
                out.push((format!("{mib} MiB host pool trim ms"), ms(t)));
            }
            reps.push(out);
        }
        // The median of each figure over the repetitions.
        for k in 0..reps[0].len() {
            let mut v: Vec<f64> = reps.iter().map(|r| r[k].1).collect();
            v.sort_by(f64::total_cmp);
            out.push((reps[0][k].0.clone(), v[v.len() / 2]));
        }
    }
    drop(cur);
    Ok(out)
}
