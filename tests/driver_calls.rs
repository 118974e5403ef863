//! The driver calls of the hot paths, counted by the simulated driver (`tests/fakecuda`,
//! `scripts/fake-gpu`): a step's commit, a stager's copy, a small D2H copy and their waits make
//! the calls the work needs and no others (no context, capture-state or stream-identity queries
//! per call once warm). Against a real driver there is nothing to count: each test says so and
//! returns.

mod common;

use std::ffi::{CStr, c_char};

use common::Put;
use pinstage::testing::DeviceBuffer;
use pinstage::{DType, Device, StepLayout, StepStager, Stream};

type Calls = unsafe extern "C" fn(*const c_char) -> u64;

/// Every entry point the simulated driver counts.
const NAMES: &[&CStr] = &[
    c"cuInit",
    c"cuDriverGetVersion",
    c"cuDeviceGetCount",
    c"cuDeviceGet",
    c"cuDeviceGetPCIBusId",
    c"cuDeviceCanAccessPeer",
    c"cuDevicePrimaryCtxRetain",
    c"cuDevicePrimaryCtxRelease_v2",
    c"cuCtxGetCurrent",
    c"cuCtxGetDevice",
    c"cuCtxPushCurrent_v2",
    c"cuCtxPopCurrent_v2",
    c"cuCtxSetCurrent",
    c"cuCtxSynchronize",
    c"cuThreadExchangeStreamCaptureMode",
    c"cuGetErrorName",
    c"cuGetErrorString",
    c"cuStreamCreate",
    c"cuStreamDestroy_v2",
    c"cuStreamSynchronize",
    c"cuStreamQuery",
    c"cuStreamIsCapturing",
    c"cuStreamBeginCapture_v2",
    c"cuStreamEndCapture",
    c"cuGraphDestroy",
    c"cuStreamGetId",
    c"cuStreamGetCtx",
    c"cuStreamWaitEvent",
    c"cuLaunchHostFunc",
    c"cuStreamWriteValue32_v2",
    c"cuEventCreate",
    c"cuEventDestroy_v2",
    c"cuEventRecord",
    c"cuEventQuery",
    c"cuEventSynchronize",
    c"cuEventElapsedTime",
    c"cuMemAlloc_v2",
    c"cuMemFree_v2",
    c"cuMemGetInfo_v2",
    c"cuMemHostAlloc",
    c"cuMemFreeHost",
    c"cuMemHostRegister_v2",
    c"cuMemHostUnregister",
    c"cuMemHostGetDevicePointer_v2",
    c"cuPointerGetAttributes",
    c"cuMemcpyHtoDAsync_v2",
    c"cuMemcpyDtoHAsync_v2",
    c"cuMemcpyAsync",
    c"cuMemcpyDtoH_v2",
    c"cuMemcpy2DAsync_v2",
    c"cuMemcpyBatchAsync",
    c"cuMemPoolCreate",
    c"cuMemPoolDestroy",
    c"cuMemPoolSetAttribute",
    c"cuMemPoolGetAttribute",
    c"cuMemPoolSetAccess",
    c"cuMemPoolTrimTo",
    c"cuMemAllocFromPoolAsync",
    c"cuMemFreeAsync",
];

/// The simulated driver's counter, once the driver is loaded (`None`: a real driver, or none).
fn fake(test: &str) -> Option<(Device, Calls)> {
    let dev = Device::new(0).ok().or_else(|| {
        eprintln!("SKIP {test}: no driver");
        None
    })?;
    // SAFETY: looking up a library the process already loaded (RTLD_NOLOAD), then a symbol in it.
    let f = unsafe {
        let h = libc::dlopen(c"libcuda.so".as_ptr(), libc::RTLD_NOLOAD | libc::RTLD_NOW);
        if h.is_null() {
            std::ptr::null_mut()
        } else {
            libc::dlsym(h, c"fakecuda_thread_calls".as_ptr())
        }
    };
    if f.is_null() {
        eprintln!("SKIP {test}: a real driver counts nothing (run under scripts/fake-gpu)");
        return None;
    }
    // SAFETY: the simulated driver's `fakecuda_thread_calls`, of this signature.
    Some((dev, unsafe {
        std::mem::transmute::<*mut libc::c_void, Calls>(f)
    }))
}

