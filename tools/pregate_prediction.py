"""How well a layer's experts can be guessed one layer early from the hidden state (pre-gating): the
next layer's router applied to the residual stream that enters this layer's experts, against the
routing-only rules of tools/next_layer_prediction.py on the same tokens (issue 20: a miss's copy
can hide behind the previous layer's compute only if its expert is known that early).

A saved Qwen3-MoE-like model (tools/train_routing_model.py --save-model DIR) reads held-out text
teacher-forced; at each position and layer l + 1 the experts its router picks are the truth, and
the targets are those the previous position did not route at l + 1 (the ones a cache of recent
experts is likely to miss); next_layer_prediction.recall and .miss_recall score every rule on the
same targets and the same cache. Rules, each with `budget` guesses outside the previous
position's experts:
  pre-gate   the top of router(l + 1) on post_attention_layernorm(l + 1) of the residual stream
             entering layer l's experts (known when layer l's experts start, before their output
             and layer l + 1's attention); its precision: the share of its guesses (budget at
             every position and layer, as a prefetcher makes them) that were targets;
  frequency, affinity, random   next_layer_prediction's, learned from the same routing.
Then the same rules on the misses of a global LRU cache (next_layer_prediction.miss_recall's
measure), guessing among the experts the cache does not hold.

    python tools/pregate_prediction.py --model DIR [--sequences 8] [--tokens 256] [--out FILE]
"""
import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from ft_ops.traces import Trace  # noqa: E402
from next_layer_prediction import miss_recall, recall  # noqa: E402


def layers_of(model):
    layers = model.model.layers
    for layer in layers:
        if not (hasattr(layer, "post_attention_layernorm") and hasattr(getattr(layer, "mlp", None), "gate")):
            raise SystemExit("--model: every decoder layer needs post_attention_layernorm and mlp.gate (a Qwen3-MoE "
                             "layout, as tools/train_routing_model.py saves)")
    return layers


@torch.no_grad()
def routed_and_pregated(model, ids: torch.Tensor, top_k: int):
    """(routed [T, L, top_k], pre-gate scores [T, L, E]: row l holds router(l)'s scores of the
    residual stream that entered layer l - 1's experts; row 0 is unused)."""
    layers = layers_of(model)
    streams = []
    hooks = [layer.post_attention_layernorm.register_forward_pre_hook(lambda m, args: streams.append(args[0][0]))
             for layer in layers]
    try:
        model(ids[None])
    finally:
        for h in hooks:
            h.remove()
    logits = lambda l, r: torch.nn.functional.linear(layers[l].post_attention_layernorm(r), layers[l].mlp.gate.weight)
    L = len(layers)
    routed = torch.stack([logits(l, streams[l]).topk(top_k, dim=-1).indices for l in range(L)], dim=1)
    pre = torch.stack([torch.zeros_like(logits(0, streams[0]))] + [logits(l, streams[l - 1]) for l in range(1, L)],
                      dim=1)
    return routed, pre.float()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="a saved model directory (train_routing_model.py --save-model)")
    parser.add_argument("--sequences", type=int, default=8, help="held-out text sequences (default 8)")
    parser.add_argument("--tokens", type=int, default=256, help="bytes a sequence (default 256)")
    parser.add_argument("--out", default=None, help="write the rows as JSON here")
    args = parser.parse_args(argv)
    if not os.path.isfile(os.path.join(args.model, "config.json")):
        parser.error(f"--model {args.model}: no config.json there; give a directory that save_pretrained wrote")
    if args.sequences < 1 or args.tokens < 2:
        parser.error("--sequences must be at least 1 and --tokens at least 2")
    import transformers as tf
    from train_routing_model import corpus

    model = tf.AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    top_k, experts = model.config.num_experts_per_tok, model.config.num_experts
    if len(layers_of(model)) < 2:
        parser.error(f"--model {args.model} has one MoE layer: nothing to guess a layer early")
    _, held = corpus()
    stride = max(args.tokens, (len(held) - args.tokens) // args.sequences)
    sequences, pregates = [], []
    for s in range(args.sequences):
        chunk = held[s * stride:s * stride + args.tokens]
        routed, pre = routed_and_pregated(model, torch.tensor(list(chunk), dtype=torch.long), top_k)
        sequences.append(routed)
        pregates.append(pre.numpy())
    # Every position but the first counts as a decode step (teacher-forced: each row's routing given its prefix).
    trace = Trace(sequences=sequences, prompt_lengths=[1] * len(sequences), experts=experts)
    print(f"{args.model}: {trace.layers} layers x {experts} experts, top-{top_k}; {args.sequences} held-out sequences "
          f"of {args.tokens} bytes; share of the experts new since the previous position that each rule guesses")
    print(f"  {'guesses a layer':>15} {'pre-gate':>9} {'its precision':>14} {'affinity':>9} {'frequency':>10} "
          f"{'random':>8} {'targets':>8}")
    rows = []
    for budget in sorted({1, 2, top_k, 2 * top_k}):
        r = recall(trace, budget, pregates)
        row = dict(guesses=budget, **{k: round(r[k], 4) for k in ("pregate", "pregate_precision", "affinity",
                                                                   "frequency", "random")}, targets=r["targets"])
        rows.append(row)
        print(f"  {budget:>15} {row['pregate']:>9.3f} {row['pregate_precision']:>14.3f} {row['affinity']:>9.3f} "
              f"{row['frequency']:>10.3f} {row['random']:>8.3f} {r['targets']:>8}")
    for share in (0.25, 0.5):
        print(f"  the misses of a global LRU cache of {share:.0%} of the pairs guessed (layer 0's not guessable):")
        print(f"  {'guesses a layer':>15} {'pre-gate':>9} {'affinity':>9} {'frequency':>10} {'random':>8} {'misses':>8} "
              f"{'hit rate':>9}")
        for budget in sorted({1, 2, top_k}):
            r = miss_recall(trace, budget, share, pregates)
            row = dict(guesses=budget, lru_share=share, **{k: round(r[k], 4) for k in ("pregate", "affinity",
                       "frequency", "random", "hit_rate")}, misses=r["misses"])
            rows.append(row)
            print(f"  {budget:>15} {row['pregate']:>9.3f} {row['affinity']:>9.3f} {row['frequency']:>10.3f} "
                  f"{row['random']:>8.3f} {r['misses']:>8} {row['hit_rate']:>9.3f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
