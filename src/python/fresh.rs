//! `to_device`: a fresh device array for torch, cupy or JAX (or any DLPack consumer), filled
//! from a host array at the rates of `copy_h2d`.

use std::sync::Arc;

use pyo3::prelude::*;
use pyo3::types::{PyDict, PyModule, PyString, PyTuple, PyType};

use super::errors::{describe, type_name};
use super::errors::{type_err, value_err};
use super::h2d::start;
use super::import::import_host_source;
use super::import::{Exchange, Imported, import_destination};
use super::linger::{Lingering, Until, linger};
use super::pending::SendPtr;
use super::stream::parse_stream;
use crate::cuda::StreamHandle;
use crate::dlpack::{DType, MemoryKind};
use crate::host::CopyPath;
use crate::python::export::DeviceArray;

/// Where a result goes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Framework {
    Torch,
    Cupy,
    Jax,
    Dlpack,
}

impl Framework {
    fn name(self) -> &'static str {
        match self {
            Framework::Torch => "torch",
            Framework::Cupy => "cupy",
            Framework::Jax => "jax",
            Framework::Dlpack => "dlpack",
        }
    }

    fn parse(f: &Bound<'_, PyAny>) -> PyResult<Self> {
        let name = if let Ok(m) = f.cast::<PyModule>() {
            m.name()?.to_string()
        } else if f.is_instance_of::<PyString>() {
            f.extract::<String>()?
        } else {
            return Err(type_err(format!(
                "framework must be 'torch', 'cupy', 'jax' or 'dlpack' (or the module); got {}",
                type_name(f)
            )));
        };
        Ok(match name.as_str() {
            "torch" => Framework::Torch,
            "cupy" => Framework::Cupy,
            "jax" | "jax.numpy" => Framework::Jax,
            "dlpack" => Framework::Dlpack,
            other => {
                return Err(value_err(format!(
                    "unknown framework '{other}': to_device makes torch, cupy or jax arrays, or \
                     'dlpack' for pinstage's own DLPack producer (numpy arrays live on the host)"
                )));
            }
        })
    }

    /// The framework of an array to imitate.
    fn of_array(like: &Bound<'_, PyAny>) -> PyResult<Self> {
        if super::import::is_jax_array(like) {
            return Ok(Framework::Jax);
        }
        let module: String = like.get_type().module()?.to_string();
        let root = module.split('.').next().unwrap_or("");
        match root {
            "torch" => Ok(Framework::Torch),
            "cupy" => Ok(Framework::Cupy),
            "jax" | "jaxlib" => Ok(Framework::Jax),
            "pinstage" => Ok(Framework::Dlpack),
            _ => Err(type_err(format!(
                "like must be a torch, cupy or jax array; got {}",
                describe(like)
            ))),
        }
    }
}

/// The CUDA ordinal of an array to imitate, if it lives on a CUDA device.
fn device_of(like: &Bound<'_, PyAny>) -> PyResult<Option<i32>> {
    let py = like.py();
    if !like.hasattr(pyo3::intern!(py, "__dlpack_device__"))? {
        return Ok(None);
    }
    let (kind, id): (u32, i32) = like
        .call_method0(pyo3::intern!(py, "__dlpack_device__"))?
        .extract()?;
    Ok((kind == crate::dlpack::DL_CUDA || kind == crate::dlpack::DL_CUDA_MANAGED).then_some(id))
}

/// The framework's current device.
fn default_device(py: Python<'_>, fw: Framework) -> PyResult<i32> {
    Ok(match fw {
        Framework::Torch => py
            .import("torch")?
            .getattr("cuda")?
            .call_method0("current_device")?
            .extract()?,
        Framework::Cupy => py
            .import("cupy")?
            .getattr("cuda")?
            .getattr("runtime")?
            .call_method0("getDevice")?
            .extract()?,
        Framework::Jax | Framework::Dlpack => 0,
    })
}