/// The calls `work` makes on this thread, by entry point (pinstage's own threads, the reaper's
/// say, are not counted; the tests run one at a time, `SERIAL`, for the stream threads' sake).
fn calls_of(calls: Calls, work: impl FnOnce()) -> Vec<(&'static str, u64)> {
    // SAFETY: the counter reads a NUL-terminated name.
    let snap = || -> Vec<u64> { NAMES.iter().map(|n| unsafe { calls(n.as_ptr()) }).collect() };
    let before = snap();
    work();
    let after = snap();
    NAMES
        .iter()
        .zip(before.iter().zip(&after))
        .filter(|(_, (b, a))| a > b)
        .map(|(n, (b, a))| (n.to_str().unwrap(), a - b))
        .collect()
}

static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// The calls of `name` made by every thread of the process so far (the simulated driver's
/// `fakecuda_calls`; only called where `fake` found it).
fn process_calls(name: &CStr) -> u64 {
    // SAFETY: as in `fake`: a symbol of the simulated driver, already loaded.
    unsafe {
        let h = libc::dlopen(c"libcuda.so".as_ptr(), libc::RTLD_NOLOAD | libc::RTLD_NOW);
        let f = libc::dlsym(h, c"fakecuda_calls".as_ptr());
        assert!(
            !f.is_null(),
            "the simulated driver counts every thread's calls"
        );
        std::mem::transmute::<*mut libc::c_void, Calls>(f)(name.as_ptr())
    }
}

/// The calls of `c` named `name` (0 if none).
fn n(c: &[(&str, u64)], name: &str) -> u64 {
    c.iter().find(|(k, _)| *k == name).map_or(0, |(_, v)| *v)
}

/// Every call of `c` is one of `allowed`.
fn only(c: &[(&str, u64)], allowed: &[&str]) {
    let other: Vec<_> = c.iter().filter(|(k, _)| !allowed.contains(k)).collect();
    assert!(
        other.is_empty(),
        "calls beyond {allowed:?}: {other:?} (all: {c:?})"
    );
}

/// A warm step on a thread whose context is current (as under torch): one copy and one record,
/// plus the three questions no cache can answer (the thread's current context and the stream's
/// capture state may change between calls, and a destroyed stream's handle may come back as
/// another stream); the claim enters the context because its slot's last copy must be known
/// complete, which the watermark usually knows without asking the event (and which an earlier
/// claim may have learned already: then the claim makes no call).
#[test]
fn a_warm_step_is_one_copy_and_one_record() {
    let Some((dev, calls)) = fake("a_warm_step_is_one_copy_and_one_record") else {
        return;
    };
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let _cur = dev.enter().unwrap();
    let layout = StepLayout::builder()
        .field("ids", DType::I32, &[1024])
        .field("pos", DType::I64, &[1024])
        .build()
        .unwrap();
    let arena = DeviceBuffer::new(&dev, layout.nbytes()).unwrap();
    let view = arena.view(DType::U8);
    let stream = Stream::new(&dev).unwrap();
    // SAFETY: `arena` outlives the stager; nothing else writes it.
    let st = unsafe { StepStager::builder(&layout).depth(4).bind(&view) }
        .build()
        .unwrap();
    let step = |k: i32| {
        let mut s = st.step().unwrap();
        s.put("ids", &[k, k + 1, k + 2]).unwrap();
        s.put("pos", &[i64::from(k); 3]).unwrap();
        s.commit(stream.handle()).unwrap();
    };
    for k in 0..8 {
        step(k);
    }
    stream.synchronize().unwrap();
    let mut s = None;
    let claim = calls_of(calls, || s = Some(st.step().unwrap()));
    let mut s = s.unwrap();
    let puts = calls_of(calls, || s.put("ids", &[1, 2, 3]).unwrap());
    let commit = calls_of(calls, || {
        s.commit(stream.handle()).unwrap();
    });
    // The claim: the context, and at most one look at an event (the watermark's evidence).
    only(
        &claim,
        &[
            "cuCtxGetCurrent",
            "cuEventQuery",
            "cuThreadExchangeStreamCaptureMode",
        ],
    );
    // None at all when an earlier claim's query already found this slot's copy complete and
    // retired the slot (how fast the stream ran decides: seen under valgrind).
    assert!(n(&claim, "cuCtxGetCurrent") <= 1, "{claim:?}");
    assert!(n(&claim, "cuEventQuery") <= 1, "{claim:?}");
    assert!(
        n(&claim, "cuThreadExchangeStreamCaptureMode") <= 2,
        "{claim:?}"
    );
    assert_eq!(puts, []);
    assert_eq!(
        commit,
        [
            ("cuCtxGetCurrent", 1),
            ("cuStreamIsCapturing", 1),
            ("cuStreamGetId", 1),
            ("cuEventRecord", 1),
            ("cuMemcpyHtoDAsync_v2", 1)
        ]
    );
}

