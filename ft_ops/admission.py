"""ExpertAdmitter, the strategy for decode and short calls: admit only the routed experts on the
device (dedup_and_admit), copy the missing rows (copy_experts), compute on the GPU (expert_gemm,
ft_ops/expert_compute.py).
Misses the admission left at -1 (fetch_fraction < 1, or a pool with fewer free victims than
misses) are computed on the CPU from the host pool and added."""
from typing import Optional

import torch

from . import ops
from .activations import Activation
from .expert_compute import dequantizes_layer, gemm_on_layer, gemm_on_slots
from .slot_pool import HostPool, SlotPool
from .stats import Stats


def count_distinct(expert_ids: torch.Tensor, experts: int) -> torch.Tensor:
    """Number of distinct routed experts, on the device and without a host sync."""
    seen = torch.zeros(experts, dtype=torch.int64, device=expert_ids.device)
    seen.scatter_(0, expert_ids.reshape(-1).long(), 1)
    return seen.sum()


class ExpertAdmitter:
    def __init__(self, pool: SlotPool, host: HostPool, activation: Activation, fetch_fraction: float = 1.0,
                 stats: Optional[Stats] = None):
        if not 0.0 <= fetch_fraction <= 1.0:
            raise ValueError(f"fetch_fraction must be in [0, 1], got {fetch_fraction}")
        self.pool, self.host = pool, host
        self.activation = activation
        self.fetch_fraction = fetch_fraction
        self.stats = stats
        if pool.device.type == "cuda":
            host.device_layer_rows(0, pool.device)  # builds every layer's mapped views, in eager mode

    def may_leave_misses(self, routed: int) -> bool:
        """Whether an admission of `routed` ids can leave a pair at -1: only when fetching a
        fraction, or when the pool could run out of victims (known on the host, no sync)."""
        unique_bound = min(routed, self.pool.shape.experts)
        return self.fetch_fraction < 1.0 or self.pool.slots < unique_bound

    def __call__(self, layer: int, hidden: torch.Tensor, top_k_index: torch.Tensor,
                 top_k_weights: torch.Tensor) -> torch.Tensor:
        pool = self.pool
        # The admission kernel adds the call's calls, routed, distinct and copied counters itself,
        # so counting costs no launch.
        counters = self.stats.admission_counters(layer) if self.stats is not None else None
        slot_ids, plan_e, plan_s, num = ops.dedup_and_admit(
            *pool.state, layer, top_k_index, self.fetch_fraction, 0, 0, counters, pool.policy)
        # Misses left to the CPU: their pairs go to the host now, so the CPU computes them while the
        # device copies and computes the rest.
        cpu_share = (self._send_cpu_share(slot_ids, hidden, top_k_index, top_k_weights)
                     if self.may_leave_misses(top_k_index.numel()) else None)
        host_rows = (self.host.device_layer_rows(layer, pool.device) if pool.device.type == "cuda"
                     else self.host.layer_rows(layer))
        ops.copy_experts(pool.banks, host_rows, plan_e, plan_s, num)
        if dequantizes_layer(pool, hidden.shape[0]):
            expert_ids = torch.where(slot_ids >= 0, top_k_index.to(slot_ids.dtype), -1)
            out = gemm_on_layer(pool, pool.slot_of[layer], hidden, expert_ids, top_k_weights, self.activation)
        else:
            out = gemm_on_slots(pool, hidden, slot_ids, top_k_weights, self.activation)
        if cpu_share is not None:
            out = self._add_cpu_misses(layer, out, *cpu_share)
        return out

    @staticmethod
    def _send_cpu_share(slot_ids, hidden, top_k_index, top_k_weights):
        """The pairs the admission left at -1 (expert ids, -1 elsewhere), the hidden states and the
        weights, on their way to the host (queued right after the admission), and an event after
        them (None on the CPU)."""
        cpu_ids = torch.where(slot_ids < 0, top_k_index.to(slot_ids.dtype), torch.full_like(slot_ids, -1))
        if hidden.device.type == "cpu":
            return cpu_ids, hidden, top_k_weights, None
        to_host = [t.to("cpu", non_blocking=True) for t in (cpu_ids, hidden, top_k_weights)]
        arrived = torch.cuda.Event()
        arrived.record(torch.cuda.current_stream(hidden.device))
        return (*to_host, arrived)

    def _add_cpu_misses(self, layer, out, ids_h, hidden_h, weights_h, arrived):
        """Pairs left at -1 are computed by expert_gemm on the host layer (expert ids as slots).
        The CPU must learn which pairs those are: it waits for their copy only, not for the
        device's copies and GEMM queued after it, which run meanwhile."""
        host = self.host
        if arrived is not None:
            arrived.synchronize()
        served = ids_h[ids_h >= 0]
        if served.numel() == 0:
            return out
        if self.stats is not None:
            pairs = torch.tensor(served.numel(), device=out.device)
            experts = torch.tensor(served.unique().numel(), device=out.device)
            self.stats.add_cpu(layer, pairs, experts)
        b13 = host.b13[layer] if host.b13 is not None else None
        b2 = host.b2[layer] if host.b2 is not None else None
        s13 = host.w13_scale[layer] if host.w13_scale is not None else None
        s2 = host.w2_scale[layer] if host.w2_scale is not None else None
        extra = ops.expert_gemm(hidden_h.contiguous(), ids_h.contiguous(), weights_h.contiguous(),
                                host.w13[layer], host.w2[layer], b13, b2, self.activation, s13, s2)
        return out + extra.to(out.device, non_blocking=True)
