"""freetoken_plugin: runs Hugging Face transformers MoE models with their experts offloaded to a
pinned host pool and cached on the GPU by ft_ops.

    handle = freetoken_plugin.offload_experts(model, cache_slots=...)   # a loaded model, in place
    model = freetoken_plugin.load_model("path/to/checkpoint", cache_bytes=...)  # experts file -> pinned host
    freetoken_plugin.stats(model)
"""
from .backend import BACKEND_NAME, register
from .loader import load_model
from .offload import OffloadHandle, offload_experts, stats
from .safetensors_io import CheckpointError

__all__ = ["BACKEND_NAME", "register", "offload_experts", "load_model", "stats", "OffloadHandle", "CheckpointError"]
