"""Shared fixtures: the dtype x size matrix, GPU gating and ctypes-built DLPack producers."""

import ctypes
import os
import pathlib

import numpy as np
import pytest

import pinstage

FIXTURES = pathlib.Path(os.environ.get("PINSTAGE_FIXTURES", pathlib.Path(__file__).parents[2] / "fixtures"))


def _lines(name):
    return [l.strip() for l in (FIXTURES / name).read_text().splitlines() if l.strip() and not l.startswith("#")]


SIZES = [int(x) for x in _lines("sizes.txt")]
DTYPES = _lines("dtypes.txt")
REQUIRE_GPU = os.environ.get("PINSTAGE_REQUIRE_GPU") == "1"


def pytest_collection_modifyitems(config, items):
    if pinstage.cuda_available():
        return
    if REQUIRE_GPU:
        return  # gpu tests run and fail through the `gpu` fixture
    skip = pytest.mark.skip(reason="no CUDA GPU: " + str(pinstage.driver_info()["reason"]))
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Where the GPU is required, a GPU test that skips (a framework missing, say) fails."""
    outcome = yield
    report = outcome.get_result()
    if REQUIRE_GPU and report.skipped and "gpu" in item.keywords and not hasattr(report, "wasxfail"):
        report.outcome = "failed"
        report.longrepr = f"PINSTAGE_REQUIRE_GPU=1: a GPU test may not skip ({report.longrepr})"


@pytest.fixture
def gpu():
    if not pinstage.cuda_available():
        pytest.fail("PINSTAGE_REQUIRE_GPU=1 but no GPU: " + str(pinstage.driver_info()["reason"]))
    return 0


def np_dtype(name):
    if name == "bfloat16":
        ml_dtypes = pytest.importorskip("ml_dtypes")
        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


def rand_values(name, n, seed):
    """Fresh random values of dtype `name`, never all zeros."""
    rng = np.random.default_rng(seed)
    dt = np_dtype(name)
    if name == "bool":
        v = rng.integers(0, 2, n).astype(bool)
        if n:
            v[0] = True
        return v
    raw = rng.integers(1, 255, n * dt.itemsize, dtype=np.uint8)
    if dt.kind in "fcV":
        # finite floats: build from small integers
        base = rng.integers(-1000, 1000, n * (2 if dt.kind == "c" else 1)).astype(np.float64) / 7.0 + 0.5
        if dt.kind == "c":
            return (base[0::2] + 1j * base[1::2]).astype(dt)
        return base.astype(dt)
    return raw.view(dt)[:n].copy()


def pad_for(name):
    return True if name == "bool" else (-3 if np.dtype(name if name != "bfloat16" else "float32").kind in "if" else 7)


# --- ctypes DLPack capsules: producers that lie ------------------------------------------------


class DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_uint32), ("device_id", ctypes.c_int32)]


class DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class DLTensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("device", DLDevice),
        ("ndim", ctypes.c_int32),
        ("dtype", DLDataType),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
    ]


class DLManagedTensor(ctypes.Structure):
    _fields_ = [("dl_tensor", DLTensor), ("manager_ctx", ctypes.c_void_p), ("deleter", ctypes.c_void_p)]


_KEEP = []
_PyCapsule_New = ctypes.pythonapi.PyCapsule_New
_PyCapsule_New.restype = ctypes.py_object
_PyCapsule_New.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]


def make_capsule(buf, *, device=(1, 0), dtype=(0, 32, 1), shape=(4,), strides=None, byte_offset=0, data=None, ndim=None):
    """A legacy 'dltensor' capsule over `buf` (a numpy array kept alive by the test module)."""
    shape_arr = (ctypes.c_int64 * max(len(shape), 1))(*shape)
    strides_arr = None if strides is None else (ctypes.c_int64 * max(len(strides), 1))(*strides)
    t = DLManagedTensor()
    t.dl_tensor.data = buf.ctypes.data if data is None else data
    t.dl_tensor.device = DLDevice(*device)
    t.dl_tensor.ndim = len(shape) if ndim is None else ndim
    t.dl_tensor.dtype = DLDataType(*dtype)
    t.dl_tensor.shape = ctypes.cast(shape_arr, ctypes.POINTER(ctypes.c_int64))
    t.dl_tensor.strides = None if strides_arr is None else ctypes.cast(strides_arr, ctypes.POINTER(ctypes.c_int64))
    t.dl_tensor.byte_offset = byte_offset
    t.deleter = None
    _KEEP.extend([buf, shape_arr, strides_arr, t])
    return _PyCapsule_New(ctypes.addressof(t), b"dltensor", None)


class CapsuleProducer:
    """A producer whose __dlpack__ returns a prepared capsule (legacy protocol only)."""

    def __init__(self, capsule, device=None):
        self.capsule = capsule
        self.device = device

    def __dlpack__(self):
        return self.capsule

    def __getattr__(self, name):
        if name == "__dlpack_device__" and self.device is not None:
            return lambda: self.device
        raise AttributeError(name)
