"""load_model in a fresh process, for the loader benchmarks: the child's own peak resident memory
is the load's (ru_maxrss can carry the parent's), and its report comes back as one JSON line."""
import json
import os
import subprocess
import sys
import time

import torch


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
