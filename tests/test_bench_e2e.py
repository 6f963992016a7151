"""`freetoken bench` on the CPU with a tiny shape: every strategy measured and reported, and the
decode routing is the calibrated trace's (the replay router replaces the model's choice)."""
import json
import re

import pytest
import torch

from freetoken_plugin import bench_e2e, host_memory
from freetoken_plugin.cli import main
from helpers import require


class Args:
    layers, hidden, experts, top_k, expert_intermediate = 2, 128, 8, 2, 64
    prompts, turn, decode_tokens = "32", "32,16", 5


def test_decode_steps_route_as_the_replayed_trace():
    require("cpu", "expert_gemm")
    model = bench_e2e.build_model(Args, torch.device("cpu"))
    bench_e2e.install_replay_routers(model)
    routers = bench_e2e.install_replay_routers(model)  # each strategy installs them again: never nested
    assert all(not isinstance(layer.mlp.gate.router, bench_e2e.ReplayRouter) for layer in model.model.layers)
    routing = torch.randint(0, Args.experts, (10, Args.layers, Args.top_k))
    seen = []
    hook = model.model.layers[1].mlp.experts.register_forward_pre_hook(
        lambda m, args: seen.append(args[1].clone()) if args[1].shape[0] == 1 else None)
    feeder = bench_e2e.StepFeeder(routers, routing)
    with torch.no_grad():
        model.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=4, min_new_tokens=4, do_sample=False, streamer=feeder)
    hook.remove()
    assert len(seen) == 3  # the prefill routes with the model's router; 3 decode steps follow
    for step, ids in enumerate(seen, start=1):
        assert torch.equal(ids[0], routing[step, 1])


def test_each_decode_run_replays_steps_no_earlier_run_saw():
    """A run that replayed the steps of an earlier one would find the cache holding exactly what they
    route to (its hit rate, and so its speed, overstated): run i replays the i-th slice of the trace,
    the compiled measurement's runs the slices after the eager ones'."""
    require("cpu", "expert_gemm")
    model = bench_e2e.build_model(Args, torch.device("cpu"))
    routers = bench_e2e.install_replay_routers(model)
    steps = 8
    routing = torch.randint(0, Args.experts, (steps * bench_e2e.DECODE_RUNS, Args.layers, Args.top_k),
                            generator=torch.Generator().manual_seed(4))
    slices = [bench_e2e.run_routing(routing, run) for run in range(bench_e2e.DECODE_RUNS)]
    assert torch.equal(torch.cat(slices), routing)
    seen = []
    hook = model.model.layers[1].mlp.experts.register_forward_pre_hook(
        lambda m, args: seen.append(args[1].clone()) if args[1].shape[0] == 1 else None)
    bench_e2e.decode_rate(model, routers, routing, 4, torch.device("cpu"), compiled=False, runs=2, first_run=1)
    hook.remove()
    assert len(seen) == 2 * 3  # two runs of 3 decode steps (the prefill routes with the model's router)
    for run, first in ((1, 0), (2, 3)):
        for step, ids in enumerate(seen[first:first + 3], start=1):
            assert torch.equal(ids[0], slices[run][step, 1]), (run, step)


