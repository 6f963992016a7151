"""freetoken_plugin: runs Hugging Face transformers MoE models with their experts offloaded to a
pinned host pool and cached on the GPU by ft_ops.

    handle = freetoken_plugin.offload_experts(model, cache_slots=...)   # a loaded model, in place
    freetoken_plugin.stats(model)
"""
from .backend import BACKEND_NAME, register
from .offload import OffloadHandle, offload_experts, stats

__all__ = ["BACKEND_NAME", "register", "offload_experts", "stats", "OffloadHandle"]