/// Makes a fresh device array holding a copy of a host array, for torch, cupy or JAX.
///
/// Parameters:
///     src: a C-contiguous host array (numpy, a torch CPU tensor, anything with DLPack on the
///         CPU), pinned or pageable. The result has its dtype and shape.
///     framework: ``"torch"``, ``"cupy"``, ``"jax"`` (or the module itself), or ``"dlpack"``
///         for a :class:`DeviceArray` that any DLPack consumer imports (see its rule on
///         releasing imports). Give this or ``like``.
///     like: an array whose framework (and CUDA device) the result imitates.
///     device: the CUDA device (an int, ``"cuda:N"``, a torch or cupy device); default:
///         ``like``'s device, else the framework's current device (device 0 for JAX and
///         ``"dlpack"``).
///     stream: torch and cupy only: the stream the copy is ordered on; None: the framework's
///         current stream, so the result is ready for the framework's next operation.
///
/// Returns:
///     A ``torch.Tensor`` / ``cupy.ndarray`` from the framework's own allocator, filled on its
///     current stream; a ``jax.Array`` over memory pinstage allocated from a stream-ordered pool
///     of its own and filled on pinstage's stream, imported once through DLPack (JAX's work
///     waits for the copy on the device; the memory returns to the pool when JAX frees the
///     array); or a :class:`DeviceArray`. A pageable ``src`` was read completely when this
///     returns and may change at once; a pinned ``src`` is read by one DMA in flight: do not
///     change it until the result is ready (e.g. the stream synchronised); pinstage keeps it
///     alive until then.
///
/// Raises:
///     PinstageValueError: an unknown framework, ``framework`` and ``like`` disagreeing,
///         a bad device, ``stream`` for JAX. PinstageTypeError: ``src`` not a host array, a
///         dtype the framework lacks (cupy: bfloat16). CudaUnavailableError: no driver.
///         ImportError: the framework is not installed. CudaDriverError: the copy failed.
///
/// Example:
///     >>> x = pinstage.to_device(numpy.arange(4, dtype=numpy.float32), "jax")
///     >>> t = pinstage.to_device(batch, like=model_param)    # torch, on the param's device
#[pyfunction]
#[pyo3(signature = (src, framework=None, *, like=None, device=None, stream=None))]
fn to_device<'py>(
    py: Python<'py>,
    src: &Bound<'py, PyAny>,
    framework: Option<&Bound<'py, PyAny>>,
    like: Option<&Bound<'py, PyAny>>,
    device: Option<&Bound<'py, PyAny>>,
    stream: Option<&Bound<'py, PyAny>>,
) -> PyResult<Bound<'py, PyAny>> {
    let _range = crate::nvtx::NvtxRange::new(c"pinstage.to_device");
    super::linger::reap(py);
    let framework = framework.filter(|f| !f.is_none());
    let like = like.filter(|l| !l.is_none());
    let fw = match (framework, like) {
        (None, None) => {
            return Err(value_err(
                "to_device needs framework= ('torch', 'cupy', 'jax', 'dlpack') or like= (an \
                 array to imitate)",
            ));
        }
        (Some(f), None) => Framework::parse(f)?,
        (None, Some(l)) => Framework::of_array(l)?,
        (Some(f), Some(l)) => {
            let (a, b) = (Framework::parse(f)?, Framework::of_array(l)?);
            if a != b {
                return Err(value_err(format!(
                    "framework='{}' but like is a {} array",
                    a.name(),
                    b.name()
                )));
            }
            a
        }
    };
    let s = parse_stream(stream)?;
    if s.is_some() && matches!(fw, Framework::Jax | Framework::Dlpack) {
        return Err(value_err(
            "stream= applies to torch and cupy results; a JAX or DLPack result is filled on \
             pinstage's stream and its consumers wait for it on the device through DLPack",
        ));
    }
    let from = import_host_source(src)?;
    let ordinal = match device.filter(|d| !d.is_none()) {
        Some(d) => super::args::parse_device(Some(d))?,
        None => match like.map(device_of).transpose()?.flatten() {
            Some(d) => d,
            None => {
                // No driver: say so before asking a framework about its devices.
                crate::driver::probe().map_err(crate::Error::unavailable)?;
                default_device(py, fw)?
            }
        },
    };
    let dev = &super::device::device_state(ordinal)?.device;
    let dtype = from.view.dtype();
    let shape: Vec<i64> = from.view.shape().to_vec();
    match fw {
        Framework::Torch | Framework::Cupy => {
            let on = match (stream.filter(|o| !o.is_none()), s) {
                (Some(obj), Some(h)) => {
                    // Another device's stream is refused before the framework wraps it (an
                    // event its allocator recorded there later would fail in a destructor).
                    // Only a definite answer refuses: a driver that cannot tell lets the
                    // copy go on as before.
                    if super::stream::stream_on(obj, h, dev).is_ok_and(|own| !own) {
                        return Err(value_err(format!(
                            "stream= belongs to another device than the result's (cuda:{ordinal})"
                        )));
                    }
                    Some((obj, h.as_raw()))
                }
                _ => None,
            };
            // The stream the fill goes on, when it is known before the array exists
            // (`stream=`, or torch's current stream through its DLPack exchange table): the
            // array is then made while pinstage's copy threads read the source.
            let early = match s {
                Some(h) => Some(h),
                None if fw == Framework::Torch => torch_current_stream(py, ordinal)?,
                None => None,
            };
            if let Some(stream) = early {
                let site = Site {
                    fw,
                    dtype,
                    shape: &shape,
                    ordinal,
                };
                return made_meanwhile(py, dev, from, site, on, stream);
            }
            let dst = empty_like_framework(py, fw, dtype, &shape, ordinal, on)?;
            let to = import_destination(&dst, s)?;
            let stream = s.unwrap_or(to.stream);
            let (path, event) = start(py, &from, &to, stream)?;
            drop(to);
            keep_pinned_source(path, event, from);
            Ok(dst)
        }
        Framework::Jax | Framework::Dlpack => {
            let arr = fresh(py, dev, from, dtype, shape)?;
            let arr = Bound::new(py, arr)?;
            if fw == Framework::Dlpack {
                return Ok(arr.into_any());
            }
            py.import("jax")?
                .getattr("dlpack")?
                .call_method1("from_dlpack", (arr,))
        }
    }
}

