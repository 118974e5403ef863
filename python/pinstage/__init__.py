"""pinstage: host<->CUDA copies at PCIe line rate for any framework, through DLPack.

- Small host-to-device copies: ``PinnedStager`` (one non-blocking copy per call from a ring of
  pinned slots), ``H2DMirror``.
- Steps: ``StepLayout`` / ``StepStager``: all of an engine step's small inputs in ONE driver
  call per step (a persistent arena for CUDA graphs, fresh blocks for JAX, or zero-copy).
- Whole arrays: ``copy_h2d`` / ``copy_h2d_async`` (pinned or pageable host arrays into device
  tensors at line rate), ``to_device`` (fresh torch, cupy or JAX arrays).
- Device to host: ``copy_d2h`` / ``copy_d2h_async`` (into pinned memory; a numpy fallback
  without a driver).
- KV-cache blocks: ``BlockMover`` (lists of block ids between device tensors and pinned host
  tensors: 2D copies across the tensors or batched copies, copy engines only).
- Pinned memory: ``empty_pinned``, ``empty_host``, ``alloc_pinned_numpy``, ``PinnedPool``,
  ``pin``.

The conventions and every name: docs/API.md in the source tree.
"""

from ._native import (
    BlockMover,
    CudaDriverError,
    CudaUnavailableError,
    DeviceArray,
    H2DMirror,
    PendingCopy,
    PinnedBlock,
    PinnedPool,
    PinnedRegion,
    PinnedStager,
    PinstageError,
    PinstageTypeError,
    PinstageValueError,
    PoolExhaustedError,
    StagedTarget,
    Step,
    StepLayout,
    StepStager,
    StepStateError,
    StreamCaptureError,
    UnknownFieldError,
    __version__,
    alloc_pinned_numpy,
    copy_d2h,
    copy_d2h_async,
    copy_h2d,
    copy_h2d_async,
    cuda_available,
    device_count,
    device_pool_stats,
    driver_info,
    empty_cache,
    empty_host,
    empty_pinned,
    is_pinned,
    NvtxRange,
    nvtx_range as _nvtx_range,
    pin,
    pinned_bytes,
    pool_stats,
    set_pool_budget,
    to_device,
)

__all__ = [
    "BlockMover",
    "CudaDriverError",
    "CudaUnavailableError",
    "DeviceArray",
    "H2DMirror",
    "PendingCopy",
    "PinnedBlock",
    "PinnedPool",
    "PinnedRegion",
    "PinnedStager",
    "PinstageError",
    "PinstageTypeError",
    "PinstageValueError",
    "PoolExhaustedError",
    "StagedTarget",
    "Step",
    "StepLayout",
    "StepStager",
    "StepStateError",
    "StreamCaptureError",
    "UnknownFieldError",
    "__version__",
    "alloc_pinned_numpy",
    "copy_d2h",
    "copy_d2h_async",
    "copy_h2d",
    "copy_h2d_async",
    "cuda_available",
    "device_count",
    "device_pool_stats",
    "driver_info",
    "empty_cache",
    "empty_host",
    "empty_pinned",
    "is_pinned",
    "NvtxRange",
    "nvtx_range",
    "pin",
    "pinned_bytes",
    "pool_stats",
    "set_pool_budget",
    "to_device",
]


def nvtx_range(message):
    """A range for Nsight named ``message``: ``with nvtx_range("plan"):`` or ``@nvtx_range("plan")``.

    Returns:
        NvtxRange: a context manager, and a decorator.

    Raises:
        PinstageTypeError: a message that is not a str.
    """
    return _nvtx_range(message)


def _nvtx_available():
    import warnings

    warnings.warn(
        "nvtx_range.available() is deprecated (removed in pinstage 0.4); write NvtxRange.available()",
        DeprecationWarning,
        stacklevel=2,
    )
    return NvtxRange.available()


nvtx_range.available = _nvtx_available


def __getattr__(name):
    # Renamed names keep working for one minor version, with a warning that says what to write.
    if name == "StepTensor":
        import warnings

        warnings.warn(
            "pinstage.StepTensor is deprecated (removed in pinstage 0.4); write pinstage.DeviceArray",
            DeprecationWarning,
            stacklevel=2,
        )
        return DeviceArray
    raise AttributeError(f"module 'pinstage' has no attribute {name!r}")
