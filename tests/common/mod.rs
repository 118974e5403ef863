//! Helpers shared by the integration tests.
#![allow(dead_code)]

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use pinstage::testing::DeviceBuffer;
use pinstage::{DType, Stream};

pub mod sim;

/// Element counts from `fixtures/sizes.txt`.
pub fn sizes() -> Vec<usize> {
    read_fixture("sizes.txt")
        .iter()
        .map(|l| l.parse().expect("size"))
        .collect()
}

/// dtypes from `fixtures/dtypes.txt`.
pub fn dtypes() -> Vec<DType> {
    read_fixture("dtypes.txt")
        .iter()
        .map(|l| DType::from_name(l).expect("dtype"))
        .collect()
}

fn read_fixture(name: &str) -> Vec<String> {
    // The GPU machine runs binaries built here from another checkout path: PINSTAGE_FIXTURES
    // (set by scripts/gpu-run) or ./fixtures take precedence over the build-time path.
    let dir = std::env::var_os("PINSTAGE_FIXTURES")
        .map(std::path::PathBuf::from)
        .or_else(|| Some(std::path::PathBuf::from("fixtures")).filter(|p| p.is_dir()))
        .unwrap_or_else(|| std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures"));
    let path = dir.join(name);
    std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .map(str::to_owned)
        .collect()
}

/// Deterministic, non-zero-heavy element bytes for `dtype` (bools are 0/1 mixed).
pub fn values(dtype: DType, n: usize, seed: u64) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut out = Vec::with_capacity(n * dtype.itemsize());
    for i in 0..n * dtype.itemsize() {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let b = if dtype == DType::Bool {
            ((x >> 11) & 1) as u8 ^ (i as u8 & 1)
        } else {
            (x >> 24) as u8 | 1
        };
        out.push(b);
    }
    out
}

/// One pad element, distinct from values and poison.
pub fn pad(dtype: DType) -> Vec<u8> {
    if dtype == DType::Bool {
        vec![1]
    } else {
        (0..dtype.itemsize())
            .map(|i| 0x5A ^ (i as u8 * 16))
            .collect()
    }
}

/// Poison byte written before every copy.
pub const POISON: u8 = 0xA5;

/// Checks `out` = values, then pad up to `padded_elems`, then poison.
pub fn check_layout(out: &[u8], values: &[u8], pad: Option<&[u8]>, padded_bytes: usize) {
    assert_eq!(&out[..values.len()], values, "values differ");
    if let Some(p) = pad {
        for (i, chunk) in out[values.len()..padded_bytes].chunks(p.len()).enumerate() {
            assert_eq!(chunk, p, "pad element {i} differs");
        }
    }
    let end = if pad.is_some() {
        padded_bytes
    } else {
        values.len()
    };
    assert!(
        out[end..].iter().all(|&b| b == POISON),
        "bytes past the copy were touched"
    );
}

/// `Some(device)` when a GPU is present; otherwise prints the skip reason and returns `None`,
/// or panics when `PINSTAGE_REQUIRE_GPU=1`.
pub fn gpu_or_skip(test: &str) -> Option<pinstage::Device> {
    match pinstage::Device::new(0) {
        Ok(d) => Some(d),
        Err(e) => {
            if std::env::var("PINSTAGE_REQUIRE_GPU").is_ok_and(|v| v == "1") {
                panic!("PINSTAGE_REQUIRE_GPU=1 but no GPU: {e}");
            }
            eprintln!("SKIP {test}: no GPU ({e})");
            None
        }
    }
}

/// A device buffer of `numel` elements of `dtype` plus a 3-element guard band, poisoned.
pub fn poisoned(dev: &pinstage::Device, dtype: DType, numel: usize) -> DeviceBuffer {
    let bytes = (numel + 3) * dtype.itemsize();
    let buf = DeviceBuffer::new(dev, bytes).unwrap();
    buf.upload(0, &vec![POISON; bytes]).unwrap();
    buf
}

/// The whole buffer, downloaded.
pub fn read(buf: &DeviceBuffer) -> Vec<u8> {
    let mut out = vec![0u8; buf.len()];
    buf.download(0, &mut out).unwrap();
    out
}

