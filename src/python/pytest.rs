//! The CPU pytest suite inside `cargo test --features python`, against the module compiled into
//! the test binary (no wheel): how cargo-mutants mutates the Python layer (tests/MUTANTS.md).
//! Ignored by default; run with a Python environment that has numpy, pytest and hypothesis:
//!
//! ```sh
//! PINSTAGE_PYTEST_SITE=$(.venv-ci/bin/python -c 'import site; print(site.getsitepackages()[0])') \
//!   cargo test --features python --lib -- --ignored --exact python::pytest::cpu_pytest_suite
//! ```
//!
//! `PINSTAGE_PYTEST_FILES`: the test files under tests/python (default: all of them). Tests
//! marked `gpu`, `two_gpus` or `child_process` (a child interpreter cannot import this build)
//! are deselected; `PINSTAGE_PYTEST_IN_PROCESS=1` tells the step tests' `_child` to run its
//! code on a thread of this process instead.

use pyo3::prelude::*;
use pyo3::types::PyList;

#[test]
#[ignore = "the CPU pytest suite in-process: needs PINSTAGE_PYTEST_SITE (module docs)"]
fn cpu_pytest_suite() {
    let site = std::env::var("PINSTAGE_PYTEST_SITE")
        .expect("PINSTAGE_PYTEST_SITE: a site-packages with numpy, pytest and hypothesis");
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let files = std::env::var("PINSTAGE_PYTEST_FILES").unwrap_or_else(|_| ".".into());
    pyo3::append_to_inittab!(_native_for_tests);
    Python::initialize();
    let rc: i64 = Python::attach(|py| -> PyResult<i64> {
        let sys = py.import("sys")?;
        let path = sys.getattr("path")?.cast_into::<PyList>()?;
        path.insert(0, site)?;
        path.insert(0, root.join("python").display().to_string())?;
        // The module registered above stands in for the wheel's `pinstage._native`.
        let native = py.import("_native_for_tests")?;
        sys.getattr("modules")?
            .set_item("pinstage._native", &native)?;
        py.import("pinstage")?.setattr("_native", native)?;
        // Tests that would run pinstage in a child interpreter run it here instead.
        py.import("os")?
            .getattr("environ")?
            .set_item("PINSTAGE_PYTEST_IN_PROCESS", "1")?;
        let tests = root.join("tests/python");
        let mut args: Vec<String> = ["-q", "-x", "-p", "no:cacheprovider", "-m"]
            .map(String::from)
            .into();
        args.push("not child_process and not gpu and not two_gpus".into());
        args.extend(
            files
                .split_whitespace()
                .map(|f| tests.join(f).display().to_string()),
        );
        py.import("os")?
            .call_method1("chdir", (tests.display().to_string(),))?;
        py.import("pytest")?
            .call_method1("main", (args,))?
            .extract()
    })
    .expect("pytest ran");
    assert_eq!(rc, 0, "pytest exit status {rc} (output above)");
}

/// `pinstage._native`, registered under the name the embedded interpreter imports.
#[pymodule]
fn _native_for_tests(m: &Bound<'_, PyModule>) -> PyResult<()> {
    super::module::init(m)
}
