"""Stats: every counter of an offloaded model, per MoE layer and per strategy, kept on the device.

Two strategies serve a call: *admit* (decode and short calls: only the routed experts are made
resident, misses copied or left to the CPU) and *stream* (long prompts: whole layers stream through
the pool's regions). The counters are int64 device tensors, so counting costs no host sync and keeps
counting under CUDA-graph replay; `summary()` reads them (one sync) and derives the rates, each a
value in [0, 1] with its definition in docs/usage.md.
"""
from typing import Dict, List, Optional

import torch

# DECODE holds the admit counters of decode-sized calls (fewer routed ids than experts), ADMIT those
# of longer calls that admit: the CPU share's split reads a layer's DECODE row on the device (its
# hits per miss, src/common/admitted_count.h), which a prompt's misses would skew. summary() adds
# the two as "admit".
ADMIT, STREAM, DECODE = 0, 1, 2

# Column order. The first four are written by the dedup_and_admit kernel itself (its `stats`
# argument: calls, routed ids, distinct ids, admitted misses), so they must stay first and in order.
CALLS, ROUTED, DISTINCT, COPIED, CPU_PAIRS, CPU_EXPERTS = range(6)
COLUMNS = ("calls", "routed", "distinct", "copied", "cpu_pairs", "cpu_experts")


class Stats:
    """Counters [layers, strategy, column] on `device`.

    admit:  calls; routed (token, expert) pairs; distinct experts per call (summed over calls);
            copied expert rows over the link; pairs and distinct experts computed on the CPU.
            Decode-sized calls count in their own rows (DECODE), longer ones in ADMIT.
    stream: calls (one per streamed layer); routed pairs; distinct experts; copied expert rows over
            the link (the rest of each streamed layer was resident already).
    """

    def __init__(self, layers: int, experts: int, device):
        self.experts = experts
        self.counts = torch.zeros(layers, 3, len(COLUMNS), dtype=torch.int64, device=device)
        # Views built once, in eager mode: a compiled graph takes them as static inputs, and the
        # admission kernel adds to a layer's row in place.
        self._admit_rows = [self.counts[layer, ADMIT] for layer in range(layers)]
        self._decode_rows = [self.counts[layer, DECODE] for layer in range(layers)]
        for t in (self.counts, *self._admit_rows, *self._decode_rows):
            torch._dynamo.mark_static_address(t)

    def admission_counters(self, layer: int, decode: bool) -> torch.Tensor:
        """The layer's row for a call's dedup_and_admit `stats` argument (the kernel adds its first
        four columns, cpu_share_submit the CPU ones): the decode row for decode-sized calls."""
        return (self._decode_rows if decode else self._admit_rows)[layer]

    def add_stream(self, layer: int, copied: torch.Tensor, routed: int, distinct: torch.Tensor) -> None:
        row = self.counts[layer, STREAM]
        row[CALLS] += 1
        row[ROUTED] += routed
        row[DISTINCT] += distinct
        row[COPIED] += copied

    def reset(self) -> None:
        self.counts.zero_()

    def summary(self, expert_bytes: int) -> Dict[str, dict]:
        """Counters summed over layers, with bytes and rates (reads the device: a host sync)."""
        totals: List[List[int]] = self.counts.sum(dim=0).cpu().tolist()
        admit = dict(zip(COLUMNS, (a + d for a, d in zip(totals[ADMIT], totals[DECODE]))))
        stream = dict(zip(COLUMNS[:COPIED + 1], totals[STREAM][:COPIED + 1]))
        for row in (admit, stream):
            row["bytes_over_link"] = row["copied"] * expert_bytes
        # Admit: a distinct routed expert is a hit when it was resident; every miss is either
        # copied or computed on the CPU, so hits = distinct - copied - cpu_experts.
        admit["hit_rate"] = _rate(admit["distinct"] - admit["copied"] - admit["cpu_experts"], admit["distinct"])
        # Stream: each call moves one layer of E experts; the share that was resident already.
        streamed = stream["calls"] * self.experts
        stream["resident_rate"] = _rate(streamed - stream["copied"], streamed)
        return {"admit": admit, "stream": stream}


def _rate(part: int, whole: int) -> Optional[float]:
    return part / whole if whole else None
