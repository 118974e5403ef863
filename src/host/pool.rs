//! A pool of pinned blocks, so repeated D2H results do not pay for pinning each time.
//!
//! Blocks are [`PinnedBuffer::alloc`]'s memory (host pool blocks, else registered pages) at the request's size rounded up to
//! whole 4 KiB pages (less than a page of waste); a cached block serves the next request of the
//! same page count. A byte budget bounds the pinned bytes the pool holds (cached and in use);
//! past it, cached blocks are evicted (largest first), and if that is not enough the request is
//! served by pageable memory (counted) or refused ([`PinnedPool::try_acquire_pinned`]). A
//! second limit bounds the cached bytes alone.

use std::collections::BTreeMap;
use std::sync::Arc;

use parking_lot::Mutex;

use super::HostRegion;
use super::{PinnedBuffer, PinnedFlags};
use crate::cuda::Device;
use crate::error::Result;

/// Default budget: 4 GiB of pinned memory.
pub const DEFAULT_BUDGET: usize = 4 << 30;

/// Counters and gauges of a pool.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PinnedPoolStats {
    /// Requests served from the cache.
    pub hits: u64,
    /// Requests that allocated a new pinned block.
    pub misses: u64,
    /// Requests served by pageable memory because the budget was exhausted.
    pub pageable_fallbacks: u64,
    /// Cached blocks freed to stay within the budget or by `empty_cache`.
    pub evictions: u64,
    /// Pinned bytes in blocks handed out now.
    pub in_use_bytes: usize,
    /// Pinned bytes cached for reuse now.
    pub pooled_bytes: usize,
    /// Highest `in_use_bytes + cached_bytes` seen.
    pub peak_bytes: usize,
    /// The budget: the most pinned bytes the pool holds, in use and cached.
    pub max_outstanding_bytes: usize,
    /// The most bytes kept cached (`usize::MAX`: only the budget bounds them); blocks returned
    /// past it are freed, the largest cached first.
    pub max_pooled_bytes: usize,
}

struct State {
    free: BTreeMap<usize, Vec<PinnedBuffer>>,
    stats: PinnedPoolStats,
}

struct Inner {
    device: Device,
    state: Mutex<State>,
}

/// A pool of pinned blocks on one device. Cheap to clone (shared).
#[derive(Clone)]
pub struct PinnedPool {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for PinnedPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PinnedPool")
            .field("stats", &self.stats())
            .finish()
    }
}

/// The size class that serves `len` bytes: whole 4 KiB pages, so a block wastes less than a
/// page (a cached block serves requests of the same page count).
pub fn size_class(len: usize) -> usize {
    len.max(1).next_multiple_of(crate::driver::mem::PAGE)
}

impl PinnedPool {
    /// An empty pool on `device` with `budget` bytes.
    pub fn new(device: &Device, budget: usize) -> Self {
        Self {
            inner: Arc::new(Inner {
                device: device.clone(),
                state: Mutex::new(State {
                    free: BTreeMap::new(),
                    stats: PinnedPoolStats {
                        max_outstanding_bytes: budget,
                        max_pooled_bytes: usize::MAX,
                        ..PinnedPoolStats::default()
                    },
                }),
            }),
        }
    }

    /// A pool holding at most `max_outstanding` pinned bytes, in use and cached together
    /// (`None`: no limit), of which at most `max_cached` cached (`None`: only the first limit).
    /// Past `max_outstanding` cached blocks are freed to make room, then
    /// [`PinnedPool::try_acquire_pinned`] refuses and [`PinnedPool::acquire`] gives pageable
    /// memory.
    pub fn with_max_outstanding(
        device: &Device,
        max_outstanding: Option<usize>,
        max_cached: Option<usize>,
    ) -> Self {
        let pool = Self::new(device, max_outstanding.unwrap_or(usize::MAX));
        pool.inner.state.lock().stats.max_pooled_bytes = max_cached.unwrap_or(usize::MAX);
        pool
    }

    /// A pinned block of at least `len` bytes (cached or newly pinned), or `None` when the pool
    /// cannot hold it within its budget even with every cached block freed (nothing is counted
    /// then but the cached blocks freed).
    ///
    /// # Errors
    /// [`crate::Error::Driver`] / [`crate::Error::OutOfMemory`] when the memory cannot be pinned.
    pub fn try_acquire_pinned(&self, len: usize) -> Result<Option<PoolBlock>> {
        self.acquire_inner(len, false)
    }

