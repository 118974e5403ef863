//! The host time of one block move's call, in Rust (no Python): `plan()`, a background offload
//! and a background load of `n` random ids between 64 device tensors and 64 pinned host tensors
//! of 8192 blocks (one allocation per side, per-tensor views, as engines allocate a pool), each
//! move then waited for untimed. Rows: median ns of 200 calls: "hot", each call right after the
//! wait for the move before; "cold", 64 MiB of other memory written before each call as well;
//! "idle", 1 ms of sleep before each call (the issuing threads parked); "rows", each direction's
//! calls back to back (no plan() or other direction between), as the Python probe's rows run.
//! The control in the first three: one bare event record timed right after each load's wait,
//! in every mode before the next round's memory writes or sleep (so it shows the state a call
//! made right after a move's wait finds, not the cold or idle state;
//! lab/probes/blocks_bg_cost.py times torch's record the same way).
//!
//! Runs against any driver: the H200's (`scripts/gpu-run`), or the simulated one on a machine
//! without a GPU (`eval "export $(scripts/fake-gpu env)"`; host figures only, the driver calls
//! then cost what the simulation costs).
//!
//!     cargo bench --features lab --bench blocks_call [-- BLOCK_BYTES]

use std::hint::black_box;
use std::time::Instant;

use pinstage::blocks::{BlockMover, Direction};
use pinstage::host::PinnedFlags;
use pinstage::testing::DeviceBuffer;
use pinstage::{Device, DeviceView, PinnedBuffer, Stream};

const L: usize = 64;
const NB: usize = 8192;

fn view(ptr: u64, cuda: bool, shape: &[i64]) -> DeviceView<'static> {
    // SAFETY: the buffers outlive every view (main holds them to the end).
    unsafe { pinstage::testing::bytes_view(ptr, cuda.then_some(0), shape, false) }
}

fn ids(n: usize, seed: u64) -> Vec<usize> {
    pinstage::testing::shuffled_ids(n, NB, seed)
}

/// Host ns of one background move's call (`d` device ids, `h` host ids, in `dir`), the move
/// then waited for untimed.
fn timed_move(
    mover: &BlockMover,
    dir: Direction,
    d: &[usize],
    h: &[usize],
    stream: &Stream,
) -> u64 {
    let t = Instant::now();
    // SAFETY: the buffers outlive the move (waited for below); nothing else touches them; the
    // stream is the mover's device's.
    let m = unsafe {
        match dir {
            Direction::Offload => mover.offload_in_background(d, h, stream.handle()),
            Direction::Load => mover.load_in_background(h, d, stream.handle()),
        }
    };
    let ns = t.elapsed().as_nanos() as u64;
    m.expect("a move").wait().expect("the move completed");
    ns
}

fn median(mut v: Vec<u64>) -> f64 {
    v.sort_unstable();
    v[v.len() / 2] as f64
}

fn main() {
    let bytes: usize = std::env::args()
        .skip(1)
        .find_map(|a| a.parse().ok())
        .unwrap_or(64);
    let device = match Device::get(0) {
        Ok(d) => d,
        Err(e) => {
            println!("blocks_call: skipped, no GPU ({e})");
            return;
        }
    };
    let per = NB * bytes;
    let dev = DeviceBuffer::new(&device, L * per).expect("device memory");
    let host = PinnedBuffer::alloc(&device, L * per, PinnedFlags::PORTABLE).expect("pinned");
    let shape = [NB as i64, bytes as i64];
    let devs: Vec<_> = (0..L)
        .map(|t| view(dev.ptr() + (t * per) as u64, true, &shape))
        .collect();
    let hosts: Vec<_> = (0..L)
        .map(|t| view(host.as_ptr() as u64 + (t * per) as u64, false, &shape))
        .collect();
    let mover = BlockMover::new(&devs, &hosts, 0).expect("a mover");
    let stream = Stream::new(&device).expect("a stream");
    if let Ok(n) = std::env::var("BLOCKS_CALL_PLAN_ONLY") {
        // For a profiler: plan() of n ids, hot, 20,000 times.
        let n: usize = n.parse().expect("a count");
        let (d, h) = (ids(n, 7), ids(n, 11));
        let t = Instant::now();
        for _ in 0..20_000 {
            black_box(mover.plan(Direction::Offload, &d, &h).expect("a plan"));
        }
        println!(
            "plan() of {n} ids: {:.0} ns",
            t.elapsed().as_nanos() as f64 / 2e4
        );
        return;
    }
    let mut other = vec![1u8; 64 << 20];
    let marker = pinstage::cuda::Event::new(&device).expect("an event");
    println!(
        "blocks_call: {L} tensors x {NB} blocks of {bytes} B; median ns per call of 200 \
         (hot: after the wait for the move before; cold: 64 MiB written before each call too; \
         idle: 1 ms of sleep before each call; rows: each direction's calls back to back)"
    );
    for n in [1usize, 128, 2048] {
        let (d, h) = (ids(n, 7), ids(n, 11));
        let p = mover.plan(Direction::Offload, &d, &h).expect("a plan");
        println!(
            "  {n} ids: {:?}, {} runs, {} calls",
            p.strategy, p.runs, p.calls
        );
        for mode in ["hot ", "cold", "idle"] {
            let cold = mode == "cold";
            // idle: 1 ms of sleep before each call, so the mover's issuing threads are parked
            // (they poll for 50 us after a move).
            let idle = || {
                if mode == "idle" {
                    std::thread::sleep(std::time::Duration::from_millis(1));
                }
            };
            let mut plan = Vec::new();
            let mut off = Vec::new();
            let mut load = Vec::new();
            let mut rec = Vec::new();
            for i in 0..200 {
                if cold {
                    for b in other.iter_mut().step_by(64) {
                        *b = b.wrapping_add(i as u8);
                    }
                }
                let t = Instant::now();
                black_box(mover.plan(Direction::Offload, &d, &h).expect("a plan"));
                plan.push(t.elapsed().as_nanos() as u64);
                if cold {
                    for b in other.iter_mut().step_by(64) {
                        *b = b.wrapping_add(1);
                    }
                }
                idle();
                off.push(timed_move(&mover, Direction::Offload, &d, &h, &stream));
                if cold {
                    for b in other.iter_mut().step_by(64) {
                        *b = b.wrapping_add(1);
                    }
                }
                idle();
                load.push(timed_move(&mover, Direction::Load, &d, &h, &stream));
                // The control: one bare driver call (an event record) right after the load's
                // wait, in the state a call made right after a move's wait finds.
                let t = Instant::now();
                marker.record(stream.handle()).expect("a record");
                rec.push(t.elapsed().as_nanos() as u64);
            }
            println!(
                "    {}: plan {:8.0}  offload bg {:8.0}  load bg {:8.0}  control: record {:6.0}",
                mode,
                median(plan),
                median(off),
                median(load),
                median(rec)
            );
        }
        // "rows": each direction's 200 calls back to back, each right after the wait for the
        // one before, no plan() or move of the other direction between (the pattern of
        // lab/probes/blocks_bg_cost.py's rows, for a like-for-like Python / Rust comparison).
        let [off, load] = [Direction::Offload, Direction::Load].map(|dir| {
            (0..200)
                .map(|_| timed_move(&mover, dir, &d, &h, &stream))
                .collect()
        });
        println!(
            "    rows: plan        -  offload bg {:8.0}  load bg {:8.0}",
            median(off),
            median(load)
        );
    }
    black_box(&other);
}
