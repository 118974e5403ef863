//! Telling a live stream's handle from any other integer without letting the driver see it.
//!
//! The driver dereferences a stream handle without validating it: an integer that points into
//! ordinary memory makes it fault (a segfault, not an error). A handle points at a small record
//! whose first word is the address of the driver's stream object, and that object holds the
//! handle back a few words in. The offset is learnt once per process from two streams this
//! process creates, so a driver laid out otherwise is detected (the check then says
//! [`Liveness::Unknown`]) rather than refusing every handle. Memory is read with
//! `process_vm_readv`, which reports an unmapped address as an error instead of faulting.

use std::sync::OnceLock;
use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};

use super::{Device, Stream};

/// What the check can tell of an integer handed in as a stream handle.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Liveness {
    /// A special handle (0, 1, 2) or one that holds a live stream's back-reference.
    Live,
    /// Not a stream handle: the driver must not see it.
    NotAStream,
    /// The layout could not be learnt (no driver, or a driver laid out otherwise).
    Unknown,
}

/// Byte offset, in the driver's stream object, of the word that holds the handle; `None` when
/// the two streams created to learn it did not agree on one.
static BACK: OnceLock<Option<usize>> = OnceLock::new();

/// Handles found live recently: a stream is long-lived, so the two reads run once per handle.
static SEEN: [AtomicUsize; 8] = [const { AtomicUsize::new(0) }; 8];

/// Words of a stream object searched for the back-reference while learning the layout.
const SEARCH_WORDS: usize = 64;

/// One word of this process's memory, or `None` where nothing readable is mapped.
fn read_word(addr: usize) -> Option<usize> {
    let mut word = 0usize;
    let local = libc::iovec {
        iov_base: (&raw mut word).cast(),
        iov_len: size_of::<usize>(),
    };
    let remote = libc::iovec {
        iov_base: addr as *mut libc::c_void,
        iov_len: size_of::<usize>(),
    };
    // SAFETY: reads this process's memory into `word` through the kernel, which checks the
    // remote range and fails (EFAULT) instead of faulting; `local` is our own word.
    let n = unsafe { libc::process_vm_readv(libc::getpid(), &local, 1, &remote, 1, 0) };
    (n == size_of::<usize>() as isize).then_some(word)
}

/// Offsets at which the object `handle` points to holds `handle` back.
fn back_offsets(handle: usize) -> Vec<usize> {
    let Some(obj) = read_word(handle).filter(|o| o % 8 == 0) else {
        return Vec::new();
    };
    (0..SEARCH_WORDS)
        .map(|i| i * 8)
        .filter(|off| obj.checked_add(*off).and_then(read_word) == Some(handle))
        .collect()
}

/// Learns the back-reference offset from two streams of device 0 (created and destroyed here).
fn learn() -> Option<usize> {
    let device = Device::new(0).ok()?;
    let a = Stream::new(&device).ok()?;
    let b = Stream::new(&device).ok()?;
    let in_b = back_offsets(b.handle().as_raw());
    back_offsets(a.handle().as_raw())
        .into_iter()
        .find(|off| in_b.contains(off))
}

/// Whether `handle`, an integer given as a stream handle, can be handed to the driver.
pub(crate) fn liveness(handle: usize) -> Liveness {
    if handle <= 2 {
        return Liveness::Live;
    }
    if !possible(handle) {
        return Liveness::NotAStream;
    }
    if seen(handle) {
        return Liveness::Live;
    }
    let live = judge(handle, *BACK.get_or_init(learn));
    if live == Liveness::Live {
        remember(handle);
    }
    live
}

/// Whether a handle other than 0, 1, 2 can be a stream object's address: above the first
/// 64 KiB and 8-byte aligned.
fn possible(handle: usize) -> bool {
    handle >= 0x1_0000 && handle % 8 == 0
}

/// The verdict on a possible handle, given the back-reference offset (`None`: the layout is
/// unknown).
fn judge(handle: usize, back: Option<usize>) -> Liveness {
    match back {
        None => Liveness::Unknown,
        Some(back) if holds_back(handle, back) => Liveness::Live,
        Some(_) => Liveness::NotAStream,
    }
}