    /// The device.
    pub fn device(&self) -> &Device {
        &self.inner.device
    }

    /// A block of at least `len` bytes: cached, newly pinned, or pageable past the budget. Never
    /// waits for pinstage's pending frees (where [`PinnedBuffer::alloc`] would): memory that
    /// cannot be pinned at once is an error, for the caller to serve with pageable memory.
    ///
    /// # Errors
    /// [`crate::Error::Driver`] / [`crate::Error::OutOfMemory`] when the memory cannot be pinned
    /// (or, past the budget, a pageable block cannot be had).
    pub fn acquire(&self, len: usize) -> Result<PoolBlock> {
        Ok(self
            .acquire_inner(len, true)?
            .expect("acquire falls back to pageable memory"))
    }

    /// Serves `len` bytes: a cached block of its size class, else a new pinned block within the
    /// budget (cached blocks evicted first, largest first), else pageable memory (`fallback`)
    /// or `None`. One lock decides, so two threads never both pass the budget.
    fn acquire_inner(&self, len: usize, fallback: bool) -> Result<Option<PoolBlock>> {
        let class = size_class(len);
        let evicted;
        {
            let mut st = self.inner.state.lock();
            // A cached block of the class moves from cached to in use: the total is unchanged.
            if let Some(buf) = st.free.get_mut(&class).and_then(Vec::pop) {
                if st.free.get(&class).is_some_and(Vec::is_empty) {
                    st.free.remove(&class);
                }
                st.stats.hits += 1;
                st.stats.pooled_bytes -= class;
                st.stats.in_use_bytes += class;
                return Ok(Some(self.block(buf, len)));
            }
            // Make room within the budget by evicting cached blocks, largest first; but only
            // when that can make room: a request larger than the budget leaves the cache alone.
            let can_fit =
                st.stats.in_use_bytes.saturating_add(class) <= st.stats.max_outstanding_bytes;
            evicted = if can_fit {
                Self::evict_until(&mut st, class)
            } else {
                Vec::new()
            };
            if !can_fit
                || st
                    .stats
                    .in_use_bytes
                    .saturating_add(st.stats.pooled_bytes)
                    .saturating_add(class)
                    > st.stats.max_outstanding_bytes
            {
                st.stats.pageable_fallbacks += u64::from(fallback);
                drop(st);
                drop(evicted);
                if !fallback {
                    return Ok(None);
                }
                return Ok(Some(PoolBlock {
                    kind: Kind::Pageable(super::zeroed_vec(len, "pageable fallback block")?),
                    len,
                }));
            }
            // Reserve before allocating outside the lock.
            st.stats.misses += 1;
            st.stats.in_use_bytes += class;
            let total = st.stats.in_use_bytes + st.stats.pooled_bytes;
            st.stats.peak_bytes = st.stats.peak_bytes.max(total);
        }
        drop(evicted); // free outside the lock
        // A caller served by pageable memory past the budget is served so when pinning fails
        // too (`empty_host`, `copy_d2h`): it never waits for pending frees.
        let pin = if fallback {
            PinnedBuffer::alloc_now
        } else {
            PinnedBuffer::alloc
        };
        match pin(&self.inner.device, class, PinnedFlags::PORTABLE) {
            Ok(buf) => Ok(Some(self.block(buf, len))),
            Err(e) => {
                self.inner.state.lock().stats.in_use_bytes -= class;
                Err(e)
            }
        }
    }

    fn block(&self, buf: PinnedBuffer, len: usize) -> PoolBlock {
        PoolBlock {
            kind: Kind::Pinned {
                buf: Some(buf),
                pool: self.inner.clone(),
            },
            len,
        }
    }

    /// Counts a request its caller served by pageable memory itself (the memory could not be
    /// pinned).
    pub fn count_fallback(&self) {
        self.inner.state.lock().stats.pageable_fallbacks += 1;
    }

    /// A snapshot of the counters.
    pub fn stats(&self) -> PinnedPoolStats {
        self.inner.state.lock().stats
    }

