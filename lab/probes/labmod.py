"""The laboratory's module `pinstage._lab`: a second Python module in the lab build's extension
library (built with `--features python,lab`; `scripts/gpu-build` puts that wheel in
`.gpu/wheels-lab`). The product's module never holds these functions.

    from labmod import lab      # with lab/probes on sys.path (the probes' own folder)

and helpers the probes share: `bench_module(name)` (benches/NAME.py loaded as a module),
`cold_sweep()` (with COLD=1, bench_h2d.py's sweeper of 1 GiB; otherwise None) and
`int32_copy_case(nbytes)` (an H2D copy's source, reference, destination and pinned twin).
"""

import importlib.machinery
import importlib.util
import os
import pathlib

import pinstage._native as _native


def _load():
    loader = importlib.machinery.ExtensionFileLoader("pinstage._lab", _native.__file__)
    spec = importlib.util.spec_from_file_location("pinstage._lab", _native.__file__, loader=loader)
    mod = importlib.util.module_from_spec(spec)
    try:
        loader.exec_module(mod)
    except ImportError as e:
        raise ImportError(f"pinstage was built without the lab feature ({_native.__file__}): {e}") from None
    return mod


lab = _load()


def bench_module(name):
    """benches/NAME.py of this repository, loaded as a module (its helpers reused by a probe)."""
    path = pathlib.Path(__file__).resolve().parents[2] / "benches" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def cold_sweep():
    """With COLD=1 in the environment, `bench_h2d.py`'s `Sweeper` of 1 GiB (every CPU reads and
    writes it when called, so a source comes from DRAM); otherwise None."""
    return bench_module("bench_h2d").Sweeper(1 << 30) if os.environ.get("COLD") == "1" else None


def int32_copy_case(nbytes):
    """An H2D copy of `nbytes` of random int32 (seeded by the size): (the pageable numpy source,
    the expected device tensor, a device destination, a pinned torch copy of the source)."""
    import numpy as np
    import torch

    n = nbytes // 4
    vals = np.random.default_rng(nbytes).integers(-(2**31), 2**31 - 1, n, dtype=np.int32)
    ref = torch.from_numpy(vals).cuda()
    dst = torch.empty(n, dtype=torch.int32, device="cuda")
    return vals, ref, dst, torch.from_numpy(vals).pin_memory()