/// Whether the word at `handle` is an 8-byte aligned address whose object holds `handle` at
/// `back` bytes (all read without faulting).
fn holds_back(handle: usize, back: usize) -> bool {
    read_word(handle)
        .filter(|obj| obj % 8 == 0)
        .and_then(|obj| obj.checked_add(back))
        .and_then(read_word)
        == Some(handle)
}

fn seen(handle: usize) -> bool {
    SEEN.iter().any(|s| s.load(Relaxed) == handle)
}

fn remember(handle: usize) {
    SEEN[handle / 8 % SEEN.len()].store(handle, Relaxed);
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A record shaped as the driver's: its first word is the address of an object of
    /// `SEARCH_WORDS` words; `at`, if given, is the word of the object that holds the record's
    /// address. Returns (record, object), both kept alive by the caller.
    fn record(at: Option<usize>) -> (Box<[usize; 3]>, Vec<usize>) {
        let mut obj = vec![0x5555_5555_5555_5550usize; SEARCH_WORDS + 1];
        let mut rec = Box::new([0usize; 3]);
        rec[0] = obj.as_ptr() as usize;
        if let Some(i) = at {
            obj[i] = &raw const *rec as usize;
        }
        (rec, obj)
    }

    fn addr(rec: &[usize; 3]) -> usize {
        rec as *const [usize; 3] as usize
    }

    #[test]
    fn reads_mapped_words_and_refuses_unmapped_ones() {
        let word: usize = 0x1234_5678_9abc_def0;
        assert_eq!(read_word(&raw const word as usize), Some(word));
        assert_eq!(read_word(8), None);
        assert_eq!(read_word(usize::MAX - 7), None);
    }

    #[test]
    fn impossible_integers_are_refused_before_any_read() {
        for h in [3, 7, 0x8000, 0xfff8, 0x1_0001, 0x1_0004, 0xffff_fff9] {
            assert!(!possible(h), "{h:#x}");
            assert_eq!(liveness(h), Liveness::NotAStream, "{h:#x}");
        }
        for h in [0x1_0000, 0x1_0008, 0x7fff_0000_0000] {
            assert!(possible(h), "{h:#x}");
        }
        for h in [0, 1, 2] {
            assert_eq!(liveness(h), Liveness::Live);
        }
    }

    #[test]
    fn a_record_holding_itself_back_is_found_and_judged_live() {
        let (rec, _obj) = record(Some(10));
        let h = addr(&rec);
        assert_eq!(back_offsets(h), vec![80]);
        assert!(holds_back(h, 80));
        assert_eq!(judge(h, Some(80)), Liveness::Live);
        assert_eq!(judge(h, Some(88)), Liveness::NotAStream);
        assert_eq!(judge(h, None), Liveness::Unknown);
    }

    #[test]
    fn a_record_without_the_back_reference_is_not_a_stream() {
        let (rec, _obj) = record(None);
        let h = addr(&rec);
        assert!(back_offsets(h).is_empty());
        assert_eq!(judge(h, Some(80)), Liveness::NotAStream);
        // Without a driver the layout cannot be learnt: the check cannot tell.
        if !crate::cuda_available() {
            assert_eq!(liveness(h), Liveness::Unknown);
            assert_eq!(
                liveness(h),
                Liveness::Unknown,
                "an unknown handle was remembered"
            );
        }
    }

    #[test]
    fn an_unaligned_first_word_is_not_followed() {
        // The object holds the handle back at +84 from an address 4 bytes into it: aligned
        // records only.
        let (mut rec, mut obj) = record(None);
        let h = addr(&rec);
        obj[11] = h;
        rec[0] = obj.as_ptr() as usize + 4;
        assert_eq!(read_word(rec[0] + 84), Some(h));
        assert!(!holds_back(h, 84));
    }

    #[test]
    fn remembered_handles_are_seen() {
        let h = 0x7777_0000_0040;
        assert!(!seen(h));
        remember(h);
        assert!(seen(h));
        assert_eq!(liveness(h), Liveness::Live);
        // Eight consecutive handles (streams are heap objects) are all kept.
        let many: Vec<usize> = (0..SEEN.len()).map(|i| 0x6666_0000_0000 + 8 * i).collect();
        many.iter().for_each(|&h| remember(h));
        assert!(many.iter().all(|&h| seen(h)));
    }
}
