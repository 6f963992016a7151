"""Typed wrappers and fake (meta) kernels of the freetoken ops, one section per op.

The wrappers call `torch.ops.freetoken.<op>.default` directly so they cost one dispatcher call on
the decode path (expert_gemm and cpu_share_join outside inference mode: also their Python autograd
kernel, which refuses gradients, ~3 us a call on a CPU; none in a compiled graph). The fake
kernels give torch.compile and FakeTensor the output shapes; every output shape follows from the
input shapes alone, so every op can be captured in a CUDA graph. docs/ops.md states each op's full contract.
"""
import functools
from typing import List, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor

from . import _extension  # noqa: F401  (loads the kernels)
from .activations import SILU, Activation, as_activation

_ops = torch.ops.freetoken


def _refuse_meta_mixed_with_real(fake):
    """A fake kernel refuses meta tensors mixed with real ones: the dispatcher sends such a call to
    the fake kernel (meta outranks the devices), which would return uninitialized memory on the
    real tensors' device, computing nothing. Under FakeTensorMode tensors report their real device."""
    @functools.wraps(fake)
    def checked(*args, **kwargs):
        tensors = [t for a in (*args, *kwargs.values()) for t in (a if isinstance(a, (list, tuple)) else (a,))
                   if isinstance(t, Tensor)]
        kinds = {t.device.type for t in tensors}
        if "meta" in kinds and len(kinds) > 1:
            other = sorted(kinds - {"meta"})[0]
            raise RuntimeError(f"{fake.__name__.strip('_').removesuffix('_fake')}: some tensors are on meta and some "
                               f"on {other}; pass every tensor on one device (meta only to trace shapes)")
        return fake(*args, **kwargs)

    return checked


# --- slot_lookup -----------------------------------------------------------------------------
def slot_lookup(slot_of: Tensor, layer: int, expert_ids: Tensor) -> Tensor:
    """Slot holding (layer, expert_ids[...]) for every routed position, or -1; int32."""
    return _ops.slot_lookup.default(slot_of, layer, expert_ids)


@torch.library.register_fake("freetoken::slot_lookup")
@_refuse_meta_mixed_with_real
def _slot_lookup_fake(slot_of, layer, expert_ids):
    return expert_ids.new_empty(expert_ids.shape, dtype=torch.int32)


# --- dedup_and_admit -------------------------------------------------------------------------
def dedup_and_admit(
    slot_of: Tensor,
    owner_of: Tensor,
    last_use: Tensor,
    clock: Tensor,
    layer: int,
    expert_ids: Tensor,
    fetch_fraction: float = 1.0,
    protect_lo: int = 0,
    protect_hi: int = 0,
    stats: Optional[Tensor] = None,
    policy: int = 0,
    cpu_expert_cost: float = 0.0,
    cpu_call_cost: float = 0.0,
    policy_state: Optional[Tensor] = None,
    shadows: Optional[Sequence[Tensor]] = None,
) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """Admits the routed experts of `layer` into the slot pool (in place, on the device).

    Returns (slot_ids, copy_experts, copy_slots, num_copies): slot per routed position (-1 for
    misses left to the CPU), and the copy plan that `copy_experts` executes. With `stats` (int64,
    >= 4 counters) the call adds (1, routed ids, distinct ids, admitted misses) to its first four.
    `policy`: the eviction policy (ft_ops.policies: 0 lru, 1 opportunity, 2 hitdensity, 3 duel;
    all but lru need a pool whose clock started at 1, as SlotPool starts it for them, hitdensity
    and duel their `policy_state`, SlotPool.policy_state; duel also its `shadows`,
    ft_ops.shadow_caches.ShadowCaches.tensors, which replay the call after it: on CUDA in the
    same launch).
    `cpu_expert_cost` > 0 (with fetch_fraction 1): the misses admitted are chosen per call to
    balance the link against the CPU share, whose cost is cpu_call_cost + n * cpu_expert_cost in
    units of one expert's copy over the link (ft_ops/rates.py measures them).
    """
    return _ops.dedup_and_admit.default(
        slot_of, owner_of, last_use, clock, layer, expert_ids, fetch_fraction, protect_lo, protect_hi,
        stats, policy, cpu_expert_cost, cpu_call_cost, policy_state, None if shadows is None else list(shadows),
    )


