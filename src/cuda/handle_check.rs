//! Telling a live stream's handle from any other integer without letting the driver see it.
//!
//! The driver dereferences a stream handle without validating it: an integer that points into
//! ordinary memory makes it fault (a segfault, not an error). A handle points at a small record
//! whose first word is the address of the driver's stream object, and that object holds the
//! handle back a few words in. The offset is learnt once per process from two streams created
//! for the purpose, so a driver laid out otherwise is detected (the check then says
//! [`Liveness::Unknown`]) rather than refusing every handle. Memory is read with
//! `process_vm_readv`, which reports an unmapped address as an error instead of faulting.
//!
//! What it cannot see: a destroyed stream whose freed record and object still hold each other
//! (glibc's allocator overwrites a freed record's first word, other allocators may not).

use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};

use super::stream::possible_handle;
use super::{Device, Stream};
use crate::driver;

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

/// The layout learnt: 0 while not learnt (nothing could be created to learn it from: tried
/// again next time), 1 when the two streams did not agree on an offset (another layout: the
/// check cannot tell, for good), else the byte offset of the back-reference plus 2.
static BACK: AtomicUsize = AtomicUsize::new(0);

/// Handles found live recently, with the stream object each pointed at: a later use reads both
/// words again in one system call, so a record freed since (its first word overwritten) is
/// judged afresh.
static SEEN: [AtomicUsize; 8] = [const { AtomicUsize::new(0) }; 8];
static SEEN_OBJ: [AtomicUsize; 8] = [const { AtomicUsize::new(0) }; 8];

/// Words of a stream object searched for the back-reference while learning the layout.
const SEARCH_WORDS: usize = 64;

/// Words of this process's memory at `addrs`, or `None` if any is not readable (one system
/// call; the kernel checks every range and fails instead of faulting).
fn read_words<const N: usize>(addrs: [usize; N]) -> Option<[usize; N]> {
    let mut words = [0usize; N];
    let local = libc::iovec {
        iov_base: words.as_mut_ptr().cast(),
        iov_len: N * size_of::<usize>(),
    };
    let remote = addrs.map(|a| libc::iovec {
        iov_base: a as *mut libc::c_void,
        iov_len: size_of::<usize>(),
    });
    // SAFETY: reads this process's memory into `words` through the kernel, which checks the
    // remote ranges and stops (EFAULT, or a short count) instead of faulting; `local` is our
    // own array of N words.
    let n =
        unsafe { libc::process_vm_readv(libc::getpid(), &local, 1, remote.as_ptr(), N as _, 0) };
    (n == (N * size_of::<usize>()) as isize).then_some(words)
}

