"""load_model(path, quantize="fp8") on a bf16 checkpoint at Qwen3-30B-A3B's expert shape (128
experts, hidden 2048, expert intermediate 768; per-expert tensors as the Hub's Qwen3-MoE
checkpoints hold them; a small vocabulary, so the experts dominate), a few layers: writes the
checkpoint (random weights, one shard per layer and an index), then loads it in a fresh process
twice, quantizing and as it is (the reference: a plain bf16 load of the same files), and reports
each load's time and peak resident growth against the bytes it keeps (the host pool plus the other
weights): quantizing, the float experts are never all held (one float layer and the layer being
read beside the FP8 pool). The shards were just written, so they are read from the page cache:
the times are the loader's and the quantizer's, not a disk's. Writes fp8_loader.json.

python benchmarks/bench_fp8_loader.py [--layers 4] [--dir /tmp/qwen3_bf16]"""
import argparse
import json
import os
import tempfile
import time

import torch

from common import print_table, write_report
from load_child import ShardedCheckpoint, load_and_report, run_child


def write_checkpoint(path: str, layers: int, hidden: int, inter: int, experts: int, vocab: int) -> dict:
    import transformers as tf

    config = tf.Qwen3MoeConfig(num_hidden_layers=layers, num_experts=experts, hidden_size=hidden,
                               moe_intermediate_size=inter, intermediate_size=3 * hidden, num_experts_per_tok=8,
                               vocab_size=vocab, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                               decoder_sparse_step=1, mlp_only_layers=[])
    config.dtype = "bfloat16"
    with torch.device("meta"):
        model = tf.AutoModelForCausalLM.from_config(config)
    gen = torch.Generator().manual_seed(0)
    checkpoint = ShardedCheckpoint(path)
    for layer in range(layers):
        shard = {}
        for e in range(experts):
            prefix = f"model.layers.{layer}.mlp.experts.{e}."
            for proj, (rows, cols) in (("gate_proj", (inter, hidden)), ("up_proj", (inter, hidden)),
                                       ("down_proj", (hidden, inter))):
                shard[prefix + proj + ".weight"] = (torch.randn(rows, cols, generator=gen) * cols ** -0.5).bfloat16()
        checkpoint.save(shard, f"experts-{layer:05d}.safetensors")
    checkpoint.save_others({n: p.shape for n, p in model.state_dict().items()}, gen)
    return checkpoint.finish(config)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--intermediate", type=int, default=768)
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--dir", default=None, help="where to write the checkpoint (default: a temporary directory)")
    parser.add_argument("--load", default=None, help=argparse.SUPPRESS)  # the child process
    parser.add_argument("--quantize", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.load:
        print(json.dumps(load_and_report(args.load, "cpu", quantize=args.quantize)))
        return
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        path = args.dir or os.path.join(tmp, "qwen3_bf16")
        t0 = time.perf_counter()
        sizes = write_checkpoint(path, args.layers, args.hidden, args.intermediate, args.experts, args.vocab)
        print(f"wrote {path}: {(sizes['experts'] + sizes['other']) / 1e9:.2f} GB in {time.perf_counter() - t0:.0f} s",
              flush=True)
        for quantize in ("fp8", None):
            got = run_child(__file__, ["--load", path] + (["--quantize", quantize] if quantize else []))
            kept = got["host_pool"] + sizes["other"]
            growth = got["peak_rss"] - got["rss_before"]
            rows.append(dict(layers=args.layers, quantize=quantize or "-", pool_format=got["host_format"],
                             checkpoint_GB=round((sizes["experts"] + sizes["other"]) / 1e9, 2),
                             host_pool_GB=round(got["host_pool"] / 1e9, 2), load_s=round(got["seconds"], 2),
                             read_GBps=round((sizes["experts"] + sizes["other"]) / got["seconds"] / 1e9, 2),
                             peak_growth_GB=round(growth / 1e9, 2), peak_growth_vs_kept=round(growth / kept, 3),
                             forward_finite=got["finite"]))
    rows[0]["load_vs_bf16"] = round(rows[0]["load_s"] / rows[1]["load_s"], 2)
    print_table("load_model on a bf16 Qwen3-30B-A3B-wide checkpoint: quantizing to FP8 as it reads, and as it is "
                f"(page cache, {torch.get_num_threads()} threads)", rows, list(rows[0]))
    write_report("fp8_loader", rows, {"threads": torch.get_num_threads()})


if __name__ == "__main__":
    main()
