"""Synthetic decode routing calibrated to recorded traces, for model shapes no trace was recorded on.

Two numbers characterize a decode trace for caching (ft_ops.traces.reuse_and_skew): `reuse`, the
share of a token's experts (per layer) that the previous token routed too, and `top10_share`, the
share of all routing taken by the most routed 10 % of (layer, expert) pairs. The generator draws,
per layer and token, each of the top-k picks as a repeat of one of the previous token's picks with
probability `repeat` (no duplicates within a token), else from a Zipf popularity 1 / (rank + 1)^s
over a fixed random order of the layer's experts. `calibrate` finds (repeat, s) that give a
recorded trace's reuse and skew at that trace's shape; the same parameters then draw routing at
any (layers, experts, top_k).
"""
import bisect
import itertools
import random
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import torch

from .traces import Trace, reuse_and_skew


@dataclass(frozen=True)
class RoutingModel:
    repeat: float  # probability that a pick repeats one of the previous token's picks
    zipf: float    # popularity exponent s of a layer's experts

    def draw(self, layers: int, experts: int, top_k: int, tokens: int, seed: int = 0,
             orders: Optional[List[List[int]]] = None) -> torch.Tensor:
        """[tokens, layers, top_k] int64 expert ids. `orders`, when given, receives each layer's
        experts from most to least popular (for `popularity`)."""
        if not 0 < top_k <= experts:
            raise ValueError(f"top_k must be in [1, {experts}], got {top_k}")
        rng = random.Random(seed)
        cumulative = list(itertools.accumulate(1.0 / (rank + 1) ** self.zipf for rank in range(experts)))
        out = torch.empty(tokens, layers, top_k, dtype=torch.int64)
        for layer in range(layers):
            order = list(range(experts))
            rng.shuffle(order)
            if orders is not None:
                orders.append(list(order))
            prev: List[int] = []
            for t in range(tokens):
                picks: List[int] = []
                for _ in range(top_k):
                    repeatable = [e for e in prev if e not in picks] if rng.random() < self.repeat else []
                    if repeatable:
                        picks.append(rng.choice(repeatable))
                        continue
                    while True:  # by popularity, without duplicates (top_k is far below experts)
                        e = order[bisect.bisect_left(cumulative, rng.random() * cumulative[-1])]
                        if e not in picks:
                            picks.append(e)
                            break
                out[t, layer] = torch.tensor(picks)
                prev = picks
        return out

    def popularity(self, orders: Sequence[Sequence[int]]) -> torch.Tensor:
        """[layers, experts] float64: the probability that a pick not repeated from the previous token
        is each expert (before the no-duplicates redraw), from `draw`'s orders."""
        experts = len(orders[0])
        weights = torch.tensor([1.0 / (rank + 1) ** self.zipf for rank in range(experts)], dtype=torch.float64)
        out = torch.empty(len(orders), experts, dtype=torch.float64)
        for layer, order in enumerate(orders):
            out[layer, torch.tensor(order)] = weights / weights.sum()
        return out

    def trace(self, layers: int, experts: int, top_k: int, tokens: int, prompt: int = 1, seed: int = 0,
              hidden: int = 0, intermediate: int = 0, orders: Optional[List[List[int]]] = None) -> Trace:
        """One sequence of `prompt` + `tokens` rows (the prompt rows drawn the same way); `orders` as
        `draw`'s."""
        ids = self.draw(layers, experts, top_k, prompt + tokens, seed, orders)
        return Trace([ids], [prompt], experts, hidden, intermediate,
                     source=f"synthetic: repeat {self.repeat:.3f}, zipf {self.zipf:.3f}")


def calibrate(trace: Trace, tokens: int = 400, iterations: int = 12, seed: int = 0) -> Tuple[RoutingModel, dict]:
    """(repeat, zipf) whose draws at the trace's shape have its reuse and top-10 % share.
    Coordinate bisection: reuse rises with repeat, the share with zipf (each nearly independent
    of the other). Returns the model and the target and reached statistics."""
    target = reuse_and_skew(trace)
    shape = (trace.layers, trace.experts, trace.top_k)

    def stats(model):
        return reuse_and_skew(model.trace(*shape, tokens=tokens, seed=seed))

    def bisect_for(statistic: str, lo: float, hi: float, model_of) -> float:
        """The parameter in [lo, hi] whose draws reach the target `statistic` (it rises with it)."""
        for _ in range(10):
            mid = (lo + hi) / 2
            if stats(model_of(mid))[statistic] < target[statistic]:
                lo = mid
            else:
                hi = mid
        return (lo + hi) / 2

    repeat, zipf = target["reuse"], 1.0
    for _ in range(iterations):
        zipf = bisect_for("top10_share", 0.0, 3.0, lambda z: RoutingModel(repeat, z))
        repeat = bisect_for("reuse", 0.0, 1.0, lambda r: RoutingModel(r, zipf))
        reached = stats(RoutingModel(repeat, zipf))
        if abs(reached["reuse"] - target["reuse"]) < 0.01 and abs(reached["top10_share"] - target["top10_share"]) < 0.01:
            break
    return RoutingModel(repeat, zipf), {"target": target, "reached": reached}
