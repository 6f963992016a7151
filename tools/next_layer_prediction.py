"""How well a decode step's next-layer experts can be guessed while the current layer runs, from
routing alone (the experts this token routed at the layer before, no hidden states): the signal a
prefetcher would need to hide misses' copies behind the previous layer's compute (issue 20).

For each decode step and layer l + 1 of a recorded trace, the experts that the previous token did
not route at l + 1 (the ones a cache of recent experts is likely to miss) are the targets; a rule
guesses `budget` experts outside the previous token's, learned online from every earlier token of
the sequence (its prompt included), and scores the share of targets it guessed:
  random     budget / (experts - previous token's), the expectation of guessing blindly;
  frequency  the experts layer l + 1 routed most so far;
  affinity   the experts most often routed at l + 1 by earlier tokens that routed this token's
             layer-l experts (a layers x experts x experts count table).

    python tools/next_layer_prediction.py [TRACE ...]      (default: the recorded fixtures)
"""
import argparse
import glob
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from ft_ops.traces import Trace  # noqa: E402

ROOT = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
FIXTURES = sorted(glob.glob(os.path.join(ROOT, "tests", "fixtures", "routing", "*.safetensors")))


def recall(trace: Trace, budget: int, pregates=None) -> dict:
    """Share of the new experts of every decode step's layers 1..L-1 that each rule guesses.
    `pregates` (one [tokens, layers, experts] array a sequence, row l scoring layer l's experts
    from what is known at layer l - 1; tools/pregate_prediction.py) adds the rule "pregate" and its
    precision: the share of its guesses, made at every step and layer, that were new experts."""
    L, E, K = trace.layers, trace.experts, trace.top_k
    got = {"random": 0.0, "frequency": 0, "affinity": 0} | ({"pregate": 0} if pregates is not None else {})
    targets = guesses = 0
    order = 1e-9 * np.arange(E)  # ties go to the lower expert id
    for s, seq in enumerate(trace.sequences):
        seq = seq.numpy()
        affinity = np.zeros((L, E, E))
        frequency = np.zeros((L, E))
        for t in range(seq.shape[0]):
            if t >= max(1, trace.prompt_lengths[s]):  # a decode step (one with a token before it)
                for l in range(L - 1):
                    previous = seq[t - 1, l + 1]
                    outside = E - len(set(previous.tolist()))
                    guesses += min(budget, outside)
                    new = set(seq[t, l + 1].tolist()) - set(previous.tolist())
                    if not new:
                        continue
                    targets += len(new)
                    got["random"] += len(new) * min(1.0, budget / outside)
                    scores = [("frequency", frequency[l + 1].copy()), ("affinity", affinity[l][seq[t, l]].sum(0))]
                    if pregates is not None:
                        scores.append(("pregate", pregates[s][t, l + 1].copy()))
                    for name, score in scores:
                        score[previous] = -np.inf  # resident already: not a guess
                        guess = set(np.argsort(-(score - order))[:budget].tolist())
                        got[name] += len(guess & new)
            for l in range(L - 1):
                for e in seq[t, l]:
                    affinity[l, e, seq[t, l + 1]] += 1
            for l in range(L):
                frequency[l, seq[t, l]] += 1
    out = {name: (v / targets if targets else float("nan")) for name, v in got.items()} | {"targets": targets}
    if pregates is not None:
        out["pregate_precision"] = got["pregate"] / guesses if guesses else float("nan")
    return out


