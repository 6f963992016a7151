"""ExpertAdmitter, the strategy for decode and short calls: admit only the routed experts on the
device (dedup_and_admit), copy the missing rows (copy_experts), compute on the GPU (expert_gemm,
ft_ops/expert_compute.py).
Misses the admission left at -1 (fetch_fraction < 1, or a pool with fewer free victims than
misses) are computed by the CPU share's worker from the host pool (ft_ops/cpu_share.py) while the
device works, and added on the device."""
import numbers
from typing import Optional, Sequence, Union

import torch

from . import ops
from .activations import Activation, per_layer
from .expert_compute import dequantizes_layer, gemm_on_layer, gemm_on_slots
from .cpu_share import DEFAULT_TOKENS, CpuShare
from .rates import CpuSplit, measure_cpu_split
from .slot_pool import HostPool, SlotPool
from .stats import CPU_EXPERTS, CPU_PAIRS, Stats


def count_distinct(expert_ids: torch.Tensor, experts: int) -> torch.Tensor:
    """Number of distinct routed experts, on the device and without a host sync."""
    seen = torch.zeros(experts, dtype=torch.int64, device=expert_ids.device)
    seen.scatter_(0, expert_ids.reshape(-1).long(), 1)
    return seen.sum()


def check_fetch_fraction(fetch_fraction) -> None:
    """Refuses a fetch_fraction that is not a share of the misses in [0, 1] or "auto"."""
    number = isinstance(fetch_fraction, numbers.Real) and not isinstance(fetch_fraction, bool)
    auto = isinstance(fetch_fraction, str) and fetch_fraction == "auto"  # an array compares elementwise
    if not (auto or (number and 0.0 <= fetch_fraction <= 1.0)):
        raise ValueError(f"fetch_fraction must be a share of the misses in [0, 1] or 'auto', got {fetch_fraction!r}")