/// A stager's copy into idle slots: one copy and one record, the same three questions, and now
/// and then one query of a slot's event (the watermark's evidence) inside one capture-mode swap.
#[test]
fn a_warm_stager_copy_is_one_copy_and_one_record() {
    let Some((dev, calls)) = fake("a_warm_stager_copy_is_one_copy_and_one_record") else {
        return;
    };
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let _cur = dev.enter().unwrap();
    let stream = Stream::new(&dev).unwrap();
    let buf = DeviceBuffer::new(&dev, 4096).unwrap();
    let dst = buf.view(DType::U32);
    let st = common::stager::<u32>(0, 1024, 4).unwrap();
    let v: Vec<u32> = (0..1024).map(|i| i * 3 + 1).collect();
    for _ in 0..8 {
        st.put(&dst, &v, None, None, stream.handle()).unwrap();
    }
    for _ in 0..16 {
        // Every slot idle: the claim waits for nothing (a claim that waits is the next test's).
        stream.synchronize().unwrap();
        let c = calls_of(calls, || {
            st.put(&dst, &v, None, None, stream.handle()).unwrap();
        });
        only(
            &c,
            &[
                "cuCtxGetCurrent",
                "cuStreamIsCapturing",
                "cuStreamGetId",
                "cuEventRecord",
                "cuMemcpy2DAsync_v2",
                "cuEventQuery",
                "cuThreadExchangeStreamCaptureMode",
            ],
        );
        assert_eq!(n(&c, "cuMemcpy2DAsync_v2"), 1, "{c:?}");
        assert_eq!(n(&c, "cuEventRecord"), 1, "{c:?}");
        assert_eq!(n(&c, "cuCtxGetCurrent"), 1, "{c:?}");
        assert!(n(&c, "cuThreadExchangeStreamCaptureMode") <= 2, "{c:?}");
    }
}

/// Waiting for a copy asks its event as often as it must, inside ONE capture-mode swap (two
/// calls), not one swap per question: an `copy_h2d` from pinned memory, a small `copy_d2h`
/// into pageable memory through the bounce buffers (one wait per buffer), with a stream held
/// for 5 ms so that every wait asks many times.
#[test]
fn a_wait_swaps_the_capture_mode_once_however_often_it_asks() {
    let Some((dev, calls)) = fake("a_wait_swaps_the_capture_mode_once_however_often_it_asks")
    else {
        return;
    };
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let _cur = dev.enter().unwrap();
    let stream = Stream::new(&dev).unwrap();
    let buf = DeviceBuffer::new(&dev, 4096).unwrap();
    let pinned =
        pinstage::PinnedBuffer::new(&dev, 4096, pinstage::host::PinnedFlags::PORTABLE).unwrap();
    // SAFETY: 4096 bytes of our pinned buffer, not written meanwhile.
    let src: &[u8] = unsafe { std::slice::from_raw_parts(pinned.as_ptr(), 4096) };
    let mut out = vec![0u8; 4096];
    for _ in 0..4 {
        pinstage::copy_h2d(&buf.view(DType::U8), src, stream.handle()).unwrap();
        pinstage::copy_d2h(&buf.view(DType::U8), &mut out, stream.handle()).unwrap();
    }
    let held = |work: &mut dyn FnMut()| {
        let go = common::stall(&stream);
        let release = std::thread::spawn(move || {
            std::thread::sleep(std::time::Duration::from_millis(5));
            drop(go);
        });
        let c = calls_of(calls, work);
        release.join().unwrap();
        c
    };
    let up = held(&mut || {
        pinstage::copy_h2d(&buf.view(DType::U8), src, stream.handle()).unwrap();
    });
    assert!(n(&up, "cuEventQuery") > 2, "the wait asked {up:?}");
    assert_eq!(n(&up, "cuThreadExchangeStreamCaptureMode"), 2, "{up:?}");
    let down = held(&mut || {
        pinstage::copy_d2h(&buf.view(DType::U8), &mut out, stream.handle()).unwrap();
    });
    assert!(
        n(&down, "cuEventQuery") + n(&down, "cuStreamQuery") > 2,
        "the wait asked {down:?}"
    );
    assert!(
        n(&down, "cuThreadExchangeStreamCaptureMode") <= 2,
        "{down:?}"
    );
}

