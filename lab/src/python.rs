//! The laboratory's Python module `pinstage._lab` (features `lab` and `python`): driver costs,
//! tuning switches and traces for the probes in `lab/probes`.

use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::python::dtype::parse_dtype;
use crate::python::import::import;
use crate::python::stream::parse_stream;
use crate::python::values::{scalar_bytes, to_values};

/// Host ns per call of `f`: one warm-up call, then the mean of `n` calls.
fn ns_per_call(n: usize, f: &mut dyn FnMut() -> PyResult<()>) -> PyResult<f64> {
    let n = n.max(1);
    f()?;
    let t0 = std::time::Instant::now();
    for _ in 0..n {
        f()?;
    }
    Ok(t0.elapsed().as_nanos() as f64 / n as f64)
}

/// Host ns per call of each driver call on the small-copy path, on device 0
/// (see [`super::driver_costs`]).
#[pyfunction]
#[pyo3(name = "_driver_costs", signature = (iters=20000))]
fn driver_costs(py: Python<'_>, iters: usize) -> PyResult<Vec<(&'static str, f64)>> {
    Ok(py.detach(|| super::driver_costs(iters))?)
}

/// Host ns per call of each step of `PinnedStager.copy_(dst, values, pad)` before the copy
/// itself: the DLPack import, the values and the pad conversions, the stream argument.
#[pyfunction]
#[pyo3(name = "_profile_copy_path", signature = (dst, values, pad, dtype, n=10000))]
fn profile_copy_path<'py>(
    py: Python<'py>,
    dst: &Bound<'py, PyAny>,
    values: &Bound<'py, PyAny>,
    pad: &Bound<'py, PyAny>,
    dtype: &Bound<'py, PyAny>,
    n: usize,
) -> PyResult<Bound<'py, PyDict>> {
    let d = parse_dtype(dtype)?;
    let out = PyDict::new(py);
    out.set_item(
        "whole import",
        ns_per_call(n, &mut || import(dst, None).map(drop))?,
    )?;
    out.set_item(
        "values",
        ns_per_call(n, &mut || to_values(values, d).map(drop))?,
    )?;
    out.set_item(
        "pad scalar",
        ns_per_call(n, &mut || scalar_bytes(pad, d).map(drop))?,
    )?;
    out.set_item(
        "parse_stream(None)",
        ns_per_call(n, &mut || parse_stream(None).map(drop))?,
    )?;
    Ok(out)
}

/// Sets how `copy_d2h` waits: `landing` (a word the stream writes after the copy, else an
/// event), `gil_held_max` (copies up to this many bytes issued with the GIL held; 0: every copy
/// releases the GIL first) and `gil_spin_us` (spun for with the GIL held before releasing it).
/// No arguments: the defaults (landing on, 256 KiB, 20 µs). Returns the previous settings.
#[pyfunction]
#[pyo3(name = "_set_d2h_tuning", signature = (landing=true, gil_held_max=256 << 10, gil_spin_us=20))]
fn set_d2h_tuning(landing: bool, gil_held_max: usize, gil_spin_us: u64) -> (bool, usize, u64) {
    let was = crate::d2h::set_landing(landing);
    let (held, spin) = crate::python::d2h::set_gil_tuning(gil_held_max, gil_spin_us);
    (was, held, spin)
}

/// Sets the pageable H2D path's tuning and returns the previous one as a dict; no arguments:
/// the defaults (see `h2d::tuning::H2DTuning`).
#[pyfunction]
#[pyo3(name = "_set_h2d_tuning", signature = (workers=None, max_piece=None, min_piece=None, slots=None, ramp=None, nt_upto=None, driver_below=None, unit=None, per_worker=None, halves_upto=None))]
#[allow(clippy::too_many_arguments)]
fn set_h2d_tuning<'py>(
    py: Python<'py>,
    workers: Option<usize>,
    max_piece: Option<usize>,
    min_piece: Option<usize>,
    slots: Option<usize>,
    ramp: Option<bool>,
    nt_upto: Option<usize>,
    driver_below: Option<usize>,
    unit: Option<usize>,
    per_worker: Option<usize>,
    halves_upto: Option<usize>,
) -> PyResult<Bound<'py, PyDict>> {
    use crate::h2d::tuning::{H2DTuning, h2d_tuning};
    let old = h2d_tuning();
    let d = H2DTuning::DEFAULT;
    crate::h2d::tuning::set_h2d_tuning(H2DTuning {
        workers: workers.unwrap_or(d.workers),
        max_piece: max_piece.unwrap_or(d.max_piece),
        min_piece: min_piece.unwrap_or(d.min_piece),
        slots: slots.unwrap_or(d.slots),
        ramp: ramp.unwrap_or(d.ramp),
        nt_upto: nt_upto.unwrap_or(d.nt_upto),
        driver_below: driver_below.unwrap_or(d.driver_below),
        unit: unit.unwrap_or(d.unit),
        per_worker: per_worker.unwrap_or(d.per_worker),
        halves_upto: halves_upto.unwrap_or(d.halves_upto),
    });
    let out = PyDict::new(py);
    out.set_item("workers", old.workers)?;
    out.set_item("max_piece", old.max_piece)?;
    out.set_item("min_piece", old.min_piece)?;
    out.set_item("slots", old.slots)?;
    out.set_item("ramp", old.ramp)?;
    out.set_item("nt_upto", old.nt_upto)?;
    out.set_item("driver_below", old.driver_below)?;
    out.set_item("unit", old.unit)?;
    out.set_item("per_worker", old.per_worker)?;
    out.set_item("halves_upto", old.halves_upto)?;
    Ok(out)
}

