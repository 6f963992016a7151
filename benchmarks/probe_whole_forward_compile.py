"""Does compiling a whole transformers forward (prefill included) under reduce-overhead work, with
and without freetoken? Each case runs in its own process (one crashed with a segfault on torch 2.11);
prints one line per case. Usage: python3 benchmarks/probe_whole_forward_compile.py [CASE]

Cases: resident / offloaded - the static cache initializes itself lazily inside the first (compiled,
prefill) call, which transformers' cache_utils says to avoid; offloaded-early - the same with a
StaticCache initialized before the call (transformers' early_initialization)."""
import subprocess
import sys

import torch

CASES = ("resident", "offloaded", "offloaded-early")


def run(case: str, device: str) -> None:
    import freetoken_plugin
    from freetoken_plugin.tiny import tiny_model
    from transformers import StaticCache

    model = tiny_model("qwen3_moe").to(device)
    prompt = torch.randint(1, 512, (1, 8), generator=torch.Generator().manual_seed(0)).to(device)
    new = 8
    kw = dict(max_new_tokens=new, min_new_tokens=new, do_sample=False, disable_compile=True)
    want = model.generate(prompt, cache_implementation="static", **kw)
    if case != "resident":
        freetoken_plugin.offload_experts(model, cache_slots=10, device=device, progress=False)
    mode = "reduce-overhead" if device == "cuda" else None
    model.forward = torch.compile(model.forward, mode=mode, fullgraph=True)

    def generate():
        if case != "offloaded-early":
            return model.generate(prompt, cache_implementation="static", **kw)
        cfg = model.config
        cache = StaticCache(config=cfg, max_cache_len=prompt.shape[1] + new)
        cache.early_initialization(batch_size=1, num_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim,
                                   dtype=model.dtype, device=prompt.device)
        return model.generate(prompt, past_key_values=cache, **kw)

    for _ in range(2):
        got = generate()
    print(f"{case}: ran, tokens equal eager: {torch.equal(got, want)}")


if __name__ == "__main__":
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if len(sys.argv) > 1:
        run(sys.argv[1], device)
    else:
        for case in CASES:
            p = subprocess.run([sys.executable, __file__, case], capture_output=True, text=True, timeout=300)
            last = (p.stdout.strip().splitlines() or ["(no output)"])[-1]
            err = [line for line in p.stderr.splitlines() if "Error" in line][-1:] or [""]
            print(f"== whole-forward compile ({device}), {case}: rc={p.returncode} {last} {err[0][:160]}")
