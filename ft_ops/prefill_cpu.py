"""PrefillCpuShare: some of a streamed prompt's missing experts are computed on the CPU from the host
pool instead of crossing the link, so a link-bound prompt ends sooner than its experts' bytes take.

A streamed prompt is bound by the link: a layer's missing experts take (missing x one expert's
copy) while the GPU computes the layer in a fraction of that and then waits. The CPU is idle
meanwhile. For each layer the streamer leaves k of the missing experts out of the region's copy
(async_layer_copy's row_sources entry -2); once the layer's routing is known, the hidden rows of
the tokens routed to them go to the host, the CPU runs expert_gemm on them from the pinned host pool
(ATen's GEMMs, AMX where the CPU has it) while the link copies the layer's other experts and the GPU
computes them, and the result is added on the device. Eager streaming only (a prompt's pass is
never compiled); one host sync per layer (the count of the tokens with a CPU pair).

k is chosen per layer when its copy is queued (one layer ahead), from the measured rates: the CPU
must finish before the GPU has computed the layer's other experts, i.e. within the window from the
layer's routing to the end of its GEMM. That window is the layer's shortened copy plus its GEMM less
the GPU's work from the start of the copy to the routing; CUDA events measure it on every layer of
the pass (with or without CPU experts), and the latest measured layer gives the part that does not
depend on the copy: window = fixed + (missing - k) x one expert's copy.
"""
import math
import time
from dataclasses import dataclass
from typing import List, Optional

import torch

from . import ops
from .activations import Activation
from .rates import Rates
from .slot_pool import HostPool

# The share of the CPU's window it is planned to fill: the rest absorbs routing that sends the CPU's
# experts more tokens than the average and the noise of the host's timing.
WINDOW_SHARE = 0.8
# At most this share of a layer's missing experts goes to the CPU.
MAX_SHARE = 0.5


@dataclass
class CpuJob:
    layer: int
    rows: torch.Tensor          # token rows with a CPU pair (on the device)
    hidden: torch.Tensor        # their hidden states (host, pinned on CUDA)
    ids: torch.Tensor           # their expert ids, -1 where the pair is the GPU's (host)
    weights: torch.Tensor       # their routing weights (host)
    copied: Optional[torch.cuda.Event]  # the device-to-host copies above are done


