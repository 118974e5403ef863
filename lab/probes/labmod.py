"""The laboratory's module `pinstage._lab`: a second Python module in the lab build's extension
library (built with `--features python,lab`; `scripts/gpu-build` puts that wheel in
`.gpu/wheels-lab`). The product's module never holds these functions.

    from labmod import lab      # with lab/probes on sys.path (the probes' own folder)
"""

import importlib.machinery
import importlib.util

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