class ExpertAdmitter:
    def __init__(self, pool: SlotPool, host: HostPool, activation: Union[Activation, Sequence[Activation]],
                 fetch_fraction: Union[float, str] = 1.0, stats: Optional[Stats] = None,
                 top_k: Optional[int] = None, cpu_share_tokens: int = DEFAULT_TOKENS):
        check_fetch_fraction(fetch_fraction)
        auto = fetch_fraction == "auto"
        if auto and top_k is None:
            raise ValueError("fetch_fraction='auto' needs the experts routed per token (top_k) to measure the split")
        if auto and stats is None:
            raise ValueError("fetch_fraction='auto' weighs each layer's hits per miss from its admission counters: "
                             "pass stats (OffloadRuntime keeps them with collect_stats=True)")
        self.pool, self.host = pool, host
        self.activations = per_layer(activation, host.shape.layers)
        self.fetch_fraction = 1.0 if auto else float(fetch_fraction)
        self.stats = stats
        self.cpu_share: Optional[CpuShare] = None
        self.cpu_share_tokens = cpu_share_tokens
        # fetch_fraction="auto": each call's misses divide between the link and the CPU share by
        # this machine's measured costs (src/common/admitted_count.h), so a call with few misses
        # fetches them all and one with many gives the CPU its share.
        self.split: Optional[CpuSplit] = None
        # A pool of fewer slots than a layer's experts may run out of victims (may_leave_misses) and
        # leave a call's misses to the CPU share as well.
        if (self.fetch_fraction < 1.0 or auto or pool.slots < pool.shape.experts) and top_k is not None:
            self._cpu_share(top_k)  # the worker starts now, outside any graph (or a compiled forward)
        if auto:
            self.split = measure_cpu_split(pool, host, self.cpu_share, top_k)
        if pool.device.type == "cuda":
            host.device_layer_rows(0, pool.device)  # builds every layer's mapped views, in eager mode

    def splits(self, routed: int) -> bool:
        """Whether the measured split (fetch_fraction="auto") decides this call: decode-sized calls
        only (fewer routed ids than experts). Its CPU costs are those of one-token calls; a
        prompt-sized call's CPU share would be compute-bound and far slower, so it fetches."""
        return self.split is not None and routed < self.pool.shape.experts

    def may_leave_misses(self, routed: int) -> bool:
        """Whether an admission of `routed` ids can leave a pair at -1: only when fetching a
        fraction or splitting, or when the pool could run out of victims (known on the host, no
        sync)."""
        unique_bound = min(routed, self.pool.shape.experts)
        return self.fetch_fraction < 1.0 or self.splits(routed) or self.pool.slots < unique_bound

    def __call__(self, layer: int, hidden: torch.Tensor, top_k_index: torch.Tensor,
                 top_k_weights: torch.Tensor) -> torch.Tensor:
        pool = self.pool
        routed = top_k_index.numel()
        # The admission kernel adds the call's calls, routed, distinct and copied counters itself,
        # so counting costs no launch.
        decode = routed < pool.shape.experts  # decode-sized: the split's own counters (ft_ops/stats.py)
        counters = self.stats.admission_counters(layer, decode) if self.stats is not None else None
        costs = (self.split.cpu_expert_cost, self.split.cpu_call_cost) if self.splits(routed) else (0.0, 0.0)
        # Under Duel its shadow caches replay the call in the same launch.
        slot_ids, plan_e, plan_s, num = ops.dedup_and_admit(
            *pool.state, layer, top_k_index, self.fetch_fraction, 0, 0, counters, pool.policy, *costs,
            pool.policy_state, pool.shadows_of_call(top_k_index))
        pool.after_admission(top_k_index)
        # Misses left to the CPU go to the worker now: it computes them while the device copies and
        # computes the rest; the join waits for it on the device (no host sync, graph-capturable).
        # A call longer than the mailbox goes in mailbox-sized chunks, one after the other.
        share = self._cpu_share(top_k_index.shape[-1]) if self.may_leave_misses(routed) else None
        chunk = share.tokens if share is not None else 0
        posted = _as_wide_as(share, slot_ids, top_k_index, top_k_weights) if share is not None else None
        # A call longer than the mailbox posts chunks, and an expert of several chunks would be
        # counted once a chunk: such calls count their CPU pairs and experts here instead, once.
        chunked = share is not None and hidden.shape[0] > chunk
        submit_counters = None if chunked else counters
        if chunked and counters is not None:
            self._count_cpu_share(counters, slot_ids, top_k_index)
        first_ticket = None
        if share is not None:
            first_ticket = share.submit(layer, hidden[:chunk], *(t[:chunk] for t in posted), submit_counters)
        host_rows = (self.host.device_layer_rows(layer, pool.device) if pool.device.type == "cuda"
                     else self.host.layer_rows(layer))
        ops.copy_experts(pool.banks, host_rows, plan_e, plan_s, num)
        if dequantizes_layer(pool, hidden.shape[0]):
            expert_ids = torch.where(slot_ids >= 0, top_k_index.to(slot_ids.dtype), -1)
            out = gemm_on_layer(pool, pool.slot_of[layer], hidden, expert_ids, top_k_weights, self.activations[layer])
        else:
            out = gemm_on_slots(pool, hidden, slot_ids, top_k_weights, self.activations[layer])
        if share is None:
            return out
        parts = [share.join(out[:chunk], first_ticket)]
        for start in range(chunk, hidden.shape[0], chunk):
            end = start + chunk
            ticket = share.submit(layer, hidden[start:end], *(t[start:end] for t in posted), submit_counters)
            parts.append(share.join(out[start:end], ticket))
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def _count_cpu_share(self, counters: torch.Tensor, slot_ids: torch.Tensor, top_k_index: torch.Tensor) -> None:
        """Adds a call's pairs left to the CPU and their distinct experts to its counters, as
        cpu_share_submit does for a call of one chunk (device ops, no host sync)."""
        experts = self.pool.shape.experts
        ids = top_k_index.long()
        left = (slot_ids < 0) & (ids >= 0) & (ids < experts)
        routed = torch.zeros(experts + 1, dtype=torch.int64, device=ids.device)
        routed.scatter_add_(0, torch.where(left, ids, experts).reshape(-1), torch.ones_like(ids).reshape(-1))
        counters[CPU_PAIRS] += left.sum()
        counters[CPU_EXPERTS] += (routed[:experts] > 0).sum()

    def _cpu_share(self, top_k: int) -> CpuShare:
        if self.cpu_share is not None:
            if top_k > self.cpu_share.top_k:  # fewer are posted padded (_as_wide_as)
                # A captured graph may hold the session: it is never replaced.
                raise ValueError(f"a call routes {top_k} experts per token, but the CPU share was started for "
                                 f"{self.cpu_share.top_k}; build the runtime with top_k={top_k}")
            return self.cpu_share
        if torch.compiler.is_compiling():
            raise RuntimeError("the CPU share's worker must start before compiling: run one eager call, or build "
                               "the runtime with top_k (the plugin passes it)")
        with torch.inference_mode(False):  # its mailbox and counter are updated by calls in and out of it
            self.cpu_share = CpuShare(self.host, self.activations, top_k, self.pool.device, self.cpu_share_tokens)
        return self.cpu_share


def _as_wide_as(share: CpuShare, slot_ids: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
    """A call's slots, ids and weights as the CPU share's worker takes them: top_k columns. A call
    of fewer experts a row than the worker was started for (Llama 4 and the other families that
    hand their experts one route a row, where the runtime's top_k is the config's) is padded with
    slot 0, which the worker takes as computed on the device, so the padding posts nothing."""
    pad = share.top_k - top_k_index.shape[-1]
    if pad == 0:
        return slot_ids, top_k_index, top_k_weights
    pad_ = torch.nn.functional.pad
    return pad_(slot_ids, (0, pad), value=0), pad_(top_k_index, (0, pad), value=0), pad_(top_k_weights, (0, pad), value=0.0)