class PrefillCpuShare:
    def __init__(self, host: HostPool, activation: Activation, rates: Rates, device: torch.device,
                 experts: object = "auto"):
        self.host, self.activation, self.rates = host, activation, rates
        self.device = torch.device(device)
        self.mode = experts  # "auto", or a fixed count per layer (tests, benchmarks)
        self.shape = host.shape
        self.tokens = 0  # the pass's prompt length, set when it opens
        self.top_k = 1
        # Measured on the pass (seconds): the latest measured layer's window from its routing to the
        # end of its GEMM, and its part that does not depend on the copy; None until measured.
        self.window_s: Optional[float] = None
        self.fixed_s: Optional[float] = None
        self.cpu_scale = 1.0  # measured CPU time over the rates' prediction (running)
        self._marks = {}  # layer -> [routing event, GEMM end event] (CUDA, auto)
        self._plan = {}  # layer -> (missing experts, left to the CPU)
        self.experts_of = {}  # layer -> the experts this pass leaves to the CPU
        self.cpu_s = 0.0  # the pass's CPU compute (seconds)

    def enabled(self) -> bool:
        return self.mode != 0

    def open_pass(self, tokens: int, top_k: int) -> None:
        self.tokens, self.top_k = tokens, top_k
        self.experts_of = {}
        self._marks, self._plan = {}, {}
        self.window_s = self.fixed_s = None
        self.cpu_s = 0.0

    # --- the choice -------------------------------------------------------------------------
    def _count(self, missing: int) -> int:
        if self.mode != "auto":
            self._read_marks(self.shape.expert_bytes / self.rates.link_bytes_per_s)  # for summary()
            return min(int(self.mode), missing)
        if self.device.type != "cuda" or missing < 2 or self.tokens <= 0:
            return 0  # without a link there is nothing to save
        s, r = self.shape, self.rates
        pairs = self.tokens * self.top_k / s.experts
        flops_pair = 6 * s.hidden * s.intermediate
        cpu_expert = self.cpu_scale * (r.cpu_expert_s + pairs * flops_pair / r.cpu_gemm_flops_per_s)
        link_expert = s.expert_bytes / r.link_bytes_per_s
        # The CPU starts at the layer's routing and must be done when the GPU has computed the
        # layer's other experts: its window is fixed + (missing - k) link_expert (module doc).
        # Before a layer of the pass is measured, fixed is guessed as minus one GEMM (the
        # previous layer's GEMM and this layer's attention before the routing, this layer's
        # GEMM after it).
        self._read_marks(link_expert)
        gemm = self.tokens * self.top_k * flops_pair / r.gemm_flops_per_s
        fixed = self.fixed_s if self.fixed_s is not None else -gemm
        # The CPU's tokens' hidden rows go to the host and their results come back (the link).
        moved = 2 * pairs * s.hidden * s.dtype.itemsize / r.link_bytes_per_s
        # k (cpu_expert + moved) <= WINDOW_SHARE (fixed + (missing - k) link_expert)
        k = WINDOW_SHARE * (fixed + missing * link_expert) / (cpu_expert + moved + WINDOW_SHARE * link_expert)
        return max(0, min(int(math.floor(k)), int(missing * MAX_SHARE)))

    def choose(self, layer: int, missing: List[int]) -> List[int]:
        """The experts of `layer` left to the CPU, among its `missing` ones (those the copy would
        read from the host): the highest ids, so the host runs of the rest stay long."""
        k = self._count(len(missing))
        chosen = sorted(missing)[len(missing) - k:] if k > 0 else []
        self.experts_of[layer] = chosen
        self._plan[layer] = (len(missing), k)
        return chosen

    # --- the compute ------------------------------------------------------------------------
    def submit(self, layer: int, hidden: torch.Tensor, top_k_index: torch.Tensor,
               top_k_weights: torch.Tensor):
        """Sends the rows of the tokens routed to the layer's CPU experts to the host (before the
        layer's region is waited for). Returns (job or None, the GPU's expert ids: -1 at CPU pairs)."""
        chosen = self.experts_of.get(layer)
        self._mark_routing(layer, hidden.device)
        if not chosen:
            return None, top_k_index
        E = self.shape.experts
        on_cuda = hidden.device.type == "cuda"
        mask = torch.zeros(E + 1, dtype=torch.bool)
        mask[torch.tensor(chosen)] = True
        mask = (mask.pin_memory() if on_cuda else mask).to(hidden.device, non_blocking=True)
        ids = top_k_index.long()
        on_cpu = mask[torch.where((ids >= 0) & (ids < E), ids, E)]  # [T, K]
        rows = on_cpu.any(dim=1).nonzero().flatten()  # a host sync: the routing is known here
        gpu_ids = top_k_index.masked_fill(on_cpu, -1)
        if rows.numel() == 0:
            return None, gpu_ids
        cpu_ids = torch.where(on_cpu, ids, -1).index_select(0, rows).to(torch.int32)
        picked = (hidden.index_select(0, rows), cpu_ids, top_k_weights.index_select(0, rows).float())
        copied = None
        if on_cuda:
            host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in picked]
            for h, t in zip(host, picked):
                h.copy_(t, non_blocking=True)
            copied = torch.cuda.Event()
            copied.record()
            picked = host
        return CpuJob(layer, rows, *picked, copied), gpu_ids

    def join(self, job: Optional[CpuJob], out: torch.Tensor) -> torch.Tensor:
        """out + the CPU's part (computed now, on this thread, while the device works)."""
        if job is None:
            return out
        if job.copied is not None:
            job.copied.synchronize()
        h = self.host
        L = job.layer
        start = time.perf_counter()
        part = ops.expert_gemm(job.hidden, job.ids, job.weights, h.w13[L], h.w2[L],
                               None if h.b13 is None else h.b13[L], None if h.b2 is None else h.b2[L],
                               self.activation, None if h.w13_scale is None else h.w13_scale[L],
                               None if h.w2_scale is None else h.w2_scale[L])
        seconds = time.perf_counter() - start
        self.cpu_s += seconds
        self._learn(len(self.experts_of.get(L, ())), int((job.ids >= 0).sum()), seconds)
        if out.device.type == "cuda":
            part = part.pin_memory().to(out.device, non_blocking=True)
        total = out.float().index_add_(0, job.rows, part.float())
        return total.to(out.dtype)

    def _learn(self, experts: int, pairs: int, seconds: float) -> None:
        """The CPU's measured time against the rates' prediction, as a running ratio."""
        if self.mode != "auto" or experts == 0:
            return
        r = self.rates
        predicted = experts * r.cpu_expert_s + pairs * 6 * self.shape.hidden * self.shape.intermediate / r.cpu_gemm_flops_per_s
        if predicted > 0:
            self.cpu_scale = 0.5 * self.cpu_scale + 0.5 * (seconds / predicted)

    def summary(self) -> dict:
        """The last pass's choice and what it was made from (for stats())."""
        chosen = [len(v) for v in self.experts_of.values()]
        ms = lambda s: None if s is None else round(s * 1e3, 3)
        return dict(mode=self.mode, experts_per_layer=round(sum(chosen) / len(chosen), 2) if chosen else 0.0,
                    per_layer=chosen,
                    cpu_ms=round(self.cpu_s * 1e3, 2), window_ms=ms(self.window_s), fixed_ms=ms(self.fixed_s),
                    cpu_over_rates=round(self.cpu_scale, 3),
                    cpu_TFLOPs=round(self.rates.cpu_gemm_flops_per_s / 1e12, 3),
                    cpu_us_per_expert=round(self.rates.cpu_expert_s * 1e6, 1))

    # --- GPU timing on the pass ---------------------------------------------------------------
    def _mark_routing(self, layer: int, device: torch.device) -> None:
        if device.type == "cuda":
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            self._marks[layer] = [e, None]

    def gemm_ended(self, layer: int) -> None:
        """Called once the layer's GEMM is queued (on the compute stream)."""
        if layer in self._marks:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            self._marks[layer][1] = e

    def _read_marks(self, link_expert: float) -> None:
        """The windows of the layers whose events have completed (query(): no wait); the latest
        one's is kept."""
        for layer in sorted(self._marks):
            routed, ended = self._marks[layer]
            if ended is None or not ended.query():
                continue
            del self._marks[layer]
            missing, k = self._plan.get(layer, (0, 0))
            self.window_s = routed.elapsed_time(ended) / 1e3
            self.fixed_s = self.window_s - (missing - k) * link_expert