/// A warm move in the background costs its caller one record (the fork) on the caller's stream
/// and the questions any copy asks (the thread's context, the stream's capture state): no event
/// made or destroyed (the device's spare events serve) and no copy on the caller's thread; its
/// wait makes or destroys no event either. Every block checked after every move.
/// `T` tensors of `NB` blocks of `W` u32 words each, at one stride in one device allocation and
/// in one pinned buffer, under one mover; word `i` of the device side holds `3 * i + 1`.
struct Blocks {
    /// First, so it is dropped before the memory its views point into.
    mover: pinstage::blocks::BlockMover<'static>,
    device: DeviceBuffer,
    host: pinstage::PinnedBuffer,
    values: Vec<u32>,
    shape: (usize, usize, usize),
}

impl Blocks {
    fn new(dev: &Device, stream: &Stream, t: usize, nb: usize, w: usize) -> Blocks {
        let bytes = t * nb * w * 4;
        let device = DeviceBuffer::new(dev, bytes).unwrap();
        let host =
            pinstage::PinnedBuffer::new(dev, bytes, pinstage::host::PinnedFlags::PORTABLE).unwrap();
        let view = |ptr: u64, cuda: bool| {
            // SAFETY: the buffers outlive the mover and every view (fields of one value, the
            // mover dropped first).
            unsafe {
                pinstage::testing::bytes_view(
                    ptr,
                    cuda.then_some(0),
                    &[nb as i64, (w * 4) as i64],
                    false,
                )
            }
        };
        let at = |i: usize| (i * nb * w * 4) as u64;
        let devs: Vec<_> = (0..t).map(|i| view(device.ptr() + at(i), true)).collect();
        let hosts: Vec<_> = (0..t)
            .map(|i| view(host.as_ptr() as u64 + at(i), false))
            .collect();
        let mover = pinstage::blocks::BlockMover::new(&devs, &hosts, 0).unwrap();
        let values: Vec<u32> = (0..(t * nb * w) as u32).map(|i| 3 * i + 1).collect();
        pinstage::copy_h2d(
            &device.view(DType::U8),
            bytemuck::cast_slice(&values),
            stream.handle(),
        )
        .unwrap();
        Blocks {
            mover,
            device,
            host,
            values,
            shape: (t, nb, w),
        }
    }

    /// The device side's bytes.
    fn device_bytes(&self) -> Vec<u8> {
        let mut out = vec![0u8; self.device.len()];
        self.device.download(0, &mut out).unwrap();
        out
    }

    /// Gives the device side its first values back.
    fn reset_device(&self) {
        self.device
            .upload(0, bytemuck::cast_slice(&self.values))
            .unwrap();
    }

    /// The host side's words.
    #[allow(clippy::mut_from_ref)]
    fn host_words(&self) -> &mut [u32] {
        // SAFETY: the pinned buffer is ours; no copy touches it between moves (the tests wait
        // for each before they look).
        unsafe { std::slice::from_raw_parts_mut(self.host.as_ptr() as *mut u32, self.values.len()) }
    }

    /// Poisons the host side before a move.
    fn poison(&self) {
        self.host_words().fill(0xDEAD_BEEF);
    }

    /// After an offload of device blocks `d` into host blocks `h`: every host block `h[i]` of
    /// every tensor holds device block `d[i]`, every other host block the poison.
    fn check(&self, d: &[usize], h: &[usize], round: impl std::fmt::Debug) {
        let (t, nb, w) = self.shape;
        let host = self.host_words();
        for ti in 0..t {
            for b in 0..nb {
                let words = &host[(ti * nb + b) * w..(ti * nb + b + 1) * w];
                match h.iter().position(|&x| x == b) {
                    Some(i) => {
                        let from = (ti * nb + d[i]) * w;
                        assert_eq!(
                            words,
                            &self.values[from..from + w],
                            "round {round:?}, tensor {ti}, block {b}"
                        );
                    }
                    None => assert!(
                        words.iter().all(|&x| x == 0xDEAD_BEEF),
                        "round {round:?}, tensor {ti}, block {b} written"
                    ),
                }
            }
        }
    }
}

