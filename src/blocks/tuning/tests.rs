//! The tuning's unit tests: classes, turns, decisions and picks.

use super::*;

/// Each way a move was chosen has its own reason, and each starts with its strategy's.
#[test]
fn each_pick_has_its_own_reason() {
    let measured = Pick::Measured {
        way: Way::Strided,
        strided: 2.0,
        batched: 1.0,
        batched_one_thread: None,
    };
    let picks = [Pick::Table, Pick::Timing(Way::Strided), measured];
    let mut seen = std::collections::HashSet::new();
    for p in &picks {
        let r = p.strided_reason();
        assert!(r.starts_with("the tensors sit at one stride"), "{r}");
        assert!(seen.insert(r), "{r}");
        for split in [false, true] {
            let r = p.batched_reason(split);
            assert!(
                r.starts_with("the copy engines move the merged runs"),
                "{r}"
            );
            seen.insert(r);
        }
    }
    // Table alone tells a split batch from one call.
    assert_eq!(seen.len(), 3 + 4, "{seen:#?}");
    assert!(
        Pick::Timing(Way::Batched)
            .batched_reason(false)
            .contains("timed on the GPU")
    );
    assert!(measured.strided_reason().contains("see choice"));
    assert!(measured.batched_reason(true).contains("see choice"));
    // The batch from one thread says so.
    let one = Pick::Measured {
        way: Way::BatchedOne,
        strided: 1.0,
        batched: 1.0,
        batched_one_thread: Some(2.0),
    };
    assert!(one.batched_reason(false).contains("from one thread"));
    assert!(!measured.batched_reason(false).contains("from one thread"));
}

#[test]
fn classes_are_powers_of_two() {
    let c = |b| class(b, false);
    assert_eq!(c(0), 0);
    assert_eq!(c(1), 0);
    assert_eq!(c(2047), 0);
    assert_eq!(c(2048), 2);
    assert_eq!(c(16 << 10), 8);
    assert_eq!(c(16 << 10), c((16 << 10) * 64 / 63));
    assert_eq!(c((32 << 10) - 1), 8);
    assert_eq!(c(32 << 10), 10);
    assert_eq!(c(usize::MAX), CLASSES - 2);
    assert_eq!(class(16 << 10, true), 9);
    assert_eq!(class(usize::MAX, true), CLASSES - 1);
}

/// A class's timings, each way's rate given per timing.
fn time_all(c: &mut Class, first: Way, ways: &[Way], rate: impl Fn(Way, usize) -> f64) -> Vec<Way> {
    let mut seen = Vec::new();
    while let Some(w) = c.next_timed(first, ways) {
        seen.push(w);
        c.sum[w as usize] += rate(w, c.timed[w as usize]);
        c.timed[w as usize] += 1;
        assert!(seen.len() <= ways.len() * SAMPLES, "{seen:?}");
    }
    seen
}

#[test]
fn a_class_times_both_ways_then_keeps_the_faster() {
    let two = ways(false);
    let mut c = Class::default();
    // Two timings of each way, handed out and harvested one at a time.
    let seen = time_all(&mut c, Way::Strided, two, |w, _| {
        if w == Way::Batched { 2.0 } else { 1.0 }
    });
    assert_eq!(
        seen,
        [Way::Strided, Way::Batched, Way::Strided, Way::Batched]
    );
    assert_eq!(c.decided(two), Some(Way::Batched));
    c.sum = [6.0, 4.0, 0.0];
    assert_eq!(c.decided(two), Some(Way::Strided));
    // A near tie keeps the 2D copies: the batch must win by the margin.
    c.sum = [2.0, 2.0 * (BATCH_MARGIN - 0.01), 0.0];
    assert_eq!(c.decided(two), Some(Way::Strided));
    c.sum = [2.0, 2.0 * (BATCH_MARGIN + 0.01), 0.0];
    assert_eq!(c.decided(two), Some(Way::Batched));
}

/// A batch whose rate spreads: its best timing beats the 2D copies by more than the margin,
/// its mean does not (the H100's 64 KiB loads), so the 2D copies keep the class.
#[test]
fn a_spreading_batch_is_judged_by_its_mean_not_its_best() {
    let two = ways(false);
    let mut c = Class::default();
    time_all(&mut c, Way::Strided, two, |w, k| match (w, k) {
        (Way::Strided, _) => 47.0,
        (_, 0) => 50.7,
        _ => 44.0,
    });
    assert_eq!(c.decided(two), Some(Way::Strided));
}

