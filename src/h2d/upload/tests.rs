//! The pageable path's slot bookkeeping, without a GPU.
use super::job::{slot_and_round, wait_issued};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

#[test]
fn pieces_take_the_slots_in_turn() {
    assert_eq!(slot_and_round(0, 12), (0, 0));
    assert_eq!(slot_and_round(11, 12), (11, 0));
    assert_eq!(slot_and_round(13, 12), (1, 1));
    assert_eq!(slot_and_round(37, 12), (1, 3));
    assert_eq!(slot_and_round(5, 1), (0, 5));
}

/// A fill of a slot's third use waits until the slot's two earlier uses were issued; a
/// failed upload stops the wait.
#[test]
fn a_fill_waits_until_the_slots_earlier_uses_were_issued() {
    let (issued, failed) = (AtomicUsize::new(1), AtomicBool::new(false));
    assert!(wait_issued(&issued, 0, &failed));
    assert!(wait_issued(&issued, 1, &failed));
    let t0 = Instant::now();
    std::thread::scope(|s| {
        s.spawn(|| {
            std::thread::sleep(Duration::from_millis(30));
            issued.store(2, Ordering::Release);
        });
        assert!(wait_issued(&issued, 2, &failed));
    });
    assert!(
        t0.elapsed() >= Duration::from_millis(30),
        "{:?}",
        t0.elapsed()
    );
    let t0 = Instant::now();
    std::thread::scope(|s| {
        s.spawn(|| {
            std::thread::sleep(Duration::from_millis(30));
            failed.store(true, Ordering::Relaxed);
        });
        assert!(
            !wait_issued(&issued, 5, &failed),
            "a failed upload still filled"
        );
    });
    assert!(
        t0.elapsed() >= Duration::from_millis(30),
        "{:?}",
        t0.elapsed()
    );
    // Failed before: nothing is filled even where the slot is free.
    assert!(!wait_issued(&issued, 0, &failed));
}
