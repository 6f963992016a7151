"""`freetoken trace` records the routing of a greedy generation into the trace format;
`freetoken replay` runs a trace through the runtime; the recorded fixture (a small MoE trained on
real text, tools/train_routing_model.py) replays with hit rates that grow with the cache and hit
nothing below one token's working set (global LRU's cliff)."""
import json
import os
import tempfile
import uuid

import pytest
import torch

from freetoken_plugin.cli import main
from freetoken_plugin.tiny import tiny_model
from ft_ops.replay import replay
from ft_ops.synthetic_routing import calibrate
from ft_ops.traces import Trace
from helpers import require

FIXTURE = os.path.join(os.path.dirname(__file__), "fixtures", "routing", "byte_qwen3moe_8x32_top4.safetensors")
# A path that does not exist: a fixed name such as /nonexistent may have been made by anyone (a bench
# run given --out /nonexistent/x did).
MISSING = os.path.join(tempfile.gettempdir(), f"freetoken-missing-{uuid.uuid4().hex}")


def test_trace_records_every_token_and_layer(tmp_path, capsys):
    require("cpu", "expert_gemm")
    model = tiny_model("qwen3_moe", experts=8, top_k=2)
    model.save_pretrained(tmp_path / "ckpt")
    out = tmp_path / "trace.safetensors"
    assert main(["trace", "--model", str(tmp_path / "ckpt"), "--prompt-ids", "5,6,7,8", "--prompt-ids", "9,10",
                 "--new-tokens", "5", "--out", str(out), "--device", "cpu"]) == 0
    trace = Trace.load(str(out))
    assert trace.prompt_lengths == [4, 2] and trace.experts == 8 and trace.top_k == 2 and trace.layers == 3
    assert [s.shape[0] for s in trace.sequences] == [4 + 5 - 1, 2 + 5 - 1]  # the last token is never fed back
    # The recorded prompt routing is the model's own: its router on the same tokens.
    with torch.no_grad():
        hidden = model.model.embed_tokens(torch.tensor([[5, 6, 7, 8]]))
        layer = model.model.layers[0]
        normed = layer.post_attention_layernorm(hidden + layer.self_attn(layer.input_layernorm(hidden),
                                                position_embeddings=model.model.rotary_emb(hidden, torch.arange(4)[None]),
                                                attention_mask=None)[0])
        _, _, ids = layer.mlp.gate(normed.reshape(-1, normed.shape[-1]))
    assert torch.equal(trace.sequences[0][:4, 0].sort(-1).values, ids.sort(-1).values)


@pytest.mark.slow  # seconds on two cores: in the slow set (pytest -m slow), which CI runs too
def test_replay_of_the_recorded_fixture(tmp_path, capsys):
    require("cpu", "expert_gemm")
    out = tmp_path / "rows.json"
    hits = {}
    for policy in ("lru", "opportunity"):
        assert main(["replay", FIXTURE, "--cache-slots", "16,64,128", "--sequences", "2", "--device", "cpu",
                     "--hidden", "32", "--intermediate", "16", "--eviction", policy, "--json", str(out)]) == 0
        report = json.load(open(out))
        assert report["eviction"] == policy
        hits[policy] = [r["hit_rate"] for r in report["rows"]]
    # Without --eviction the pool takes the default, Duel.
    assert main(["replay", FIXTURE, "--cache-slots", "16", "--sequences", "1", "--device", "cpu",
                 "--hidden", "32", "--intermediate", "16", "--json", str(out)]) == 0
    assert json.load(open(out))["eviction"] == "duel"
    # The prompts' stream-or-admit decisions take fixed rates, not this machine's measured ones.
    assert all(r["rates"] == "given" for r in json.load(open(out))["rows"])
    lru, opportunity = hits["lru"], hits["opportunity"]
    assert lru[0] == 0.0, "16 slots hold less than one token's 32 (layer, expert) pairs: LRU hits nothing"
    assert opportunity[0] > 0.2, "Opportunity has no such cliff"
    assert 0.5 < lru[1] < lru[2] <= 1.0
    assert all(o >= l - 0.01 for o, l in zip(opportunity, lru))
    assert "hit_rate" in capsys.readouterr().out


