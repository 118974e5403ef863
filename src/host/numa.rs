//! NUMA placement of pinned host memory: a preferred-node policy for a fresh mapping (`mbind`), so the pinned pages pinstage makes for a
//! device sit next to it on hosts with several nodes. On a host with one node nothing is done.

use std::sync::OnceLock;

/// How many NUMA nodes are online (`/sys/devices/system/node/online`, e.g. `0-1` or `0,2-3`);
/// 1 when the system does not say. Read once.
pub(crate) fn online_nodes() -> usize {
    static N: OnceLock<usize> = OnceLock::new();
    *N.get_or_init(|| {
        std::fs::read_to_string("/sys/devices/system/node/online")
            .ok()
            .and_then(|s| count_nodes(&s))
            .unwrap_or(1)
    })
}

/// Counts the nodes of a sysfs node list (`0`, `0-3`, `0,2-3`); `None` if it does not parse.
fn count_nodes(list: &str) -> Option<usize> {
    let mut n = 0usize;
    for part in list.trim().split(',').filter(|p| !p.is_empty()) {
        match part.split_once('-') {
            Some((a, b)) => {
                let (a, b) = (a.parse::<usize>().ok()?, b.parse::<usize>().ok()?);
                n += b.checked_sub(a)? + 1;
            }
            None => {
                part.parse::<usize>().ok()?;
                n += 1;
            }
        }
    }
    (n > 0).then_some(n)
}

/// Bits in the node masks passed to the kernel.
const MASK_BITS: usize = 1024;

/// Asks the kernel to take the not yet faulted pages of `addr..addr+len` from node `node`
/// (`mbind` with `MPOL_PREFERRED`: another node serves when that one is full, so this never
/// fails an allocation). Whether the kernel accepted it.
///
/// # Safety
/// `addr..addr+len` is a page-aligned anonymous mapping of ours (a policy changes where its
/// pages come from, not what they hold).
pub(crate) unsafe fn prefer_node(addr: *mut u8, len: usize, node: u32) -> bool {
    const MPOL_PREFERRED: libc::c_long = 1;
    let node = node as usize;
    if node >= MASK_BITS {
        return false;
    }
    let mut mask = [0u64; MASK_BITS / 64];
    mask[node / 64] |= 1 << (node % 64);
    // SAFETY: a range of our mapping (caller); the mask holds MASK_BITS bits (the kernel reads
    // maxnode - 1 of them).
    let rc = unsafe {
        libc::syscall(
            libc::SYS_mbind,
            addr,
            len,
            MPOL_PREFERRED,
            mask.as_ptr(),
            MASK_BITS + 1,
            0usize,
        )
    };
    rc == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn node_lists_count() {
        assert_eq!(count_nodes("0\n"), Some(1));
        assert_eq!(count_nodes("0-1"), Some(2));
        assert_eq!(count_nodes("0,2-3\n"), Some(3));
        assert_eq!(count_nodes(""), None);
        assert_eq!(count_nodes("x"), None);
        assert_eq!(count_nodes("3-1"), None);
        assert!(online_nodes() >= 1);
    }

    #[test]
    fn a_preferred_node_is_the_ranges_policy() {
        const MPOL_F_ADDR: libc::c_ulong = 2;
        let pages = crate::host::mapped::MappedPages::new_untouched(4 << 20).unwrap();
        let (p, len) = (pages.as_ptr(), pages.len());
        // SAFETY: our fresh, untouched mapping.
        let took = unsafe { prefer_node(p, len, 0) };
        assert!(took, "{}", std::io::Error::last_os_error());
        let mut mode: libc::c_int = -1;
        let mut mask = [0u64; MASK_BITS / 64];
        // SAFETY: valid out-pointers; the mask holds MASK_BITS bits; `p` is in our mapping.
        let rc = unsafe {
            libc::syscall(
                libc::SYS_get_mempolicy,
                &mut mode as *mut libc::c_int,
                mask.as_mut_ptr(),
                MASK_BITS + 1,
                p,
                MPOL_F_ADDR,
            )
        };
        assert_eq!(rc, 0, "{}", std::io::Error::last_os_error());
        assert_eq!(mode, 1, "MPOL_PREFERRED");
        assert_eq!(mask[0] & 1, 1, "node 0");
        drop(pages);
        // A node beyond the mask is refused before the kernel is asked.
        // SAFETY: nothing is mapped or touched for a refused node.
        assert!(!unsafe { prefer_node(std::ptr::null_mut(), 4096, MASK_BITS as u32) });
    }
}
