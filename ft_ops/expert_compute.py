"""The expert FFN over a slot pool's banks in the pool's format, as the two strategies call it.

Dense pools and small quantized (FP8, MXFP4) calls run expert_gemm on the slots in place
(dequantized in registers). A prompt-sized call on a quantized pool on a GPU passes the layer's
slot map with the expert ids: for bf16 hidden states expert_gemm dequantizes the layer's experts
into a bf16 scratch bank, a window of at most LIMITS["dequantize_window_bytes"] at a time, and runs
the grouped tensor-core GEMM on it (fp16 and float32 ones take the decode kernels on the quantized
rows). Dequantizing a layer costs ~0.3 ms on an H200 against the ~11 ms its
FP8 bytes take over the link (Qwen3-30B-A3B's layer; a GPT-OSS-120B MXFP4 layer writes 6.4 GB of
bf16 against ~30 ms over the link), so prefill stays bound by the link.
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
    """Whether a call of `tokens` tokens passes the layer's slot map to expert_gemm, which then
    computes on the layer's dequantized experts (bf16 hidden states) or the quantized rows."""
    return (pool.shape.format != DENSE and pool.device.type == "cuda"
            and tokens >= LIMITS["grouped_gemm_min_tokens"])


def gemm_on_layer(pool: SlotPool, layer_slots: torch.Tensor, hidden: torch.Tensor, expert_ids: torch.Tensor,
                  weights: torch.Tensor, activation: Activation) -> torch.Tensor:
    """The FFN of one layer's routed pairs, `expert_ids` [T, K] in [0, E) (-1: not computed here),
    with the layer's experts in slots `layer_slots` [E] (-1: not resident; no pair may route to
    one). Quantized experts are dequantized a window at a time by expert_gemm (prompt-sized calls
    on a GPU); dense ones are read in place through the slot map."""
    return ops.expert_gemm(hidden, expert_ids, weights, pool.w13, pool.w2, pool.b13, pool.b2, activation,
                           pool.w13_scale, pool.w2_scale, slot_map=layer_slots)