/// The torch or cupy array `to_device` makes: its framework, dtype, shape and device.
#[derive(Clone, Copy)]
struct Site<'a> {
    fw: Framework,
    dtype: DType,
    shape: &'a [i64],
    ordinal: i32,
}

/// torch's current stream on device `ordinal` (its DLPack exchange table's
/// `current_work_stream`), `None` where torch offers no table.
fn torch_current_stream(py: Python<'_>, ordinal: i32) -> PyResult<Option<StreamHandle<'static>>> {
    let tensor = py.import("torch")?.getattr("Tensor")?;
    let Ok(ty) = tensor.cast::<PyType>() else {
        return Ok(None);
    };
    match Exchange::of_type(ty)? {
        Some(ex) => Ok(Some(ex.current_stream(
            py,
            crate::dlpack::DL_CUDA,
            ordinal,
        )?)),
        None => Ok(None),
    }
}

/// `to_device` into a torch or cupy array made (by the framework's allocator, on this thread)
/// while pinstage's copy threads fill the first bounce slots from a pageable source: the
/// allocator's call costs the copy nothing. No copy is issued before the array exists, none if
/// it cannot be made (that error is raised).
fn made_meanwhile<'py>(
    py: Python<'py>,
    dev: &crate::Device,
    from: Imported,
    site: Site<'_>,
    on: Option<(&Bound<'py, PyAny>, usize)>,
    stream: StreamHandle<'static>,
) -> PyResult<Bound<'py, PyAny>> {
    let (ptr, len) = (from.view.ptr() as *const u8, from.view.nbytes());
    let mut made: Option<Bound<'py, PyAny>> = None;
    let mut failure: Option<PyErr> = None;
    // With the GIL held: the copy threads fill while the framework makes the array, with no
    // hand-over of the GIL in between.
    let mut make = || match make_destination(py, site, on, stream, len) {
        Ok((arr, addr)) => {
            made = Some(arr);
            Some(addr)
        }
        Err(e) => {
            failure = Some(e);
            None
        }
    };
    // The rest of the copy (the caller's share of the fill, the wait for the copy threads)
    // with the GIL released.
    let mut unlocked = |f: &mut (dyn FnMut() + Send)| py.detach(&mut *f);
    // SAFETY: the source is host memory of `len` bytes kept alive by `from` (a pinned one
    // lingers below until its copy completed, as documented); the address `make` returns is
    // `len` writable bytes of the array it keeps in `made` (checked there).
    let started = unsafe {
        crate::h2d::start_h2d_made_meanwhile(dev, ptr, len, stream, &mut make, &mut unlocked)
    };
    if let Some(e) = failure {
        // The array could not be made: nothing was issued.
        return Err(e);
    }
    let (path, event) = started?
        .ok_or_else(|| value_err("to_device: the destination was not made (a pinstage bug)"))?;
    let dst = made.ok_or_else(|| value_err("to_device: no destination (a pinstage bug)"))?;
    keep_pinned_source(path, event, from);
    Ok(dst)
}

