"""Loads the compiled kernels (ft_ops._C) and answers which devices they cover."""
import torch

try:
    from . import _C  # noqa: F401  (importing registers torch.ops.freetoken.*)
except ImportError as exc:  # pragma: no cover - exercised only on a broken install
    raise ImportError(
        "ft_ops._C, the compiled freetoken kernels, could not be loaded "
        f"({exc}). Build it against the installed torch from the repository root with "
        "`pip install --no-build-isolation -e .` (or run `bash scripts/setup.sh`)."
    ) from exc

OP_NAMES = ("slot_lookup", "dedup_and_admit", "copy_experts", "async_layer_copy", "expert_gemm",
            "dequantize_experts")

# The kernels' limits (src/common/limits.h), read from the build rather than written down again:
# grouped_gemm_max_slots, grouped_gemm_min_tokens, dequantize_window_bytes, copy_blocks, layer_copy_blocks,
# decode_call_max_ids, max_register_pool_slots, max_slots.
LIMITS = dict(_C.limits())


def has_kernel(op: str, device_type: str) -> bool:
    """Whether freetoken::<op> has a kernel registered for the dispatch key of `device_type`.

    Tests use this to skip per missing kernel instead of guessing from the build or the GPU.
    """
    key = {"cpu": "CPU", "cuda": "CUDA"}[device_type]
    return torch._C._dispatch_has_kernel_for_dispatch_key(f"freetoken::{op}", key)


def cuda_kernels_available() -> bool:
    """All ops have CUDA kernels and a GPU is visible."""
    return torch.cuda.is_available() and all(has_kernel(op, "cuda") for op in OP_NAMES)
