"""The expert FFN over a slot pool's banks in the pool's format, as the two strategies call it.

Dense pools and small quantized (FP8, MXFP4) calls run expert_gemm on the slots in place
(dequantized in registers). A prompt-sized call on a quantized pool on a GPU dequantizes the layer's
experts into a scratch bank of E experts in the compute dtype (dequantize_experts) and runs the
grouped tensor-core GEMM on it with the expert ids as slots: dequantizing a layer costs ~0.3 ms on
an H200 against the ~11 ms its FP8 bytes take over the link (Qwen3-30B-A3B's layer; a GPT-OSS-120B
MXFP4 layer writes 6.4 GB of bf16 against ~30 ms over the link), so prefill stays bound by the link.
"""
import torch

from . import ops
from ._extension import LIMITS
from .activations import Activation
from .formats import DENSE
from .slot_pool import SlotPool


def gemm_on_slots(pool: SlotPool, hidden: torch.Tensor, slot_ids: torch.Tensor, weights: torch.Tensor,
                  activation: Activation) -> torch.Tensor:
    return ops.expert_gemm(hidden, slot_ids, weights, pool.w13, pool.w2, pool.b13, pool.b2, activation,
                           pool.w13_scale, pool.w2_scale)


def dequantizes_layer(pool: SlotPool, tokens: int) -> bool:
    """Whether a call of `tokens` tokens computes on the layer's dequantized experts."""
    return (pool.shape.format != DENSE and pool.device.type == "cuda"
            and tokens >= LIMITS["grouped_gemm_min_tokens"])


def gemm_on_layer(pool: SlotPool, layer_slots: torch.Tensor, hidden: torch.Tensor, expert_ids: torch.Tensor,
                  weights: torch.Tensor, activation: Activation) -> torch.Tensor:
    """The FFN of one layer's routed pairs, `expert_ids` [T, K] in [0, E) (-1: not computed here),
    with the layer's experts in slots `layer_slots` [E] (-1: not resident; no pair may route to
    one). Quantized experts are dequantized into a scratch bank first; dense ones are read in place
    through the slot map."""
    if pool.shape.format == DENSE:
        slot_ids = torch.where(expert_ids >= 0, layer_slots[expert_ids.clamp(min=0).long()], -1)
        return gemm_on_slots(pool, hidden, slot_ids, weights, activation)
    dtype = pool.shape.dtype
    w13 = ops.dequantize_experts(pool.w13, pool.w13_scale, layer_slots, 2 if pool.shape.gated else 1, dtype)
    w2 = ops.dequantize_experts(pool.w2, pool.w2_scale, layer_slots, 1, dtype)
    gather = layer_slots.clamp(min=0).long()
    b13 = pool.b13[gather] if pool.b13 is not None else None
    b2 = pool.b2[gather] if pool.b2 is not None else None
    return ops.expert_gemm(hidden, expert_ids, weights, w13, w2, b13, b2, activation)
