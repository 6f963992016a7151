"""ft_ops: the freetoken operator library and the offloaded-experts runtime built on it.

`ft_ops.ops` holds the typed wrappers of `torch.ops.freetoken.*` (re-exported here); the runtime
(slot_pool, streaming, admission, moe) composes them. `ft_ops.testing.reference` is the pure-torch
oracle the tests compare every op against.
"""
from ._extension import LIMITS, cuda_kernels_available, has_kernel
from . import ops
from .ops import async_layer_copy, copy_experts, dedup_and_admit, dequantize_experts, expert_gemm, slot_lookup

__all__ = [
    "ops",
    "LIMITS",
    "has_kernel",
    "cuda_kernels_available",
    "slot_lookup",
    "dedup_and_admit",
    "copy_experts",
    "async_layer_copy",
    "expert_gemm",
    "dequantize_experts",
]