/// What pinned memory costs per size (see [`super::pinned_costs`]), in ms.
#[pyfunction]
#[pyo3(name = "_pinned_costs")]
fn pinned_costs(py: Python<'_>, sizes: Vec<usize>) -> PyResult<Vec<(String, f64)>> {
    Ok(py.detach(|| super::pinned_costs(&sizes))?)
}

/// Whether pinstage's pools, bounce slots and pinned arrays register pages (True, the default)
/// or call `cuMemHostAlloc`; returns the previous setting.
#[pyfunction]
#[pyo3(name = "_set_pin_by_register")]
fn set_pin_by_register(on: bool) -> bool {
    crate::host::set_pin_by_register(on)
}

/// Whether pinstage's pools, bounce slots and pinned arrays come from host memory pools where
/// the driver makes them (True, the default); returns the previous setting.
#[pyfunction]
#[pyo3(name = "_set_pin_from_pool")]
fn set_pin_from_pool(on: bool) -> bool {
    crate::host::host_pool::set_pin_from_pool(on)
}

/// Starts (clearing it) or stops the pageable H2D path's trace.
#[pyfunction]
#[pyo3(name = "_h2d_trace_set")]
fn h2d_trace_set(on: bool) {
    crate::h2d::trace::set(on);
}

/// The trace since it started: (piece, bytes, filled µs, issued µs) per piece, from the
/// call's start; a piece of -1 marks the call's return (its time in both fields).
#[pyfunction]
#[pyo3(name = "_h2d_trace")]
fn h2d_trace() -> Vec<(i64, usize, f64, f64)> {
    crate::h2d::trace::take()
        .into_iter()
        .map(|(p, n, a, b)| (if p == usize::MAX { -1 } else { p as i64 }, n, a, b))
        .collect()
}

/// The last traced call's pieces as the copy engine finished them: (piece, µs from the call's
/// start), read once the stream was synchronized.
#[pyfunction]
#[pyo3(name = "_h2d_trace_landed")]
fn h2d_trace_landed() -> Vec<(usize, f64)> {
    crate::h2d::trace::take_landed()
}

/// This thread's timestamps through its last call (variant `stamps`: `crate::stamps`), as
/// (label, ns since the stamp before), and clears them.
#[cfg(pinstage_lab_variant = "stamps")]
#[pyfunction]
#[pyo3(name = "_stamps")]
fn stamps() -> Vec<(&'static str, u64)> {
    crate::stamps::take()
}

/// The laboratory's Python module, `pinstage._lab`: a second module of the lab build's
/// extension library, loaded from its file by `lab/probes/labmod.py` (the product's module never
/// registers these).
#[pymodule]
fn _lab(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(h2d_trace_set, m)?)?;
    m.add_function(wrap_pyfunction!(h2d_trace, m)?)?;
    m.add_function(wrap_pyfunction!(h2d_trace_landed, m)?)?;
    m.add_function(wrap_pyfunction!(pinned_costs, m)?)?;
    m.add_function(wrap_pyfunction!(set_pin_by_register, m)?)?;
    m.add_function(wrap_pyfunction!(set_pin_from_pool, m)?)?;
    m.add_function(wrap_pyfunction!(set_h2d_tuning, m)?)?;
    m.add_function(wrap_pyfunction!(set_d2h_tuning, m)?)?;
    m.add_function(wrap_pyfunction!(driver_costs, m)?)?;
    m.add_function(wrap_pyfunction!(profile_copy_path, m)?)?;
    #[cfg(pinstage_lab_variant = "stamps")]
    m.add_function(wrap_pyfunction!(stamps, m)?)?;
    Ok(())
}
