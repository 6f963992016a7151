"""Pure-torch reference of every freetoken op: the oracle the tests compare the kernels against.

Written for clarity, not speed: state is read into Python values, updated step by step as the
contract in docs/ops.md says, and written back in place, so a reference call mutates its inputs
exactly like the op. Works on any device.
"""
import math
from typing import List, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor

from ..policies import (DUEL, DUEL_REPLAYS, DUEL_WORDS, HIT_DENSITY, LRU, STREAMED, duel_count_replay,
                        duel_next, hit_density_after_use, keeps_hit_density, pack_estimates, streams_stamped, unpack_estimates,
                        victim_key)
from ..activations import Activation, as_activation


def slot_lookup(slot_of: Tensor, layer: int, expert_ids: Tensor) -> Tensor:
    return slot_of[layer][expert_ids.long()].to(torch.int32)


def recopy_share(stats: Optional[Tensor], compulsory: float) -> float:
    """The later copies one expert left to the CPU costs: the layer's hits per miss so far (from
    its counters: distinct, admitted, cpu_experts), its first `compulsory` misses (slots / layers:
    they fill the cache) not counted, at most 1; 1 while it has missed no more than those, 0
    without counters."""
    if stats is None or stats.numel() < 6:
        return 0.0
    distinct, admitted, cpu_experts = (int(stats[i]) for i in (2, 3, 5))
    misses = admitted + cpu_experts
    counted = misses - compulsory
    if counted <= 0.0:
        return 1.0
    hits = distinct - misses
    return 0.0 if hits <= 0 else min(1.0, hits / counted)


def admitted_count(misses: int, fetch_fraction: float, cpu_expert_cost: float = 0.0,
                   cpu_call_cost: float = 0.0, recopy: float = 0.0) -> int:
    """F = floor(m * fetch_fraction + 0.5), clamped to [0, m]; with cpu_expert_cost > 0, the F of
    least max(F, cpu_call_cost + (m - F) * cpu_expert_cost) + (m - F) * recopy (both CPU terms 0
    when F = m), ties to the larger F, by trying every F."""
    if cpu_expert_cost <= 0.0:
        return max(0, min(misses, math.floor(misses * fetch_fraction + 0.5)))

    def cost(n: int) -> float:
        left = misses - n
        if not left:
            return float(n)
        return max(float(n), cpu_call_cost + left * cpu_expert_cost) + left * recopy
    return min(range(misses, -1, -1), key=cost)  # the first minimum from the top


def cpu_share(hidden: Tensor, slot_ids: Tensor, expert_ids: Tensor, weights: Tensor, out: Tensor, w13: Tensor,
              w2: Tensor, b13: Optional[Tensor] = None, b2: Optional[Tensor] = None,
              activation: Union[Activation, str] = "silu", w13_scale: Optional[Tensor] = None,
              w2_scale: Optional[Tensor] = None) -> Tensor:
    """What cpu_share_submit + cpu_share_join compute, in float64: out + expert_gemm of the pairs
    whose slot is -1 over one layer's banks (expert ids as slots)."""
    cpu_ids = torch.where(slot_ids.cpu() < 0, expert_ids.cpu().to(torch.int32), -1)
    extra = expert_gemm(hidden.cpu(), cpu_ids, weights.cpu().float(), w13, w2, b13, b2, activation, w13_scale=w13_scale,
                        w2_scale=w2_scale)
    return out.cpu().double() + extra.double()


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
    policy: int = LRU,
    cpu_expert_cost: float = 0.0,
    cpu_call_cost: float = 0.0,
    policy_state: Optional[Tensor] = None,
    shadows: Optional[Sequence[Tensor]] = None,
) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    replayed = shadows is not None and expert_ids.numel() > 0
    out = _admit(slot_of, owner_of, last_use, clock, layer, expert_ids, fetch_fraction, protect_lo, protect_hi, stats,
                 policy, cpu_expert_cost, cpu_call_cost, policy_state)
    if replayed:  # DUEL: the shadows replay the call after it, each counting it in the pool's words
        words = policy_state[-DUEL_WORDS:]
        words[DUEL_REPLAYS] += 1
        for shadow, (maps, kind, state) in enumerate(((shadows[:4], LRU, None), (shadows[4:8], HIT_DENSITY, shadows[8]))):
            calls = torch.zeros(4, dtype=torch.int64)
            _admit(*maps, layer, expert_ids, stats=calls, policy=kind, policy_state=state)
            duel_count_replay(words, shadow, *calls[1:].tolist())
    return out