#[test]
fn a_warm_background_move_makes_no_event() {
    let Some((dev, calls)) = fake("a_warm_background_move_makes_no_event") else {
        return;
    };
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let _cur = dev.enter().unwrap();
    let stream = Stream::new(&dev).unwrap();
    const NB: usize = 64;
    let blocks = Blocks::new(&dev, &stream, 4, NB, 1);
    let mover = &blocks.mover;
    for round in 0..6usize {
        blocks.poison();
        // Runs of 1, 2 and 3 ids adjacent on both sides (merged by the mover's thread), and
        // singles, in no order.
        let d: Vec<usize> = [0, 1, 2, 9, 10, 30, 17, 40]
            .map(|b| (b + round) % NB)
            .to_vec();
        let h: Vec<usize> = [5, 6, 7, 20, 21, 3, 50, 11]
            .map(|b| (b + 2 * round) % NB)
            .to_vec();
        let mut m = None;
        let copies_before = process_calls(c"cuMemcpy2DAsync_v2");
        // SAFETY: the buffers outlive the move (waited for below); nothing else touches them;
        // the stream is the mover's device's.
        let call = calls_of(calls, || {
            m = Some(unsafe { mover.offload_in_background(&d, &h, stream.handle()) }.unwrap())
        });
        let wait = calls_of(calls, || m.take().unwrap().wait().unwrap());
        blocks.check(&d, &h, round);
        if round < 2 {
            continue; // the first moves make the events later ones reuse
        }
        // The mover's thread merged the runs: 5 copies (2D across the tensors), not 8, as
        // plan() says (the tests run one at a time: no other thread copies meanwhile).
        let plan = mover
            .plan(pinstage::blocks::Direction::Offload, &d, &h)
            .unwrap();
        assert_eq!((plan.runs, plan.calls), (5, 5), "round {round}: {plan:?}");
        let copies = process_calls(c"cuMemcpy2DAsync_v2") - copies_before;
        assert_eq!(
            copies, 5,
            "round {round}: the mover's thread issued {copies} copies"
        );
        only(
            &call,
            &[
                "cuCtxGetCurrent",
                "cuStreamIsCapturing",
                "cuStreamGetCtx",
                "cuEventRecord",
                "cuThreadExchangeStreamCaptureMode",
            ],
        );
        assert_eq!(n(&call, "cuEventRecord"), 1, "round {round}: {call:?}");
        assert_eq!(n(&wait, "cuEventCreate"), 0, "round {round}: {wait:?}");
        assert_eq!(n(&wait, "cuEventDestroy_v2"), 0, "round {round}: {wait:?}");
    }
    // A move of no block: done at once, no driver call, nothing handed over.
    let mut m = None;
    // SAFETY: nothing to move.
    let call = calls_of(calls, || {
        m = Some(unsafe { mover.offload_in_background(&[], &[], stream.handle()) }.unwrap())
    });
    assert_eq!(call, []);
    assert!(m.unwrap().is_done());
}

