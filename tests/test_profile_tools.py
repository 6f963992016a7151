"""The timeline analyses of benchmarks/profile_prefill.py and profile_decode.py on hand-made device events (CPU)."""
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
from profile_prefill import analyze, bench_model_arguments, host_side, union  # noqa: E402


def copy(ts, dur, nbytes=0):
    return dict(cat="gpu_memcpy", name="Memcpy HtoD (Pinned -> Device)", ts=ts, dur=dur, args=dict(bytes=nbytes))


def kernel(name, ts, dur):
    return dict(cat="kernel", name=name, ts=ts, dur=dur, args={})


def test_union_merges_overlaps_and_keeps_gaps():
    assert union([(5, 7), (0, 2), (1, 3), (3, 4)]) == [(0, 4), (5, 7)]
    assert union([]) == []


def test_head_gaps_tail_and_rate():
    events = [
        kernel("map", 0, 10),               # the pass starts: 10 us before the first copy
        copy(10, 100, nbytes=5_000_000),    # 5 MB in 100 us busy
        copy(50, 40, nbytes=0),             # overlaps the first: busy stays one interval
        kernel("gemm", 100, 80),            # runs through the gap below
        copy(150, 50, nbytes=5_000_000),    # a 40 us gap after the first copy ends at 110
        copy(205, 45, nbytes=0),            # a 5 us gap: below the threshold
        kernel("gemm", 250, 30),            # the tail: 30 us after the last copy
        dict(cat="cpu_op", name="aten::add", ts=0, dur=1000),  # host events are ignored
    ]
    s = analyze(events, min_gap_us=20)
    assert s["wall_ms"] == pytest.approx(0.280)
    assert s["head_ms"] == pytest.approx(0.010)
    assert s["link_busy_ms"] == pytest.approx(0.100 + 0.095)
    assert s["copies"] == 4
    assert s["copy_GBps_while_busy"] == pytest.approx(10e6 / 195 / 1e3, rel=1e-2)
    assert s["link_gaps_ms"] == pytest.approx(0.040)
    assert s["tail_ms"] == pytest.approx(0.030)
    (gap,) = s["largest_gaps"]
    assert gap["gap_us"] == 40 and gap["kernels_meanwhile"] == ["gemm (40 us)"]
    assert s["kernels_ms"] == {"gemm": pytest.approx(0.110), "map": pytest.approx(0.010)}
    assert s["link_gaps_all_ms"] == pytest.approx(0.045)  # the 40 us gap and the 5 us one


def test_copy_rates_by_size_overlap_and_time():
    d2d = dict(cat="gpu_memcpy", name="Memcpy DtoD (Device -> Device)", ts=300, dur=50, args=dict(bytes=8 << 20))
    events = [
        copy(0, 100, nbytes=5_000_000),          # alone, 4-8 MB: 50 GB/s
        copy(200, 200, nbytes=20_000_000),       # overlaps the device-to-device copy, >= 16 MB: 100 GB/s
        d2d,
        kernel("gemm", 700, 100),                # the pass ends at 800: eighths of 100 us
    ]
    r = analyze(events)["h2d_copies"]
    assert r["size 4-8MB"] == dict(copies=1, GB=0.005, ms=0.1, GBps=50.0)
    assert r["size >=16MB"]["GBps"] == 100.0 and r["size <4MB"]["copies"] == 0
    assert r["alone"]["copies"] == 1 and r["alone"]["GBps"] == 50.0
    assert r["overlapping another copy"]["copies"] == 1
    assert r["device-to-device"]["copies"] == 1
    assert r["eighth 0"]["copies"] == 1 and r["eighth 2"]["copies"] == 1 and r["eighth 1"]["copies"] == 0


def test_host_side_of_a_generate_call():
    events = [
        dict(cat="user_annotation", name="generate", ph="X", ts=1000, dur=500),
        kernel("embedding", 1030, 5),
        copy(1035, 2, nbytes=4096),         # a small input copy: not a layer copy
        copy(1040, 400, nbytes=2 << 20),
        copy(1100, 200, nbytes=2 << 20),
        kernel("lm_head", 1450, 20),
    ]
    s = host_side(events)
    assert s == dict(generate_ms=pytest.approx(0.5), call_to_first_device_work_ms=pytest.approx(0.03),
                     call_to_first_copy_ms=pytest.approx(0.04), last_copy_to_return_ms=pytest.approx(0.06))
    assert host_side([kernel("x", 0, 1)]) == {}


def test_a_trace_without_device_events_is_refused():
    with pytest.raises(ValueError, match="no device events"):
        analyze([dict(cat="cpu_op", name="aten::mm", ts=0, dur=5)])


def test_decode_summary_per_token_and_differences():
    from profile_decode import differences, summarize_decode

    resident = summarize_decode([kernel("gemm", 0, 100), kernel("attn", 150, 50), kernel("gemm", 200, 100)], tokens=2)
    assert resident["ms_per_token"] == pytest.approx(0.150)
    assert resident["kernels_per_token"] == 1.5
    assert resident["busy_ms_per_token"] == pytest.approx(0.125)
    assert resident["idle_ms_per_token"] == pytest.approx(0.025)
    offloaded = summarize_decode([kernel("gemm", 0, 100), kernel("admit", 100, 40), kernel("gemm", 200, 100)], tokens=2)
    (top, *rest) = differences(resident, offloaded)
    assert top["kernel"] in ("admit", "attn") and abs(top["delta_us"]) == pytest.approx(25.0)
    assert {r["kernel"]: r["delta_us"] for r in [top, *rest]} == {"admit": 20.0, "attn": -25.0, "gemm": 0.0}