@torch.library.register_fake("freetoken::dedup_and_admit")
@_refuse_meta_mixed_with_real
def _dedup_and_admit_fake(slot_of, owner_of, last_use, clock, layer, expert_ids, fetch_fraction,
                          protect_lo, protect_hi, stats=None, policy=0, cpu_expert_cost=0.0, cpu_call_cost=0.0,
                          policy_state=None, shadows=None):
    plan_len = torch.sym_min(expert_ids.numel(), slot_of.shape[1])
    return (
        expert_ids.new_empty(expert_ids.shape, dtype=torch.int32),
        slot_of.new_empty((plan_len,)),
        slot_of.new_empty((plan_len,)),
        slot_of.new_empty((1,)),
    )


# --- copy_experts ----------------------------------------------------------------------------
def copy_experts(
    banks: Sequence[Tensor],
    host_rows: Sequence[Tensor],
    copy_experts: Tensor,
    copy_slots: Tensor,
    num_copies: Tensor,
) -> None:
    """banks[j][copy_slots[i]] = host_rows[j][copy_experts[i]] for i < num_copies (on the device)."""
    _ops.copy_experts.default(list(banks), list(host_rows), copy_experts, copy_slots, num_copies)


@torch.library.register_fake("freetoken::copy_experts")
@_refuse_meta_mixed_with_real
def _copy_experts_fake(banks, host_rows, copy_experts, copy_slots, num_copies):
    return None


# --- async_layer_copy ------------------------------------------------------------------------
def async_layer_copy(
    slot_of: Tensor,
    owner_of: Tensor,
    last_use: Tensor,
    clock: Tensor,
    banks: Sequence[Tensor],
    host_rows: Sequence[Tensor],
    layer: int,
    first_slot: int,
    skip_resident: bool = True,
    reclaim_lo: int = 0,
    reclaim_hi: int = 0,
    policy: int = 0,
    row_sources: Optional[Tensor] = None,
) -> Tensor:
    """Puts the row of every expert e of `layer` in slot first_slot + e, for a prefill.

    Without skip_resident every row comes from the host and the layer is registered in the region.
    With it, a row resident elsewhere in the pool is copied from there (device to device) and the
    expert stays registered where it was, except inside [reclaim_lo, reclaim_hi) (the other
    prefill region), from where it moves into the region. `row_sources` (CPU int32 [E], slots or
    -1 for the host) says where the CUDA copy engine takes each row; a row whose source the maps
    contradict is read again from the host, so it decides speed, never contents. Runs on the
    current stream; returns the rows read from the host pool (int64 scalar on the device).
    `policy` (ft_ops.policies) decides the stamps of streamed and kept rows.
    """
    return _ops.async_layer_copy.default(
        slot_of, owner_of, last_use, clock, list(banks), list(host_rows), layer, first_slot,
        skip_resident, reclaim_lo, reclaim_hi, policy, row_sources,
    )


@torch.library.register_fake("freetoken::async_layer_copy")
@_refuse_meta_mixed_with_real
def _async_layer_copy_fake(slot_of, owner_of, last_use, clock, banks, host_rows, layer, first_slot,
                           skip_resident, reclaim_lo=0, reclaim_hi=0, policy=0, row_sources=None):
    return slot_of.new_empty((), dtype=torch.int64)


