"""Shared builders of the tests: a slot pool on a device and a host pool of fingerprinted rows, tiny
checkpoints, greedy generation and its inputs."""
import copy
from dataclasses import dataclass
from typing import List

import pytest
import torch

import ft_ops

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]


def with_rounded_experts(model, round13, round2):
    """A copy of `model` whose experts hold round13(w13) and round2(w2) of their canonical weights
    (w13 [E, 2I, H], gate rows then up rows; w2 [E, H, I]): the quantize-then-dequantize reference
    of a quantize= route."""
    from freetoken_plugin.layouts import from_canonical, read_layout, to_canonical
    from freetoken_plugin.offload import find_experts

    ref = copy.deepcopy(model)
    with torch.no_grad():
        for _, module in find_experts(ref):
            layout = read_layout(module)
            b13 = module.gate_up_proj_bias if layout.bias else None
            b2 = module.down_proj_bias if layout.bias else None
            w13, w2, b13, b2 = to_canonical(module.gate_up_proj, module.down_proj, b13, b2, layout)
            gate_up, down, _, _ = from_canonical(round13(w13), round2(w2), b13, b2, layout)
            module.gate_up_proj.copy_(gate_up)
            module.down_proj.copy_(down)
    return ref


def require(device: str, op: str) -> None:
    """Skip unless the dispatcher has a kernel of `op` for `device` (and the device exists)."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    if not ft_ops.has_kernel(op, device):
        pytest.skip(f"freetoken::{op} has no {device} kernel in this build")


@dataclass
class Pool:
    slot_of: torch.Tensor
    owner_of: torch.Tensor
    last_use: torch.Tensor
    clock: torch.Tensor
    banks: List[torch.Tensor]
    host: List[torch.Tensor]  # [L, E, ...] per bank, pinned when the pool is on CUDA

    @property
    def state(self):
        return self.slot_of, self.owner_of, self.last_use, self.clock

    def host_rows(self, layer: int) -> List[torch.Tensor]:
        return [h[layer] for h in self.host]

    def clone(self) -> "Pool":
        return Pool(*(t.clone() for t in self.state), [b.clone() for b in self.banks], self.host)

    def bytes_mismatches(self) -> List[int]:
        """Registered slots whose bank rows differ from their owner's host rows."""
        owners = self.owner_of.cpu()
        used = (owners >= 0).nonzero().flatten()
        if len(used) == 0:
            return []
        bad = torch.zeros(len(used), dtype=torch.bool)
        for bank, host in zip(self.banks, self.host):
            flat_host = host.reshape(-1, *host.shape[2:])
            want = flat_host[owners[used].long()]
            got = bank.cpu()[used]
            bad |= (want != got).reshape(len(used), -1).any(dim=1)
        return used[bad].tolist()


    def region_mismatches(self, layer: int, first_slot: int) -> List[int]:
        """Experts e of `layer` whose row in slot first_slot + e differs from the host row (what
        async_layer_copy must leave there for the prefill GEMM, registered or not)."""
        experts = self.host[0].shape[1]
        bad = torch.zeros(experts, dtype=torch.bool)
        for bank, host in zip(self.banks, self.host):
            got = bank.cpu()[first_slot:first_slot + experts]
            bad |= (got != host[layer]).reshape(experts, -1).any(dim=1)
        return bad.nonzero().flatten().tolist()


def make_pool(layers: int, experts: int, slots: int, device: str, seed: int = 0,
              row_shapes=((6, 4), (4, 3)), dtype=torch.float32) -> Pool:
    """Empty pool; every host row holds random values, a fingerprint of its (layer, expert)."""
    gen = torch.Generator().manual_seed(seed)
    host = []
    for shape in row_shapes:
        h = torch.randn((layers, experts, *shape), generator=gen).to(dtype)
        host.append(h.pin_memory() if device == "cuda" else h)
    banks = [torch.full((slots, *shape), float("nan"), dtype=dtype, device=device) for shape in row_shapes]
    return Pool(
        slot_of=torch.full((layers, experts), -1, dtype=torch.int32, device=device),
        owner_of=torch.full((slots,), -1, dtype=torch.int32, device=device),
        last_use=torch.zeros(slots, dtype=torch.int64, device=device),
        clock=torch.zeros(1, dtype=torch.int64, device=device),
        banks=banks,
        host=host,
    )


def admit_and_copy(pool: Pool, layer: int, ids: torch.Tensor, fetch_fraction=1.0, lo=0, hi=0):
    out = ft_ops.dedup_and_admit(*pool.state, layer, ids, fetch_fraction, lo, hi)
    ft_ops.copy_experts(pool.banks, pool.host_rows(layer), out[1], out[2], out[3])
    return out


def assert_state_equal(a: Pool, b: Pool) -> None:
    for name, x, y in zip(("slot_of", "owner_of", "last_use", "clock"), a.state, b.state):
        assert torch.equal(x.cpu(), y.cpu()), f"{name} differs:\n{x}\n{y}"


