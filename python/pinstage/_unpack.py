"""``StepLayout.unpack``: a packed step (1-D uint8) split into its fields, without copies.

For JAX (inside or outside ``jax.jit``) the fields are slices bitcast with
``lax.bitcast_convert_type``; for torch, cupy and numpy they are ``.view(dtype)`` views.
"""

from __future__ import annotations

from typing import Any


def _is_jax(x: Any) -> bool:
    mod = type(x).__module__
    return mod.startswith("jax") or mod.startswith("jaxlib")


def _check(packed: Any, nbytes: int) -> None:
    if not hasattr(packed, "shape") or not hasattr(packed, "dtype"):
        from ._native import PinstageTypeError

        raise PinstageTypeError(
            f"packed must be a 1-D uint8 array (numpy, torch, cupy or JAX), got {type(packed).__name__}"
        )
    shape = tuple(packed.shape)
    if shape != (nbytes,) or "uint8" not in str(packed.dtype):
        from ._native import PinstageValueError

        raise PinstageValueError(
            f"packed must be a 1-D uint8 array of {nbytes} bytes (the layout's nbytes), "
            f"got shape {shape} of {packed.dtype}"
        )


def _unpack_jax(fields: list, packed: Any) -> dict:
    import jax
    import jax.numpy as jnp
    from jax import lax

    from ._native import PinstageTypeError

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
            from ._native import PinstageValueError

            raise PinstageValueError(
                f"field {f['name']!r}: packed cannot be viewed as {f['dtype']} ({e}); pass a "
                "contiguous 1-D uint8 array"
            ) from e
    return out
