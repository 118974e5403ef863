//! Seeded-bug builds (scripts/gpu-build): `PINSTAGE_SEEDED_BUG=name` compiles this crate, and
//! only this crate, with `cfg(pinstage_seeded_bug = "name")`, so a seeded build reuses the
//! dependencies already built. Unset (every normal build): nothing.
fn main() {
    println!("cargo::rerun-if-env-changed=PINSTAGE_SEEDED_BUG");
    match std::env::var("PINSTAGE_SEEDED_BUG") {
        Ok(bug) if !bug.is_empty() => println!("cargo::rustc-cfg=pinstage_seeded_bug=\"{bug}\""),
        _ => {}
    }
}
