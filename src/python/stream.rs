//! The `stream=` argument: None, an int handle (checked to be one before the driver sees it), a
//! torch or cupy stream, or an object with `__cuda_stream__()`.

use pyo3::prelude::*;

use super::errors::type_name;
use super::errors::{type_err, value_err};
use crate::cuda::StreamHandle;

/// Parses a `stream=` argument: None, an int handle, an object with `__cuda_stream__()`, a torch
/// stream (`.cuda_stream`) or a cupy stream (`.ptr`).
pub(crate) fn parse_stream(
    obj: Option<&Bound<'_, PyAny>>,
) -> PyResult<Option<StreamHandle<'static>>> {
    let Some(obj) = obj.filter(|o| !o.is_none()) else {
        return Ok(None);
    };
    let hit = known_handle(obj);
    let (raw, trusted) = match hit {
        Some(h) => (h, false),
        None => parse_stream_object(obj)?,
    };
    // SAFETY: the handle of a stream object the caller passed, or an integer the caller passed
    // as a stream; the Python API documents that the stream must stay alive while its copies
    // run. Impossible handles are refused here.
    let handle = unsafe { StreamHandle::from_raw(raw) }?;
    // (Python code run by the parse may have passed the same object already.)
    if trusted && known_handle(obj).is_none() {
        let known = Known {
            obj: obj.clone().unbind(),
            handle: raw,
            ctx: std::cell::Cell::new(None),
        };
        let old = KNOWN.with_borrow_mut(|k| {
            k.insert(0, known);
            (k.len() > KNOWN_STREAMS).then(|| k.pop())
        });
        // Dropped outside the borrow: a destructor may run Python code that passes a stream.
        drop(old);
    }
    Ok(Some(handle))
}

/// Whether `handle`, parsed from `obj` by [`parse_stream`], is a stream of `device` (the
/// special handles belong to every device). The driver is asked once per stream object this
/// thread passed lately; an int or a wrapped handle is asked about every time.
///
/// # Errors
/// The driver cannot tell (callers let the copy go on: only a definite answer refuses).
pub(crate) fn stream_on(
    obj: &Bound<'_, PyAny>,
    handle: StreamHandle<'_>,
    device: &crate::Device,
) -> crate::Result<bool> {
    let known = with_known(obj, |k| (k.handle == handle.as_raw()).then(|| k.ctx.get()));
    let ctx = match known.flatten().flatten() {
        Some(ctx) => ctx,
        None => {
            let Some(ctx) = handle.ctx()? else {
                return Ok(true);
            };
            with_known(obj, |k| {
                if k.handle == handle.as_raw() {
                    k.ctx.set(Some(ctx));
                }
            });
            ctx
        }
    };
    Ok(ctx == device.ctx() as usize)
}

/// How many stream objects each thread remembers: an engine's few streams (one per direction
/// of its block moves, its compute stream) passed in turn all stay known.
const KNOWN_STREAMS: usize = 4;

/// A torch or cupy stream object this thread passed, its handle and, once asked, its context.
/// Such an object holds one stream for its whole life, and the reference held here keeps its
/// address from being reused, so passing the same object again costs a pointer compare instead
/// of a Python call (`__cuda_stream__()` or an attribute) and a driver call.
struct Known {
    #[cfg_attr(pinstage_seeded_bug = "stream_cache_any", allow(dead_code))]
    obj: Py<PyAny>,
    handle: usize,
    ctx: std::cell::Cell<Option<usize>>,
}