/// Where the batch would be split over threads, the class times the batch from one thread
/// too, and keeps whichever of the three is fastest (a batch by the margin).
#[test]
fn a_split_class_times_the_batch_from_one_thread_too() {
    let three = ways(true);
    let rates = |one: f64| {
        move |w: Way, _| match w {
            Way::Strided => 40.0,
            Way::Batched => 38.0,
            Way::BatchedOne => one,
        }
    };
    let mut c = Class::default();
    let seen = time_all(&mut c, Way::Batched, three, rates(44.0));
    // The table's way first, then the others in turn.
    assert_eq!(
        seen,
        [
            Way::Batched,
            Way::Strided,
            Way::BatchedOne,
            Way::Batched,
            Way::Strided,
            Way::BatchedOne
        ]
    );
    assert_eq!(c.decided(three), Some(Way::BatchedOne));
    // Within the margin of the 2D copies: the 2D copies.
    let mut c = Class::default();
    time_all(&mut c, Way::Strided, three, rates(41.0));
    assert_eq!(c.decided(three), Some(Way::Strided));
    // Undecided until every way has its timings.
    let c = Class {
        timed: [SAMPLES, SAMPLES, SAMPLES - 1],
        ..Class::default()
    };
    assert_eq!(c.decided(three), None);
    assert_eq!(c.next_timed(Way::Strided, three), Some(Way::BatchedOne));
    assert!(c.decided(ways(false)).is_some());
}

#[test]
fn timings_in_flight_count_against_more_timing() {
    let two = ways(false);
    let mut c = Class {
        out: [SAMPLES, SAMPLES, 0],
        ..Class::default()
    };
    assert_eq!(c.next_timed(Way::Strided, two), None);
    assert_eq!(c.decided(two), None);
    // The third way is timed only where the batch is split.
    assert_eq!(
        c.next_timed(Way::Strided, ways(true)),
        Some(Way::BatchedOne)
    );
    c.out = [SAMPLES, 1, 0];
    assert_eq!(c.next_timed(Way::Strided, two), Some(Way::Batched));
    // The table's way first on a tie.
    c.out = [1, 1, 0];
    assert_eq!(c.next_timed(Way::Batched, two), Some(Way::Batched));
    assert_eq!(c.next_timed(Way::Strided, two), Some(Way::Strided));
    // A class whose timings keep failing stops timing.
    c.failed = MAX_FAILED;
    assert_eq!(c.next_timed(Way::Strided, two), None);
}

#[test]
fn small_moves_and_undecided_classes_follow_the_table() {
    let t = Tuning::default();
    let s = Way::Strided;
    assert_eq!(
        t.pick(Direction::Load, (16 << 10, false), MIN_BYTES - 1, s),
        Pick::Table
    );
    assert_eq!(
        t.pick(Direction::Load, (16 << 10, false), MIN_BYTES, s),
        Pick::Timing(Way::Strided)
    );
    assert_eq!(
        t.pick(Direction::Load, (16 << 10, false), MIN_BYTES, Way::Batched),
        Pick::Timing(Way::Batched)
    );
    // Decided for loads of 16 KiB copies: offloads, and other sizes, still time.
    {
        let mut st = t.state.lock();
        let c = &mut st.classes[Direction::Load as usize][class(16 << 10, false)];
        c.timed = [SAMPLES, SAMPLES, 0];
        c.sum = [2e9, 6e9, 0.0];
    }
    assert_eq!(
        t.pick(Direction::Load, (24 << 10, false), MIN_BYTES, s),
        Pick::Measured {
            way: Way::Batched,
            strided: 1e9,
            batched: 3e9,
            batched_one_thread: None,
        }
    );
    // A split class reports the batch from one thread too.
    {
        let mut st = t.state.lock();
        let c = &mut st.classes[Direction::Load as usize][class(32 << 10, true)];
        c.timed = [SAMPLES; WAYS];
        c.sum = [2e9, 2e9, 8e9];
    }
    assert_eq!(
        t.pick(Direction::Load, (32 << 10, true), MIN_BYTES, s),
        Pick::Measured {
            way: Way::BatchedOne,
            strided: 1e9,
            batched: 1e9,
            batched_one_thread: Some(4e9),
        }
    );
    // A small move of a decided class follows the table all the same.
    assert_eq!(
        t.pick(Direction::Load, (24 << 10, false), MIN_BYTES - 1, s),
        Pick::Table
    );
    assert_eq!(
        t.pick(Direction::Offload, (16 << 10, false), MIN_BYTES, s),
        Pick::Timing(Way::Strided)
    );
    assert_eq!(
        t.pick(Direction::Load, (64 << 10, false), MIN_BYTES, s),
        Pick::Timing(Way::Strided)
    );
}
