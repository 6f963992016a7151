"""A host pool that the machine's available memory cannot hold is refused before any of it is
taken (a pinned allocation would fail, or the out-of-memory killer strike, part way through minutes
of filling), saying how much it needs against how much there is, and naming quantize='fp8' where the
block-FP8 pool would fit, else quantize='int4' where the int4 pool would."""
import pytest
import torch

import freetoken_plugin
from freetoken_plugin import host_memory, loader
from freetoken_plugin.host_memory import HostMemoryError
from freetoken_plugin.offload import find_experts
from freetoken_plugin.tiny import tiny_model
from ft_ops import formats
from ft_ops.slot_pool import ExpertShape
from helpers import require


def pool_bytes(model, fmt, group=0):
    _, module = find_experts(model)[0]
    E, H2I, _ = module.gate_up_proj.shape  # qwen3_moe: [E, 2I, H]
    I, H = H2I // 2, module.gate_up_proj.shape[2]
    shape = ExpertShape(len(find_experts(model)), E, H, I, torch.float32, False, fmt, group=group)
    return shape.expert_bytes * shape.layers * shape.experts


@pytest.mark.parametrize("fits", ["fp8", "int4", None])
def test_load_model_refuses_a_pool_beyond_the_host_memory_before_reading(tmp_path, monkeypatch, fits):
    require("cpu", "expert_gemm")
    model = tiny_model("qwen3_moe")
    model.save_pretrained(tmp_path)
    dense, fp8, int4 = (pool_bytes(model, formats.DENSE), pool_bytes(model, formats.FP8),
                        pool_bytes(model, formats.INT4, group=32))  # hidden 64, intermediate 32: groups of 32
    others = loader._non_expert_bytes(model, find_experts(model))  # on the CPU, beside the pool
    beside = 2 * dense // len(find_experts(model)) + others  # a quantizing read's two float layers, the rest
    assert int4 + beside < fp8 + beside < dense + others
    available = {"fp8": (fp8 + beside + dense + others) // 2, "int4": (int4 + fp8) // 2 + beside,
                 None: int4 // 2}[fits]
    monkeypatch.setattr(host_memory, "available_host_bytes", lambda: available)
    monkeypatch.setattr(loader, "_load_non_experts", lambda *a: pytest.fail("a weight was read"))
    match = {"fp8": r"load it with load_model\(path, quantize='fp8'\) \(.*, block-FP8 as transformers quantizes\) fits",
             "int4": r"load it with load_model\(path, quantize='int4'\) \(.*, int4 in groups of 32, rounded to "
                     r"nearest\) fits",
             None: "free host memory, or run the model on a machine with more"}[fits]
    with pytest.raises(HostMemoryError, match=r"^the host pool needs .* \(3 MoE layers of 8 dense experts.*" + match):
        freetoken_plugin.load_model(str(tmp_path), cache_slots=16, device="cpu", progress=False)
    if fits:  # the way the message names: the quantized pool, its float layers and the other weights fit
        monkeypatch.undo()
        monkeypatch.setattr(host_memory, "available_host_bytes", lambda: available)
        loaded = freetoken_plugin.load_model(str(tmp_path), cache_slots=16, device="cpu", progress=False,
                                             quantize=fits)
        assert freetoken_plugin.stats(loaded)["pool"]["format"] == fits


def test_offload_experts_refuses_a_pool_beyond_the_host_memory_and_leaves_the_model(monkeypatch):
    require("cpu", "expert_gemm")
    model = tiny_model("qwen3_moe")
    params = dict(model.named_parameters())
    monkeypatch.setattr(host_memory, "available_host_bytes", lambda: pool_bytes(model, formats.DENSE) - 1)
    with pytest.raises(HostMemoryError, match=r"offload_experts\(model, quantize='fp8'\), or load_model\(path, "
                                              r"quantize='fp8'\) from its checkpoint"):
        freetoken_plugin.offload_experts(model, cache_slots=16, device="cpu", progress=False)
    assert all(p is params[n] for n, p in model.named_parameters())
    freetoken_plugin.offload_experts(model, cache_slots=16, device="cpu", progress=False, quantize="fp8")


def write_files(directory, files):
    directory.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (directory / name).write_text(text)


def test_a_cgroup_v2_limit_below_the_machine_bounds_the_memory_available(tmp_path):
    root = tmp_path / "cgroup"
    write_files(root, {"cgroup.controllers": "cpu memory\n"})
    # The job's cgroup and its parent: the parent's limit is the tighter once usage is counted.
    write_files(root / "jobs", {"memory.max": str(10 << 30), "memory.current": str(7 << 30),
                                "memory.stat": "anon 1\ninactive_file %d\n" % (1 << 30)})
    write_files(root / "jobs" / "job1", {"memory.max": str(8 << 30), "memory.current": str(2 << 30),
                                         "memory.stat": "inactive_file 0\n"})
    membership = tmp_path / "cgroup_membership"
    membership.write_text("0::/jobs/job1\n")
    assert host_memory.cgroup_headroom_bytes(str(root), str(membership)) == 4 << 30  # 10 - 7 + 1 GiB
    (root / "jobs" / "memory.max").write_text("max\n")  # no limit above: the job's own
    assert host_memory.cgroup_headroom_bytes(str(root), str(membership)) == 6 << 30


def test_a_cgroup_v1_limit_and_a_namespaced_container(tmp_path):
    root = tmp_path / "cgroup"
    # A container with its own cgroup namespace: its path is "/" and the mount's memory/ is its cgroup.
    write_files(root / "memory", {"memory.limit_in_bytes": str(16 << 30), "memory.usage_in_bytes": str(5 << 30),
                                  "memory.stat": "cache 3\ntotal_inactive_file %d\n" % (2 << 30)})
    membership = tmp_path / "cgroup_membership"
    membership.write_text("4:memory:/\n3:cpuset:/\n0::/\n")
    assert host_memory.cgroup_headroom_bytes(str(root), str(membership)) == 13 << 30
    (root / "memory" / "memory.limit_in_bytes").write_text("9223372036854771712\n")  # v1's "no limit"
    assert host_memory.cgroup_headroom_bytes(str(root), str(membership)) is None
    assert host_memory.cgroup_headroom_bytes(str(root), str(tmp_path / "missing")) is None


def test_the_memory_available_is_the_tighter_of_the_machine_and_the_cgroup(monkeypatch):
    monkeypatch.setattr(host_memory, "_meminfo_available", lambda: 64 << 30)
    monkeypatch.setattr(host_memory, "cgroup_headroom_bytes", lambda: 12 << 30)
    assert host_memory.available_host_bytes() == 12 << 30
    monkeypatch.setattr(host_memory, "cgroup_headroom_bytes", lambda: None)
    assert host_memory.available_host_bytes() == 64 << 30
    monkeypatch.setattr(host_memory, "_meminfo_available", lambda: None)
    assert host_memory.available_host_bytes() is None