# --- expert_gemm -----------------------------------------------------------------------------
def expert_gemm(
    hidden: Tensor,
    slot_ids: Tensor,
    weights: Tensor,
    w13: Tensor,
    w2: Tensor,
    b13: Optional[Tensor] = None,
    b2: Optional[Tensor] = None,
    activation: Union[Activation, str] = SILU,
    w13_scale: Optional[Tensor] = None,
    w2_scale: Optional[Tensor] = None,
    slot_map: Optional[Tensor] = None,
) -> Tensor:
    """sum_k weights[t,k] * (w2[s] @ act(w13[s] @ hidden[t] + b13[s]) + b2[s]), s = slot_ids[t,k].

    `activation` is an ft_ops.activations.Activation (a kind and its parameters) or the name of a
    preset ("silu", "gelu_tanh", "gelu", "swigluoai", "relu2"); an ungated one (activation.gated
    False, e.g. "relu2") takes w13 [S, I, H], the up rows alone, as its gate and up. With
    w13_scale and w2_scale, w13 and w2 are FP8 (float8_e4m3fn with 128 x 128 scale_inv blocks,
    or with one float32 scale a row: w13_scale [S, 2I], w2_scale [S, H]), MXFP4 (uint8, two e2m1
    values a byte, uint8 e8m0 scales per 32 values) or int4 (uint8, two 4-bit codes a byte, value
    code - 8, float32 scales per group of G values: w13_scale [S, 2I, H/G]; ft_ops/formats.py). Pairs whose slot is -1 contribute nothing. Output has hidden's shape and
    dtype.

    With `slot_map` (int32/int64 [E], a layer's experts: the slot of each, -1 for one not in the
    bank), slot_ids hold expert ids and s = slot_map[slot_ids[t,k]] (ids outside [0, E) contribute
    nothing). On CUDA a prompt-sized call (grouped_gemm_min_tokens tokens or more, bf16) on a
    quantized bank then dequantizes the map's experts into a scratch bank, a window of at most
    LIMITS["dequantize_window_bytes"] at a time, and runs the grouped tensor-core GEMM on them.
    """
    act = as_activation(activation)
    return _ops.expert_gemm.default(hidden, slot_ids, weights, w13, w2, b13, b2, *act.op_args(), w13_scale,
                                    w2_scale, act.limit_after_act, act.gated, slot_map)


@torch.library.register_fake("freetoken::expert_gemm")
@_refuse_meta_mixed_with_real
def _expert_gemm_fake(hidden, slot_ids, weights, w13, w2, b13, b2, activation, alpha=1.0, limit=0.0,
                      up_offset=0.0, gate_softcap=0.0, up_softcap=0.0, w13_scale=None, w2_scale=None,
                      limit_after_act=False, gated=True, slot_map=None):
    return hidden.new_empty(hidden.shape)


# --- dequantize_experts ----------------------------------------------------------------------
def dequantize_experts(weight: Tensor, scale: Tensor, slots: Tensor, parts: int = 1,
                       dtype: torch.dtype = torch.bfloat16) -> Tensor:
    """out[i] = weight[slots[i]] dequantized as `dtype`: FP8 (e4m3 with 128 x 128 scale_inv blocks,
    `parts` the projections per row, blocked on their own, w13: 2, w2: 1; or with scale [S, R], one
    a row), MXFP4 (uint8, two e2m1 values a byte, e8m0 scales per 32 values) or int4 (uint8, two
    codes a byte, float32 scales per group of G values): the 4-bit formats' out has twice the
    columns. Rows whose slot is -1 are left unwritten."""
    return _ops.dequantize_experts.default(weight, scale, slots, parts, dtype)


@torch.library.register_fake("freetoken::dequantize_experts")
@_refuse_meta_mixed_with_real
def _dequantize_experts_fake(weight, scale, slots, parts, dtype):
    cols = weight.shape[2] * (2 if weight.dtype == torch.uint8 else 1)  # MXFP4, int4: two values a byte
    return weight.new_empty((slots.shape[0], weight.shape[1], cols), dtype=dtype)