/// One word of this process's memory, or `None` where nothing readable is mapped.
fn read_word(addr: usize) -> Option<usize> {
    read_words([addr]).map(|[w]| w)
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

/// The back-reference offset both handles agree on (`None`: none).
fn common_offset(a: usize, b: usize) -> Option<usize> {
    let in_b = back_offsets(b);
    back_offsets(a).into_iter().find(|off| in_b.contains(off))
}

/// Learns the offset from two streams made for it: in the context current on this thread if
/// there is one (a framework's) and it makes them, else in device 0's primary context. `Err`
/// when no stream could be made (no driver, a device that refuses): learning is tried again
/// next time.
fn learn() -> Result<Option<usize>, ()> {
    driver::probe().map_err(|_| ())?;
    super::device::ensure_usable().map_err(|_| ())?;
    if driver::ctx::ctx_get_current().is_ok_and(|c| !c.is_null())
        && let Some(found) = learn_in_current()
    {
        return Ok(found);
    }
    let device = Device::new(0).map_err(|_| ())?;
    let a = Stream::new(&device).map_err(|_| ())?;
    let b = Stream::new(&device).map_err(|_| ())?;
    Ok(common_offset(a.handle().as_raw(), b.handle().as_raw()))
}

/// [`learn`] in the context current on this thread; `None` if it makes no streams.
fn learn_in_current() -> Option<Option<usize>> {
    // SAFETY: a context is current on this thread (the caller asked).
    let a = unsafe { driver::stream::stream_create() }.ok()?;
    // SAFETY: as above.
    let b = unsafe { driver::stream::stream_create() };
    let found = b
        .as_ref()
        .ok()
        .map(|b| common_offset(a as usize, *b as usize));
    // SAFETY: the streams made above, idle, destroyed once.
    unsafe {
        let _ = driver::stream::stream_destroy(a);
        if let Ok(b) = b {
            let _ = driver::stream::stream_destroy(b);
        }
    }
    found
}

/// Learns the driver's stream layout now, if not yet (two streams created and destroyed): the
/// Python layer learns it when it first uses a device, so the first int handle a copy is given
/// does not pay for it.
#[cfg(feature = "python")]
pub(crate) fn learn_layout() {
    let _ = back();
}

/// The offset, learnt on first use (`None`: the layout is unknown, for now or for good).
fn back() -> Option<usize> {
    match decode(BACK.load(Relaxed)) {
        Some(known) => known,
        None => match learn() {
            // The first thread to store what it learnt decides; one that learnt at the same
            // time uses that.
            Ok(found) => match BACK.compare_exchange(0, encode(found), Relaxed, Relaxed) {
                Ok(_) => found,
                Err(word) => decode(word).flatten(),
            },
            Err(()) => None,
        },
    }
}

/// [`BACK`]'s word for what learning found.
fn encode(found: Option<usize>) -> usize {
    found.map_or(1, |off| off + 2)
}

/// What [`BACK`]'s word says: `None` while nothing was learnt.
fn decode(word: usize) -> Option<Option<usize>> {
    match word {
        0 => None,
        1 => Some(None),
        b => Some(Some(b - 2)),
    }
}

/// Whether `handle`, an integer given as a stream handle, can be handed to the driver.
pub(crate) fn liveness(handle: usize) -> Liveness {
    if handle <= 2 {
        return Liveness::Live;
    }
    if !possible_handle(handle) {
        return Liveness::NotAStream;
    }
    let back = back();
    if let Some(back) = back
        && seen(handle, back)
    {
        return Liveness::Live;
    }
    judge(handle, back)
}

/// The verdict on a possible handle, given the back-reference offset (`None`: the layout is
/// unknown); a live one is remembered.
fn judge(handle: usize, back: Option<usize>) -> Liveness {
    let Some(back) = back else {
        return Liveness::Unknown;
    };
    match stream_object(handle, back) {
        Some(obj) => {
            remember(handle, obj);
            Liveness::Live
        }
        None => Liveness::NotAStream,
    }
}

/// The stream object `handle` points at, if it is an 8-byte aligned address whose object holds
/// `handle` at `back` bytes (all read without faulting).
fn stream_object(handle: usize, back: usize) -> Option<usize> {
    let obj = read_word(handle).filter(|obj| obj % 8 == 0)?;
    (read_word(obj.checked_add(back)?)? == handle).then_some(obj)
}

/// Whether `handle` was found live before and its record and object still hold each other
/// (read again, in one system call).
fn seen(handle: usize, back: usize) -> bool {
    (0..SEEN.len()).any(|i| {
        if SEEN[i].load(Relaxed) != handle {
            return false;
        }
        let obj = SEEN_OBJ[i].load(Relaxed);
        obj.checked_add(back)
            .and_then(|at| read_words([handle, at]))
            .is_some_and(|w| w == [obj, handle])
    })
}

fn remember(handle: usize, obj: usize) {
    let i = handle / 16 % SEEN.len();
    // Two stores a reader may see half of: it then reads a pair that does not hold, and judges
    // the handle afresh.
    SEEN_OBJ[i].store(obj, Relaxed);
    SEEN[i].store(handle, Relaxed);
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The tests that remember handles share the process's cache.
    static CACHE: std::sync::Mutex<()> = std::sync::Mutex::new(());

    fn cache() -> std::sync::MutexGuard<'static, ()> {
        CACHE.lock().unwrap_or_else(|e| e.into_inner())
    }

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
        let words: [usize; 2] = [0x1234_5678_9abc_def0, 77];
        let at = |i: usize| &raw const words[i] as usize;
        assert_eq!(read_word(at(0)), Some(words[0]));
        assert_eq!(read_words([at(1), at(0)]), Some([77, words[0]]));
        assert_eq!(read_word(8), None);
        assert_eq!(read_word(usize::MAX - 7), None);
        assert_eq!(
            read_words([at(0), 8]),
            None,
            "one unreadable word fails the read"
        );
        assert_eq!(read_words([8, at(0)]), None);
    }

    #[test]
    fn impossible_integers_are_refused_before_any_read() {
        for h in [3, 7, 0x8000, 0xfff8, 0x1_0001, 0x1_0004, 0xffff_fff9] {
            assert!(!possible_handle(h), "{h:#x}");
            assert_eq!(liveness(h), Liveness::NotAStream, "{h:#x}");
        }
        for h in [0x1_0000, 0x1_0008, 0x7fff_0000_0000] {
            assert!(possible_handle(h), "{h:#x}");
        }
        for h in [0, 1, 2] {
            assert_eq!(liveness(h), Liveness::Live);
        }
    }

    #[test]
    fn a_record_holding_itself_back_is_found_judged_live_and_remembered() {
        let _cache = cache();
        let (rec, obj) = record(Some(10));
        let h = addr(&rec);
        assert_eq!(back_offsets(h), vec![80]);
        assert_eq!(stream_object(h, 80), Some(obj.as_ptr() as usize));
        assert!(!seen(h, 80));
        assert_eq!(judge(h, Some(88)), Liveness::NotAStream);
        assert!(!seen(h, 80), "a refused handle was remembered");
        assert_eq!(judge(h, None), Liveness::Unknown);
        assert!(!seen(h, 80), "an unknown handle was remembered");
        assert_eq!(judge(h, Some(80)), Liveness::Live);
        assert!(seen(h, 80));
        assert!(!seen(h, 88), "seen at another offset");
    }

    #[test]
    fn a_remembered_handle_whose_record_changed_is_judged_again() {
        let _cache = cache();
        // As glibc does to a freed record: its first word overwritten.
        let (mut rec, _obj) = record(Some(10));
        let h = addr(&rec);
        assert_eq!(judge(h, Some(80)), Liveness::Live);
        assert!(seen(h, 80));
        rec[0] ^= 0x5a50;
        assert!(!seen(h, 80));
        assert_eq!(judge(h, Some(80)), Liveness::NotAStream);
        // And an object that no longer holds the handle.
        let (rec2, mut obj2) = record(Some(10));
        let h2 = addr(&rec2);
        assert_eq!(judge(h2, Some(80)), Liveness::Live);
        obj2[10] = 0;
        assert!(!seen(h2, 80));
    }

    #[test]
    fn a_record_without_the_back_reference_is_not_a_stream() {
        let (rec, _obj) = record(None);
        let h = addr(&rec);
        assert!(back_offsets(h).is_empty());
        assert_eq!(common_offset(h, h), None);
        assert_eq!(judge(h, Some(80)), Liveness::NotAStream);
        // Without a driver the layout cannot be learnt: the check cannot tell, and does not
        // give up learning.
        if !crate::cuda::cuda_available() {
            assert_eq!(back(), None);
            assert_eq!(BACK.load(Relaxed), 0);
            assert_eq!(liveness(h), Liveness::Unknown);
        }
    }

    /// On a machine with a driver: the layout is learnt from real streams, a live stream is
    /// taken, and its handle is refused once the stream is destroyed.
    #[test]
    fn the_layout_is_learnt_from_the_drivers_streams() {
        if !crate::cuda::cuda_available() {
            assert!(
                !std::env::var("PINSTAGE_REQUIRE_GPU").is_ok_and(|v| v == "1"),
                "PINSTAGE_REQUIRE_GPU=1 but no CUDA driver"
            );
            eprintln!("skipped: no CUDA driver");
            return;
        }
        let _cache = cache();
        let off = back().expect("the stream layout was not learnt on this driver");
        eprintln!("stream layout: the object holds its handle back at +{off}");
        // The first words of an object are where a coincidence is likeliest (a vtable, a
        // self-pointer); a back-reference found there would make the check weak.
        assert!(off >= 16, "back-reference at +{off}: too weak a check");
        let device = Device::new(0).unwrap();
        let s = Stream::new(&device).unwrap();
        let h = s.handle().as_raw();
        assert_eq!(liveness(h), Liveness::Live);
        assert_eq!(liveness(h), Liveness::Live, "remembered");
        assert_eq!(liveness(h + 8), Liveness::NotAStream);
        drop(s);
        assert_eq!(
            liveness(h),
            Liveness::NotAStream,
            "a destroyed stream's handle was taken"
        );
    }

    #[test]
    fn what_was_learnt_reads_back() {
        assert_eq!(decode(0), None, "nothing learnt yet");
        for found in [None, Some(0), Some(8), Some(80), Some(504)] {
            assert_ne!(encode(found), 0, "{found:?} would read as nothing learnt");
            assert_eq!(decode(encode(found)), Some(found));
        }
    }

    #[test]
    fn two_records_agree_on_their_offset() {
        let (a, _oa) = record(Some(10));
        let (b, _ob) = record(Some(10));
        let (c, _oc) = record(Some(3));
        assert_eq!(common_offset(addr(&a), addr(&b)), Some(80));
        assert_eq!(common_offset(addr(&a), addr(&c)), None);
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
        assert_eq!(stream_object(h, 84), None);
    }

    #[test]
    fn remembered_handles_are_kept_side_by_side() {
        let _cache = cache();
        // Eight records 16 bytes apart (allocators align small objects to 16) are all kept.
        let n = SEEN.len();
        let mut recs = vec![[0usize; 2]; n];
        let mut objs = vec![vec![0usize; SEARCH_WORDS]; n];
        for (rec, obj) in recs.iter_mut().zip(objs.iter_mut()) {
            rec[0] = obj.as_ptr() as usize;
            obj[10] = rec.as_ptr() as usize;
        }
        let hs: Vec<usize> = recs.iter().map(|r| r.as_ptr() as usize).collect();
        for &h in &hs {
            assert_eq!(judge(h, Some(80)), Liveness::Live);
        }
        assert!(
            hs.iter().all(|&h| seen(h, 80)),
            "a remembered handle was pushed out"
        );
    }
}
