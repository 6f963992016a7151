"""Routing traces: the expert ids a model routed, token by token and layer by layer.

A trace file is safetensors: per sequence i, `expert_ids.{i}` int16 [tokens, layers, top_k] (the
prompt's tokens first, then one row per generated token that was fed back), and metadata: the
prompt lengths, the model's shape (layers, experts, top_k, hidden, intermediate) and where it came
from. `freetoken trace` records one from a greedy generation; `freetoken replay` runs one through
the real runtime and kernels; ft_ops/synthetic_routing.py draws traces calibrated to recorded ones.
"""
import json
from dataclasses import dataclass, field
from typing import Dict, List

import torch


@dataclass
class Trace:
    sequences: List[torch.Tensor]          # [tokens, layers, top_k] each (int16 on file, int64 here)
    prompt_lengths: List[int]
    experts: int
    hidden: int = 0                         # the model's expert shape, when known
    intermediate: int = 0
    source: str = ""
    extra: Dict[str, str] = field(default_factory=dict)

    def __post_init__(self):
        if not self.sequences:
            raise ValueError("a trace holds at least one sequence")
        self.sequences = [s.to(torch.int64) for s in self.sequences]
        shapes = {tuple(s.shape[1:]) for s in self.sequences}
        if len(shapes) != 1 or any(s.dim() != 3 for s in self.sequences):
            raise ValueError(f"every sequence must be [tokens, layers, top_k] of one shape, got {sorted(shapes)}")
        if len(self.prompt_lengths) != len(self.sequences):
            raise ValueError("one prompt length per sequence")
        if self.hidden < 0 or self.intermediate < 0:
            raise ValueError(f"the expert shape must be positive (or 0: unknown), got hidden {self.hidden} and "
                             f"intermediate {self.intermediate}")
        for s, p in zip(self.sequences, self.prompt_lengths):
            if not 0 < p <= s.shape[0]:
                raise ValueError(f"prompt length {p} outside [1, {s.shape[0]}] tokens")
            if s.numel() and (int(s.min()) < 0 or int(s.max()) >= self.experts):
                raise ValueError(f"expert ids outside [0, {self.experts})")

    @property
    def layers(self) -> int:
        return self.sequences[0].shape[1]

    @property
    def top_k(self) -> int:
        return self.sequences[0].shape[2]

    def first(self, n: int) -> "Trace":
        """The trace of its first n sequences."""
        return Trace(self.sequences[:n], self.prompt_lengths[:n], self.experts, self.hidden, self.intermediate,
                     self.source, dict(self.extra))

    def decode_steps(self, sequence: int) -> torch.Tensor:
        """[steps, layers, top_k]: the routing of the generated tokens (one decode step each)."""
        return self.sequences[sequence][self.prompt_lengths[sequence]:]

    def save(self, path: str) -> None:
        from safetensors.torch import save_file

        meta = {"prompt_lengths": json.dumps(self.prompt_lengths), "experts": str(self.experts),
                "layers": str(self.layers), "top_k": str(self.top_k), "hidden": str(self.hidden),
                "intermediate": str(self.intermediate), "source": self.source, **self.extra}
        save_file({f"expert_ids.{i}": s.to(torch.int16).contiguous() for i, s in enumerate(self.sequences)},
                  path, metadata=meta)

    @classmethod
    def load(cls, path: str) -> "Trace":
        import os

        from safetensors import safe_open

        if os.path.isdir(path):
            raise ValueError(f"{path} is a directory; pass a trace file that `freetoken trace` wrote")
        if not os.path.isfile(path):
            raise FileNotFoundError(f"trace file {path} does not exist")
        try:
            handle = safe_open(path, "pt")
        except Exception as error:  # safetensors raises its own error types for a bad header
            raise ValueError(f"{path} is not a safetensors file ({error}); a routing trace is the .safetensors "
                             "file that `freetoken trace` writes") from None
        not_a_trace = (f"{path} is not a routing trace (expert_ids.0, .1, ... int [tokens, layers, top_k] "
                       "with prompt_lengths and experts metadata); record one with `freetoken trace`")
        with handle as f:
            meta = dict(f.metadata() or {})
            names = {k for k in f.keys() if k.startswith("expert_ids.")}
            if not names or names != {f"expert_ids.{i}" for i in range(len(names))} \
                    or "prompt_lengths" not in meta or "experts" not in meta:
                raise ValueError(not_a_trace)
            sequences = [f.get_tensor(f"expert_ids.{i}") for i in range(len(names))]
        known = {"prompt_lengths", "experts", "layers", "top_k", "hidden", "intermediate", "source"}
        try:
            prompts = json.loads(meta["prompt_lengths"])
            experts, hidden, inter = (int(meta["experts"]), int(meta.get("hidden", 0)), int(meta.get("intermediate", 0)))
        except (TypeError, ValueError):
            raise ValueError(f"{not_a_trace}: its metadata does not parse") from None
        integer = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)
        shapes = {tuple(s.shape[1:]) for s in sequences}
        if (not isinstance(prompts, list) or not all(isinstance(n, int) and not isinstance(n, bool) for n in prompts)
                or len(prompts) != len(sequences) or len(shapes) != 1 or any(s.dim() != 3 for s in sequences)
                or min(shapes.pop() + (experts,)) < 1 or any(s.dtype not in integer for s in sequences)
                or sequences[0].shape[2] > experts):
            raise ValueError(f"{not_a_trace}: its tensors or prompt lengths do not fit together")
        for name, have in (("layers", sequences[0].shape[1]), ("top_k", sequences[0].shape[2])):
            if name in meta and meta[name] != str(have):
                raise ValueError(f"{not_a_trace}: its metadata says {name} {meta[name]}, its tensors hold {have}")
        try:
            return cls(sequences, prompts, experts, hidden, inter, meta.get("source", ""),
                       {k: v for k, v in meta.items() if k not in known})
        except ValueError as error:  # the trace's own checks (prompt lengths, ids in range)
            raise ValueError(f"{path}: {error}") from None


def reuse_and_skew(trace: Trace) -> Dict[str, float]:
    """What characterizes a trace's decode routing for caching: the share of a token's experts
    (per layer) that the previous token routed too, and the share of all routing that the most
    routed 10 % of (layer, expert) pairs take."""
    reused, total = 0, 0
    counts = torch.zeros(trace.layers, trace.experts, dtype=torch.int64)
    for i in range(len(trace.sequences)):
        steps = trace.decode_steps(i)
        for t in range(steps.shape[0]):
            for layer in range(trace.layers):
                ids = steps[t, layer]
                counts[layer].index_add_(0, ids, torch.ones_like(ids))
                if t:
                    prev = set(steps[t - 1, layer].tolist())
                    reused += sum(1 for e in ids.tolist() if e in prev)
                    total += len(ids)
    flat = counts.flatten().sort(descending=True).values
    top = max(1, flat.numel() // 10)
    return {"reuse": reused / total if total else 0.0,
            "top10_share": float(flat[:top].sum()) / max(1, int(flat.sum()))}
