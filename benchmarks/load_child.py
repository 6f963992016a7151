"""The loader benchmarks' shared pieces: their checkpoints written shard by shard (ShardedCheckpoint),
and load_model in a fresh process, whose own peak resident memory is the load's (ru_maxrss can carry
the parent's) and whose report comes back as one JSON line."""
import json
import os
import subprocess
import sys
import time

import torch


class ShardedCheckpoint:
    """A safetensors checkpoint of random weights written shard by shard, with its index: the
    experts' shards from the caller (save), the other weights (norms 1, the rest N(0, 0.02)) in one
    shard (save_others), then the index and the config (finish). `sizes` counts the bytes of each."""

    def __init__(self, path: str):
        os.makedirs(path, exist_ok=True)
        self.path, self.weight_map, self.sizes = path, {}, dict(experts=0, other=0)

    def save(self, tensors: dict, name: str, kind: str = "experts") -> None:
        from safetensors.torch import save_file

        save_file(tensors, os.path.join(self.path, name), metadata={"format": "pt"})
        self.weight_map.update({n: name for n in tensors})
        self.sizes[kind] += sum(t.numel() * t.element_size() for t in tensors.values())

    def save_others(self, shapes: dict, gen: torch.Generator) -> None:
        """Every tensor of `shapes` (name: shape) outside the experts, bf16."""
        other = {}
        for n, shape in shapes.items():
            if ".mlp.experts." in n:
                continue
            norm = n.endswith("norm.weight")
            other[n] = (torch.randn(shape, generator=gen) * (0.0 if norm else 0.02) + (1.0 if norm else 0.0)).bfloat16()
        self.save(other, "other.safetensors", "other")

    def finish(self, config) -> dict:
        with open(os.path.join(self.path, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": sum(self.sizes.values())}, "weight_map": self.weight_map}, f)
        config.save_pretrained(self.path)
        return self.sizes


def status_bytes(key: str) -> int:
    """VmRSS (now) or VmHWM (this process's own peak)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key))


def load_and_report(path: str, device: str, **load_options) -> dict:
    """In the child: load_model(path, device=device, **load_options), timed, its peak resident
    memory, and one forward (finite logits)."""
    import freetoken_plugin

    if device == "cuda":
        torch.zeros(1, device="cuda")  # the CUDA context before the baseline
    before = status_bytes("VmRSS")
    t0 = time.perf_counter()
    model = freetoken_plugin.load_model(path, device=device, progress=False, **load_options)
    seconds = time.perf_counter() - t0
    peak = status_bytes("VmHWM")
    host = model._freetoken_handle.runtime.host
    ids = torch.randint(0, 1000, (1, 8), generator=torch.Generator().manual_seed(1)).to(device)
    with torch.no_grad():
        logits = model(ids).logits
    return dict(seconds=seconds, rss_before=before, peak_rss=peak, host_pool=host.nbytes,
                host_format=host.shape.format, finite=bool(torch.isfinite(logits).all()))


def run_child(script: str, arguments: list) -> dict:
    """Runs `script` with `arguments` in a fresh Python; returns the JSON of its last output line."""
    child = subprocess.run([sys.executable, os.path.abspath(script), *arguments], capture_output=True, text=True)
    if child.returncode != 0:
        sys.stderr.write(child.stderr[-4000:])
        raise SystemExit(f"the loading process failed (exit status {child.returncode})")
    return json.loads(child.stdout.strip().splitlines()[-1])