/// A view of the first `numel` elements of `buf`.
pub fn view(buf: &DeviceBuffer, dtype: DType, numel: usize) -> pinstage::DeviceView<'_> {
    buf.view_at(0, dtype, numel)
}

/// The stager calls of the tests in one line each: `put(dst, values, pad, mirror, stream)`.
pub trait Put<T: pinstage::dlpack::Element> {
    /// `self.to(dst)` with the options given, then `.copy(values)`.
    fn put(
        &self,
        dst: &pinstage::DeviceView<'_>,
        values: &[T],
        pad: Option<T>,
        mirror: Option<&mut pinstage::H2DMirror>,
        stream: pinstage::StreamHandle,
    ) -> pinstage::Result<pinstage::h2d::CopyOutcome>;
}

impl<T: pinstage::dlpack::Element> Put<T> for pinstage::PinnedStager<T> {
    fn put(
        &self,
        dst: &pinstage::DeviceView<'_>,
        values: &[T],
        pad: Option<T>,
        mirror: Option<&mut pinstage::H2DMirror>,
        stream: pinstage::StreamHandle,
    ) -> pinstage::Result<pinstage::h2d::CopyOutcome> {
        let mut c = self.to(dst).stream(stream);
        if let Some(p) = pad {
            c = c.pad(p);
        }
        if let Some(m) = mirror {
            c = c.mirror(m);
        }
        c.copy(values)
    }
}

/// [`Put`] for the untyped stager, with raw element bytes.
pub fn put_bytes(
    st: &pinstage::h2d::RawStager,
    dst: &pinstage::DeviceView<'_>,
    values: &[u8],
    pad: Option<&[u8]>,
    mirror: Option<&mut pinstage::H2DMirror>,
    stream: pinstage::StreamHandle,
) -> pinstage::Result<pinstage::h2d::CopyOutcome> {
    let mut c = st.to(dst).stream(stream);
    if let Some(p) = pad {
        c = c.pad(p);
    }
    if let Some(m) = mirror {
        c = c.mirror(m);
    }
    c.copy(values)
}

/// `PinnedStager::<T>::builder().device(device).numel(numel).depth(depth).build()`.
pub fn stager<T: pinstage::dlpack::Element>(
    device: i32,
    numel: usize,
    depth: usize,
) -> pinstage::Result<pinstage::PinnedStager<T>> {
    pinstage::PinnedStager::<T>::builder()
        .device(device)
        .numel(numel)
        .depth(depth)
        .build()
}

/// Releases a stalled stream when dropped, so a failing assertion cannot leave the stream (and
/// every allocation that synchronizes the device) blocked forever.
pub struct Stall(Arc<AtomicBool>);

impl Stall {
    pub fn release(&self) {
        self.0.store(true, Ordering::Release);
    }
}

impl Drop for Stall {
    fn drop(&mut self) {
        self.release();
    }
}

/// Stalls `stream` through a host function (no kernel) until the returned guard is released or
/// dropped. Allocate everything the test needs BEFORE stalling: pinned and device allocations may
/// synchronize the whole device, and would wait for the stall. The stall begins once pinstage's
/// reaper thread finished the frees handed to it so far (earlier tests' stagers and blocks): a
/// free under way when the stall begins waits for the stall and meanwhile holds up every other
/// thread's driver calls (`lab/c/free_lock.c`), which a test would misread as its own blocking.
pub fn stall(stream: &Stream) -> Stall {
    stall_handle(stream.device(), stream.handle())
}

/// [`stall`] on any stream handle of `dev` (this thread's per-thread default stream, say).
pub fn stall_handle(dev: &pinstage::Device, stream: pinstage::StreamHandle<'_>) -> Stall {
    pinstage::host::wait_for_frees();
    let go = Arc::new(AtomicBool::new(false));
    let g = go.clone();
    // SAFETY: the host function calls no CUDA function and drops only an Arc<AtomicBool>.
    unsafe {
        pinstage::testing::launch_host_fn_on(dev, stream, move || {
            let t0 = std::time::Instant::now();
            // Bounded: never hold a stream longer than 20 s even if the test thread died.
            while !g.load(Ordering::Acquire) && t0.elapsed() < Duration::from_secs(20) {
                std::thread::sleep(Duration::from_micros(200));
            }
        })
    }
    .unwrap();
    Stall(go)
}