/// Only a pinned source is still read after the call (one DMA in flight): it lingers until its
/// copy completed.
fn keep_pinned_source(path: CopyPath, event: Option<crate::cuda::Event>, from: Imported) {
    if let (CopyPath::Pinned, Some(ev)) = (path, event) {
        linger(Lingering {
            until: Until::Event(Arc::new(ev)),
            array: None,
            src: Some(from),
        });
    }
}

/// Makes the framework's array for [`made_meanwhile`] and returns it with its address, after
/// checking that it is `len` writable bytes of the device.
fn make_destination<'py>(
    py: Python<'py>,
    site: Site<'_>,
    on: Option<(&Bound<'py, PyAny>, usize)>,
    stream: StreamHandle<'static>,
    len: usize,
) -> PyResult<(Bound<'py, PyAny>, u64)> {
    let dst = empty_like_framework(py, site.fw, site.dtype, site.shape, site.ordinal, on)?;
    let to = import_destination(&dst, Some(stream))?;
    if to.view.nbytes() != len || to.view.memory() != MemoryKind::Cuda(site.ordinal) {
        return Err(value_err(format!(
            "to_device: the {} array made for the copy is {} bytes of {:?}, not {len} of \
             cuda:{} (a pinstage bug)",
            site.fw.name(),
            to.view.nbytes(),
            to.view.memory(),
            site.ordinal
        )));
    }
    Ok((dst, to.view.ptr()))
}

/// Fills fresh pool memory from `from` (pinstage's stream); a pinned source lingers until its
/// copy completed.
fn fresh(
    py: Python<'_>,
    dev: &crate::Device,
    from: Imported,
    dtype: DType,
    shape: Vec<i64>,
) -> PyResult<DeviceArray> {
    let (ptr, len) = (SendPtr(from.view.ptr() as *const u8), from.view.nbytes());
    let (mem, path) = py.detach(move || {
        let ptr = ptr;
        // SAFETY: `len` readable host bytes kept alive by `from`; a pinned one lingers below
        // until its copy completed (the documented contract: unchanged until then).
        unsafe { crate::h2d::start_to_device(dev, ptr.0, len) }
    })?;
    let mem = Arc::new(mem);
    if path == CopyPath::Pinned {
        // The DMA still reads `from`: it lingers until the fill completed.
        linger(Lingering {
            until: Until::Fresh(Arc::clone(&mem)),
            array: None,
            src: Some(from),
        });
    }
    Ok(DeviceArray::of_fresh(mem, dtype, shape))
}

