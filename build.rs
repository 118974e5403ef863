//! Seeded-bug builds (scripts/gpu-build): `PINSTAGE_SEEDED_BUG=name` compiles this crate, and
//! only this crate, with `cfg(pinstage_seeded_bug = "name")`, so a seeded build reuses the
//! dependencies already built; `PINSTAGE_LAB_VARIANT=name` likewise gives
//! `cfg(pinstage_lab_variant = "name")` (a lab control). Unset (every normal build): nothing.
fn main() {
    println!("cargo::rerun-if-env-changed=PINSTAGE_SEEDED_BUG");
    match std::env::var("PINSTAGE_SEEDED_BUG") {
        Ok(bug) if !bug.is_empty() => println!("cargo::rustc-cfg=pinstage_seeded_bug=\"{bug}\""),
        _ => {}
    }
    // A lab variant (a control for an A/B on the GPU, scripts/gpu-build's PINSTAGE_VARIANTS).
    println!("cargo::rerun-if-env-changed=PINSTAGE_LAB_VARIANT");
    match std::env::var("PINSTAGE_LAB_VARIANT") {
        Ok(v) if !v.is_empty() => println!("cargo::rustc-cfg=pinstage_lab_variant=\"{v}\""),
        _ => {}
    }
}
