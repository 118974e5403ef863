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
    if handle < 0x1_0000 || handle % 8 != 0 {
        return Liveness::NotAStream;
    }
    if SEEN.iter().any(|s| s.load(Relaxed) == handle) {
        return Liveness::Live;
    }
    let Some(back) = *BACK.get_or_init(learn) else {
        return Liveness::Unknown;
    };
    let holds_it = read_word(handle)
        .filter(|obj| obj % 8 == 0)
        .and_then(|obj| obj.checked_add(back))
        .and_then(read_word)
        == Some(handle);
    if !holds_it {
        return Liveness::NotAStream;
    }
    SEEN[handle / 8 % SEEN.len()].store(handle, Relaxed);
    Liveness::Live
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_mapped_words_and_refuses_unmapped_ones() {
        let word: usize = 0x1234_5678_9abc_def0;
        assert_eq!(read_word(&raw const word as usize), Some(word));
        assert_eq!(read_word(8), None);
        assert_eq!(read_word(usize::MAX - 7), None);
    }

    #[test]
    fn impossible_integers_are_refused_before_any_read() {
        for h in [3, 7, 0x8000, 0x1_0001, 0xffff_fff9] {
            assert_eq!(liveness(h), Liveness::NotAStream, "{h:#x}");
        }
        for h in [0, 1, 2] {
            assert_eq!(liveness(h), Liveness::Live);
        }
    }

    #[test]
    fn an_object_that_does_not_hold_the_handle_back_is_not_a_stream() {
        // A record shaped like a handle (its first word points at readable memory) whose
        // target does not hold the handle back at any offset.
        let target = vec![0x5555_5555_5555_5550usize; SEARCH_WORDS + 1];
        let record = Box::new([target.as_ptr() as usize, 0, 0]);
        let h = &raw const *record as usize;
        assert!(back_offsets(h).is_empty());
        match liveness(h) {
            // With a driver the layout is known and the record refused; without one the
            // check cannot tell.
            Liveness::NotAStream | Liveness::Unknown => {}
            Liveness::Live => panic!("a record without the back-reference passed"),
        }
    }

    #[test]
    fn a_record_holding_itself_back_is_found() {
        let mut target = vec![0usize; SEARCH_WORDS];
        let mut record = Box::new([0usize; 3]);
        let h = &raw mut *record as usize;
        target[10] = h;
        record[0] = target.as_ptr() as usize;
        assert_eq!(back_offsets(h), vec![80]);
    }
}