thread_local! {
    /// The stream objects this thread passed lately, the most recently passed first.
    static KNOWN: std::cell::RefCell<Vec<Known>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// The handle this thread remembers for `obj`, its entry moved to the front (the least
/// recently passed object is the one forgotten).
fn known_handle(obj: &Bound<'_, PyAny>) -> Option<usize> {
    KNOWN.with_borrow_mut(|k| {
        let i = k.iter().position(|k| same(k, obj))?;
        k[..=i].rotate_right(1);
        Some(k[0].handle)
    })
}

/// `f` of the entry this thread remembers for `obj`, if any.
fn with_known<T>(obj: &Bound<'_, PyAny>, f: impl FnOnce(&Known) -> T) -> Option<T> {
    KNOWN.with_borrow(|k| k.iter().find(|k| same(k, obj)).map(f))
}

/// Whether `known` is `obj`'s entry.
#[cfg_attr(pinstage_seeded_bug = "stream_cache_any", allow(unused_variables))]
fn same(known: &Known, obj: &Bound<'_, PyAny>) -> bool {
    #[cfg(pinstage_seeded_bug = "stream_cache_any")]
    return true;
    #[cfg(not(pinstage_seeded_bug = "stream_cache_any"))]
    return known.obj.as_ptr() == obj.as_ptr();
}

/// Whether `obj` is a stream object of torch or cupy that owns its stream: its handle is fixed,
/// and the stream lives, as long as the object. An `ExternalStream` wraps a handle its caller
/// owns (and may destroy): it is checked like an int.
///
/// Each thread remembers the answer for the last type it asked about (holding the type, so
/// its address cannot be reused): `torch.cuda.current_stream()` returns a new object on every
/// call, of the same type.
fn is_framework_stream(obj: &Bound<'_, PyAny>) -> bool {
    thread_local! {
        static LAST_TYPE: std::cell::RefCell<Option<(Py<pyo3::types::PyType>, bool)>> =
            const { std::cell::RefCell::new(None) };
    }
    let ty = obj.get_type();
    let hit = LAST_TYPE.with(|c| {
        c.borrow()
            .as_ref()
            .and_then(|(t, v)| t.bind(obj.py()).is(&ty).then_some(*v))
    });
    if let Some(v) = hit {
        return v;
    }
    let module = ty.module().map(|m| m.to_string()).unwrap_or_default();
    let name = type_name(obj);
    let v = (module.starts_with("torch.") || module.starts_with("cupy."))
        && name.contains("Stream")
        && !name.contains("External");
    // The old entry is dropped after the borrow ends (its drop may run Python code).
    let old = LAST_TYPE.with(|c| c.replace(Some((ty.unbind(), v))));
    drop(old);
    v
}

/// The handle of a stream argument, and whether it is trusted without a check (and may be
/// remembered): a torch or cupy stream object's.
fn parse_stream_object(obj: &Bound<'_, PyAny>) -> PyResult<(usize, bool)> {
    let py = obj.py();
    if obj.is_instance_of::<pyo3::types::PyBool>() {
        return Err(type_err(
            "stream must be a stream object or an int handle; got a bool",
        ));
    }
    // An int, or a numpy integer (a handle kept in an array, say).
    let int = if obj.is_instance_of::<pyo3::types::PyInt>() {
        Some(obj.clone())
    } else if obj
        .get_type()
        .module()
        .is_ok_and(|m| m.to_cow().is_ok_and(|m| m == "numpy"))
        && obj.is_instance(&py.import("numpy")?.getattr("integer")?)?
    {
        super::args::as_index(obj)?
    } else {
        None
    };
    if let Some(int) = int {
        let h = int.extract::<usize>().map_err(|_| {
            value_err(format!(
                "stream={}: an int stream handle is 0 to 2**64 - 1 (0, 1, 2 or a stream's handle)",
                int.repr().map(|r| r.to_string()).unwrap_or_default()
            ))
        })?;
        return checked_int_stream(h).map(|h| (h, false));
    }
    if obj.hasattr(pyo3::intern!(py, "__cuda_stream__"))? {
        // A closed stream object (cuda.core's Stream.close()) refuses to give its handle or
        // gives None: a typed error, never a handle the driver would dereference.
        let r = obj
            .call_method0(pyo3::intern!(py, "__cuda_stream__"))
            .map_err(|e| {
                value_err(format!(
                    "the stream object's __cuda_stream__() failed (is the stream closed?): {e}"
                ))
            })?;
        if let Ok((_, h)) = r.extract::<(i64, usize)>() {
            // A torch or cupy stream object holds a live stream while it lives; any other
            // object's handle is checked as an int would be (a stale or made-up handle would
            // fault in the driver).
            if is_framework_stream(obj) {
                return Ok((h, true));
            }
            return checked_int_stream(h).map(|h| (h, false));
        }
        if let Ok((_, h)) = r.extract::<(i64, Bound<'_, PyAny>)>()
            && h.is_none()
        {
            return Err(value_err(
                "the stream object has no handle (__cuda_stream__() gave None): it is closed",
            ));
        }
        return Err(type_err(format!(
            "__cuda_stream__() returned {}, expected a (version, handle) tuple",
            r.repr()?
        )));
    }
    for attr in ["cuda_stream", "ptr"] {
        if let Ok(v) = obj.getattr(attr) {
            if let Ok(h) = v.extract::<usize>() {
                // A torch or cupy stream object holds a live stream while it lives; anything
                // else with such an attribute (a cupy Event or MemoryPointer: `.ptr`) is checked
                // as an int would be.
                if is_framework_stream(obj) {
                    return Ok((h, true));
                }
                return checked_int_stream(h).map(|h| (h, false));
            }
            if v.is_none() {
                return Err(value_err(format!(
                    "the stream object's .{attr} is None: the stream is closed"
                )));
            }
        }
    }
    Err(type_err(format!(
        "stream must be None, an int handle, an object with __cuda_stream__(), a torch stream or a \
         cupy stream; got {}",
        type_name(obj)
    )))
}

/// An integer given as a stream handle, if the driver may see it: 0, 1, 2, or the handle of a
/// live stream (its driver object holds it back, read without faulting). An integer the driver
/// would dereference into a fault (a segfault, not an error) is refused here with a typed error.
/// Where the driver's layout could not be learnt, the handle must at least lie in private
/// read-write heap or anonymous memory, where stream objects live.
pub(crate) fn checked_int_stream(h: usize) -> PyResult<usize> {
    let live = match crate::cuda::liveness(h) {
        crate::cuda::Liveness::Live => true,
        crate::cuda::Liveness::NotAStream => false,
        // Only a possible handle other than 0, 1, 2 is unknown.
        crate::cuda::Liveness::Unknown => stream_memory_plausible(h),
    };
    if live {
        Ok(h)
    } else {
        Err(crate::Error::BadStreamHandle { handle: h }.into())
    }
}

/// Whether `addr` can be a stream object, judged from the memory map alone: readable, writable,
/// private memory that is anonymous or the heap (where the driver allocates its stream objects),
/// not a mapping of a file or of a device (`/dev/nvidia*`: pinned and unified memory). The
/// fallback where the driver's stream layout is unknown: an address inside the heap that is not
/// a live stream passes it.
fn stream_memory_plausible(addr: usize) -> bool {
    use std::sync::atomic::Ordering::Relaxed;
    // The map is read once per handle (a torch process has thousands of mappings).
    if PLAUSIBLE.iter().any(|a| a.load(Relaxed) == addr) {
        return true;
    }
    let Ok(maps) = std::fs::read_to_string("/proc/self/maps") else {
        // No /proc: nothing can be checked; the handle is used as given, as documented.
        return true;
    };
    let ok = maps.lines().any(|line| {
        let mut parts = line.split_whitespace();
        let (Some(range), Some(perms)) = (parts.next(), parts.next()) else {
            return false;
        };
        let path = parts.nth(3).unwrap_or("");
        let Some((lo, hi)) = range.split_once('-') else {
            return false;
        };
        let (Ok(lo), Ok(hi)) = (usize::from_str_radix(lo, 16), usize::from_str_radix(hi, 16))
        else {
            return false;
        };
        (lo..hi).contains(&addr)
            && addr.checked_add(64).is_some_and(|end| end <= hi)
            && perms.starts_with("rw")
            && perms.ends_with('p')
            && (path.is_empty() || path == "[heap]" || path.starts_with("[anon"))
    });
    if ok {
        PLAUSIBLE[addr / 16 % PLAUSIBLE.len()].store(addr, Relaxed);
    }
    ok
}

/// Handles the memory-map check accepted recently (the fallback's cache).
static PLAUSIBLE: [std::sync::atomic::AtomicUsize; 8] =
    [const { std::sync::atomic::AtomicUsize::new(0) }; 8];