#[test]
fn a_timed_move_issues_the_way_its_plan_says() {
    let Some((dev, _calls)) = fake("a_timed_move_issues_the_way_its_plan_says") else {
        return;
    };
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let _cur = dev.enter().unwrap();
    let stream = Stream::new(&dev).unwrap();
    // 8 tensors at one stride in one allocation, blocks of 16 KiB: 2D copies and a batch can
    // both carry a move, and 64 ids carry 8 MiB, the least a timed move carries.
    const NB: usize = 96;
    let blocks = Blocks::new(&dev, &stream, 8, NB, 4096);
    let mover = &blocks.mover;
    let mut ways = Vec::new();
    for round in 0..6u64 {
        blocks.poison();
        let d = pinstage::testing::shuffled_ids(64, NB, 3 + round);
        let h = pinstage::testing::shuffled_ids(64, NB, 30 + round);
        let plan = mover
            .plan(pinstage::blocks::Direction::Offload, &d, &h)
            .unwrap();
        let (two_d, batch) = (c"cuMemcpy2DAsync_v2", c"cuMemcpyBatchAsync");
        let before = (process_calls(two_d), process_calls(batch));
        // SAFETY: the buffers outlive the move (waited for); nothing else touches them.
        unsafe { mover.offload(&d, &h, stream.handle()) }
            .unwrap()
            .wait()
            .unwrap();
        let issued = (
            process_calls(two_d) - before.0,
            process_calls(batch) - before.1,
        );
        // The move issued the way its plan said, in the calls the plan counted.
        let want = match plan.strategy {
            pinstage::blocks::Strategy::Strided => (plan.calls as u64, 0),
            pinstage::blocks::Strategy::Batched => (0, plan.calls as u64),
            other => panic!("round {round}: {other:?}"),
        };
        assert_eq!(issued, want, "round {round}: {plan:?}");
        ways.push((plan.strategy, plan.choice));
        blocks.check(&d, &h, round);
    }
    // Both ways were timed, then one kept.
    let timed: Vec<_> = ways[..4].iter().map(|&(s, _)| s).collect();
    assert!(
        timed.contains(&pinstage::blocks::Strategy::Strided),
        "{ways:?}"
    );
    assert!(
        timed.contains(&pinstage::blocks::Strategy::Batched),
        "{ways:?}"
    );
    assert!(
        ways[4..]
            .iter()
            .all(|&(_, c)| matches!(c, pinstage::blocks::Choice::Measured { .. })),
        "{ways:?}"
    );
}

/// A staged mover makes its ring (device and pinned host memory) at its first staged move and
/// keeps it from move to move until the chunk size changes; each move issues the copies its plan
/// counts: a 2D copy per piece and ONE copy across per chunk. Every block checked.
#[test]
fn a_staged_mover_keeps_its_ring_until_the_chunk_changes() {
    let Some((dev, _calls)) = fake("a_staged_mover_keeps_its_ring_until_the_chunk_changes") else {
        return;
    };
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let _cur = dev.enter().unwrap();
    let stream = Stream::new(&dev).unwrap();
    // 4 tensors of 64 blocks of 16 KiB at one stride: 40 blocks are 2.5 MiB, ten or five
    // chunks of 256 or 512 KiB.
    const NB: usize = 64;
    let blocks = Blocks::new(&dev, &stream, 4, NB, 4096);
    let mover = &blocks.mover;
    let allocs = || process_calls(c"cuMemAlloc_v2") + process_calls(c"cuMemHostAlloc");
    let mut chunk = 0;
    for (round, want) in [256usize << 10, 256 << 10, 256 << 10, 512 << 10, 512 << 10]
        .into_iter()
        .enumerate()
    {
        if want != chunk {
            chunk = want;
            mover
                .set_staging(pinstage::blocks::Staging::Always, chunk)
                .unwrap();
        }
        blocks.poison();
        let d = pinstage::testing::shuffled_ids(40, NB, 7 + round as u64);
        let h = pinstage::testing::shuffled_ids(40, NB, 70 + round as u64);
        let plan = mover
            .plan_in_background(pinstage::blocks::Direction::Offload, &d, &h)
            .unwrap();
        assert_eq!(
            plan.strategy,
            pinstage::blocks::Strategy::Staged,
            "{plan:?}"
        );
        let before = (
            allocs(),
            process_calls(c"cuMemcpy2DAsync_v2"),
            process_calls(c"cuMemcpyAsync"),
        );
        // SAFETY: the buffers outlive the move (waited for); nothing else touches them.
        unsafe { mover.offload_in_background(&d, &h, stream.handle()) }
            .unwrap()
            .wait()
            .unwrap();
        blocks.check(&d, &h, round);
        let (made, gathers, crossings) = (
            allocs() - before.0,
            process_calls(c"cuMemcpy2DAsync_v2") - before.1,
            process_calls(c"cuMemcpyAsync") - before.2,
        );
        // A ring (device and pinned host memory) at the first move of each chunk size only.
        let fresh = round == 0 || round == 3;
        assert_eq!(made, if fresh { 2 } else { 0 }, "round {round}");
        assert_eq!(mover.staging_bytes(), 2 * 4 * chunk, "round {round}");
        // The plan's copies: a 2D gather per piece, ONE copy across per chunk.
        assert_eq!(gathers as usize, plan.copies, "round {round}: {plan:?}");
        assert_eq!(
            crossings as usize,
            plan.calls - plan.copies,
            "round {round}: {plan:?}"
        );
        assert_eq!(
            crossings as usize,
            ((40 * 4 * 16usize) << 10).div_ceil(chunk),
            "round {round}"
        );
    }
}