@pytest.mark.slow  # a whole CLI run of every strategy (20-25 s): in the slow run, which CI also runs
def test_bench_reports_every_strategy(tmp_path, capsys):
    require("cpu", "expert_gemm")
    out = tmp_path / "bench"
    assert main(["bench", "--layers", "2", "--hidden", "128", "--experts", "8", "--top-k", "2",
                 "--expert-intermediate", "64", "--prompts", "48", "--turn", "32,16", "--decode-tokens", "4",
                 "--cache-gib", "0.001", "--strategies", "resident,cpu-experts,freetoken", "--formats", "bf16,fp8",
                 "--fetch-fractions", "1,auto", "--evictions", "lru,duel", "--device", "cpu",
                 "--out", str(out)]) == 0
    report = json.load(open(out / "bench_e2e.json"))
    names = [r["strategy"] for r in report["rows"]]
    assert names[0] == "resident" and names[1] == "cpu-experts" and names[2].startswith("freetoken 0.001 GiB")
    # Per format: fetch 1 (lru, duel), then auto (lru, duel); the default policy, Duel, goes unnamed.
    assert names[2].endswith(" lru") and names[3].endswith("slots)") and names[4].endswith("split auto lru")
    assert names[5].endswith("split auto") and names[6].startswith("freetoken fp8 0.001 GiB")
    assert len(names) == 10
    for row in report["rows"]:
        assert row["ttft_48_s"] > 0 and row["turn2_s"] > 0 and row["decode_tok_s"] > 0
    for row in report["rows"][2:]:  # offloaded rows: the decode's hit rate and the policy, beside its speed
        assert 0 <= row["decode_hit_rate"] <= 1, row
        assert row["eviction"] == ("lru" if row["strategy"].removesuffix(" (compiled decode)").endswith(" lru")
                                   else "duel"), row
    assert "decode_hit_rate" not in report["rows"][0]
    peers = {r["strategy"]: r for r in report["against_peers"]}
    assert peers["resident"]["ttft_x_resident"] == 1.0 and peers["resident"]["decode_x_resident"] == 1.0
    for name, row in peers.items():
        if name != "resident":
            want = next(r for r in report["rows"] if r["strategy"] == name)
            assert row["ttft_x_resident"] == round(want["ttft_48_s"] / report["rows"][0]["ttft_48_s"], 2)
    # Offloaded rows also time their prompt on a warm cache and bound it, and the second turn, by
    # the experts they copied; every freetoken row has its empty-cache bound at each prompt.
    for row in report["rows"][2:]:
        if not row["strategy"].endswith("(compiled decode)"):
            assert row["ttft_warm_48_s"] > 0 and "warm_link_bound_s" not in row  # no link on the CPU
    assert "ttft_warm_48_s" not in report["rows"][0]
    printed = capsys.readouterr().out
    assert "end to end" in printed and "against the peers" in printed


def test_offloaded_rows_bound_the_warm_prompt_and_the_second_turn_by_what_they_copied():
    require("cpu", "expert_gemm")
    import freetoken_plugin

    class A(Args):
        prompts, turn = "48", "48,16"

    model = bench_e2e.build_model(A, torch.device("cpu"))
    handle = freetoken_plugin.offload_experts(model, cache_slots=A.experts, device="cpu", progress=False)
    copies = []
    stats = handle.stats
    handle.stats = lambda: copies.append(stats()) or copies[-1]
    link = 1e9  # bytes/s: a rate the test chooses, so the bounds are the copies' bytes / 1e9
    routing = torch.randint(0, A.experts, ((A.decode_tokens + 8) * bench_e2e.DECODE_RUNS, A.layers, A.top_k))
    row = bench_e2e.measure("freetoken", model, A, torch.device("cpu"), routing, False, link=link, handle=handle)[0]
    expert_bytes = handle.runtime.shape.expert_bytes
    # Each read of the counters is (stream copied + admit copied); the warm prompt moved half the
    # difference of reads 0 and 1 (two timed runs), the timed turn that of reads 4 and 5 (2 and 3
    # frame its untimed first run); reads 6-7 and 8-9 frame the decode steps of the two decode runs
    # (after each run's prompt, and at its end): the decode hit rate is the timed (second) run's.
    total = [c["stream"]["copied"] + c["admit"]["copied"] for c in copies]
    assert len(copies) == 10
    assert row["turn2_link_bound_s"] == round((total[5] - total[4]) * expert_bytes / link, 3)
    assert row["warm_link_bound_s"] == round((total[1] - total[0]) / 2 * expert_bytes / link, 3)
    assert row["turn2_link_bound_s"] > 0  # the turn's prompt streamed layers the cache did not hold
    peers = bench_e2e.against_peers([row], A)[0]
    assert peers["turn2_over_share_bound"] == round(row["turn2_s"] / row["turn2_link_bound_s"], 3)
    admit = [(c["admit"]["distinct"], c["admit"]["distinct"] - c["admit"]["copied"] - c["admit"]["cpu_experts"])
             for c in copies[6:]]
    distinct, hits = admit[3][0] - admit[2][0], admit[3][1] - admit[2][1]
    assert row["decode_hit_rate"] == round(hits / distinct, 3)