@pytest.mark.slow  # a whole CLI run (5-10 s): in the slow run, which CI also runs
def test_opportunity_eviction_hits_below_one_tokens_working_set(tmp_path):
    """The same replay with the kernels' Opportunity policy: hits below one token's working set
    (no cliff at 16 slots), and not below LRU at 64."""
    require("cpu", "expert_gemm")
    hits = {}
    for policy in ("lru", "opportunity", "hitdensity"):
        out = tmp_path / f"{policy}.json"
        assert main(["replay", FIXTURE, "--cache-slots", "16,64", "--sequences", "2", "--device", "cpu",
                     "--hidden", "32", "--intermediate", "16", "--eviction", policy, "--json", str(out)]) == 0
        hits[policy] = [r["hit_rate"] for r in json.load(open(out))["rows"]]
    assert hits["lru"][0] == 0.0 and hits["opportunity"][0] > 0.1
    assert hits["opportunity"][1] >= hits["lru"][1] - 0.01
    # Hit density (per-pair reuse estimates) is above Opportunity at both sizes on this trace.
    assert all(h > o for h, o in zip(hits["hitdensity"], hits["opportunity"]))


@pytest.mark.slow  # seconds on two cores: in the slow set (pytest -m slow), which CI runs too
def test_synthetic_routing_is_calibrated_to_the_fixture():
    trace = Trace.load(FIXTURE)
    model, info = calibrate(trace)
    target, reached = info["target"], info["reached"]
    assert abs(reached["reuse"] - target["reuse"]) < 0.03
    assert abs(reached["top10_share"] - target["top10_share"]) < 0.03
    full = model.trace(48, 128, 8, tokens=64, seed=1)  # a full-size shape
    assert full.sequences[0].shape == (65, 48, 8)
    assert all(len(set(row.tolist())) == 8 for row in full.sequences[0].reshape(-1, 8)), "no duplicate in a token"


