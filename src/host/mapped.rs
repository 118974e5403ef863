//! Host pages straight from the kernel for registered pinned memory: an anonymous mapping at the
//! page-rounded size, aligned to 2 MiB and advised to use transparent huge pages where the
//! system offers them, populated (by the kernel in one call per range, on several threads for
//! large mappings) before it is registered.

use std::ptr::NonNull;

use crate::error::{Error, Result};

use crate::driver::mem::PAGE;
/// A transparent huge page (x86-64, aarch64 with 4 KiB pages).
const HUGE: usize = 2 << 20;
/// Mappings up to this size are populated by the calling thread alone.
const POPULATE_ALONE: usize = 8 << 20;
/// `madvise` advice: populate (prefault) page tables writable (Linux 5.14+; `EINVAL` before).
const MADV_POPULATE_WRITE: libc::c_int = 23;

/// An anonymous private mapping of `len` bytes (a multiple of [`PAGE`]), every page touched;
/// unmapped when dropped.
pub(crate) struct MappedPages {
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: uniquely owned plain memory.
unsafe impl Send for MappedPages {}
// SAFETY: `&MappedPages` hands out only the address.
unsafe impl Sync for MappedPages {}

impl MappedPages {
    /// Maps at least `len` bytes (rounded up to whole pages), populated.
    ///
    /// # Errors
    /// [`Error::OutOfMemory`] when the kernel refuses the mapping or its pages.
    #[cfg(any(test, feature = "lab"))]
    pub(crate) fn new(len: usize) -> Result<Self> {
        Self::new_on(len, None)
    }

    /// [`MappedPages::new`] with the pages taken from NUMA node `node` where the kernel can
    /// (a preferred node: another one serves when it is full).
    ///
    /// # Errors
    /// As [`MappedPages::new`].
    pub(crate) fn new_on(len: usize, node: Option<u32>) -> Result<Self> {
        let pages = Self::new_untouched(len)?;
        if let Some(node) = node {
            // SAFETY: our fresh, untouched mapping. Advice only: refused, the pages come from
            // wherever the kernel's default policy takes them.
            unsafe { super::numa::prefer_node(pages.as_ptr(), pages.len(), node) };
        }
        pages.populate()?;
        Ok(pages)
    }

    /// [`MappedPages::new`] without touching the pages (the laboratory compares).
    pub(crate) fn new_untouched(len: usize) -> Result<Self> {
        let oom = || Error::OutOfMemory {
            what: "host pages to pin",
            bytes: len,
        };
        let len = len
            .max(1)
            .checked_next_multiple_of(PAGE)
            .filter(|l| l.checked_add(HUGE).is_some())
            .ok_or_else(oom)?;
        // Touching more pages than the system (or this process's cgroup) can give would wake
        // the kernel's OOM killer instead of failing: refuse first.
        if available_bytes().is_some_and(|avail| len > avail / 10 * 9) {
            return Err(oom());
        }
        let huge = len >= HUGE;
        // Reserve 2 MiB more address space when huge pages may serve, to align the start.
        let reserve = if huge { len + HUGE } else { len };
        // SAFETY: a fresh anonymous private mapping; no existing memory is touched.
        let base = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                reserve,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if base == libc::MAP_FAILED {
            return Err(oom());
        }
        let base = base.cast::<u8>();
        let start = if huge {
            let lead = base.align_offset(HUGE);
            // SAFETY: both trimmed ranges lie within our reservation and are unmapped once.
            unsafe {
                if lead > 0 {
                    libc::munmap(base.cast(), lead);
                }
                let tail = HUGE - lead;
                libc::munmap(base.add(lead + len).cast(), tail);
                let start = base.add(lead);
                // Advice only: without transparent huge pages the mapping keeps small pages.
                libc::madvise(start.cast(), len, libc::MADV_HUGEPAGE);
                start
            }
        } else {
            base
        };
        Ok(Self {
            ptr: NonNull::new(start).ok_or_else(oom)?,
            len,
        })
    }