/// A staged move whose copy the driver refuses partway (on the mover's own thread), or one of
/// whose tasks panics (a bug), fails: its wait reports the error instead of hanging, and the
/// mover's next moves land, every block checked.
#[test]
fn a_staged_move_that_fails_partway_reports_it_and_the_next_lands() {
    let Some((dev, _calls)) =
        fake("a_staged_move_that_fails_partway_reports_it_and_the_next_lands")
    else {
        return;
    };
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let _cur = dev.enter().unwrap();
    let stream = Stream::new(&dev).unwrap();
    type Fail = unsafe extern "C" fn(*const c_char, u64, u32);
    // SAFETY: the simulated driver, loaded (`fake`), exports it with this signature.
    let fail: Fail = unsafe {
        let h = libc::dlopen(c"libcuda.so".as_ptr(), libc::RTLD_NOLOAD | libc::RTLD_NOW);
        let f = libc::dlsym(h, c"fakecuda_fail".as_ptr());
        assert!(!f.is_null());
        std::mem::transmute::<*mut libc::c_void, Fail>(f)
    };
    // 40 blocks of 4 tensors x 16 KiB in 256 KiB chunks: 10 chunks, 40 2D copies, 20 tasks.
    const NB: usize = 64;
    let blocks = Blocks::new(&dev, &stream, 4, NB, 4096);
    let mover = &blocks.mover;
    mover
        .set_staging(pinstage::blocks::Staging::Always, 256 << 10)
        .unwrap();
    let (offload, load) = (
        pinstage::blocks::Direction::Offload,
        pinstage::blocks::Direction::Load,
    );
    // SAFETY (each move): the buffers outlive it (waited for); nothing else touches them.
    let run = |direction, d: &[usize], h: &[usize]| unsafe {
        match direction {
            pinstage::blocks::Direction::Offload => {
                mover.offload_in_background(d, h, stream.handle())
            }
            _ => mover.load_in_background(h, d, stream.handle()),
        }
        .unwrap()
        .wait()
    };
    let faults: [(&str, &CStr, u64); 4] = [
        ("cuMemcpyAsync", c"cuMemcpyAsync", 3),
        ("cuMemcpy2DAsync", c"cuMemcpy2DAsync_v2", 17),
        ("(a bug)", c"", 5),
        ("cuMemcpyAsync", c"cuMemcpyAsync", 9),
    ];
    for (round, &(what, call, after)) in faults.iter().enumerate() {
        for direction in [offload, load] {
            let d = pinstage::testing::shuffled_ids(40, NB, 3 + round as u64);
            let h = pinstage::testing::shuffled_ids(40, NB, 30 + round as u64);
            if direction == load {
                // The host blocks hold other device blocks' values, which the load writes over
                // device blocks `d`: checked first.
                let other: Vec<usize> = d.iter().map(|&b| (b + 1) % NB).collect();
                blocks.poison();
                run(offload, &other, &h).unwrap();
                blocks.check(&other, &h, (round, "before the load"));
            }
            if call.is_empty() {
                pinstage::testing::panic_in_staged_task(after as u32);
            } else {
                // SAFETY: a NUL-terminated name.
                unsafe { fail(call.as_ptr(), after, 999) };
            }
            let failed = run(direction, &d, &h);
            pinstage::testing::panic_in_staged_task(0);
            let err = failed.expect_err("a move that failed partway");
            assert!(
                err.to_string().contains(what),
                "round {round} {direction:?}: {err}"
            );
            if direction == load {
                // Nothing of the failed load writes the device blocks once its wait returned
                // (its queued scatters drained first).
                let seen = blocks.device_bytes();
                std::thread::sleep(std::time::Duration::from_millis(20));
                assert!(
                    blocks.device_bytes() == seen,
                    "round {round}: the device blocks changed after the failed load's wait"
                );
                blocks.reset_device();
                stream.synchronize().unwrap();
            }
            // The next moves land: every host block, through one offload of every block (after
            // a load: of the device blocks as they were).
            blocks.poison();
            let all: Vec<usize> = (0..NB).collect();
            let back = pinstage::testing::shuffled_ids(NB, NB, 99 + round as u64);
            run(offload, &all, &back).unwrap();
            blocks.check(&all, &back, (round, direction, "after the failure"));
        }
    }
}