def test_a_compiled_row_reports_the_cuda_graphs_torch_compile_skipped(monkeypatch, capsys):
    """A compiled decode whose graphs CUDA graph trees refused (a mutated input, ...) runs without
    them at a fraction of the speed: its row counts the skipped graphs and the bench warns."""
    skips = iter([3, 5])  # the process's count before and after the compiled decode
    monkeypatch.setattr(bench_e2e, "cuda_graph_skips", lambda: next(skips))
    monkeypatch.setattr(bench_e2e, "time_to_first_token", lambda *a, **k: 0.5)
    monkeypatch.setattr(bench_e2e, "second_turn", lambda *a, **k: 0.25)
    monkeypatch.setattr(bench_e2e, "install_replay_routers", lambda model: None)
    monkeypatch.setattr(bench_e2e, "decode_rate", lambda *a, **k: 20.0)
    rows = bench_e2e.measure("freetoken", None, Args, torch.device("cpu"), None, True)
    assert "cuda_graphs_skipped" not in rows[0] and rows[1]["cuda_graphs_skipped"] == 2
    assert "torch.compile skipped 2 CUDA graph(s)" in capsys.readouterr().out


@pytest.mark.slow  # a whole CLI run (5-10 s): in the slow run, which CI also runs
def test_append_adds_strategies_measured_in_another_run(tmp_path, capsys):
    require("cpu", "expert_gemm")
    out = tmp_path / "bench"
    shape = ["--layers", "2", "--hidden", "128", "--experts", "8", "--top-k", "2", "--expert-intermediate", "64",
             "--prompts", "48", "--turn", "32,16", "--decode-tokens", "4", "--cache-gib", "0.001", "--device", "cpu",
             "--out", str(out)]
    assert main(["bench", *shape, "--strategies", "resident,freetoken"]) == 0
    first = json.load(open(out / "bench_e2e.json"))["rows"]
    assert main(["bench", *shape, "--strategies", "cpu-experts,freetoken", "--append"]) == 0
    report = json.load(open(out / "bench_e2e.json"))
    names = [r["strategy"] for r in report["rows"]]
    assert names[0] == "resident" and names[1] == "cpu-experts" and names[2].startswith("freetoken")
    assert len(names) == 3 and report["rows"][0] == first[0]  # freetoken measured again: one row, the new one
    assert all("measured" in r for r in report["rows"])
    assert {p["strategy"] for p in report["against_peers"]} == set(names)
    capsys.readouterr()
    assert main(["bench", *shape[2:], "--layers", "3", "--strategies", "resident", "--append"]) == 2
    assert "another model shape (layers 2 there, 3 now)" in capsys.readouterr().err
    # Rows of another second turn or decode length would make the peers' ratios mix settings.
    turn = shape.index("--turn") + 1
    assert main(["bench", *shape[:turn], "32,8", *shape[turn + 1:], "--strategies", "resident", "--append"]) == 2
    assert re.search("other settings.*--turn", capsys.readouterr().err)


@pytest.mark.slow  # seconds on two cores: in the slow set (pytest -m slow), which CI runs too
def test_each_strategys_model_is_gone_before_the_next_is_built(tmp_path, monkeypatch):
    # Two 48-layer models and a 32 GiB cache do not fit one H200: the resident model must be freed
    # before the first freetoken row builds its own (it once stayed referenced until then).
    require("cpu", "expert_gemm")
    import weakref
    built, build = [], bench_e2e.build_model

    def tracked(*args, **kwargs):
        assert all(ref() is None for ref in built), "an earlier strategy's model is still alive"
        model = build(*args, **kwargs)
        built.append(weakref.ref(model))
        return model

    monkeypatch.setattr(bench_e2e, "build_model", tracked)
    assert main(["bench", "--layers", "2", "--hidden", "128", "--experts", "8", "--top-k", "2",
                 "--expert-intermediate", "64", "--prompts", "32", "--turn", "32,8", "--decode-tokens", "4",
                 "--cache-gib", "0.0005,0.001", "--strategies", "resident,cpu-experts,freetoken", "--no-compile",
                 "--device", "cpu", "--out", str(tmp_path)]) == 0
    assert len(built) == 4  # 0.0005 GiB holds 10 of the 16 experts, 0.001 GiB all
    # A size beyond the model's experts gives the same pool as 0.001: not measured again.
    built.clear()
    assert main(["bench", "--layers", "2", "--hidden", "128", "--experts", "8", "--top-k", "2",
                 "--expert-intermediate", "64", "--prompts", "32", "--turn", "32,8", "--decode-tokens", "4",
                 "--cache-gib", "0.001,0.002", "--strategies", "freetoken", "--no-compile",
                 "--device", "cpu", "--out", str(tmp_path)]) == 0
    assert len(built) == 1


