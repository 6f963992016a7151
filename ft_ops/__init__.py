"""ft_ops: the freetoken operator library and the offloaded-experts runtime built on it.

`ft_ops.ops` holds the typed wrappers of `torch.ops.freetoken.*`, `ft_ops.reference` their
pure-torch oracle; the runtime (slot pool, prefill streamer, decode path, MoE layer) composes them.
"""
from ._extension import cuda_kernels_available, has_kernel
from . import ops, reference
from .ops import async_layer_copy, copy_experts, dedup_and_admit, expert_gemm, slot_lookup

__all__ = [
    "ops",
    "reference",
    "has_kernel",
    "cuda_kernels_available",
    "slot_lookup",
    "dedup_and_admit",
    "copy_experts",
    "async_layer_copy",
    "expert_gemm",
]