    /// Changes the budget; cached blocks beyond it are freed now.
    pub fn set_budget(&self, budget: usize) {
        let evicted = {
            let mut st = self.inner.state.lock();
            st.stats.max_outstanding_bytes = budget;
            Self::trim(&mut st)
        };
        drop(evicted);
    }

    /// Frees every cached block (blocks in use are unaffected).
    pub fn empty_cache(&self) {
        let evicted = {
            let mut st = self.inner.state.lock();
            let all: Vec<_> = std::mem::take(&mut st.free)
                .into_values()
                .flatten()
                .collect();
            st.stats.evictions += all.len() as u64;
            st.stats.pooled_bytes = 0;
            all
        };
        drop(evicted);
    }

    fn trim(st: &mut State) -> Vec<PinnedBuffer> {
        Self::evict_until(st, 0)
    }

    /// Frees cached blocks, largest first, until `extra` more bytes fit the budget and the
    /// cached bytes fit their own limit, or nothing is cached. Returns them, to be dropped
    /// outside the lock.
    fn evict_until(st: &mut State, extra: usize) -> Vec<PinnedBuffer> {
        let mut evicted = Vec::new();
        while (st
            .stats
            .in_use_bytes
            .saturating_add(st.stats.pooled_bytes)
            .saturating_add(extra)
            > st.stats.max_outstanding_bytes
            || st.stats.pooled_bytes > st.stats.max_pooled_bytes)
            && st.stats.pooled_bytes > 0
        {
            let (&c, list) = st.free.iter_mut().next_back().expect("cached bytes > 0");
            if let Some(b) = list.pop() {
                st.stats.pooled_bytes -= c;
                st.stats.evictions += 1;
                evicted.push(b);
            }
            if st.free.get(&c).is_some_and(Vec::is_empty) {
                st.free.remove(&c);
            }
        }
        evicted
    }
}

enum Kind {
    Pinned {
        buf: Option<PinnedBuffer>,
        pool: Arc<Inner>,
    },
    Pageable(Vec<u8>),
}

/// A block from a [`PinnedPool`]: `len` usable bytes, pinned unless the budget was exhausted.
/// Returns to the pool's cache when dropped.
pub struct PoolBlock {
    kind: Kind,
    len: usize,
}

impl PoolBlock {
    /// Usable length (the requested size).
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the block is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Whether the block is pinned (else it is a pageable fallback).
    pub fn is_pinned(&self) -> bool {
        matches!(self.kind, Kind::Pinned { .. })
    }

    /// Start of the block.
    pub fn as_mut_ptr(&mut self) -> *mut u8 {
        match &mut self.kind {
            Kind::Pinned { buf, .. } => buf.as_mut().expect("present until drop").as_mut_ptr(),
            Kind::Pageable(v) => v.as_mut_ptr(),
        }
    }

    /// The usable bytes.
    pub fn as_slice(&self) -> &[u8] {
        match &self.kind {
            Kind::Pinned { buf, .. } => {
                &buf.as_ref().expect("present until drop").as_slice()[..self.len]
            }
            Kind::Pageable(v) => &v[..self.len],
        }
    }

    /// The usable bytes, mutably.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        let len = self.len;
        match &mut self.kind {
            Kind::Pinned { buf, .. } => {
                &mut buf.as_mut().expect("present until drop").as_mut_slice()[..len]
            }
            Kind::Pageable(v) => &mut v[..len],
        }
    }
}

// SAFETY: both the pinned block and the Vec's heap block stay put when the PoolBlock moves.
unsafe impl HostRegion for PoolBlock {
    fn region(&mut self) -> (*mut u8, usize) {
        (self.as_mut_ptr(), self.len)
    }
}

impl Drop for PoolBlock {
    fn drop(&mut self) {
        if let Kind::Pinned { buf, pool } = &mut self.kind
            && let Some(buf) = buf.take()
        {
            let class = buf.len();
            let evicted = {
                let mut st = pool.state.lock();
                st.stats.in_use_bytes -= class;
                st.stats.pooled_bytes += class;
                st.free.entry(class).or_default().push(buf);
                PinnedPool::trim(&mut st)
            };
            drop(evicted);
        }
    }
}