def miss_recall(trace: Trace, budget: int, share: float, pregates=None) -> dict:
    """The same rules scored on the misses of a global LRU cache of `share` x layers x experts
    (layer, expert) pairs, every call's experts admitted (decode steps only, as compare_eviction's
    replay): the share of a decode step's misses at layer l + 1 that the rule guessed at layer l
    (outside the experts the cache held then). `pregates`: as recall's."""
    from collections import OrderedDict
    L, E, K = trace.layers, trace.experts, trace.top_k
    slots = max(K, round(share * L * E))
    got = {"random": 0.0, "frequency": 0, "affinity": 0} | ({"pregate": 0} if pregates is not None else {})
    misses = calls = 0
    order = 1e-9 * np.arange(E)
    cache: "OrderedDict[tuple, None]" = OrderedDict()
    for s, seq in enumerate(trace.sequences):
        seq = seq.numpy()
        affinity = np.zeros((L, E, E))
        frequency = np.zeros((L, E))
        for t in range(seq.shape[0]):
            decode = t >= max(1, trace.prompt_lengths[s])
            guesses = None
            for l in range(L):
                ids = sorted(set(seq[t, l].tolist()))
                if decode:
                    calls += len(ids)
                    missed = [e for e in ids if (l, e) not in cache]
                    misses += len(missed)
                    if guesses is not None and missed:
                        held = [e for e in range(E) if (l, e) in cache]
                        got["random"] += len(missed) * min(1.0, budget / max(1, E - len(held)))
                        for name, score in guesses.items():
                            score[held] = -np.inf  # resident already: not a guess
                            guess = set(np.argsort(-(score - order))[:budget].tolist())
                            got[name] += len(guess & set(missed))
                    for e in ids:
                        cache[(l, e)] = None
                        cache.move_to_end((l, e))
                    while len(cache) > slots:
                        cache.popitem(last=False)
                    if l + 1 < L:
                        guesses = {"frequency": frequency[l + 1].copy(), "affinity": affinity[l][seq[t, l]].sum(0)}
                        if pregates is not None:
                            guesses["pregate"] = pregates[s][t, l + 1].copy()
            for l in range(L - 1):
                for e in seq[t, l]:
                    affinity[l, e, seq[t, l + 1]] += 1
            for l in range(L):
                frequency[l, seq[t, l]] += 1
    out = {name: (v / misses if misses else float("nan")) for name, v in got.items()}
    return out | {"slots": slots, "hit_rate": 1 - misses / calls if calls else float("nan"), "misses": misses}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("traces", nargs="*", default=FIXTURES, help="trace files (default: the recorded fixtures)")
    parser.add_argument("--out", default=None, help="write the rows as JSON here")
    args = parser.parse_args(argv)
    rows = []
    for path in args.traces:
        trace = Trace.load(path)
        print(f"{os.path.basename(path)}: {trace.layers} layers x {trace.experts} experts, top-{trace.top_k}; "
              "share of the experts new since the previous token that each rule guesses")
        print(f"  {'guesses a layer':>15} {'random':>8} {'frequency':>10} {'affinity':>9} {'targets':>8}")
        for budget in (trace.top_k, 2 * trace.top_k, 3 * trace.top_k):
            r = recall(trace, budget)
            print(f"  {budget:>15} {r['random']:>8.3f} {r['frequency']:>10.3f} {r['affinity']:>9.3f} {r['targets']:>8}")
            rows.append(dict(trace=os.path.basename(path), guesses=budget, **{k: (round(v, 4) if isinstance(v, float)
                                                                                  else v) for k, v in r.items()}))
        for share in (0.25, 0.5):
            print(f"  the misses of a global LRU cache of {share:.0%} of the pairs (first layer's misses not guessable):")
            print(f"  {'guesses a layer':>15} {'random':>8} {'frequency':>10} {'affinity':>9} {'misses':>8} {'hit rate':>9}")
            for budget in sorted({1, 2, trace.top_k, 2 * trace.top_k}):
                r = miss_recall(trace, budget, share)
                print(f"  {budget:>15} {r['random']:>8.3f} {r['frequency']:>10.3f} {r['affinity']:>9.3f} "
                      f"{r['misses']:>8} {r['hit_rate']:>9.3f}")
                rows.append(dict(trace=os.path.basename(path), guesses=budget, lru_share=share,
                                 **{k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items()}))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