@pytest.mark.parametrize("argv,message", [
    (["replay", MISSING + ".safetensors", "--cache-slots", "8"], "no such trace file"),
    (["replay", FIXTURE, "--cache-slots", "0"], "must be positive"),
    (["replay", FIXTURE, "--cache-slots", "a,b"], "comma-separated slot counts"),
    (["trace", "--model", MISSING, "--prompt-ids", "1", "--out", "/tmp/t.safetensors"], "no such directory"),
    (["trace", "--model", "/tmp", "--out", "/tmp/t.safetensors"], "--prompt TEXT or --prompt-ids"),
    (["trace", "--model", "/tmp", "--prompt-ids", "x", "--out", "/tmp/t.safetensors"], "comma-separated token ids"),
    (["replay", FIXTURE, "--cache-slots", "8", "--hidden", "-4"], "--hidden must be positive"),
    (["replay", FIXTURE, "--cache-slots", "8", "--json", os.path.join(MISSING, "x.json")], "does not exist"),
    # Found before the work, not after it (a stranger's check): a directory that cannot be written
    # (root may write anywhere permissions say, not in /proc), an id beyond int64, expert sizes whose
    # host pool no machine holds.
    (["replay", FIXTURE, "--cache-slots", "8", "--json", "/proc/x.json"], "cannot write in /proc"),
    (["trace", "--model", "/tmp", "--prompt-ids", "1", "--out", "/proc/t.safetensors"], "cannot write in /proc"),
    (["trace", "--model", "/tmp", "--prompt-ids", "1,99999999999999999999", "--out", "/tmp/t.safetensors"],
     "token id 99999999999999999999 is outside the model's vocabulary"),
    (["replay", FIXTURE, "--cache-slots", "8", "--hidden", "100000000", "--intermediate", "100000000"],
     "check --hidden / --intermediate"),
])
def test_bad_arguments_are_one_line(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err


def test_a_value_starting_with_a_dash_is_explained(capsys):
    with pytest.raises(SystemExit) as stop:
        main(["replay", FIXTURE, "--cache-slots", "-1,4"])
    assert stop.value.code == 2
    err = capsys.readouterr().err.strip()
    assert "expected one argument (a value that starts with '-' reads as an option: write --option=VALUE" in err
    assert "\n" not in err


def test_more_sequences_than_the_trace_holds_is_one_line(capsys):
    assert main(["replay", FIXTURE, "--cache-slots", "8", "--sequences", "1000"]) == 2
    err = capsys.readouterr().err.strip()
    assert "--sequences 1000" in err and "sequence(s)" in err and "\n" not in err


def test_prompt_ids_outside_the_vocabulary_are_one_line(tmp_path, capsys):
    from freetoken_plugin.tiny import tiny_config

    config = tiny_config("qwen3_moe")
    config.save_pretrained(tmp_path)
    argv = ["trace", "--model", str(tmp_path), "--prompt-ids", f"1,{config.vocab_size},3",
            "--out", str(tmp_path / "t.safetensors"), "--device", "cpu"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert f"token id {config.vocab_size} is outside the model's vocabulary" in err and "\n" not in err
    # Beyond the model's positions, and text without tokenizer files: refused before the weights load.
    argv = ["trace", "--model", str(tmp_path), "--prompt-ids", "1,2,3", "--new-tokens", str(10 ** 6),
            "--out", str(tmp_path / "t.safetensors"), "--device", "cpu"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert f"exceed the model's {config.max_position_embeddings} positions; give at most" in err and "\n" not in err
    argv = ["trace", "--model", str(tmp_path), "--prompt", "hello", "--out", str(tmp_path / "t.safetensors")]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "lacks (tokenizer.json" in err and "--prompt-ids" in err and "\n" not in err
    argv = ["trace", "--model", str(tmp_path), "--prompt-ids", "1", "--out", str(tmp_path)]
    assert main(argv) == 2
    assert "is a directory; give the trace file's name" in capsys.readouterr().err


def test_every_cache_size_is_checked_before_the_first_replay(tmp_path, capsys):
    trace = Trace.load(FIXTURE)
    for sizes, message in ((f"64,{trace.top_k - 1}", f"give at least {trace.top_k}"),
                           (f"64,{trace.layers * trace.experts + 1}", f"give at most {trace.layers * trace.experts}")):
        assert main(["replay", FIXTURE, "--cache-slots", sizes, "--sequences", "1", "--device", "cpu"]) == 2
        out, err = capsys.readouterr()
        assert message in err and "\n" not in err.strip() and "hit_rate" not in out
    assert main(["replay", FIXTURE, "--cache-slots", "64", "--json", str(tmp_path)]) == 2
    assert "is a directory; give the report's file name" in capsys.readouterr().err
    assert main(["replay", FIXTURE, "--cache-slots", "64", "--device", "gpu"]) == 2


def test_a_file_that_is_not_a_trace_is_one_line(tmp_path, capsys):
    not_safetensors = tmp_path / "notes.safetensors"
    not_safetensors.write_text("hello")
    assert main(["replay", str(not_safetensors), "--cache-slots", "8"]) == 2  # a bad argument, as the directory below
    err = capsys.readouterr().err.strip()
    assert f"{not_safetensors} is not a safetensors file" in err and "freetoken trace" in err and "\n" not in err
    assert main(["replay", str(tmp_path), "--cache-slots", "8"]) == 2
    err = capsys.readouterr().err.strip()
    assert f"{tmp_path} is a directory; pass a trace file" in err and "\n" not in err
    # Traces made by hand that do not hold together: a gap in the numbering, a top-k of 0, float ids,
    # metadata that does not parse, prompt lengths for another number of sequences.
    from safetensors.torch import save_file

    ids = torch.zeros(5, 2, 2, dtype=torch.int16)
    meta = {"prompt_lengths": "[2]", "experts": "8"}
    for case, tensors, metadata in [("gap", {"expert_ids.0": ids, "expert_ids.2": ids}, {**meta, "prompt_lengths": "[2, 2]"}),
                                    ("top0", {"expert_ids.0": ids[:, :, :0]}, meta),
                                    ("float", {"expert_ids.0": ids.float()}, meta),
                                    ("meta", {"expert_ids.0": ids}, {**meta, "experts": "abc"}),
                                    ("prompts", {"expert_ids.0": ids}, {**meta, "prompt_lengths": "[2, 3]"}),
                                    ("fraction", {"expert_ids.0": ids}, {**meta, "prompt_lengths": "[2.7]"}),
                                    ("zeros", {"expert_ids.00": ids}, meta),
                                    ("bool", {"expert_ids.0": ids.bool()}, meta),
                                    ("topk", {"expert_ids.0": ids}, {**meta, "experts": "1"}),
                                    ("layers", {"expert_ids.0": ids}, {**meta, "layers": "7"})]:
        bad = tmp_path / f"{case}.safetensors"
        save_file({k: v.clone().contiguous() for k, v in tensors.items()}, str(bad), metadata=metadata)
        assert main(["replay", str(bad), "--cache-slots", "8"]) == 2, case
        err = capsys.readouterr().err.strip()
        assert f"{bad} is not a routing trace" in err and "\n" not in err, (case, err)


def test_a_trace_with_a_negative_expert_shape_and_an_interrupted_command_are_one_line(tmp_path, capsys, monkeypatch):
    from safetensors.torch import save_file

    import freetoken_plugin.cli_routing as cli_routing

    bad = tmp_path / "negative.safetensors"
    save_file({"expert_ids.0": torch.zeros(5, 2, 2, dtype=torch.int16)}, str(bad),
              metadata={"prompt_lengths": "[2]", "experts": "8", "hidden": "-64", "intermediate": "32"})
    assert main(["replay", str(bad), "--cache-slots", "8"]) == 2
    err = capsys.readouterr().err.strip()
    assert "the expert shape must be positive (or 0: unknown), got hidden -64" in err and "\n" not in err

    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli_routing, "replay_command", interrupted)
    assert main(["replay", FIXTURE, "--cache-slots", "8"]) == 130
    assert capsys.readouterr().err.strip() == "freetoken: interrupted"


@pytest.mark.parametrize("threads", [3, pytest.param(5, marks=pytest.mark.slow)])
def test_replay_reports_how_the_cpu_rows_spread_over_the_row_threads(threads):
    """With every miss left to the CPU share, a replay reports the share of the row kernel's chunks
    that helper threads ran and the wakes a job: none split with one row thread (torch's threads
    less two: 3), some with three (5)."""
    require("cpu", "expert_gemm")
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        trace = Trace.load(FIXTURE)
        trace.sequences = trace.sequences[:1]
        row = replay(trace, 64, fetch_fraction=0.0, device="cpu", hidden=64, intermediate=32)
    finally:
        torch.set_num_threads(before)
    assert row["cpu_rows_per_token"] > 0 and row["cpu_wakes_per_job"] >= 0
    if threads - 2 > 1:
        assert 0.0 <= row["cpu_helper_chunk_share"] <= 1.0
    else:
        assert row["cpu_helper_chunk_share"] is None


@pytest.mark.slow  # seconds on two cores: in the slow set (pytest -m slow), which CI runs too
def test_traces_replay_cannot_measure_are_refused(tmp_path, capsys):
    """A trace of one new token records no decode step: trace refuses it. A trace whose decode
    steps replay would all spend on its warm-up (trace notes it when it writes it), and a synthetic trace without the experts' shape
    (without --hidden / --intermediate), are refused by replay. A checkpoint without experts is a
    bad --model (exit 2)."""
    require("cpu", "expert_gemm")
    from ft_ops.synthetic_routing import calibrate

    model = tiny_model("qwen3_moe", experts=8, top_k=2)
    model.save_pretrained(tmp_path / "ckpt")
    out = tmp_path / "t.safetensors"
    assert main(["trace", "--model", str(tmp_path / "ckpt"), "--prompt-ids", "1,2,3", "--new-tokens", "1",
                 "--out", str(out), "--device", "cpu"]) == 2
    assert "--new-tokens must be at least 2" in capsys.readouterr().err
    assert main(["trace", "--model", str(tmp_path / "ckpt"), "--prompt-ids", "1,2,3", "--new-tokens", "2",
                 "--out", str(out), "--device", "cpu"]) == 0
    assert "replay` measures the steps after the first" in capsys.readouterr().out  # trace says so at once
    assert main(["replay", str(out), "--cache-slots", "8", "--device", "cpu"]) == 2
    assert "holds 1 decode step(s)" in capsys.readouterr().err
    synthetic = tmp_path / "synthetic.safetensors"
    calibrate(Trace.load(FIXTURE))[0].trace(2, 8, 2, tokens=6, seed=0).save(str(synthetic))
    assert main(["replay", str(synthetic), "--cache-slots", "8", "--device", "cpu"]) == 2
    assert "give --hidden H --intermediate I" in capsys.readouterr().err
    assert main(["replay", str(synthetic), "--cache-slots", "8", "--device", "cpu", "--hidden", "32",
                 "--intermediate", "16"]) == 0
    import transformers as tf

    dense = tf.AutoModelForCausalLM.from_config(tf.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                                               num_hidden_layers=1, num_attention_heads=2))
    dense.save_pretrained(tmp_path / "dense")
    assert main(["trace", "--model", str(tmp_path / "dense"), "--prompt-ids", "1,2,3", "--new-tokens", "4",
                 "--out", str(out), "--device", "cpu"]) == 2
    assert "no experts block freetoken serves" in capsys.readouterr().err


def test_trace_keeps_the_command_lines_order_of_prompts(tmp_path, capsys):
    """--prompt and --prompt-ids mixed: the sequences come in the order the options were given."""
    require("cpu", "expert_gemm")
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(vocab={f"w{i}": i for i in range(64)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="w0").save_pretrained(tmp_path)
    tiny_model("qwen3_moe", experts=8, top_k=2).save_pretrained(tmp_path)
    out = tmp_path / "t.safetensors"
    assert main(["trace", "--model", str(tmp_path), "--prompt", "w5", "--prompt-ids", "1,2,3", "--prompt", "w7 w8",
                 "--new-tokens", "3", "--out", str(out), "--device", "cpu"]) == 0
    assert Trace.load(str(out)).prompt_lengths == [1, 3, 2]


def test_next_layer_prediction_scores_rules_against_blind_guessing(tmp_path):
    """tools/next_layer_prediction.py on the random-weight model's trace: every rule's share is a
    share, blind guessing gets budget / (experts - held), and a rule that guesses every expert
    outside the previous token's catches every new one."""
    import json
    import os
    import sys
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tools"))
    from ft_ops.traces import Trace
    from next_layer_prediction import main, recall

    path = os.path.join(os.path.dirname(__file__), "fixtures", "routing", "random_qwen3moe_3x16_top2.safetensors")
    out = tmp_path / "rows.json"
    assert main([path, "--out", str(out)]) == 0
    rows = json.loads(out.read_text())
    assert {r["guesses"] for r in rows if "lru_share" not in r} == {2, 4, 6}
    for r in rows:
        for rule in ("random", "frequency", "affinity"):
            assert 0.0 <= r[rule] <= 1.0, r
    trace = Trace.load(path)
    everything = recall(trace, trace.experts)
    assert everything["frequency"] == everything["affinity"] == everything["random"] == 1.0


def test_pregate_prediction_scores_the_next_router_on_the_hidden_state(tmp_path):
    """tools/pregate_prediction.py: the routing it reads is the model's own (its routers' top-k);
    where attention and experts add nothing to the residual stream the next router sees what this
    one saw, so the pre-gate guesses every new expert with top_k guesses, and on a model whose
    layers change the stream it does not; a score that ranks the truth last guesses nothing; the
    command's rows are shares."""
    import json
    import os
    import sys
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tools"))
    from pregate_prediction import main, routed_and_pregated
    from next_layer_prediction import miss_recall, recall
    from ft_ops.traces import Trace

    K = 2
    model = tiny_model("qwen3_moe", experts=8, top_k=K).float().eval()
    ids = torch.randint(0, model.config.vocab_size, (40,), generator=torch.Generator().manual_seed(3))
    own = []  # each router's top-k from the input it receives in the model's own forward
    hooks = [layer.mlp.gate.register_forward_pre_hook(
        lambda m, a: own.append(torch.nn.functional.linear(a[0].reshape(-1, a[0].shape[-1]), m.weight).topk(K).indices))
        for layer in model.model.layers]
    routed, pre = routed_and_pregated(model, ids, K)
    for h in hooks:
        h.remove()
    for l, indices in enumerate(own):
        assert [set(r) for r in indices.tolist()] == [set(r) for r in routed[:, l].tolist()], f"layer {l}"
    trace = Trace(sequences=[routed], prompt_lengths=[1], experts=8)
    r = recall(trace, K, [pre.numpy()])
    assert 0 < r["pregate"] < 1 and 0 < r["pregate_precision"] < 1  # the layers change the stream

    still = tiny_model("qwen3_moe", experts=8, top_k=K).float().eval()
    with torch.no_grad():
        for layer in still.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.experts.down_proj.zero_()
    routed, pre = routed_and_pregated(still, ids, K)
    trace = Trace(sequences=[routed], prompt_lengths=[1], experts=8)
    assert recall(trace, K, [pre.numpy()])["pregate"] == 1.0
    assert recall(trace, K, [-pre.numpy()])["pregate"] == 0.0
    assert 0.0 <= miss_recall(trace, 1, 0.5, [pre.numpy()])["pregate"] <= 1.0

    model.save_pretrained(tmp_path / "model")
    out = tmp_path / "rows.json"
    assert main(["--model", str(tmp_path / "model"), "--sequences", "2", "--tokens", "24", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())
    assert [r["guesses"] for r in rows if "lru_share" not in r] == [1, 2, 4]
    assert {(r["lru_share"], r["guesses"]) for r in rows if "lru_share" in r} == {(s, g) for s in (0.25, 0.5) for g in (1, 2)}
    for r in rows:
        for rule in ("pregate", "pregate_precision", "affinity", "frequency", "random"):
            assert 0.0 <= r.get(rule, 0.0) <= 1.0, r


@pytest.mark.slow  # seconds on two cores: in the slow set (pytest -m slow), which CI runs too
def test_prefetch_bound_timeline_known_answers(capsys):
    """tools/prefetch_bound.py's timeline: no misses take layers x (a + g); a miss on demand adds its
    copy; a predicted miss whose copy fits the window before its GEMM (the previous layer's GEMM and
    this layer's attention) adds nothing, one that does not adds the rest; layer 0 is never
    predicted; the link serves copies one after another (two predicted misses take twice as
    long); the command calibrates the layer time so that no prefetch reproduces the measured token."""
    import sys
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tools"))
    from prefetch_bound import bound_rows, main, token_times

    a, g = 80.0, 20.0
    none = lambda t, l, m: 0
    every = lambda t, l, m: m
    assert token_times([[0, 0, 0]] * 4, a, g, 50.0, every) == [300.0] * 4
    assert token_times([[0, 1, 0]], a, g, 50.0, none) == [350.0]
    assert token_times([[0, 1, 0]], a, g, 50.0, every) == [300.0]     # 50 us of copy within the 100 us window
    assert token_times([[0, 1, 0]], a, g, 130.0, every) == [330.0]    # 30 us past it
    assert token_times([[1, 0, 0]], a, g, 50.0, every) == [350.0]     # layer 0: on demand
    assert token_times([[0, 2, 0]], a, g, 90.0, every) == [380.0]     # 180 us of copies, 100 us of window
    # Two layers ahead: layer 2's copy starts at layer 0's experts part, 200 us before it is needed.
    assert token_times([[0, 0, 1, 0]], a, g, 150.0, every, ahead=2) == [400.0]
    assert token_times([[0, 0, 1, 0]], a, g, 150.0, every, ahead=1) == [450.0]
    assert token_times([[0, 1, 0, 0]], a, g, 50.0, every, ahead=2) == [450.0]  # layer 1: too early to know
    # Across tokens the link carries over: a token's last-layer miss delays nothing of the next token
    # but its own layer.
    assert token_times([[0, 0, 1], [0, 0, 0]], a, g, 50.0, none) == [350.0, 300.0]

    report = bound_rows([[0, 2, 1, 0]] * 10, token_ms=1.0, resident_ms=0.5, x_us=100.0, g_us=20.0)
    rows = {r["rule"]: r for r in report["rows"]}
    assert report["layer_us"] == (1000.0 - 300.0) / 4
    assert rows["none"]["ms_per_token"] == 1.0 and rows["none"]["x_resident"] == 2.0
    assert rows["oracle"]["ms_per_token"] <= rows["oracle, 1 a layer"]["ms_per_token"] <= 1.0
    with pytest.raises(ValueError, match="below its misses' copies"):
        bound_rows([[3, 3]], token_ms=0.5, resident_ms=0.5, x_us=100.0, g_us=20.0)
    assert main(["--token-ms", "12.77", "--resident-ms", "7.66", "--tokens", "40", "--layers", "8"]) == 0
    out = capsys.readouterr().out
    assert "| none | 12.77 |" in out and "| oracle |" in out


def test_replay_counts_decode_steps_that_stream_their_layer():
    """A trace whose every token routes to every expert (top-k = experts): decode steps stream
    their whole layer rather than admit; the replay's link traffic and hit rate count those copies
    (they once counted admissions only: 0 MB a token and no hit rate)."""
    layers, experts = 2, 4
    tokens = torch.arange(experts).repeat(6, layers, 1)  # [tokens, layers, top_k]: every expert, every layer
    trace = Trace([tokens.to(torch.int16)], [2], experts, 16, 8, "every expert routed")
    small = replay(trace, cache_slots=experts, device="cpu", cuda_graph=False)
    assert small["streamed_prompt_layers"] == layers  # the one prompt's (not the untimed first decode step's)
    assert small["streamed_decode_layers"] == layers * (6 - 2 - 1)  # the timed steps: each streams every layer
    assert small["MB_over_link_per_token"] > 0 and small["hit_rate"] is not None and small["hit_rate"] < 1
    whole = replay(trace, cache_slots=layers * experts, device="cpu", cuda_graph=False)
    assert whole["hit_rate"] == 1.0 and whole["MB_over_link_per_token"] == 0.0
