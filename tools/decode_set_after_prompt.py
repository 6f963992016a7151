"""Whether a streamed prompt leaves the decode set resident (issue 23's item 3), through the runtime
on the CPU: a random-weight Qwen3-MoE decodes greedily, then a long prompt streams through the
pool; of the pairs decode routed most, how many are resident before the prompt and after it, and
how many of those outside the prompt's regions (slots 0 to 2E - 1) it keeps, per eviction policy
and cache size.

    python tools/decode_set_after_prompt.py                     # 8 layers x 16 experts, about 30 s
    python tools/decode_set_after_prompt.py --slots 36,64,96 --evictions lru,duel

Prints one table and writes decode_set_after_prompt.json to $OUT (default: the repository's out/).
"""
import argparse
import collections
import json
import os
import sys

ROOT = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path[:0] = [ROOT, os.path.join(ROOT, "plugin")]

import torch  # noqa: E402

import freetoken_plugin  # noqa: E402
from freetoken_plugin.offload import find_experts  # noqa: E402
from freetoken_plugin.tiny import random_weights  # noqa: E402


def build(layers: int, experts: int, top_k: int):
    """A float32 Qwen3-MoE with random weights large enough that routing depends on the tokens."""
    import transformers as tf

    torch.manual_seed(0)
    config = tf.Qwen3MoeConfig(vocab_size=512, hidden_size=64, num_hidden_layers=layers, num_attention_heads=4,
                               num_key_value_heads=2, head_dim=16, intermediate_size=96, moe_intermediate_size=32,
                               num_experts=experts, num_experts_per_tok=top_k, decoder_sparse_step=1,
                               mlp_only_layers=[], max_position_embeddings=1024, bos_token_id=0,
                               eos_token_id=None, pad_token_id=0)
    return random_weights(tf.AutoModelForCausalLM.from_config(config, dtype=torch.float32))


def measure(args, eviction: str, slots: int) -> dict:
    model = build(args.layers, args.experts, args.top_k)
    blocks = [module for _, module in find_experts(model)]
    handle = freetoken_plugin.offload_experts(model, cache_slots=slots, device="cpu", progress=False,
                                              eviction=eviction)
    routed = collections.Counter()

    def count(layer):
        def hook(module, args_, kwargs):
            ids = args_[1] if len(args_) > 1 else kwargs["top_k_index"]
            if ids.shape[0] == 1:  # a decode step
                routed.update((layer, e) for e in ids.flatten().tolist())
        return hook

    hooks = [b.register_forward_pre_hook(count(i), with_kwargs=True) for i, b in enumerate(blocks)]
    with torch.no_grad():
        model.generate(torch.tensor([[5, 6, 7, 8]]), max_new_tokens=args.decode_tokens,
                       min_new_tokens=args.decode_tokens, do_sample=False)
    for h in hooks:
        h.remove()
    hot = [pair for pair, _ in routed.most_common(args.hot)]
    pool = handle.runtime.pool

    regions = handle.runtime.streamer.regions * args.experts  # slots 0 .. regions - 1, whatever the policy

    def held() -> dict:
        """The hot pairs resident now, with their slots."""
        slot_of = pool.slot_of.tolist()
        return {pair: slot_of[pair[0]][pair[1]] for pair in hot if slot_of[pair[0]][pair[1]] >= 0}

    before = held()
    outside = [pair for pair, slot in before.items() if slot >= regions]
    prompt = torch.randint(1, 512, (1, args.prompt_tokens), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        model(prompt)
    after = held()
    streamed = handle.stats().get("stream", {}).get("calls", 0)
    return dict(eviction=eviction, slots=slots, regions=regions, hot_pairs=len(hot), resident_before=len(before),
                resident_after=len(after), outside_regions_before=len(outside),
                outside_regions_kept=sum(pair in after for pair in outside), streamed_calls=streamed)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--slots", default="36,64,96", help="cache sizes, comma-separated")
    parser.add_argument("--evictions", default="lru,duel", help="eviction policies, comma-separated")
    parser.add_argument("--decode-tokens", type=int, default=80)
    parser.add_argument("--prompt-tokens", type=int, default=400)
    parser.add_argument("--hot", type=int, default=32, help="the decode pairs counted: the most routed")
    args = parser.parse_args(argv)
    rows = [measure(args, e, int(s)) for s in args.slots.split(",") for e in args.evictions.split(",")]
    print(f"{'eviction':>10} {'slots':>6} {'regions':>8} {'hot pairs resident before':>26} {'after the prompt':>17} "
          f"{'outside the regions before':>27} {'kept':>5}")
    for r in rows:
        print(f"{r['eviction']:>10} {r['slots']:>6} {r['regions']:>8} {r['resident_before']:>26} "
              f"{r['resident_after']:>17} {r['outside_regions_before']:>27} {r['outside_regions_kept']:>5}")
    out = os.environ.get("OUT", os.path.join(ROOT, "out"))
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "decode_set_after_prompt.json"), "w") as f:
        json.dump(dict(settings=vars(args), rows=rows), f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