    /// Faults every page in. The kernel populates each range in one call
    /// (`MADV_POPULATE_WRITE`, Linux 5.14+: no fault per page, huge pages whole) or, where it
    /// cannot, every page is touched. Small mappings (up to [`POPULATE_ALONE`]) on the calling
    /// thread (waking threads costs more than it saves), larger ones in 2 MiB chunks on several
    /// threads (the kernel zeroes each page; one core alone would take several times longer).
    fn populate(&self) -> Result<()> {
        let addr = self.ptr.as_ptr() as usize;
        // SAFETY: every range passed lies inside our mapping.
        let fill = |from: usize, to: usize| unsafe { populate_range(addr + from, to - from, true) };
        let populated = if self.len <= POPULATE_ALONE {
            fill(0, self.len)
        } else {
            let touch = |chunk: usize| fill(chunk * HUGE, ((chunk + 1) * HUGE).min(self.len));
            let chunks = self.len.div_ceil(HUGE);
            match super::workers::workers() {
                Some(pool) => pool.install(|| {
                    use rayon::prelude::*;
                    (0..chunks).into_par_iter().all(touch)
                }),
                None => (0..chunks).all(touch),
            }
        };
        if populated {
            Ok(())
        } else {
            Err(Error::OutOfMemory {
                what: "host pages to pin",
                bytes: self.len,
            })
        }
    }

    pub(crate) fn as_ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    pub(crate) fn len(&self) -> usize {
        self.len
    }
}

/// Faults in `len` bytes from `addr` writable: `MADV_POPULATE_WRITE` when `advise` and the
/// kernel knows it, else a touch per page. `false`: the kernel refused the memory
/// (`MADV_POPULATE_WRITE` failing for another reason than not knowing it, e.g. `ENOMEM` under a
/// cgroup's limit): touching the pages would wake the OOM killer instead.
///
/// # Safety
/// `addr..addr+len` is one writable private anonymous mapping of ours whose content may be
/// overwritten with zeros (only untouched pages are touched: zero-filled already).
unsafe fn populate_range(addr: usize, len: usize, advise: bool) -> bool {
    if advise {
        // SAFETY: advice over a range of our mapping (caller); it populates, changing no
        // content.
        if unsafe { libc::madvise(addr as *mut libc::c_void, len, MADV_POPULATE_WRITE) } == 0 {
            return true;
        }
        if std::io::Error::last_os_error().raw_os_error() != Some(libc::EINVAL) {
            return false;
        }
    }
    let mut off = 0;
    while off < len {
        // SAFETY: inside the mapping (caller); a volatile write so the touch is not elided. The
        // page is fresh (zero), so writing a zero changes nothing.
        unsafe { std::ptr::write_volatile((addr + off) as *mut u8, 0) };
        off += PAGE;
    }
    true
}

/// Memory the kernel can still give this process: `MemAvailable`, and the cgroup's limit less
/// its usage where one is set. `None` when neither can be read.
fn available_bytes() -> Option<usize> {
    let meminfo = std::fs::read_to_string("/proc/meminfo").ok().and_then(|s| {
        s.lines()
            .find_map(|l| l.strip_prefix("MemAvailable:"))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<usize>().ok())
            .map(|kb| kb.saturating_mul(1024))
    });
    let read = |p: &str| {
        std::fs::read_to_string(p)
            .ok()
            .and_then(|s| s.trim().parse::<usize>().ok())
    };
    let cgroup = read("/sys/fs/cgroup/memory.max")
        .zip(read("/sys/fs/cgroup/memory.current"))
        .map(|(max, cur)| max.saturating_sub(cur));
    match (meminfo, cgroup) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    }
}

