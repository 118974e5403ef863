"""pinstage: host<->CUDA copies at PCIe line rate for any framework, through DLPack.

- ``alloc_pinned_numpy`` / ``empty_pinned``: numpy arrays on page-locked memory.
- ``PinnedStager``: a ring of pinned buffers for small host-to-device copies (one
  non-blocking copy per call, values and padding written on the host).
- ``copy_d2h`` / ``copy_d2h_async``: device-to-host into pinned memory, from torch, jax,
  cupy or numpy tensors; a transparent numpy fallback where no CUDA driver exists.
- ``copy_h2d``: a whole host array (pinned or pageable) into a device tensor at line rate.
- ``StepLayout`` / ``StepStager``: all of an engine step's small inputs in ONE driver call per
  step, into a persistent device arena (stable addresses for CUDA graphs), a fresh block per
  step (JAX), or read in place by kernels (zero-copy).
"""

from ._native import (
    CudaDriverError,
    CudaUnavailableError,
    H2DMirror,
    PendingCopy,
    PinnedBlock,
    PinnedPool,
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
    StepTensor,
    StreamCaptureError,
    UnknownFieldError,
    __version__,
    alloc_pinned_numpy,
    copy_d2h,
    copy_d2h_async,
    copy_h2d,
    cuda_available,
    device_count,
    driver_info,
    empty_cache,
    empty_host,
    empty_pinned,
    is_pinned,
    nvtx_range,
    pinned_bytes,
    pool_stats,
    set_pool_budget,
)

__all__ = [
    "CudaDriverError",
    "CudaUnavailableError",
    "H2DMirror",
    "PendingCopy",
    "PinnedBlock",
    "PinnedPool",
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
    "StepTensor",
    "StreamCaptureError",
    "UnknownFieldError",
    "__version__",
    "alloc_pinned_numpy",
    "copy_d2h",
    "copy_d2h_async",
    "copy_h2d",
    "cuda_available",
    "device_count",
    "driver_info",
    "empty_cache",
    "empty_host",
    "empty_pinned",
    "is_pinned",
    "nvtx_range",
    "pinned_bytes",
    "pool_stats",
    "set_pool_budget",
]