# --- cpu_share_submit / cpu_share_join ---------------------------------------------------------
def cpu_share_submit(session: int, layer: int, hidden: Tensor, slot_ids: Tensor, expert_ids: Tensor,
                     weights: Tensor, seq: Tensor, stats: Optional[Tensor] = None) -> Tensor:
    """Posts a call's CPU share to the session's worker (ft_ops/cpu_share.py): the pairs the
    admission left at slot -1 (slot_ids int32 [T, K]), their experts (expert_ids [T, K]) of `layer`
    of the host pool computed on hidden [T, H] with their weights. Returns the job's ticket (int64
    [1], 0 when no pair is on the CPU); increments `seq` when it posts; adds the call's CPU pairs and
    distinct CPU experts to columns 4 and 5 of `stats` (the layer's admit counters). No host sync
    on CUDA."""
    return _ops.cpu_share_submit.default(session, layer, hidden, slot_ids, expert_ids, weights, seq, stats)


@torch.library.register_fake("freetoken::cpu_share_submit")
@_refuse_meta_mixed_with_real
def _cpu_share_submit_fake(session, layer, hidden, slot_ids, expert_ids, weights, seq, stats=None):
    return seq.new_empty((1,))


def cpu_share_join(session: int, out: Tensor, ticket: Tensor) -> Tensor:
    """out + the result of the job `ticket` (waits for the worker on the device; 0: out as it is)."""
    return _ops.cpu_share_join.default(session, out, ticket)


@torch.library.register_fake("freetoken::cpu_share_join")
@_refuse_meta_mixed_with_real
def _cpu_share_join_fake(session, out, ticket):
    return out.new_empty(out.shape)


# --- no gradients ------------------------------------------------------------------------------
# The ops compute inference only (the experts are the pools' buffers, not parameters). Without an
# autograd formula torch's fallback backpropagated through them as if they were not there, silently
# wrong (or failing in an unrelated index op). Their backward is refuse_gradient: an op that raises
# when it runs, so an eager backward fails at once with a message, and a model compiled in grad mode
# still compiles (its traced backward holds the op) and runs its forward. It is marked as having a
# side effect, so a compiled backward keeps it even where nothing reads its output (a backward that
# wants only the routing weights' gradient). Defined here, not in src/registration.cpp: it is the
# autograd registration's, in Python like that registration.
_NO_GRADIENT = ("{op} has no gradient: offloaded experts are for inference (run the model under "
                "torch.no_grad() or torch.inference_mode()); take gradients on the model before offload_experts")


@torch.library.custom_op("freetoken::refuse_gradient", mutates_args=())
def _refuse_gradient(grad: Tensor, op: str) -> Tensor:
    raise RuntimeError(_NO_GRADIENT.format(op=op))


@_refuse_gradient.register_fake
def _refuse_gradient_fake(grad, op):
    return torch.empty_like(grad)


torch.fx.node.has_side_effect(torch.ops.freetoken.refuse_gradient.default)


def _refusing_backward(op: str, carried: int):
    """The backward of freetoken::{op}: refuse_gradient of the output's gradient as the gradient of
    input `carried` (the tensor the output carries on: expert_gemm's hidden, cpu_share_join's out),
    None for the other inputs (refuse_gradient raises before any gradient is used)."""
    def backward(ctx, grad, *rest):
        grads = [None] * ctx.inputs
        grads[carried] = _refuse_gradient(grad, f"freetoken::{op}")
        return tuple(grads)

    def setup_context(ctx, inputs, output):
        ctx.inputs = len(inputs)

    torch.library.register_autograd(f"freetoken::{op}", backward, setup_context=setup_context)


_refusing_backward("expert_gemm", 0)
_refusing_backward("cpu_share_join", 1)  # (session, out, ticket)


__all__: List[str] = [
    "cpu_share_submit",
    "cpu_share_join",
    "slot_lookup",
    "dedup_and_admit",
    "copy_experts",
    "async_layer_copy",
    "expert_gemm",
    "dequantize_experts",
]