def test_the_slow_peers_time_the_prompts_asked_for():
    """accelerate and cpu-experts take seconds a forward at full size: by default they time the
    shortest prompt only; --peer-prompts all or lengths make them time others too."""
    import types

    for option, lengths in (("shortest", [24]), ("all", [40, 24]), ("40,8192", [40, 8192])):
        assert bench_e2e.peer_prompts(types.SimpleNamespace(prompts="40,24", peer_prompts=option)) == lengths


@pytest.mark.slow  # 2 s: a whole CLI run
def test_a_peer_row_holds_every_prompt_length_asked_for(tmp_path):
    require("cpu", "expert_gemm")
    assert main(["bench", "--layers", "2", "--hidden", "128", "--experts", "8", "--top-k", "2",
                 "--expert-intermediate", "64", "--prompts", "40,24", "--turn", "32,8", "--decode-tokens", "3",
                 "--strategies", "cpu-experts", "--no-compile", "--device", "cpu", "--out", str(tmp_path),
                 "--peer-prompts", "all"]) == 0
    row = json.load(open(tmp_path / "bench_e2e.json"))["rows"][0]
    assert sorted(int(k.split("_")[1]) for k in row if re.fullmatch(r"ttft_\d+_s", k)) == [24, 40]


def test_a_model_larger_than_host_memory_is_refused_before_building_it(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(bench_e2e, "build_model", lambda *a, **k: pytest.fail("a model was built"))
    monkeypatch.setattr(host_memory, "available_host_bytes", lambda: 8 * 2**30)
    assert main(["bench", "--strategies", "resident", "--device", "cpu", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert "54.0 GiB of host memory (48 layers of 1.12 GiB of experts, held once)" in err and "8.0 GiB available" in err
    assert "--layers 5" in err and "\n" not in err
    # On the CPU an offloading strategy holds the experts twice while it fills its host pool, and
    # its cache is host memory too (at most every expert).
    assert main(["bench", "--layers", "4", "--strategies", "freetoken", "--cache-gib", "2", "--device", "cpu",
                 "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert "11.0 GiB of host memory (4 layers of 1.12 GiB of experts, held twice" in err
    assert "a cache of 2 GiB" in err and "--layers 1" in err


def test_append_to_a_report_of_another_shape_is_refused_before_measuring(tmp_path, monkeypatch, capsys):
    (tmp_path / "bench_e2e.json").write_text(json.dumps(dict(layers=1, rows=[])))
    monkeypatch.setattr(bench_e2e, "build_model", lambda *a, **k: pytest.fail("a model was built"))
    assert main(["bench", "--layers", "2", "--strategies", "resident", "--device", "cpu", "--out", str(tmp_path),
                 "--append"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("freetoken: error: --append:") and "another model shape" in err


@pytest.mark.parametrize("args, message", [
    (["--turn", "64"], "--turn takes two lengths, HISTORY,NEW"),
    (["--strategies", "accelerate"], "measured on --device cuda only"),
    (["--hidden", "0"], "--hidden must be positive, got 0"),
    (["--hidden", "100"], "--hidden 100: give a multiple of 8"),
    (["--top-k", "9", "--experts", "8"], "--top-k 9 routes more experts than a layer has (--experts 8)"),
    (["--out", "/proc/freetoken-bench"], "--out /proc/freetoken-bench: cannot create it"),
    (["--cache-gib", "nan"], "cache sizes must be positive"),
    (["--cache-gib", "inf"], "cache sizes must be positive"),
    (["--strategies", "freetoken", "--cache-gib", "0.5"], "--cache-gib 0.5 holds fewer than one layer's 128 bf16"),
    (["--strategies", "freetoken", "--formats", "fp8", "--cache-gib", "0.5"], "one layer's 128 fp8 experts"),
    (["--strategies", "freetoken", "--formats", "int4", "--cache-gib", "0.2"], "one layer's 128 int4 experts (0.299"),
    (["--decode-tokens", "2"], "--decode-tokens 2: give at least 3"),
    (["--peer-prompts", "longest"], "--peer-prompts longest: give shortest, all, or positive prompt lengths"),
    (["--peer-prompts", "2048,0"], "--peer-prompts 2048,0: give shortest, all"),
    (["--prompts", "16", "--peer-prompts", "99"], "--peer-prompts 99: 99 is not one of --prompts 16"),
])
def test_bench_arguments_are_checked_before_measuring(tmp_path, monkeypatch, capsys, args, message):
    monkeypatch.setattr(bench_e2e, "build_model", lambda *a, **k: pytest.fail("a model was built"))
    assert main(["bench", "--layers", "2", "--device", "cpu", "--out", str(tmp_path), *args]) == 2
    assert message in capsys.readouterr().err


def test_bench_out_that_is_a_file_is_refused(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(bench_e2e, "build_model", lambda *a, **k: pytest.fail("a model was built"))
    (tmp_path / "f").write_text("")
    assert main(["bench", "--layers", "2", "--device", "cpu", "--out", str(tmp_path / "f")]) == 2
    assert "is a file; give a directory" in capsys.readouterr().err


def test_append_replaces_a_strategys_compiled_row_too(tmp_path):
    rows = [dict(strategy="resident"), dict(strategy="resident (compiled decode)"), dict(strategy="other")]

    class A(Args):
        out, device, append = str(tmp_path), "cpu", True

    meta = {k: getattr(A, k) for k in bench_e2e.SHAPE_KEYS + bench_e2e.RUN_KEYS}
    (tmp_path / "bench_e2e.json").write_text(json.dumps(dict(**meta, device="cpu", rows=rows)))
    merged = bench_e2e.appended([dict(strategy="resident", ttft_32_s=1.0)], A)
    assert [r["strategy"] for r in merged] == ["other", "resident"]


def test_append_names_the_policy_of_rows_from_before_rows_recorded_it(tmp_path):
    """Older reports' freetoken rows carry no `eviction`: unnamed ones ran Opportunity, the default
    until 2026-12-02; named ones say theirs."""
    rows = [dict(strategy="freetoken 8 GiB (910 slots)"), dict(strategy="freetoken 8 GiB (910 slots) (compiled decode)"),
            dict(strategy="freetoken 8 GiB (910 slots) lru"), dict(strategy="resident")]

    class A(Args):
        out, device, append = str(tmp_path), "cpu", True

    meta = {k: getattr(A, k) for k in bench_e2e.SHAPE_KEYS + bench_e2e.RUN_KEYS}
    (tmp_path / "bench_e2e.json").write_text(json.dumps(dict(**meta, device="cpu", rows=rows)))
    merged = bench_e2e.appended([dict(strategy="freetoken 16 GiB (1820 slots)", eviction="duel")], A)
    assert [r.get("eviction") for r in merged] == ["opportunity", "opportunity", "lru", None, "duel"]
    # Named now as this version names them (the default, Duel, goes unnamed).
    assert [r["strategy"] for r in merged[:3]] == ["freetoken 8 GiB (910 slots) opportunity",
                                                   "freetoken 8 GiB (910 slots) opportunity (compiled decode)",
                                                   "freetoken 8 GiB (910 slots) lru"]


def test_append_keeps_an_earlier_defaults_rows_beside_todays(tmp_path):
    """A report of a run under an earlier default (hit density, unnamed) and this run's unnamed
    default rows share a name: the earlier rows are renamed by their policy, not replaced; its rows
    that named today's default are today's default rows, which this run's replace."""
    name = "freetoken 16 GiB (1820 slots)"
    rows = [dict(strategy=name, eviction="hitdensity", decode_tok_s=10.0),
            dict(strategy=name + " (compiled decode)", eviction="hitdensity", decode_tok_s=60.0),
            # The same run's rows of today's default, named then: replaced by this run's.
            dict(strategy=f"{name} {bench_e2e.DEFAULT_EVICTION}", eviction=bench_e2e.DEFAULT_EVICTION, decode_tok_s=9.0),
            dict(strategy=f"{name} {bench_e2e.DEFAULT_EVICTION} (compiled decode)", eviction=bench_e2e.DEFAULT_EVICTION,
                 decode_tok_s=59.0)]

    class A(Args):
        out, device, append = str(tmp_path), "cpu", True

    meta = {k: getattr(A, k) for k in bench_e2e.SHAPE_KEYS + bench_e2e.RUN_KEYS}
    (tmp_path / "bench_e2e.json").write_text(json.dumps(dict(**meta, device="cpu", rows=rows)))
    merged = bench_e2e.appended([dict(strategy=name, eviction=bench_e2e.DEFAULT_EVICTION, decode_tok_s=11.0)], A)
    assert [(r["strategy"], r["decode_tok_s"]) for r in merged] == [
        (name + " hitdensity", 10.0), (name + " hitdensity (compiled decode)", 60.0), (name, 11.0)]
    # A row of today's default measured again still replaces its rows.
    (tmp_path / "bench_e2e.json").write_text(json.dumps(dict(**meta, device="cpu", rows=merged)))
    again = bench_e2e.appended([dict(strategy=name, eviction=bench_e2e.DEFAULT_EVICTION, decode_tok_s=12.0)], A)
    assert [r["decode_tok_s"] for r in again] == [10.0, 60.0, 12.0]


def test_bad_arguments(capsys):
    assert main(["bench", "--prompts", "a"]) == 2
    assert main(["bench", "--strategies", "resident,magic"]) == 2
    assert "unknown ['magic']" in capsys.readouterr().err
    assert main(["bench", "--fetch-fractions", "1,1.5"]) == 2
    assert "'1.5' is not a share in [0, 1] or auto" in capsys.readouterr().err
    assert main(["bench", "--evictions", "lru,fifo"]) == 2
    assert "--evictions: unknown ['fifo']" in capsys.readouterr().err
    # Spaces around a list's items are dropped as by every list option: only the unknown one is named.
    assert main(["bench", "--strategies", "freetoken ,magic"]) == 2
    assert "unknown ['magic']" in capsys.readouterr().err
    assert main(["bench", "--evictions", "hitdensity, fifo"]) == 2
    assert "--evictions: unknown ['fifo']" in capsys.readouterr().err
    assert main(["bench", "--formats", "nf4"]) == 2
    assert "--formats nf4: choose from bf16, fp8, int4" in capsys.readouterr().err
    # int4 groups must divide the sizes (quantize="int4" picks 128, 64 or 32): refused before any work.
    assert main(["bench", "--formats", "int4", "--hidden", "40", "--expert-intermediate", "24"]) == 2
    err = capsys.readouterr().err
    assert "--formats int4: no int4 group of 32, 64 or 128 values divides" in err and "use --formats fp8" in err
    assert "quantize=" not in err


@pytest.mark.parametrize("content", ["{bad", "[1, 2]", '{"layers": 2}'])
def test_append_to_a_file_that_is_not_a_report_is_refused_naming_it(tmp_path, monkeypatch, capsys, content):
    (tmp_path / "bench_e2e.json").write_text(content)
    monkeypatch.setattr(bench_e2e, "build_model", lambda *a, **k: pytest.fail("a model was built"))
    assert main(["bench", "--layers", "2", "--strategies", "resident", "--device", "cpu", "--out", str(tmp_path),
                 "--append"]) == 2
    err = capsys.readouterr().err.strip()
    assert f"{tmp_path / 'bench_e2e.json'} is not a" in err and "use another --out" in err and "\n" not in err


def test_the_model_has_positions_for_every_sequence_the_bench_runs():
    class Long(Args):
        prompts, turn, decode_tokens = "32,64", "100,16", 4200
    assert bench_e2e.longest_sequence(Long) == 64 + 4200
    Long.turn = "8000,200"
    assert bench_e2e.longest_sequence(Long) == 8200
    assert bench_e2e.longest_sequence(Args) == 64 + bench_e2e.SLOW_DECODE_TOKENS  # the slow strategies' 6 tokens