def test_bench_compile_trained_shape_is_the_trained_routing_models():
    # The small-model fixed tax is measured on the shape whose routing the fixture recorded.
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tools"))
    from bench_compile import build_model
    from train_routing_model import build_model as trained_model

    class Args:
        layers, hidden, expert_intermediate, experts, top_k = 2, 256, 128, 32, 4

    ours = build_model(2, "trained", device="cpu").config
    theirs = trained_model(Args).config
    for field in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                  "head_dim", "intermediate_size", "moe_intermediate_size", "num_experts", "num_experts_per_tok",
                  "norm_topk_prob", "tie_word_embeddings"):
        assert getattr(ours, field) == getattr(theirs, field), field


def test_bench_compile_reads_a_saved_byte_level_checkpoint_and_its_prompt(tmp_path):
    # bench_compile.py --model DIR --prompt-file FILE: a byte-level checkpoint (no tokenizer files)
    # takes the file's bytes; a checkpoint with neither a tokenizer nor 256 tokens refuses.
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tools"))
    import torch
    from bench_compile import load_checkpoint, text_prompt
    from train_routing_model import build_model as trained_model

    class Args:
        layers, hidden, expert_intermediate, experts, top_k = 1, 32, 16, 4, 2

    trained_model(Args).save_pretrained(tmp_path / "byte")
    (tmp_path / "p.txt").write_bytes(b"def f(x):\n    return x\n")
    assert text_prompt(str(tmp_path / "p.txt"), str(tmp_path / "byte"), 4).tolist() == [[100, 101, 102, 32]]
    assert load_checkpoint(str(tmp_path / "byte"), "cpu").dtype == torch.bfloat16
    with pytest.raises(SystemExit, match="fewer than --prompt 99"):
        text_prompt(str(tmp_path / "p.txt"), str(tmp_path / "byte"), 99)
    model = trained_model(Args)
    model.config.vocab_size = 300
    model.save_pretrained(tmp_path / "wide")
    with pytest.raises(SystemExit, match="no tokenizer and a vocabulary of 300"):
        text_prompt(str(tmp_path / "p.txt"), str(tmp_path / "wide"), 4)


def test_bench_compile_counts_a_checkpoints_moe_layers_and_experts():
    # --model takes any MoE family: the layers and experts come from the modules the plugin finds,
    # not from one family's config names (Mixtral: num_local_experts).
    import transformers
    from bench_compile import moe_layers_and_experts

    mixtral = transformers.MixtralConfig(vocab_size=64, hidden_size=32, intermediate_size=16, num_hidden_layers=3,
                                         num_attention_heads=2, num_key_value_heads=1, num_local_experts=6)
    assert moe_layers_and_experts(mixtral) == (3, 6)
    with pytest.raises(SystemExit, match="finds no experts"):
        moe_layers_and_experts(transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=16,
                                                        num_hidden_layers=1, num_attention_heads=2))


def test_bench_compile_refuses_a_directory_that_is_not_a_checkpoint(tmp_path):
    # --model DIR without config.json: one line that says what is missing, not a traceback.
    from bench_compile import read_config

    with pytest.raises(SystemExit, match="no config.json"):
        read_config(str(tmp_path))
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(SystemExit, match="cannot read its config.json"):
        read_config(str(tmp_path))


def test_bench_compile_pairs_alternate_and_skip_missing_hit_rates(monkeypatch):
    # ABBA order (neither model always runs first), medians and ratios from the pairs, and a decode
    # hit rate averaged over the runs that have one.
    import bench_compile

    calls = []

    def fake(model, prompt, new_tokens, runs, compiled, handle=None):
        calls.append(model)
        ms = {"resident": 2.0, "offloaded": 3.0}[model]
        return ms, 5.0, None, (None if len(calls) == 2 else 0.9) if model == "offloaded" else None

    monkeypatch.setattr(bench_compile, "timed_generate", fake)
    row = bench_compile.paired_runs("resident", "offloaded", object(), None, 8, 4)
    assert calls == ["resident", "offloaded", "offloaded", "resident"] * 2
    assert row["paired_vs_resident"] == 1.5 and row["resident_paired_ms"] == 2.0 and row["ms_per_token"] == 3.0
    assert row["decode_hit_rate"] == 0.9 and row["rounds"] == 4 and row["paired_spread"] == "1.50-1.50"


def test_bench_cpu_gemv_share_reports_the_workers_part_of_a_call():
    # share_us splits into the worker's compute (share_worker_us) and the hand-off; on a machine
    # whose share has no helper threads, no chunk share is reported.
    from bench_cpu_gemv import host_layers, share_us
    import torch

    layers = host_layers("bf16", 2, 2, 64, 32)
    got = share_us(layers, torch.randn(1, 64).bfloat16(), 2, 4)
    assert set(got) == {"share_us", "share_worker_us", "share_worker_chunks"}
    assert got["share_us"] > 0 and 0 <= got["share_worker_us"]
    assert got["share_worker_chunks"] is None or 0 <= got["share_worker_chunks"] <= 1


def test_the_profiled_model_is_the_benchs_model_of_one_prompt():
    """--transformers builds freetoken bench's model from these arguments (a missing one broke it
    once): the positions cover the prompt and its one generated token."""
    import torch

    from freetoken_plugin.bench_e2e import build_model

    model = build_model(bench_model_arguments(layers=2, tokens=8192), torch.device("meta"))
    assert model.config.num_hidden_layers == 2 and model.config.max_position_embeddings >= 8193