impl Drop for MappedPages {
    fn drop(&mut self) {
        // SAFETY: our mapping, unmapped once; its registration (if any) was dropped first.
        let _rc = unsafe { libc::munmap(self.ptr.as_ptr().cast(), self.len) };
        #[cfg(test)]
        tests::UNMAPPED.with(|u| {
            u.borrow_mut()
                .push((self.ptr.as_ptr() as usize, self.len, _rc))
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn more_than_the_system_has_is_refused_not_touched() {
        let avail = available_bytes().expect("linux reports available memory");
        assert!(avail > 0);
        assert!(matches!(
            MappedPages::new(avail.saturating_mul(2)),
            Err(Error::OutOfMemory { .. })
        ));
        for len in [usize::MAX / 2, usize::MAX - 5, usize::MAX] {
            assert!(matches!(
                MappedPages::new(len),
                Err(Error::OutOfMemory { .. })
            ));
        }
    }

    thread_local! {
        /// The ranges this thread's drops unmapped, with `munmap`'s return code. Read instead of
        /// the address space: another test's mapping may take a freed range at once.
        pub(super) static UNMAPPED: std::cell::RefCell<Vec<(usize, usize, libc::c_int)>> =
            const { std::cell::RefCell::new(Vec::new()) };
    }

    /// The tests that map memory run one at a time (their resident-page counts are read while
    /// nothing else maps or unmaps within this module's tests).
    static MAPS: std::sync::Mutex<()> = std::sync::Mutex::new(());

    /// How many of the mapping's pages are resident (`mincore`); `None` when the range is not
    /// mapped.
    fn resident(ptr: *mut u8, len: usize) -> Option<usize> {
        let mut v = vec![0u8; len.div_ceil(PAGE)];
        // SAFETY: `v` holds one byte per page of the range; mincore only reads the page tables.
        let rc = unsafe { libc::mincore(ptr.cast(), len, v.as_mut_ptr()) };
        (rc == 0).then(|| v.iter().filter(|&&b| b & 1 == 1).count())
    }

    #[test]
    fn populated_before_use_and_unmapped_when_dropped() {
        let _one = MAPS.lock().unwrap_or_else(|e| e.into_inner());
        // One thread alone, and chunks on several threads (past `POPULATE_ALONE`).
        for len in [
            4096,
            3 << 20,
            (4 << 20) + 4096,
            POPULATE_ALONE + (3 << 20) + 4096,
        ] {
            let m = MappedPages::new(len).unwrap();
            let pages = m.len() / PAGE;
            assert_eq!(
                resident(m.as_ptr(), m.len()),
                Some(pages),
                "every page touched"
            );
            let (ptr, l) = (m.as_ptr() as usize, m.len());
            UNMAPPED.with(|u| u.borrow_mut().clear());
            drop(m);
            assert_eq!(
                UNMAPPED.with(|u| u.borrow().clone()),
                vec![(ptr, l, 0)],
                "the drop unmapped exactly the mapping"
            );
        }
        let u = MappedPages::new_untouched(3 << 20).unwrap();
        assert_eq!(
            resident(u.as_ptr(), u.len()),
            Some(0),
            "untouched: nothing resident"
        );
    }

    #[test]
    fn pages_are_touched_where_the_kernel_cannot_populate() {
        let _one = MAPS.lock().unwrap_or_else(|e| e.into_inner());
        let u = MappedPages::new_untouched(3 << 20).unwrap();
        // SAFETY: the whole untouched mapping, ours.
        assert!(unsafe { populate_range(u.as_ptr() as usize, u.len(), false) });
        assert_eq!(resident(u.as_ptr(), u.len()), Some(u.len() / PAGE));
    }

    #[test]
    fn mappings_are_page_rounded_zeroed_and_writable() {
        let _one = MAPS.lock().unwrap_or_else(|e| e.into_inner());
        for len in [1, 4096, 4097, (2 << 20) + 1, 9 << 20] {
            let m = MappedPages::new(len).unwrap();
            assert_eq!(m.len() % PAGE, 0);
            assert!(m.len() >= len && m.len() - len < PAGE);
            if len >= HUGE {
                assert_eq!(
                    m.as_ptr() as usize % HUGE,
                    0,
                    "huge mappings start 2 MiB aligned"
                );
            }
            // SAFETY: the mapping holds `len` bytes.
            let s = unsafe { std::slice::from_raw_parts_mut(m.as_ptr(), m.len()) };
            assert!(s.iter().all(|&b| b == 0));
            s.fill(0x5A);
            assert!(s.iter().all(|&b| b == 0x5A));
        }
    }
}
