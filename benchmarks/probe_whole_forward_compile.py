"""Does compiling a whole transformers forward (prefill included) under reduce-overhead work, with
and without freetoken? Each case runs in its own process (one crashed with a segfault on torch 2.11);
prints one line per case. Usage: python3 benchmarks/probe_whole_forward_compile.py [resident|offloaded]"""
import subprocess
import sys

import torch


def run(case: str) -> None:
    import freetoken_plugin
    from freetoken_plugin.tiny import tiny_model

    model = tiny_model("qwen3_moe").cuda()
    prompt = torch.randint(1, 512, (1, 8), generator=torch.Generator().manual_seed(0)).cuda()
    kw = dict(max_new_tokens=8, min_new_tokens=8, do_sample=False, cache_implementation="static",
              disable_compile=True)
    want = model.generate(prompt, **kw)
    if case == "offloaded":
        freetoken_plugin.offload_experts(model, cache_slots=10, progress=False)
    model.forward = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)
    for _ in range(2):
        got = model.generate(prompt, **kw)
    print(f"{case}: ran, tokens equal eager: {torch.equal(got, want)}")


if __name__ == "__main__":
    if len(sys.argv) > 1:
        run(sys.argv[1])
    else:
        for case in ("resident", "offloaded"):
            p = subprocess.run([sys.executable, __file__, case], capture_output=True, text=True, timeout=300)
            last = (p.stdout.strip().splitlines() or ["(no output)"])[-1]
            err = [line for line in p.stderr.splitlines() if "Error" in line][-1:] or [""]
            print(f"== whole-forward reduce-overhead compile, {case}: rc={p.returncode} {last} {err[0][:160]}")
