"""Python pieces of the native module ``pinstage._native``, loaded from the extension itself
(``src/python/helpers.rs``), never from the ``pinstage`` package: the stats dicts (a renamed
key still reads for one minor version, with a warning), ``NvtxRange`` as a decorator, and
``StepLayout.unpack``. ``PinstageTypeError`` and ``PinstageValueError`` are set by the loader.
"""

import functools
import warnings
from typing import Any

PinstageTypeError = TypeError  # replaced by the loader
PinstageValueError = ValueError  # replaced by the loader


class Stats(dict):
    """Counters as a plain dict of numbers; an old key reads its new one, with a warning."""

    __slots__ = ()
    _owner = "stats()"
    _renamed: dict = {}

    def __missing__(self, key):
        new = type(self)._renamed.get(key)
        if new is None:
            raise KeyError(key)
        warnings.warn(
            f"{self._owner}[{key!r}] is deprecated (removed in pinstage 0.4); write "
            f"{self._owner}[{new!r}]",
            DeprecationWarning,
            stacklevel=2,
        )
        return self[new]

    def get(self, key, default=None):
        try:
            return self[key]
        except KeyError:
            return default

    def __reduce__(self):
        return (dict, (dict(self),))


def stats_class(owner, renamed):
    """A ``Stats`` whose ``owner`` (``"pool_stats()"``) renamed the keys ``{old: new}``."""
    return type("Stats", (Stats,), {"__slots__": (), "_owner": owner, "_renamed": dict(renamed)})


def wrap(cm, func):
    """``func`` wrapped so that each call runs inside the context manager ``cm``."""

    @functools.wraps(func)
    def inner(*args, **kwargs):
        with cm:
            return func(*args, **kwargs)

    return inner


def _is_jax(x: Any) -> bool:
    mod = type(x).__module__
    return mod.startswith("jax") or mod.startswith("jaxlib")


def _check(packed: Any, nbytes: int) -> None:
    if not hasattr(packed, "shape") or not hasattr(packed, "dtype"):
        raise PinstageTypeError(
            f"packed must be a 1-D uint8 array (numpy, torch, cupy or JAX), got {type(packed).__name__}"
        )
    shape = tuple(packed.shape)
    if shape != (nbytes,) or "uint8" not in str(packed.dtype):
        raise PinstageValueError(
            f"packed must be a 1-D uint8 array of {nbytes} bytes (the layout's nbytes), "
            f"got shape {shape} of {packed.dtype}"
        )


def _unpack_jax(fields: list, packed: Any) -> dict:
    import jax
    import jax.numpy as jnp
    from jax import lax


    out = {}
    for f in fields:
        name, off, n, shape = f["name"], f["offset"], f["nbytes"], f["shape"]
        dt = jnp.dtype(f["dtype"])
        raw = lax.slice(packed, (off,), (off + n,))
        if dt == jnp.bool_:
            x = raw != 0
        elif dt.kind == "c":
            raise PinstageTypeError(f"field {name!r}: complex fields cannot be unpacked in JAX")
        elif dt.itemsize == 1:
            x = lax.bitcast_convert_type(raw, dt)
        else:
            if dt.itemsize == 8 and not jax.config.jax_enable_x64:
                raise PinstageTypeError(
                    f"field {name!r} is {dt.name}: 64-bit fields need "
                    "jax.config.update('jax_enable_x64', True)"
                )
            x = lax.bitcast_convert_type(raw.reshape(-1, dt.itemsize), dt)
        out[name] = x.reshape(shape)
    return out


def _dtype_for(packed: Any, name: str) -> Any:
    mod = type(packed).__module__
    if mod.startswith("torch"):
        import torch

        return getattr(torch, name)
    import numpy as np

    if name == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


def unpack(layout: Any, packed: Any) -> dict:
    """Splits ``packed`` (1-D uint8 of ``layout.nbytes``) into ``{name: field}``."""
    _check(packed, layout.nbytes)
    fields = layout.fields
    if _is_jax(packed):
        return _unpack_jax(fields, packed)
    out = {}
    for f in fields:
        off, n = f["offset"], f["nbytes"]
        try:
            out[f["name"]] = packed[off : off + n].view(_dtype_for(packed, f["dtype"])).reshape(f["shape"])
        except (ValueError, RuntimeError) as e:
            # e.g. a non-contiguous packed array, which cannot be viewed as another dtype.
                raise PinstageValueError(
                f"field {f['name']!r}: packed cannot be viewed as {f['dtype']} ({e}); pass a "
                "contiguous 1-D uint8 array"
            ) from e
    return out
