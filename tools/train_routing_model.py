"""Trains a small byte-level Qwen3-MoE on real text for a few minutes, then records routing traces
of greedy generations (tests/fixtures/routing/*.safetensors come from here).

Random-weight models route almost constantly while decoding, so they say nothing about misses; a
trained one routes like a real model (experts reused from token to token, skewed popularity).
Text: the Python sources of the installed packages (torch, transformers), read as bytes; the last
5 % of files are held out for the trace prompts. Run on a GPU (a few minutes):
    python tools/train_routing_model.py --minutes 3 --out $OUT
Writes routing_traces.safetensors (held-out prompts, greedy decode) and train_log.json; with
--save-model DIR also the model (benchmarks/bench_compile.py --model DIR times its compiled decode).
"""
import argparse
import glob
import json
import math
import os
import random
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "plugin"))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))


def corpus(seed: int = 0):
    import torch as _t
    import transformers as _tf

    files = []
    for pkg in (_tf, _t):
        files += sorted(glob.glob(os.path.join(os.path.dirname(pkg.__file__), "**", "*.py"), recursive=True))
    random.Random(seed).shuffle(files)
    held = max(1, len(files) // 20)
    read = lambda fs: b"\n".join(open(f, "rb").read() for f in fs)
    return read(files[held:]), read(files[:held])


def build_model(args):
    import transformers as tf

    config = tf.Qwen3MoeConfig(
        vocab_size=256, hidden_size=args.hidden, num_hidden_layers=args.layers, num_attention_heads=4,
        num_key_value_heads=2, head_dim=args.hidden // 4, intermediate_size=2 * args.hidden,
        moe_intermediate_size=args.expert_intermediate, num_experts=args.experts, num_experts_per_tok=args.top_k,
        norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], max_position_embeddings=4096,
        router_aux_loss_coef=0.01, output_router_logits=True, tie_word_embeddings=False,
        bos_token_id=None, eos_token_id=None, pad_token_id=0)
    return tf.AutoModelForCausalLM.from_config(config)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--minutes", type=float, default=3.0)
    parser.add_argument("--out", default=os.environ.get("OUT", "out"))
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--experts", type=int, default=32)
    parser.add_argument("--top-k", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--expert-intermediate", type=int, default=128)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--prompt-bytes", type=int, default=384)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--save-model", default=None, metavar="DIR",
                        help="also save the trained model there (bf16 safetensors, with a held-out prompt in "
                             "prompt.txt), e.g. for benchmarks/bench_compile.py --model DIR --prompt-file DIR/prompt.txt")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    train, held = corpus()
    data = torch.frombuffer(bytearray(train), dtype=torch.uint8).to(device).long()
    print(f"[train] corpus {len(train) / 1e6:.1f} MB, held out {len(held) / 1e6:.1f} MB, device {device}", flush=True)
    model = build_model(args).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3, betas=(0.9, 0.95), weight_decay=0.05)
    deadline = time.time() + 60 * args.minutes
    log, step, t0 = [], 0, time.time()
    gen = torch.Generator(device=device).manual_seed(0)
    model.train()
    while time.time() < deadline:
        starts = torch.randint(0, data.numel() - args.seq - 1, (args.batch,), device=device, generator=gen)
        idx = starts[:, None] + torch.arange(args.seq + 1, device=device)
        chunk = data[idx]
        lr = 2e-3 * min(1.0, (step + 1) / 100) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, (time.time() - t0) / (deadline - t0)))))
        for group in opt.param_groups:
            group["lr"] = lr
        with torch.autocast(device, dtype=torch.bfloat16, enabled=device == "cuda"):
            out = model(input_ids=chunk[:, :-1], labels=chunk[:, 1:].contiguous(), output_router_logits=True)
        opt.zero_grad(set_to_none=True)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % 50 == 0:
            entry = dict(step=step, seconds=round(time.time() - t0, 1), loss=round(float(out.loss), 4),
                         bits_per_byte=round(float(out.loss) / math.log(2), 3))
            log.append(entry)
            print(f"[train] {entry}", flush=True)
        step += 1
    model.eval()

    from freetoken_plugin.tracing import record_trace
    from ft_ops.traces import reuse_and_skew

    rng = random.Random(1)
    prompts = []
    for _ in range(args.prompts):
        start = rng.randrange(0, len(held) - args.prompt_bytes)
        prompts.append(torch.tensor(list(held[start:start + args.prompt_bytes]), dtype=torch.long))
    model.config.output_router_logits = False
    trace = record_trace(model, prompts, args.new_tokens,
                         source=f"byte-level Qwen3-MoE, {args.layers} layers x {args.experts} experts, top-{args.top_k}, "
                                f"hidden {args.hidden}, trained {step} steps ({args.minutes} min) on Python sources")
    trace.extra["train_steps"] = str(step)
    trace.extra["final_bits_per_byte"] = str(log[-1]["bits_per_byte"] if log else "")
    path = os.path.join(args.out, "routing_traces.safetensors")
    trace.save(path)
    stats = reuse_and_skew(trace)
    with open(os.path.join(args.out, "train_log.json"), "w") as f:
        json.dump(dict(args=vars(args), steps=step, log=log, routing=stats), f, indent=1)
    sample = bytes(int(b) for b in model.generate(prompts[0][None].to(device), max_new_tokens=120, do_sample=False,
                                                  pad_token_id=0)[0, args.prompt_bytes:].tolist())
    print(f"[train] {step} steps; routing: reuse {stats['reuse']:.3f}, top-10% share {stats['top10_share']:.3f}; "
          f"wrote {path}")
    print("[train] sample continuation:", sample.decode("utf-8", "replace")[:200].replace("\n", "\\n"))
    if args.save_model:
        # Last: the cast to bf16 changes the model the sample generates with.
        model.to(torch.bfloat16).save_pretrained(args.save_model)
        with open(os.path.join(args.save_model, "prompt.txt"), "wb") as f:  # a held-out text the model did not see
            f.write(bytes(int(b) for b in prompts[0].tolist()))
        print(f"[train] saved the model to {args.save_model}", flush=True)


if __name__ == "__main__":
    main()