/// `torch.empty` / `cupy.empty` on CUDA device `ordinal`. With `on` (the caller's `stream=`
/// object and its handle, not a default stream), the framework's caching allocator learns that
/// the array is used on that stream, where pinstage fills it: torch records the stream on the
/// tensor (`record_stream`), cupy allocates it under that stream; so freeing the array early
/// never hands its memory to another allocation while the fill may still write it.
fn empty_like_framework<'py>(
    py: Python<'py>,
    fw: Framework,
    dtype: DType,
    shape: &[i64],
    ordinal: i32,
    on: Option<(&Bound<'py, PyAny>, usize)>,
) -> PyResult<Bound<'py, PyAny>> {
    let shape = PyTuple::new(py, shape)?;
    let is_from = |obj: &Bound<'py, PyAny>, module: &str| {
        obj.get_type()
            .module()
            .is_ok_and(|m| m.to_cow().is_ok_and(|m| m.starts_with(module)))
    };
    match fw {
        Framework::Torch => {
            let torch = py.import("torch")?;
            let kw = PyDict::new(py);
            kw.set_item("dtype", torch.getattr(dtype.name())?)?;
            let device = torch.call_method1("device", ("cuda", ordinal))?;
            kw.set_item("device", &device)?;
            let t = torch.call_method("empty", (shape,), Some(&kw))?;
            if let Some((obj, handle)) = on {
                let s = if is_from(obj, "torch") {
                    obj.clone()
                } else if handle <= 1 {
                    // The legacy default stream: torch's default stream of the device.
                    torch
                        .getattr("cuda")?
                        .call_method1("default_stream", (&device,))?
                } else if handle == 2 {
                    // The per-thread default stream has no torch object: the fill's completion
                    // is waited for by the caller's own ordering (documented).
                    return Ok(t);
                } else {
                    let kw = PyDict::new(py);
                    kw.set_item("device", &device)?;
                    torch
                        .getattr("cuda")?
                        .getattr("ExternalStream")?
                        .call((handle,), Some(&kw))?
                };
                t.call_method1("record_stream", (s,))?;
            }
            Ok(t)
        }
        _ => {
            if dtype == DType::BF16 {
                return Err(type_err(
                    "cupy has no bfloat16 arrays: make a torch or jax array instead",
                ));
            }
            let cupy = py.import("cupy")?;
            // cupy's pool keeps memory per stream: allocate under the fill's stream (a stream
            // object, or an int handle other than the default streams').
            let cs = match on {
                Some((obj, _)) if is_from(obj, "cupy") => Some(obj.clone()),
                Some((_, handle)) if handle > 2 => Some(
                    cupy.getattr("cuda")?
                        .getattr("ExternalStream")?
                        .call1((handle, ordinal))?,
                ),
                _ => None,
            };
            let dev = cupy.getattr("cuda")?.call_method1("Device", (ordinal,))?;
            dev.call_method0("__enter__")?;
            // Whatever happens inside, the device and the stream are left as they were found.
            let inner = || -> PyResult<Bound<'py, PyAny>> {
                if let Some(cs) = &cs {
                    cs.call_method0("__enter__")?;
                }
                let kw = PyDict::new(py);
                kw.set_item("dtype", dtype.name())?;
                let out = cupy.call_method("empty", (shape,), Some(&kw));
                if let Some(cs) = &cs {
                    cs.call_method1("__exit__", (py.None(), py.None(), py.None()))?;
                }
                out
            };
            let out = inner();
            let exited = dev.call_method1("__exit__", (py.None(), py.None(), py.None()));
            let out = out?;
            exited?;
            Ok(out)
        }
    }
}

/// Device memory ``to_device`` holds for JAX and DLPack results on one device.
///
/// Returns:
///     dict: ``in_use_arrays`` and ``in_use_bytes`` (results not yet released by their
///     consumers), ``pooled_bytes`` (memory kept for reuse; ``empty_cache()`` gives it back),
///     ``outstanding_bytes`` (both). Zeros before the first use, and without a driver.
///
/// Raises:
///     PinstageValueError: a device that does not exist.
#[pyfunction]
#[pyo3(signature = (*legacy, device=None), text_signature = "(*, device=None)")]
fn device_pool_stats<'py>(
    py: Python<'py>,
    legacy: &Bound<'py, PyTuple>,
    mut device: Option<Bound<'py, PyAny>>,
) -> PyResult<Bound<'py, PyDict>> {
    super::args::legacy_positional(
        legacy,
        &["device"],
        &mut [&mut device],
        "device_pool_stats(device)",
        "device_pool_stats(device=device)",
    )?;
    let ordinal = super::args::parse_device(device.as_ref())?;
    let s = if crate::cuda::cuda_available() {
        crate::h2d::device_pool_stats(&super::device::device_state(ordinal)?.device)?
    } else {
        crate::h2d::DevicePoolStats::default()
    };
    let d = super::helpers::stats(
        py,
        "device_pool_stats()",
        &[
            ("live_arrays", "in_use_arrays"),
            ("live_bytes", "in_use_bytes"),
            ("reserved_bytes", "outstanding_bytes"),
        ],
    )?;
    d.set_item("in_use_arrays", s.in_use_arrays)?;
    d.set_item("in_use_bytes", s.in_use_bytes)?;
    d.set_item("pooled_bytes", s.outstanding_bytes - s.in_use_bytes)?;
    d.set_item("outstanding_bytes", s.outstanding_bytes)?;
    Ok(d)
}

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(to_device, m)?)?;
    m.add_function(wrap_pyfunction!(device_pool_stats, m)?)?;
    Ok(())
}