def load_model_peak_growth(path, **load_options) -> int:
    """Bytes by which the peak resident memory of a fresh process grows while
    freetoken_plugin.load_model(path, device="cpu", progress=False, **load_options) runs, from a
    baseline taken after the library's own state is initialized (building a model the first time
    imports ~100 MB that has nothing to do with the checkpoint). VmHWM is the process's own peak
    (ru_maxrss can carry the parent's)."""
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent(f"""
        import torch, freetoken_plugin, transformers
        def status(key):
            with open("/proc/self/status") as f:
                return next(int(l.split()[1]) * 1024 for l in f if l.startswith(key))
        with torch.device("meta"):
            transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained({str(path)!r}))
        before = status("VmRSS")
        model = freetoken_plugin.load_model({str(path)!r}, device="cpu", progress=False, **{load_options!r})
        print(before, status("VmHWM"))
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    before, peak = map(int, out.stdout.split()[-2:])
    return peak - before


def assert_experts_loaded_once(path, experts_bytes: int, **load_options) -> None:
    """load_model(path) never holds a second copy of the experts: its peak grows by less than the
    checkpoint's bytes and half the experts' (one copy of the checkpoint and slack: the probe's
    experts for the function check, the non-expert weights, allocator state; a second copy of
    the experts would add experts_bytes more: half of it is the line)."""
    import os

    ckpt_bytes = sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path) if f.endswith(".safetensors"))
    grown = load_model_peak_growth(path, **load_options)
    assert grown < ckpt_bytes + 0.5 * experts_bytes, (
        f"peak grew {grown / 2**20:.0f} MiB for a {ckpt_bytes / 2**20:.0f} MiB checkpoint")


def trace_on_cpu(checkpoint, out, new_tokens: int, prompt_ids: str = "5,6,7,8"):
    """`freetoken trace` of a checkpoint on the CPU (warnings silenced); the Trace it wrote."""
    import warnings

    from freetoken_plugin.cli import main
    from ft_ops.traces import Trace

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert main(["trace", "--model", str(checkpoint), "--prompt-ids", prompt_ids, "--new-tokens",
                     str(new_tokens), "--out", str(out), "--device", "cpu"]) == 0
    return Trace.load(str(out))


def fail_while_switching(monkeypatch, layer: int) -> dict:
    """Makes offload_experts fail part way through switching the model: building the runtime module
    of MoE layer `layer` raises "injected failure". Returns the count of modules built ({"n": ...})."""
    import freetoken_plugin.offload as offload_mod

    made = {"n": 0}
    real = offload_mod.OffloadedExperts

    def failing(runtime, at):
        made["n"] += 1
        if at == layer:
            raise RuntimeError(f"injected failure while converting layer {layer}")
        return real(runtime, at)

    monkeypatch.setattr(offload_mod, "OffloadedExperts", failing)
    return made


def refuse_host_pool(monkeypatch) -> None:
    """Makes allocating a host pool fail the test: the refusal under test must come before it."""
    from ft_ops.slot_pool import HostPool

    def no_pool(*args, **kwargs):
        raise AssertionError("the host pool was allocated before the refusal")

    monkeypatch.setattr(HostPool, "allocate", classmethod(no_pool))


def assert_quantized_configs_refused(path, fp8_match: str, mxfp4_match: str, **load_options) -> None:
    """The checkpoint at `path` with a block-FP8 and then an MXFP4 quantization_config in its
    config.json: load_model refuses each with a CheckpointError matching the pattern given."""
    import json
    import os

    import pytest

    import freetoken_plugin
    from freetoken_plugin import CheckpointError

    config_path = os.path.join(path, "config.json")
    with open(config_path) as f:
        config = json.load(f)
    for quantization, match in (({"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                                  "weight_block_size": [128, 128]}, fp8_match),
                                ({"quant_method": "mxfp4"}, mxfp4_match)):
        config["quantization_config"] = quantization
        with open(config_path, "w") as f:
            json.dump(config, f)
        with pytest.raises(CheckpointError, match=match):
            freetoken_plugin.load_model(str(path), device="cpu", progress=False, **load_options)


# Greedy generation and inputs of the undecorated families' tests (DBRX, JetMoE): the same prompts,
# settings and block inputs for the original model and its offloaded copy.
GENERATE_KW = dict(max_new_tokens=6, min_new_tokens=6, do_sample=False)


def prompts() -> torch.Tensor:
    return torch.randint(2, 100, (2, 8), generator=torch.Generator().manual_seed(1))


def generate(model, ids=None) -> torch.Tensor:
    """greedy_tokens of `ids` (the first of prompts() by default), transformers' warnings silenced."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return greedy_tokens(model, prompts()[:1] if ids is None else ids)


def logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(prompts()).logits


def block_input(tokens: int, scale: float, hidden: int, dtype=torch.float32, device="cpu") -> torch.Tensor:
    """[2, tokens, hidden] of one seed per token count, times `scale`."""
    x = torch.randn(2, tokens, hidden, generator=torch.Generator().manual_seed(tokens)) * scale
    return x.to(device=device, dtype=dtype)


def greedy_tokens(model, prompt, steps=GENERATE_KW["max_new_tokens"]):
    """`prompt` and `steps` greedy new tokens after it (exactly that many)."""
    with torch.no_grad():
        return model.generate(prompt, **dict(GENERATE_KW, max_new_tokens=steps, min_new_tokens=steps))


def snapshot(model):
    """The model's parameters by name and a deep copy of its state, to check it was left as it was."""
    return {n: p for n, p in model.named_parameters()}, copy.deepcopy(model.state_dict())
