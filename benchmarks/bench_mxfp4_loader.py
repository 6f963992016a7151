"""load_model on a GPT-OSS MXFP4 checkpoint at GPT-OSS-120B's width (hidden 2880, 128 experts,
intermediate 2880, vocabulary 201,088) with a few layers: writes the checkpoint (random weights, the
experts as blocks + scales as GPT-OSS ships them, one shard per layer and an index), then loads it in
a fresh process and reports the load time, the read rate and the process's peak resident memory
against the bytes it keeps (the MXFP4 host pool plus the other weights), and runs one forward.
The shards were just written, so they are read from the page cache: the rate is the loader's, not
a disk's. Writes mxfp4_loader.json.

python benchmarks/bench_mxfp4_loader.py [--layers 2] [--device cuda] [--dir /tmp/gpt_oss_mxfp4]"""
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

    config = tf.GptOssConfig(num_hidden_layers=layers, num_local_experts=experts, hidden_size=hidden,
                             intermediate_size=inter, num_experts_per_tok=4, vocab_size=vocab,
                             layer_types=["sliding_attention", "full_attention"] * (layers // 2) + ["full_attention"] * (layers % 2))
    config.dtype = "bfloat16"
    with torch.device("meta"):
        model = tf.AutoModelForCausalLM.from_config(config)
    shapes = {n: tuple(p.shape) for n, p in model.state_dict().items()}
    gen = torch.Generator().manual_seed(0)
    checkpoint = ShardedCheckpoint(path)
    for layer in range(layers):
        shard, prefix = {}, f"model.layers.{layer}.mlp.experts."
        for proj, (rows, cols) in (("gate_up_proj", (2 * inter, hidden)), ("down_proj", (hidden, inter))):
            shard[prefix + proj + "_blocks"] = torch.randint(0, 256, (experts, rows, cols // 32, 16), dtype=torch.uint8,
                                                            generator=gen)
            shard[prefix + proj + "_scales"] = torch.randint(118, 123, (experts, rows, cols // 32), dtype=torch.uint8,
                                                            generator=gen)
        for n in (prefix + "gate_up_proj_bias", prefix + "down_proj_bias"):
            shard[n] = (torch.randn(shapes[n], generator=gen) * 0.1).to(torch.bfloat16)
        checkpoint.save(shard, f"experts-{layer:05d}.safetensors")
    checkpoint.save_others(shapes, gen)
    sizes = checkpoint.finish(config)
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    cfg["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    return sizes


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=2880)
    parser.add_argument("--intermediate", type=int, default=2880)
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--vocab", type=int, default=201088)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dir", default=None, help="where to write the checkpoint (default: a temporary directory)")
    parser.add_argument("--load", default=None, help=argparse.SUPPRESS)  # the child process
    args = parser.parse_args()
    if args.load:
        print(json.dumps(load_and_report(args.load, args.device)))
        return
    with tempfile.TemporaryDirectory() as tmp:
        path = args.dir or os.path.join(tmp, "gpt_oss_mxfp4")
        t0 = time.perf_counter()
        sizes = write_checkpoint(path, args.layers, args.hidden, args.intermediate, args.experts, args.vocab)
        print(f"wrote {path}: {(sizes['experts'] + sizes['other']) / 1e9:.2f} GB in {time.perf_counter() - t0:.0f} s",
              flush=True)
        got = run_child(__file__, ["--load", path, "--device", args.device])
    kept = got["host_pool"] + sizes["other"]
    growth = got["peak_rss"] - got["rss_before"]
    row = dict(layers=args.layers, device=args.device, checkpoint_GB=round((sizes["experts"] + sizes["other"]) / 1e9, 2),
               host_pool_GB=round(got["host_pool"] / 1e9, 2), pool_format=got["host_format"],
               other_weights_GB=round(sizes["other"] / 1e9, 2), load_s=round(got["seconds"], 2),
               read_GBps=round((sizes["experts"] + sizes["other"]) / got["seconds"] / 1e9, 2),
               peak_growth_GB=round(growth / 1e9, 2), peak_growth_vs_kept=round(growth / kept, 3),
               forward_finite=got["finite"], goal="peak <= 1.2x")
    print_table("load_model on a GPT-OSS-120B-wide MXFP4 checkpoint (page cache)", [row], list(row))
    write_report("mxfp4_loader", [row], {})


if __name__ == "__main__":
    main()