def _admit(slot_of, owner_of, last_use, clock, layer, expert_ids, fetch_fraction=1.0, protect_lo=0, protect_hi=0,
           stats=None, policy=LRU, cpu_expert_cost=0.0, cpu_call_cost=0.0, policy_state=None):
    num_experts = slot_of.shape[1]
    layers = slot_of.shape[0]
    ids = expert_ids.reshape(-1).tolist()
    clock += 1
    now = int(clock.item())
    pairs = layers * num_experts
    lru_keys = False  # DUEL: this call takes LRU's keys
    if policy == DUEL:
        words, lru_keys = duel_next(policy_state[-DUEL_WORDS:].tolist())
        policy_state[-DUEL_WORDS:] = torch.tensor(words, dtype=torch.int64)

    def used(e: int, s: int) -> None:  # HIT_DENSITY, DUEL: a decode use of (layer, e) in slot s
        if not keeps_hit_density(policy):
            return
        p = layer * num_experts + e
        b, d = hit_density_after_use(*unpack_estimates(int(policy_state[pairs + p])), int(policy_state[p]), now, layers)
        policy_state[p] = now
        policy_state[pairs + p] = policy_state[2 * pairs + s] = pack_estimates(b, d)

    counts = {}
    for e in ids:
        counts[e] = counts.get(e, 0) + 1
    misses = []
    for e in sorted(counts):
        s = int(slot_of[layer, e])
        if s >= 0:
            last_use[s] = now
            used(e, s)
        else:
            misses.append(e)
    # Most-routed misses are admitted first; ties go to the lower expert id.
    misses.sort(key=lambda e: (-counts[e], e))
    compulsory = owner_of.shape[0] / layers  # the layer's share of the pool
    recopy = recopy_share(stats, compulsory) if cpu_expert_cost > 0.0 else 0.0
    wanted = admitted_count(len(misses), fetch_fraction, cpu_expert_cost, cpu_call_cost, recopy)

    stamps = last_use.tolist()
    candidates = [
        s for s in range(owner_of.shape[0])
        if stamps[s] < now and not (protect_lo <= s < protect_hi)
    ]
    def key(s: int) -> int:
        if lru_keys:
            return victim_key(stamps[s], now, layers, LRU)
        if keeps_hit_density(policy):
            return victim_key(stamps[s], now, layers, HIT_DENSITY,
                              unpack_estimates(int(policy_state[2 * pairs + s])))
        return victim_key(stamps[s], now, layers, policy)
    victims = sorted(candidates, key=lambda s: (key(s), s))[:wanted]

    plan_len = min(len(ids), num_experts)
    copy_experts = torch.full((plan_len,), -1, dtype=torch.int32, device=slot_of.device)
    copy_slots = torch.full((plan_len,), -1, dtype=torch.int32, device=slot_of.device)
    for i, (e, v) in enumerate(zip(misses, victims)):
        old = int(owner_of[v])
        if old >= 0:
            slot_of[old // num_experts, old % num_experts] = -1
        owner_of[v] = layer * num_experts + e
        slot_of[layer, e] = v
        last_use[v] = now
        used(e, v)
        copy_experts[i] = e
        copy_slots[i] = v
    num_copies = torch.tensor([len(victims)], dtype=torch.int32, device=slot_of.device)
    slot_ids = slot_of[layer][expert_ids.long()].to(torch.int32)
    if stats is not None:
        stats[:4] += torch.tensor([1, len(ids), len(counts), len(victims)], device=stats.device)
    return slot_ids, copy_experts, copy_slots, num_copies


def copy_experts(
    banks: Sequence[Tensor],
    host_rows: Sequence[Tensor],
    copy_experts: Tensor,
    copy_slots: Tensor,
    num_copies: Tensor,
) -> None:
    for i in range(int(num_copies[0])):
        e, s = int(copy_experts[i]), int(copy_slots[i])
        if e < 0 or s < 0:  # skipped, as the kernels do
            continue
        for bank, host in zip(banks, host_rows):
            bank[s].copy_(host[e])


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
    policy: int = LRU,
    row_sources: Optional[Tensor] = None,
) -> Tensor:
    """Under OPPORTUNITY and HIT_DENSITY, streamed rows are stamped STREAMED and resident rows keep their stamps, so
    a prompt does not make its layers look recently used to decode. Returns the rows read from the
    host pool (int64 scalar on slot_of's device)."""
    num_experts = slot_of.shape[1]
    if row_sources is not None and not skip_resident:
        raise ValueError("row_sources says where resident rows come from: it needs skip_resident")
    clock += 1
    now = int(clock.item())
    streamed_stamp = STREAMED if streams_stamped(policy) else now
    base = layer * num_experts
    # The region's previous owners lose their slots, except an expert already in its own slot
    # (with skip_resident).
    for e in range(num_experts):
        s = first_slot + e
        old = int(owner_of[s])
        if old < 0 or (skip_resident and old == base + e):
            continue
        slot_of[old // num_experts, old % num_experts] = -1
        owner_of[s] = -1
        last_use[s] = 0
    from_host = 0
    for e in range(num_experts):
        cur = int(slot_of[layer, e])
        target = first_slot + e
        # Where the row comes from: the host, a slot of the pool, or nowhere (already in place).
        source = "host"
        if skip_resident and cur >= 0:
            source = None if cur == target else cur
        if skip_resident and row_sources is not None:
            hint = int(row_sources[e])
            if hint == -1 or hint != cur:
                source = "host"  # moved from the host, or a hint the maps contradict: re-read
        if source == "host":
            from_host += 1
            for bank, host in zip(banks, host_rows):
                bank[target].copy_(host[e])
        elif source is not None:
            for bank in banks:
                bank[target].copy_(bank[source])
        # A copy inside the reclaim range (about to be overwritten) does not count as resident.
        reclaimed = reclaim_lo <= cur < reclaim_hi and cur != target
        if skip_resident and cur >= 0 and not reclaimed:
            if policy == LRU:
                last_use[cur] = now
            continue
        if cur >= 0:
            owner_of[cur] = -1
            last_use[cur] = 0
        slot_of[layer, e] = target
        owner_of[target] = base + e
        last_use[target] = streamed_stamp
    return torch.tensor(from_host, dtype=torch.int64, device=slot_of.device)


def activation_fn(gate: Tensor, up: Tensor, activation: Union[Activation, str]) -> Tensor:
    """act(gate, up) of ft_ops.activations, written out step by step in the inputs' dtype."""
    act = as_activation(activation)
    if act.limit > 0:
        if not act.limit_after_act:
            gate = gate.clamp(max=act.limit)
        up = up.clamp(min=-act.limit, max=act.limit)
    if act.up_softcap > 0:
        up = act.up_softcap * torch.tanh(up / act.up_softcap)
    up = up + act.up_offset
    if act.kind == "silu":
        phi = torch.sigmoid(act.alpha * gate)
    elif act.kind == "gelu_tanh":
        phi = 0.5 * (1 + torch.tanh(math.sqrt(2 / math.pi) * (gate + 0.044715 * gate ** 3)))
    elif act.kind == "gelu":
        phi = 0.5 * (1 + torch.erf(gate / math.sqrt(2)))
    else:  # relu
        phi = (gate > 0).to(gate.dtype)
    lin = act.gate_softcap * torch.tanh(gate / act.gate_softcap) if act.gate_softcap > 0 else gate
    activated = lin * phi
    if act.limit_after_act:
        activated = activated.clamp(max=act.limit)
    return activated * up


def expert_gemm(
    hidden: Tensor,
    slot_ids: Tensor,
    weights: Tensor,
    w13: Tensor,
    w2: Tensor,
    b13: Optional[Tensor] = None,
    b2: Optional[Tensor] = None,
    activation: Union[Activation, str] = "silu",
    compute_dtype: torch.dtype = torch.float64,
    w13_scale: Optional[Tensor] = None,
    w2_scale: Optional[Tensor] = None,
) -> Tensor:
    """The expert FFN sum, computed per routed pair in `compute_dtype` (float64 for the oracle).
    Quantized weights (FP8, MXFP4 or int4, with their scales) are dequantized to `compute_dtype` first.
    An ungated activation takes w13's rows (the up projection alone) as both gate and up."""
    gated = as_activation(activation).gated
    if w13_scale is not None:
        w13 = _dequantized(w13, w13_scale, 2 if gated else 1, compute_dtype)
        w2 = _dequantized(w2, w2_scale, 1, compute_dtype)
    inter = w13.shape[1] // 2 if gated else w13.shape[1]
    out = torch.zeros(hidden.shape, dtype=compute_dtype, device=hidden.device)
    for t in range(hidden.shape[0]):
        x = hidden[t].to(compute_dtype)
        for k in range(slot_ids.shape[1]):
            s = int(slot_ids[t, k])
            if s < 0:
                continue
            h = w13[s].to(compute_dtype) @ x
            if b13 is not None:
                h = h + b13[s].to(compute_dtype)
            a = activation_fn(h[:inter], h[inter:] if gated else h, activation)
            y = w2[s].to(compute_dtype) @ a
            if b2 is not None:
                y = y + b2[s].to(compute_dtype)
            out[t] += weights[t, k].to(compute_dtype) * y
    return out


def dequantize_experts(weight: Tensor, scale: Tensor, slots: Tensor, parts: int = 1,
                       dtype: torch.dtype = torch.bfloat16) -> Tensor:
    """Rows of slot -1 are zeros here (the op leaves them unwritten: compare the others)."""
    cols = weight.shape[2] * (2 if weight.dtype == torch.uint8 else 1)
    out = torch.zeros((slots.shape[0], weight.shape[1], cols), dtype=dtype, device=weight.device)
    for i, s in enumerate(slots.tolist()):
        if s >= 0:
            out[i] = _dequantized(weight[s], scale[s], parts, torch.float32).to(dtype)
    return out


def _dequantized(weight: Tensor, scale: Tensor, parts: int, dtype: torch.dtype) -> Tensor:
    """FP8 (float8_e4m3fn), MXFP4 (uint8 with uint8 scales) or int4 (uint8 with float32 scales) weights
    as `dtype`."""
    from ..formats import dequantize_fp8, dequantize_int4, dequantize_mxfp4
    if weight.dtype == torch.uint8 and scale.dtype == torch.float32:
        return dequantize_int4(weight, scale, dtype)
    if weight.dtype == torch.uint8:
        return dequantize_mxfp4(weight, scale, dtype)
    return dequantize_fp8(weight, scale, parts, dtype)


def check_pool_invariants(slot_of: Tensor, owner_of: Tensor) -> List[str]:
    """Violations of the bijection slot_of[l, e] == s  <=>  owner_of[s] == l*E + e (empty if none)."""
    num_experts = slot_of.shape[1]
    problems = []
    flat = slot_of.reshape(-1).tolist()
    owners = owner_of.tolist()
    for fid, s in enumerate(flat):
        if s >= 0 and owners[s] != fid:
            problems.append(f"slot_of[{fid // num_experts}, {fid % num_experts}] = {s} but owner_of[{s}] = {owners[s]}")
    for s, fid in enumerate(owners):
        if fid >= 0 and flat[fid] != s:
            problems.append(f"owner_of[{s}] = {fid} but slot_of[{fid // num_experts}, {fid % num_experts}] = {flat[fid]}")
    return problems
