//! Timestamps through one call, for the laboratory's variant `stamps` only
//! (`PINSTAGE_VARIANTS=stamps scripts/gpu-build`; `lab/probes/blocks_bg_cost.py` reads them):
//! `stamp!("label")` records when the calling thread got there; every other build compiles it to
//! nothing.

#[cfg(pinstage_lab_variant = "stamps")]
mod imp {
    use std::cell::RefCell;
    use std::time::Instant;

    thread_local! {
        static STAMPS: RefCell<Vec<(&'static str, Instant)>> = RefCell::new(Vec::with_capacity(64));
    }

    /// Records `label` now; a label starting with `>` starts a new call (clears the list), as
    /// does a full list (a caller that never reads them, as Rust's benches).
    pub(crate) fn push(label: &'static str) {
        let now = Instant::now();
        STAMPS.with_borrow_mut(|s| {
            if label.starts_with('>') || s.len() >= 64 {
                s.clear();
            }
            s.push((label, now));
        });
    }

    /// This thread's stamps since the last call began, as (label, ns since the previous stamp).
    #[cfg_attr(not(feature = "python"), allow(dead_code))]
    pub(crate) fn take() -> Vec<(&'static str, u64)> {
        STAMPS.with_borrow_mut(|s| {
            let out = s
                .iter()
                .enumerate()
                .map(|(i, &(l, t))| {
                    let prev = if i == 0 { t } else { s[i - 1].1 };
                    (l, t.duration_since(prev).as_nanos() as u64)
                })
                .collect();
            s.clear();
            out
        })
    }
}
#[cfg(pinstage_lab_variant = "stamps")]
pub(crate) use imp::{push, take};

/// Records where the calling thread is (variant `stamps`; otherwise nothing).
#[cfg(pinstage_lab_variant = "stamps")]
macro_rules! stamp {
    ($label:literal) => {
        $crate::stamps::push($label)
    };
}
/// Records where the calling thread is (variant `stamps`; otherwise nothing).
#[cfg(not(pinstage_lab_variant = "stamps"))]
macro_rules! stamp {
    ($label:literal) => {};
}
pub(crate) use stamp;
