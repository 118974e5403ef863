//! The slot-check and copy-entry-point experiment (`benches/slot_check_costs.rs`).

use crate::driver::mem::{
    memcpy_2d_htod_async, memcpy_async, memcpy_batch_async_one, memcpy_htod_async,
};
use crate::driver::stream::{stream_get_id, stream_is_capturing};
use crate::host::PinnedFlags;
use crate::ring::write::store_fence;
use crate::testing::DeviceBuffer;
use crate::{DType, Device, PinnedBuffer, PinnedStager, Result, Stream, StreamHandle};

/// Loop and paced timings that decide how the stager checks its slots and what one copy can
/// cost at all, on device 0: `(name, ns per call in each of `rounds` rounds)`. Every variant
/// runs once per round, in turn, so machine drift hits all of them alike.
///
/// - copy entry points: `cuMemcpyHtoDAsync` from 4 B to 64 KiB, `cuMemcpyAsync`,
///   `cuMemcpyBatchAsync` with one copy (16 KiB);
/// - slot checks: A = copy + record over 8 slices and 8 events (no check), D = A + a query of
///   the slot's own event before each copy (what the stager did before the watermark), Qk = A +
///   one query every k calls (of the event recorded k calls before: what an amortized check
///   costs);
/// - paced copy + record by size (4 B to 64 KiB), through `cuMemcpy2DAsync` in several row
///   shapes, and with the stager's other calls added one at a time;
/// - the stager itself: watermark and rows (default), a query per claim, depth 8, one 1-D copy.
pub fn slot_check_costs(iters: usize, rounds: usize) -> Result<Vec<(String, Vec<f64>)>> {
    use std::time::{Duration, Instant};
    let dev = Device::new(0)?;
    let stream = Stream::new(&dev)?;
    let s = stream.handle();
    let leg = StreamHandle::LEGACY;
    const SLOT: usize = 64 << 10;
    let arena = PinnedBuffer::new(&dev, 8 * SLOT, PinnedFlags::WRITE_COMBINED)?;
    let dbuf = DeviceBuffer::new(&dev, SLOT)?;
    let events = (0..8)
        .map(|_| crate::cuda::Event::new(&dev))
        .collect::<Result<Vec<_>>>()?;
    let cur = dev.enter()?;
    let cur = &cur;
    let base = arena.as_ptr() as usize;
    let copy = |k: usize, n: usize, h: StreamHandle| -> Result<()> {
        // SAFETY: slice k of our 8 x 64 KiB pinned arena and our 64 KiB device buffer, n <= 64
        // KiB; both outlive the synchronize ending each measurement; `h` ours or legacy.
        Ok(unsafe { memcpy_htod_async(dbuf.ptr(), (base + k * SLOT) as *const _, n, h.raw()) }?)
    };
    // The stager itself, 256 of 4096 int32 padded, with the completion watermark (default) and
    // with a query of the own slot's event on every claim (the stager before the watermark).
    let amortized = PinnedStager::<i32>::builder().build()?;
    let shallow = PinnedStager::<i32>::builder().depth(8).build()?;
    let view = dbuf.view(DType::I32);
    let view16 = dbuf.view_at(0, DType::I32, 4096);
    let sets: Vec<Vec<i32>> = (0..8)
        .map(|k| (0..256).map(|i| k * 1000 + i + 1).collect())
        .collect();
    // Sixteen separate 16 KiB buffers and events, as a default-depth stager's grown slots.
    let sep16 = (0..16)
        .map(|_| PinnedBuffer::new(&dev, 16384, PinnedFlags::WRITE_COMBINED))
        .collect::<Result<Vec<_>>>()?;
    let ev16 = (0..16)
        .map(|_| crate::cuda::Event::new(&dev))
        .collect::<Result<Vec<_>>>()?;
    let ones = vec![7u8; 1024];
    let sep16p: Vec<usize> = sep16.iter().map(|b| b.as_ptr() as usize).collect();
    let dptr = dbuf.ptr();
    type Body<'a> = Box<dyn FnMut(usize, StreamHandle) -> Result<()> + 'a>;
    let mut variants: Vec<(String, StreamHandle, bool, Body<'_>)> = Vec::new();
    for n in [4usize, 64, 1024, 4096, 16384, 65536] {
        variants.push((
            format!("loop: cuMemcpyHtoDAsync {n} B"),
            s,
            false,
            Box::new(move |k, h| copy(k % 8, n, h)),
        ));
    }
    variants.push((
        "loop: cuMemcpyAsync 16 KiB".into(),
        s,
        false,
        Box::new(|k, h| {
            // SAFETY: as `copy`; the host slice's unified address is its pointer.
            Ok(
                unsafe {
                    memcpy_async(dbuf.ptr(), (base + (k % 8) * SLOT) as u64, 16384, h.raw())
                }?,
            )
        }),
    ));
    variants.push((
        "loop: cuMemcpyBatchAsync 1 x 16 KiB".into(),
        s,
        false,
        Box::new(|k, h| {
            // SAFETY: as `copy`; `h` is our created stream.
            Ok(unsafe {
                memcpy_batch_async_one(
                    dbuf.ptr(),
                    (base + (k % 8) * SLOT) as *const _,
                    16384,
                    h.raw(),
                )
            }?)
        }),
    ));
    for (name, h) in [("", s), (", legacy", leg)] {
        variants.push((
            format!("loop: cuStreamGetId{name}"),
            h,
            false,
            Box::new(|_, h| {
                // SAFETY: ours or the legacy stream; context current.
                Ok(unsafe { stream_get_id(h.raw()) }.map(|_| ())?)
            }),
        ));
    }
    let ev = &events;
    let check = move |every: usize| {
        move |k: usize, h: StreamHandle| -> Result<()> {
            let slot = k % 8;
            if every == 1 {
                ev[slot].query()?;
            } else if every > 1 && k % every == 0 {
                ev[(k + 8 - every) % 8].query()?;
            }
            copy(slot, 16384, h)?;
            ev[slot].record_in(cur, h)
        }
    };
    for paced in [false, true] {
        for (hn, h) in [("", s), (", legacy", leg)] {
            if paced && h == leg {
                continue;
            }
            let kind = if paced { "paced" } else { "loop" };
            for (label, every) in [
                ("A copy+record", 0usize),
                ("D = A + query own", 1),
                ("Q4", 4),
                ("Q8", 8),
            ] {
                variants.push((
                    format!("{kind}: {label}{hn}"),
                    h,
                    paced,
                    Box::new(check(every)),
                ));
            }
        }
    }
    // Copy + record by size, paced: what one copy costs the host with the GPU idle.
    for n in [4usize, 1024, 4096, 16384, 32768, 49152, 65536] {
        let ev = &events;
        variants.push((
            format!("paced: cuMemcpyHtoDAsync {n} B + record"),
            s,
            true,
            Box::new(move |k, h| {
                copy(k % 8, n, h)?;
                ev[k % 8].record_in(cur, h)
            }),
        ));
    }
    {
        let ev = &events;
        variants.push((
            "paced: cuMemcpyBatchAsync 1 x 16 KiB + record".into(),
            s,
            true,
            Box::new(move |k, h| {
                // SAFETY: as `copy`; `h` is our created stream.
                unsafe {
                    memcpy_batch_async_one(
                        dptr,
                        (base + (k % 8) * SLOT) as *const _,
                        16384,
                        h.raw(),
                    )
                }?;
                ev[k % 8].record_in(cur, h)
            }),
        ));
    }
    // Other entry points for the same 16 KiB, paced: is any spared the small-copy cost?
    let plain = PinnedBuffer::new(&dev, 16384, PinnedFlags::PORTABLE)?;
    let plain_p = plain.as_ptr() as usize;
    for (paced, label, how) in [
        (true, "cuMemcpyAsync (unified) 16 KiB + record", 0u8),
        (true, "cuMemcpy2DAsync 1 x 16 KiB + record", 1),
        (true, "cuMemcpy2DAsync 2 x 8 KiB + record", 4),
        (true, "cuMemcpy2DAsync 4 x 4 KiB + record", 5),
        (true, "cuMemcpy2DAsync 16 x 1 KiB + record", 2),
        (true, "cuMemcpy2DAsync 64 x 256 B + record", 6),
        (true, "cuMemcpy2DAsync 4 x 1 KiB + record", 7),
        (
            true,
            "cuMemcpyHtoDAsync 16 KiB from plain pinned + record",
            3,
        ),
        (false, "cuMemcpyHtoDAsync 16 KiB + record", 8),
        (false, "cuMemcpy2DAsync 16 x 1 KiB + record", 2),
    ] {
        let ev = &events;
        let kind = if paced { "paced" } else { "loop" };
        variants.push((
            format!("{kind}: {label}"),
            s,
            paced,
            Box::new(move |k, h| {
                let src = base + (k % 8) * SLOT;
                // SAFETY: 16 KiB of our pinned arena (or of `plain`) into our 64 KiB device
                // buffer; both outlive the synchronize ending each measurement.
                unsafe {
                    match how {
                        0 => memcpy_async(dptr, src as u64, 16384, h.raw()),
                        1 => memcpy_2d_htod_async(dptr, src as *const _, 16384, 1, h.raw()),
                        2 => memcpy_2d_htod_async(dptr, src as *const _, 1024, 16, h.raw()),
                        4 => memcpy_2d_htod_async(dptr, src as *const _, 8192, 2, h.raw()),
                        5 => memcpy_2d_htod_async(dptr, src as *const _, 4096, 4, h.raw()),
                        6 => memcpy_2d_htod_async(dptr, src as *const _, 256, 64, h.raw()),
                        7 => memcpy_2d_htod_async(dptr, src as *const _, 1024, 4, h.raw()),
                        8 => memcpy_htod_async(dptr, src as *const _, 16384, h.raw()),
                        _ => memcpy_htod_async(dptr, plain_p as *const _, 16384, h.raw()),
                    }
                }?;
                ev[k % 8].record_in(cur, h)
            }),
        ));
    }
    // What the stager does besides copy + record, added one at a time (paced).
    for (label, getid, ctx, write, sixteen) in [
        ("A + cuStreamGetId", true, false, false, false),
        (
            "A + cuCtxGetCurrent + cuStreamIsCapturing",
            false,
            true,
            false,
            false,
        ),
        ("A + write 1 KiB + sfence", false, false, true, false),
        (
            "A from 16 separate buffers, 16 events",
            false,
            false,
            false,
            true,
        ),
        (
            "all four (the stager without queries)",
            true,
            true,
            true,
            true,
        ),
    ] {
        let (ev, ev16, sep16p, ones) = (&events, &ev16, &sep16p, &ones);
        variants.push((
            format!("paced: {label}"),
            s,
            true,
            Box::new(move |k, h| {
                if ctx {
                    crate::driver::ctx::ctx_get_current()?;
                    // SAFETY: our stream; context current.
                    unsafe { stream_is_capturing(h.raw()) }?;
                }
                if getid {
                    // SAFETY: as above.
                    unsafe { stream_get_id(h.raw()) }?;
                }
                let (src, event) = if sixteen {
                    (sep16p[k % 16], &ev16[k % 16])
                } else {
                    (base + (k % 8) * SLOT, &ev[k % 8])
                };
                if write {
                    // SAFETY: `src` starts one of our pinned buffers of >= 16 KiB; 1 KiB is
                    // written. A copy issued from it earlier may still read it: that could only
                    // change what lands in `dbuf`, which these rows never check.
                    unsafe {
                        std::ptr::copy_nonoverlapping(ones.as_ptr(), src as *mut u8, ones.len())
                    };
                    store_fence();
                }
                // SAFETY: `src` holds 16 KiB of pinned memory and `dbuf` 64 KiB; both outlive
                // the synchronize ending each measurement.
                unsafe { memcpy_htod_async(dptr, src as *const _, 16384, h.raw()) }?;
                event.record_in(cur, h)
            }),
        ));
    }
    for paced in [false, true] {
        for (hn, h) in [("", s), (", legacy", leg)] {
            let kind = if paced { "paced" } else { "loop" };
            // The stager itself.
            for (label, st, v) in [
                ("watermark", &amortized, &view),
                ("watermark, depth 8", &shallow, &view),
                ("watermark, 16 KiB dst", &amortized, &view16),
            ] {
                let sets = &sets;
                variants.push((
                    format!("{kind}: PinnedStager::copy_ (64 KiB dst unless said), {label}{hn}"),
                    h,
                    paced,
                    Box::new(move |k, h| st.to(v).pad(-1).stream(h).copy(&sets[k % 8]).map(|_| ())),
                ));
            }
        }
    }
    let mut out: Vec<(String, Vec<f64>)> =
        variants.iter().map(|v| (v.0.clone(), Vec::new())).collect();
    for _ in 0..rounds {
        for (i, (_, h, paced, f)) in variants.iter_mut().enumerate() {
            let h = *h;
            for k in 0..200 {
                f(k, h)?;
            }
            // SAFETY: ours or the legacy stream; context current.
            h.synchronize(cur)?;
            let ns = if *paced {
                let mut total = 0u128;
                let n = iters.min(4000);
                for k in 0..n {
                    let t = Instant::now();
                    while t.elapsed() < Duration::from_micros(10) {
                        std::hint::spin_loop();
                    }
                    let t0 = Instant::now();
                    f(k, h)?;
                    total += t0.elapsed().as_nanos();
                }
                total as f64 / n as f64
            } else {
                let t0 = Instant::now();
                for k in 0..iters {
                    f(k, h)?;
                }
                t0.elapsed().as_nanos() as f64 / iters as f64
            };
            // SAFETY: as above.
            h.synchronize(cur)?;
            out[i].1.push(ns);
        }
    }
    drop(variants);
    // Every stager copy wrote the same destination; the last one wins: check it.
    let mut got = vec![0u8; 4096 * 4];
    dbuf.download(0, &mut got)?;
    let got: &[i32] = bytemuck::cast_slice(&got);
    let last = &sets[(if iters.min(4000) > 0 {
        iters.min(4000) - 1
    } else {
        0
    }) % 8];
    if got[..256] != last[..] || got[256..].iter().any(|&x| x != -1) {
        return Err(crate::Error::arg(
            "slot_check_costs",
            "a destination that does not hold the last copy",
            "the last copy's values",
        ));
    }
    for (name, st) in [("watermark", &amortized), ("watermark, depth 8", &shallow)] {
        let st = st.stats();
        out.push((
            format!("stager {name}: queries per copy (x1000)"),
            vec![1000.0 * st.queries as f64 / st.copies.max(1) as f64],
        ));
    }
    Ok(out)
}
