"""The console entry point: `freetoken demo` with the built-in model and with a checkpoint, `generate`,
the argument checks that answer before any model is built, and one-line errors."""
import pytest
import torch

import freetoken_plugin
from freetoken_plugin import cli, cli_routing
from freetoken_plugin.cli import main
from freetoken_plugin.tiny import tiny_model
from helpers import require


def test_demo_with_the_built_in_model(capsys):
    require("cpu", "expert_gemm")
    assert main(["demo", "--device", "cpu", "--prompt-tokens", "12", "--new-tokens", "4"]) == 0
    out = capsys.readouterr().out
    assert "identical" in out and "time to first token" in out and "decode hit rate" in out
    assert "duel eviction" in out, "the default policy is named"


def test_demo_with_a_checkpoint(tmp_path, capsys):
    require("cpu", "expert_gemm")
    tiny_model("mixtral").save_pretrained(tmp_path, max_shard_size="200KB")
    assert main(["demo", "--device", "cpu", "--model", str(tmp_path), "--cache-slots", "16",
                 "--prompt-tokens", "8", "--new-tokens", "3", "--eviction", "opportunity"]) == 0
    out = capsys.readouterr().out
    assert "identical" in out and "opportunity eviction" in out


def test_a_demo_whose_reference_transformers_cannot_load_is_refused(tmp_path, capsys):
    """Mixtral's experts under gate_proj / up_proj / down_proj (as llm-compressor writes them), which
    load_model reads and transformers' Mixtral does not (it leaves the experts newly initialized): the
    demo says it has no reference instead of reporting different tokens; generate runs."""
    require("cpu", "expert_gemm")
    import os

    from safetensors.torch import load_file, save_file

    tiny_model("mixtral").save_pretrained(tmp_path)
    file = os.path.join(tmp_path, "model.safetensors")
    names = {".w1.": ".gate_proj.", ".w3.": ".up_proj.", ".w2.": ".down_proj."}
    renamed = {}
    for name, t in load_file(file).items():
        for old, new in names.items():
            name = name.replace(old, new) if ".experts." in name else name
        renamed[name] = t
    save_file(renamed, file, metadata={"format": "pt"})
    assert main(["demo", "--device", "cpu", "--model", str(tmp_path), "--prompt-tokens", "8", "--new-tokens", "3"]) == 1
    err = capsys.readouterr().err
    assert "from_pretrained leaves" in err and "newly initialized" in err and "freetoken generate --model" in err
    assert main(["generate", "--model", str(tmp_path), "--prompt-ids", "3,4,5", "--device", "cpu",
                 "--new-tokens", "2"]) == 0


def test_demo_of_a_checkpoint_in_bf16_on_the_cpu(tmp_path, capsys):
    """--dtype: a checkpoint on the CPU in bfloat16 (the default there is float32); the
    layer-shaped demo, bf16 by construction, refuses another dtype in one line."""
    require("cpu", "expert_gemm")
    tiny_model("qwen3_moe").save_pretrained(tmp_path)
    assert main(["demo", "--device", "cpu", "--model", str(tmp_path), "--dtype", "bfloat16", "--prompt-tokens", "8",
                 "--new-tokens", "3"]) == 0
    out = capsys.readouterr().out
    assert "torch.bfloat16" in out and "greedy tokens" in out and "DIFFERENT" not in out
    assert main(["demo", "--device", "cpu", "--shape", "qwen3-30b-a3b", "--dtype", "float32"]) == 2
    assert "--dtype float32: the Qwen3-30B-A3B-shaped demo runs in bfloat16" in capsys.readouterr().err


@pytest.mark.parametrize("source", ["model", "arch"])
def test_a_16_bit_demo_is_judged_against_the_float32_model(tmp_path, capsys, source):
    """GPT-OSS in bfloat16: its logits round by more than the fixed 16-bit tolerance, so the demo of
    a checkpoint or the built-in model judged a correct offload "DIFFERENT" (exit 1); it compares
    both models with the same model in float32 now, as the layer-shaped demo does."""
    require("cpu", "expert_gemm")
    if source == "model":
        tiny_model("gpt_oss").save_pretrained(tmp_path)
        what = ["--model", str(tmp_path)]
    else:
        what = ["--arch", "gpt_oss"]
    assert main(["demo", "--device", "cpu", *what, "--dtype", "bfloat16"]) == 0
    out = capsys.readouterr().out
    assert "torch.bfloat16" in out and "DIFFERENT" not in out


def test_unknown_architecture_is_refused():
    with pytest.raises(SystemExit):
        main(["demo", "--arch", "llama"])


def test_generate_from_a_checkpoint_with_a_tokenizer(tmp_path, capsys):
    require("cpu", "expert_gemm")
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(512)}
    vocab.update({"hello": 3, "world": 4})
    tok = Tokenizer(models.WordLevel(vocab={k: v for k, v in vocab.items() if v < 512}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="w0").save_pretrained(tmp_path)
    tiny_model("olmoe").save_pretrained(tmp_path, max_shard_size="200KB")
    assert main(["generate", "--model", str(tmp_path), "--prompt", "hello world", "--device", "cpu",
                 "--new-tokens", "3", "--eviction", "lru"]) == 0
    out = capsys.readouterr().out.strip().split()
    assert len(out) == 3 and all(w.startswith("w") or w in vocab for w in out)


def test_argparse_errors_are_one_line(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["demo", "--eviction", "fifo"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert "invalid choice: 'fifo'" in err and "freetoken demo --help" in err and "\n" not in err


def test_cache_bytes_take_units():
    from freetoken_plugin.cli import parse_bytes

    assert parse_bytes("16GiB") == 16 * 2**30 and parse_bytes("1.5 GB") == 1_500_000_000
    assert parse_bytes("4096") == 4096
    with pytest.raises(Exception, match="is not a size"):
        parse_bytes("16 parsecs")
    # Plain numbers of bytes in decimal or scientific notation, if whole; a unit keeps taking fractions.
    assert parse_bytes("1e9") == parse_bytes("1E9") == parse_bytes("1.0e9") == 10**9
    assert parse_bytes("2.5e3") == parse_bytes("1000.0") + 1500 == 2500 and parse_bytes("1.5e3 KiB") == 1500 * 2**10
    for text, match in (("1.5", "'1.5' is not a whole number of bytes: give whole bytes"),
                        ("1e-3", "less than one byte"), ("1e400", "too large a size"), ("1e", "is not a size"),
                        ("-1e9", "a size must be positive")):
        with pytest.raises(Exception, match=match):
            parse_bytes(text)


def test_compare_greedy_accepts_flips_only_after_a_near_tie():
    import torch

    from freetoken_plugin.cli import compare_greedy

    want = torch.tensor([[5, 6, 1, 2, 3]])
    logits = torch.zeros(3, 8)
    logits[0, 1], logits[1, 2], logits[2, 3] = 4.0, 4.0, 4.0
    close = logits + 0.01
    assert compare_greedy(want, want.clone(), logits, close, 2) == (True, "identical")
    flipped = torch.tensor([[5, 6, 1, 7, 3]])
    assert compare_greedy(want, flipped, logits, close, 2, torch.bfloat16) == (False, "DIFFERENT at step 2")
    tie = logits.clone()
    tie[1, 7] = 3.99  # step 2 of the reference is a near tie: a flip there is rounding
    assert compare_greedy(want, flipped, tie, tie + 0.01, 2, torch.bfloat16) == (True, "equal to a near tie at step 2")
    # ... but only while the logits agree to the dtype's rounding: a model 0.5 off flips ties too.
    ok, verdict = compare_greedy(want, flipped, tie, tie + 0.5, 2, torch.bfloat16)
    assert not ok and verdict.startswith("DIFFERENT at step 2 (logits differ by 1.2e-01 of their size")
    ok, verdict = compare_greedy(want, flipped, tie, tie + 0.01, 2)  # float32 rounds far finer than 0.01
    assert not ok and "beyond torch.float32's rounding" in verdict
    # NaN logits (a damaged checkpoint) give equal argmaxes in both models: not a match.
    broken = logits.clone()
    broken[1, 3] = float("nan")
    ok, verdict = compare_greedy(want, want.clone(), broken, broken.clone(), 2)
    assert not ok and verdict.startswith("NOT COMPARED: the reference's logits hold inf or NaN")
    ok, verdict = compare_greedy(want, want.clone(), logits, broken, 2)
    assert not ok and verdict == "DIFFERENT: the offloaded model's logits hold inf or NaN"


def test_compare_greedy_measures_rounding_against_exact_logits():
    """With the float32 model's logits, the tolerance is the reference's own distance to them: a
    random-weight bf16 model whose rounding moves its logits by 12 % may flip a near tie, one twice
    as far off as that again may not."""
    import torch

    from freetoken_plugin.cli import compare_greedy

    want = torch.tensor([[5, 6, 1, 2, 3]])
    exact = torch.zeros(3, 8)
    exact[0, 1], exact[1, 2], exact[2, 3] = 4.0, 4.0, 4.0
    exact[1, 7] = 3.9
    reference = exact + 0.5                 # bf16's own rounding: 0.5 on logits of 4 (12 %)
    flipped = torch.tensor([[5, 6, 1, 7, 3]])
    close = exact - 0.6                     # as far from exact as the reference, the other way
    assert compare_greedy(want, flipped, reference, close, 2, torch.bfloat16, exact) == (
        True, "equal to a near tie at step 2")
    far = exact + 1.5                       # 3x the reference's distance
    ok, verdict = compare_greedy(want, flipped, reference, far, 2, torch.bfloat16, exact)
    assert not ok and verdict == ("DIFFERENT at step 2 (logits 3.8e-01 of their size from the float32 model's, "
                                  "3.0x the reference's own 1.2e-01)")


def test_demo_on_cuda(capsys):
    require("cuda", "expert_gemm")
    assert main(["demo", "--device", "cuda", "--shape", "tiny", "--prompt-tokens", "12", "--new-tokens", "6"]) == 0
    out = capsys.readouterr().out
    assert "identical" in out and "cuda" in out


def test_layer_shaped_demo_on_cuda(capsys):
    """The GPU default: Qwen3-30B-A3B-shaped bf16 layers beside resident and accelerate."""
    require("cuda", "expert_gemm")
    assert main(["demo", "--device", "cuda", "--layers", "2", "--prompt-tokens", "256", "--new-tokens", "4"]) == 0
    out = capsys.readouterr().out
    assert "Qwen3-30B-A3B's shape" in out and "all resident" in out and "accelerate offload" in out


def test_layer_shaped_demo_runs_its_three_columns(monkeypatch, capsys):
    """The layer-shaped demo's code path on the CPU at a small width (no accelerate column there)."""
    require("cpu", "expert_gemm")
    monkeypatch.setattr(cli, "LAYER_SHAPE", dict(hidden=128, experts=8, top_k=2, expert_intermediate=64))
    assert main(["demo", "--device", "cpu", "--shape", "qwen3-30b-a3b", "--layers", "2", "--prompt-tokens", "48",
                 "--new-tokens", "3"]) == 0
    out = capsys.readouterr().out
    assert "freetoken demo: 2 MoE layers x 8 experts" in out and "all resident" in out
    assert "greedy tokens" in out and "DIFFERENT" not in out


def one_error_line(capsys) -> str:
    captured = capsys.readouterr()
    lines = captured.err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("freetoken: error: "), captured.err
    assert "Traceback" not in captured.err and captured.out == ""
    return lines[0]


@pytest.fixture
def no_model_is_built(monkeypatch):
    """The checks under test must answer before a model (or transformers) is reached."""
    import freetoken_plugin.cli as cli

    monkeypatch.setattr(cli, "_demo", lambda args: pytest.fail("the demo started"))
    monkeypatch.setattr(cli, "_generate", lambda args: pytest.fail("generation started"))


def test_generate_reports_the_checkpoints_fault_before_the_tokenizers(tmp_path, capsys):
    """A checkpoint without a model type, or without weights, is named as such: the tokenizer would
    fail on it first with a message about tokenizer backends or an empty prompt."""
    (tmp_path / "config.json").write_text("{}")
    assert main(["generate", "--model", str(tmp_path), "--prompt", "hi", "--device", "cpu"]) == 2  # a bad --model
    assert "has no model_type" in one_error_line(capsys)
    from freetoken_plugin.tiny import tiny_config

    tiny_config("qwen3_moe").save_pretrained(tmp_path)
    assert main(["generate", "--model", str(tmp_path), "--prompt", "hi", "--device", "cpu"]) == 2  # a bad --model
    assert "has no model.safetensors" in one_error_line(capsys)


def test_bad_arguments_are_refused_in_one_line_before_any_model(tmp_path, capsys, no_model_is_built):
    assert main(["demo", "--model", str(tmp_path / "nowhere")]) == 2
    assert f"--model {tmp_path / 'nowhere'}: no such directory" in one_error_line(capsys)
    assert main(["generate", "--model", str(tmp_path), "--prompt", "hi"]) == 2
    assert "has no config.json" in one_error_line(capsys)
    (tmp_path / "config.json").write_text("{}")
    assert main(["generate", "--model", str(tmp_path), "--prompt", "   "]) == 2
    assert "--prompt is empty" in one_error_line(capsys)
    assert main(["demo", "--prompt-tokens", "0"]) == 2
    assert "--prompt-tokens must be at least 1" in one_error_line(capsys)
    assert main(["demo", "--experts", "3"]) == 2
    assert "--experts 3 is below the demo model's top-k of 4" in one_error_line(capsys)
    assert main(["demo", "--new-tokens", "0"]) == 2
    assert "--new-tokens must be at least 1" in one_error_line(capsys)
    assert main(["demo", "--shape", "tiny", "--layers", "2"]) == 2
    assert "--layers sets the qwen3-30b-a3b shape's layers" in one_error_line(capsys)
    assert main(["demo", "--model", str(tmp_path), "--arch", "mixtral"]) == 2
    assert "--arch and --model" in one_error_line(capsys)


def test_errors_are_one_line_and_exit_non_zero(monkeypatch, capsys):
    """Bad arguments (a device this process cannot use among them) exit 2, failures during the work 1."""
    import freetoken_plugin.cli as cli

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["demo", "--device", "cuda"]) == 2
    line = one_error_line(capsys)
    assert "--device cuda was asked for, but CUDA is not available" in line and "pass --device cpu" in line
    assert main(["demo", "--device", "banana"]) == 2
    assert "--device banana is not a device: freetoken runs experts on 'cuda'" in one_error_line(capsys)
    # bench's checks that depend on the device (its host memory at 48 layers) come after the device's.
    assert main(["bench", "--device", "cuda"]) == 2
    assert "--device cuda was asked for, but CUDA is not available" in one_error_line(capsys)

    def fails(args):
        raise RuntimeError("something broke\n  on a second line")

    monkeypatch.setattr(cli, "_demo", fails)
    assert main(["demo", "--device", "cpu"]) == 1
    assert one_error_line(capsys) == "freetoken: error: something broke on a second line"
    # --traceback prints the whole traceback and exits as without it (a script sees the same status).
    assert main(["--traceback", "demo", "--device", "cpu"]) == 1
    err = capsys.readouterr().err
    assert "Traceback (most recent call last)" in err and "RuntimeError: something broke" in err
    # after the command too; without it, the one line again
    assert main(["demo", "--device", "cpu", "--traceback"]) == 1
    assert "Traceback (most recent call last)" in capsys.readouterr().err
    assert main(["demo", "--device", "cpu"]) == 1
    assert one_error_line(capsys) == "freetoken: error: something broke on a second line"

    def refuses(args):
        raise cli_routing.UsageError("a bad trace")

    monkeypatch.setattr(cli, "_demo", refuses)
    assert main(["--traceback", "demo", "--device", "cpu"]) == 2


def test_one_new_token_has_no_decode_rate(capsys):
    require("cpu", "expert_gemm")
    assert main(["demo", "--device", "cpu", "--prompt-tokens", "8", "--new-tokens", "1"]) == 0
    out = capsys.readouterr().out
    decode = next(line for line in out.splitlines() if line.startswith("decode "))
    assert decode.split()[1:] == ["-", "-"] and "0.0 tokens/s" not in out


@pytest.mark.slow  # seconds on two cores: in the slow set (pytest -m slow), which CI runs too
def test_a_missing_model_directory_is_refused_without_importing_transformers(tmp_path):
    import os
    import subprocess
    import sys

    script = ("import sys; from freetoken_plugin.cli import main; "
              f"rc = main(['generate', '--model', {str(tmp_path / 'nowhere')!r}, '--prompt', 'hi']); "
              "print(rc, 'transformers' in sys.modules)")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, os.path.join(root, "plugin"), os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, check=True)
    assert out.stdout.split() == ["2", "False"]
    assert out.stderr.strip().endswith("no such directory; pass a local checkpoint directory (config.json and "
                                       "safetensors shards)")  # a path, not a hub id: no download hint
    out = subprocess.run([sys.executable, "-c", script.replace(repr(str(tmp_path / "nowhere")), "'Org/model-x'")],
                         capture_output=True, text=True, env=env, check=True)
    assert out.stdout.split() == ["2", "False"]
    assert "for a Hugging Face Hub id, download it first (hf download Org/model-x" in out.stderr


def test_the_built_in_model_follows_the_arguments():
    """On a GPU the default is the Qwen3-30B-A3B-shaped model; --arch or --experts ask for the tiny
    one, as does a checkpoint or the CPU; --shape decides when given."""
    from types import SimpleNamespace

    def shape(device="cuda", **kw):
        args = dict(shape=None, arch=None, experts=None, model=None)
        args.update(kw)
        return cli._shape_of(SimpleNamespace(**args), torch.device(device).type)

    assert shape() == "qwen3-30b-a3b"
    assert shape(arch="gpt_oss") == shape(experts=32) == shape(model="ckpt") == shape("cpu") == "tiny"
    assert shape("cpu", shape="qwen3-30b-a3b") == "qwen3-30b-a3b" and shape(shape="tiny") == "tiny"


def test_demo_refuses_a_dense_checkpoint_before_loading_it(tmp_path, monkeypatch, capsys):
    """A checkpoint load_model cannot serve (here a dense Llama) is refused in one line before the
    demo loads its weights for the reference generation."""
    import transformers as tf

    config = tf.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                            num_attention_heads=2, num_key_value_heads=2)
    tf.LlamaForCausalLM(config).save_pretrained(tmp_path)
    capsys.readouterr()  # transformers' own progress while saving
    monkeypatch.setattr(tf.AutoModelForCausalLM, "from_pretrained",
                        lambda *a, **k: pytest.fail("the demo loaded the checkpoint's weights"))
    assert main(["demo", "--device", "cpu", "--model", str(tmp_path)]) == 2  # a bad --model
    assert "LlamaForCausalLM (llama) has no experts block freetoken serves" in one_error_line(capsys)


def test_demo_refuses_a_checkpoint_without_safetensors_before_loading_it(tmp_path, monkeypatch, capsys):
    """load_model reads safetensors shards only; the demo says so before loading a .bin checkpoint."""
    import transformers as tf

    from freetoken_plugin.tiny import tiny_model

    model = tiny_model("qwen3_moe")
    model.save_pretrained(tmp_path)
    for shard in tmp_path.glob("*.safetensors*"):  # the weights as a torch pickle instead
        shard.unlink()
    torch.save(model.state_dict(), tmp_path / "pytorch_model.bin")
    capsys.readouterr()
    monkeypatch.setattr(tf.AutoModelForCausalLM, "from_pretrained",
                        lambda *a, **k: pytest.fail("the demo loaded the checkpoint's weights"))
    assert main(["demo", "--device", "cpu", "--model", str(tmp_path)]) == 2  # a bad --model
    assert "safetensors" in one_error_line(capsys)


def test_warnings_of_the_command_line_are_one_line(capsys):
    import warnings

    import freetoken_plugin.cli as cli

    before = warnings.formatwarning
    assert main(["replay", "/nonexistent.safetensors", "--cache-slots", "8"]) == 2
    assert warnings.formatwarning is before, "main restores the formatter"
    assert cli._one_line_warning("slot pool of 16 slots\n  holds", UserWarning, "x.py", 3) == \
        "freetoken: warning: slot pool of 16 slots holds\n"


def test_time_to_first_token_and_decode_rate_come_from_one_run(monkeypatch):
    """Both figures are read off one timed generate() (its streamer notes each new token), so noise
    between two runs can no longer make the decode rate absurd (it printed 1.5e10 tokens/s)."""
    clock = iter(range(100))
    monkeypatch.setattr(cli.time, "perf_counter", lambda: float(next(clock)))

    class Model:
        def generate(self, prompt, max_new_tokens, min_new_tokens, streamer=None, **kw):
            if streamer is not None:
                streamer.put(prompt)
                for _ in range(max_new_tokens):
                    streamer.put(torch.zeros(1, dtype=torch.long))
                streamer.end()
            return prompt

    _, first, rate, hit_rate, sent = cli._timed_generate(Model(), torch.zeros(1, 3, dtype=torch.long), 5)
    # t0 = 0; the first token at 1, the decode timed from 2 (after what the clock does at the first
    # token), the other four tokens at 3, 4, 5, 6.
    assert first == 1.0 and rate == 4 / 4 and hit_rate is None and sent is None


def test_a_demo_model_beyond_host_memory_is_refused_before_it_is_built(monkeypatch, capsys):
    from freetoken_plugin import host_memory, tiny

    monkeypatch.setattr(host_memory, "available_host_bytes", lambda: 2**30)
    monkeypatch.setattr(tiny, "tiny_model", lambda *a, **k: pytest.fail("a model was built"))
    assert main(["demo", "--device", "cpu", "--experts", "1000000"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("freetoken: error: --experts 1000000: the demo holds the tiny model three times")
    assert "1.0 GiB available; give fewer experts" in err and "\n" not in err


def test_a_cache_below_one_layer_exits_2(capsys):
    require("cpu", "expert_gemm")
    assert main(["demo", "--device", "cpu", "--cache-slots", "1", "--prompt-tokens", "4", "--new-tokens", "2"]) == 2
    assert "below one layer of 16 experts" in capsys.readouterr().err


def test_prompts_beyond_the_models_positions_are_refused(tmp_path, capsys):
    """demo and generate check the prompt and the new tokens against the model's positions before
    loading it (generate used to run far past them), as trace does."""
    tiny_model("qwen3_moe").save_pretrained(tmp_path)  # 256 positions, no tokenizer files
    assert main(["demo", "--device", "cpu", "--prompt-tokens", "100000"]) == 2
    assert "the prompt (100000 tokens) leaves no room for new tokens in the model's 256 positions" in (
        capsys.readouterr().err)
    assert main(["generate", "--model", str(tmp_path), "--prompt-ids", "1,2,3", "--new-tokens", "2000",
                 "--device", "cpu"]) == 2
    assert "give at most 253" in capsys.readouterr().err
    assert main(["generate", "--model", str(tmp_path), "--prompt", "hi", "--device", "cpu"]) == 2
    assert "give token ids with --prompt-ids 1,2,3" in capsys.readouterr().err


def test_generate_from_token_ids_prints_token_ids(tmp_path, capsys):
    require("cpu", "expert_gemm")
    model = tiny_model("qwen3_moe")
    model.save_pretrained(tmp_path)
    with torch.no_grad():
        want = model.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=4, do_sample=False)[0, 3:]
    assert main(["generate", "--model", str(tmp_path), "--prompt-ids", "1,2,3", "--new-tokens", "4",
                 "--device", "cpu"]) == 0
    assert capsys.readouterr().out.strip() == ",".join(str(int(t)) for t in want)
    # The cache in experts, as demo and replay take it, or in bytes; not both, and not zero.
    assert main(["generate", "--model", str(tmp_path), "--prompt-ids", "1,2,3", "--new-tokens", "4",
                 "--device", "cpu", "--cache-slots", "9"]) == 0
    assert capsys.readouterr().out.strip() == ",".join(str(int(t)) for t in want)
    with pytest.raises(SystemExit):
        main(["generate", "--model", str(tmp_path), "--prompt-ids", "1", "--cache-slots", "9", "--cache-bytes", "1GB"])
    assert "not allowed with argument" in capsys.readouterr().err
    assert main(["generate", "--model", str(tmp_path), "--prompt-ids", "1", "--cache-slots", "0"]) == 2
    assert "--cache-slots must be positive, got 0; give at least one MoE layer's experts" in capsys.readouterr().err
    # The Python API's size errors in the command line's words.
    assert main(["generate", "--model", str(tmp_path), "--prompt-ids", "1", "--cache-bytes", "100"]) == 2
    err = capsys.readouterr().err
    assert "error: --cache-bytes 100 holds no expert" in err and "cache_bytes" not in err
    assert main(["generate", "--model", str(tmp_path), "--prompt-ids", "1", "--cache-bytes", "1e3"]) == 2
    assert "error: --cache-bytes 1000 holds no expert" in capsys.readouterr().err  # read as bytes, not refused
    assert main(["generate", "--model", str(tmp_path), "--prompt-ids", "1", "--cache-bytes", "50KiB"]) == 2
    err = capsys.readouterr().err
    assert "error: --cache-bytes 51200 holds" in err and "below one layer of 8 experts" in err and "Python" not in err
    # One prompt: a repeated --prompt-ids is refused, not dropped.
    with pytest.raises(SystemExit):
        main(["generate", "--model", str(tmp_path), "--prompt-ids", "1,2", "--prompt-ids", "3,4"])
    assert "--prompt-ids given twice: generate continues one prompt (freetoken trace takes several)" in \
        capsys.readouterr().err
    # --quantize fp8: the experts quantized as they are read, the tokens of the quantized model.
    freetoken_plugin.offload_experts(model, cache_slots=16, device="cpu", progress=False, quantize="fp8")
    with torch.no_grad():
        quantized = model.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=4, do_sample=False)[0, 3:]
    assert main(["generate", "--model", str(tmp_path), "--prompt-ids", "1,2,3", "--new-tokens", "4",
                 "--device", "cpu", "--quantize", "fp8"]) == 0
    assert capsys.readouterr().out.strip() == ",".join(str(int(t)) for t in quantized)


def test_a_rope_scaling_stretches_the_positions_the_check_allows():
    """A YaRN (or linear) factor multiplies max_position_embeddings, which keeps the trained length:
    such prompts are not refused."""
    import transformers as tf

    from freetoken_plugin.cli_routing import UsageError, check_prompts

    config = tf.Qwen3MoeConfig(max_position_embeddings=100)
    with pytest.raises(UsageError, match="exceed the model's 100 positions"):
        check_prompts(config, [torch.zeros(90)], 20)
    config.rope_parameters = dict(rope_type="yarn", factor=4.0, rope_theta=10000.0,
                                  original_max_position_embeddings=100)
    check_prompts(config, [torch.zeros(350)], 10)
    with pytest.raises(UsageError, match="exceed the model's 400 positions; give at most 50"):
        check_prompts(config, [torch.zeros(350)], 100)


def test_an_unknown_option_is_named_by_the_parser_it_belongs_to(capsys):
    """An option after a command is the command's: the error points at that command's --help; one
    before it is freetoken's own."""
    with pytest.raises(SystemExit) as exit_info:
        main(["demo", "--frobnicate"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["freetoken demo: error: unrecognized arguments: --frobnicate (freetoken demo --help lists the options)"]
    with pytest.raises(SystemExit):
        main(["--frobnicate", "demo"])
    assert capsys.readouterr().err.strip() == \
        "freetoken: error: unrecognized arguments: --frobnicate (freetoken --help lists the options)"


def test_sizes_below_a_byte_and_empty_token_ids_are_refused_as_given(tmp_path, capsys):
    """--cache-bytes 0.5 is refused naming what was given (it was read as 0 first), and token ids
    with an empty item (1,,2) or a negative id are refused, not read as something else."""
    tiny_model("qwen3_moe").save_pretrained(tmp_path)
    with pytest.raises(SystemExit):
        main(["generate", "--model", str(tmp_path), "--prompt-ids", "1", "--cache-bytes", "0.5"])
    assert "'0.5' is less than one byte" in capsys.readouterr().err
    for ids in ("1,,2", "1,2,", "1,-3"):
        assert main(["generate", "--model", str(tmp_path), "--prompt-ids", ids, "--device", "cpu"]) == 2
        assert f"--prompt-ids {ids!r}: expected comma-separated token ids (whole numbers >= 0, no empty item)" in (
            capsys.readouterr().err)


@pytest.mark.parametrize("model", ["tiny", "layer-shaped", "checkpoint"])
def test_a_demo_cache_below_one_layer_is_refused_before_the_reference_runs(model, tmp_path, monkeypatch, capsys):
    """--cache-slots below one layer of experts is refused (exit 2, offload_experts' message) before
    the demo builds or loads its reference model: for a real checkpoint that reference takes minutes."""
    monkeypatch.setattr(cli, "_timed_generate", lambda *a, **k: pytest.fail("the reference generation ran"))
    args = ["demo", "--device", "cpu", "--cache-slots", "3"]
    experts = 16
    if model == "layer-shaped":
        monkeypatch.setattr(cli, "LAYER_SHAPE", dict(hidden=128, experts=8, top_k=2, expert_intermediate=64))
        args += ["--shape", "qwen3-30b-a3b", "--layers", "2"]
        experts = 8
    elif model == "checkpoint":
        import transformers as tf

        tiny_model("mixtral", experts=12).save_pretrained(tmp_path)
        capsys.readouterr()
        monkeypatch.setattr(tf.PreTrainedModel, "from_pretrained",
                            classmethod(lambda *a, **k: pytest.fail("the demo loaded the checkpoint's weights")))
        args += ["--model", str(tmp_path)]
        experts = 12
    assert main(args) == 2
    assert f"a cache of 3 expert slots, below one layer of {experts} experts" in one_error_line(capsys)


def test_the_demo_hit_rate_counts_the_timed_runs_decode_steps_alone():
    """The clock reads the admission counters at the first new token (the prompt done) and at the
    end: the warm-up and the prompt's admissions stay out of the demo's decode hit rate."""
    counts = iter([(100, 40), (130, 64)])  # (distinct, hits) at the first new token, then at the end

    class Handle:
        def stats(self):
            distinct, hits = next(counts)
            return {"admit": {"distinct": distinct, "copied": distinct - hits, "cpu_experts": 0}}

    clock = cli._TokenClock(Handle())
    for step in range(4):  # the prompt, then three new tokens
        clock.put(torch.tensor([step]))
    clock.end()
    assert len(clock.times) == 3 and clock.decode_start >= clock.times[0]
    assert clock.decode_hit_rate == pytest.approx(24 / 30)


def test_the_demo_counts_the_timed_runs_bytes_over_the_link_alone(capsys):
    """The demo's "bytes over the link" is the timed run's, as its hit rate (the warm-up's copies
    are not in it): the counters' growth over that generate call."""
    require("cpu", "expert_gemm")
    model = tiny_model("qwen3_moe")
    handle = freetoken_plugin.offload_experts(model, cache_slots=12, device="cpu", progress=False)
    prompt = torch.tensor([[1, 2, 3, 4]])
    sent_before = cli._link_bytes(handle)
    *_, sent = cli._timed_generate(model, prompt, 6, handle)
    total = cli._link_bytes(handle) - sent_before
    assert 0 < sent < total, "the warm-up's copies are left out"


@pytest.mark.parametrize("stored", ["fp8", "mxfp4", "int4"])
def test_generate_refuses_quantizing_quantized_experts_in_the_flags_words(stored, tmp_path, monkeypatch, capsys):
    """--quantize on a checkpoint whose experts are quantized already (int4 on FP8, any on MXFP4 or
    int4) is load_model's refusal, named as the command line gives it (--quantize int4, leave
    --quantize out), before the model loads; --quantize fp8 on FP8 experts changes nothing (test_loader_fp8)."""
    path = tmp_path / stored
    if stored == "fp8":
        from test_loader_fp8 import write_fp8_checkpoint

        write_fp8_checkpoint(tiny_model("qwen3_moe"), path, fused=False)
        held, refused = "FP8", ["int4", "int4-g32"]
        why = "would round them a second time"
    elif stored == "mxfp4":
        from test_mxfp4 import write_mxfp4_checkpoint

        write_mxfp4_checkpoint(tiny_model("gpt_oss"), path)
        held, refused = "MXFP4", ["fp8", "int4"]
        why = "would dequantize and quantize them again"
    else:
        from test_loader_int4 import write_int4_checkpoint

        write_int4_checkpoint(tiny_model("qwen3_moe"), path, "ct")
        held, refused = "int4", ["fp8", "int4-g64"]
        why = "would dequantize and quantize them again"
    monkeypatch.setattr(freetoken_plugin, "load_model", lambda *a, **k: pytest.fail("the model was loaded"))
    capsys.readouterr()  # (the writer's progress bar)
    for quantize in refused:
        assert main(["generate", "--model", str(path), "--prompt-ids", "1,2,3", "--device", "cpu",
                     "--quantize", quantize]) == 2  # a bad argument
        line = one_error_line(capsys)
        assert line == (f"freetoken: error: {path} holds {held} experts, which load as they are "
                        f"({'half' if held == 'FP8' else 'about a quarter'} of bf16's bytes); --quantize {quantize} "
                        f"{why}: leave --quantize out"), line
        assert "quantize=" not in line


def olmoe_checkpoint_grouped_mm_refuses(path) -> bool:
    """A tiny float32 OLMoE checkpoint at `path` whose experts' intermediate size (130) gives rows
    of 520 bytes, which transformers' default experts implementation (grouped_mm, 16-byte strides)
    refuses; returns whether it does on this torch (older CPU builds fall back by themselves)."""
    import transformers as tf

    from freetoken_plugin.tiny import TINY, random_weights

    torch.manual_seed(0)
    config = tf.OlmoeConfig(**{**TINY, "num_hidden_layers": 2}, intermediate_size=130, num_experts=4,
                            num_experts_per_tok=2)
    model = random_weights(tf.AutoModelForCausalLM.from_config(config, dtype=torch.float32))
    model.save_pretrained(path)
    try:
        with torch.no_grad():
            model(torch.tensor([[1, 2, 3]]))
    except RuntimeError:
        return True
    return False


def test_demo_of_a_checkpoint_grouped_mm_refuses_runs_its_reference_with_eager_experts(tmp_path, capsys):
    """The demo's reference is the untouched model in transformers; where its grouped_mm experts
    refuse the shapes (an intermediate size of 130), the reference runs the class's eager experts
    code, the same function, and says so; the offloaded tokens are compared with it."""
    require("cpu", "expert_gemm")
    refuses = olmoe_checkpoint_grouped_mm_refuses(tmp_path)
    assert main(["demo", "--device", "cpu", "--model", str(tmp_path), "--prompt-tokens", "8",
                 "--new-tokens", "3"]) == 0
    out = capsys.readouterr().out
    assert "identical" in out
    note = "[demo] transformers' grouped_mm experts refuse this model (strides should be multiple of 16 bytes)"
    assert (note in out) == refuses, out
    assert ("(all resident: transformers' eager experts code" in out) == refuses


def test_a_failing_reference_run_says_it_is_transformers_in_one_line(tmp_path, monkeypatch, capsys):
    """The reference generation (handle None) failing: a RuntimeError under grouped_mm is retried with
    the eager experts (the demo then runs); failing there too, or failing otherwise, the one line
    says it was transformers' run of the untouched model, with its message and what runs instead."""
    require("cpu", "expert_gemm")
    tiny_model("olmoe").save_pretrained(tmp_path)
    real = cli._timed_generate
    failure = {}

    def reference_fails(model, prompt, new_tokens, handle=None):
        implementation = model.config._experts_implementation
        if handle is None and implementation in failure:
            raise failure[implementation]
        return real(model, prompt, new_tokens, handle)

    monkeypatch.setattr(cli, "_timed_generate", reference_fails)
    demo = ["demo", "--device", "cpu", "--model", str(tmp_path), "--prompt-tokens", "8", "--new-tokens", "3"]
    failure["grouped_mm"] = RuntimeError("strides should be\nmultiple of 16 bytes")
    assert main(demo) == 0
    out = capsys.readouterr().out
    assert "refuse this model (strides should be multiple of 16 bytes)" in out and "identical" in out
    failure["eager"] = RuntimeError("eager broke")
    assert main(demo) == 1
    assert one_error_line(capsys) == (
        "freetoken: error: transformers' generation with the untouched model (the demo's reference, before freetoken "
        "offloads it) failed: strides should be multiple of 16 bytes (experts_implementation grouped_mm), and with "
        f"its eager experts: eager broke; `freetoken generate --model {tmp_path}` runs the offloaded model without a "
        "reference")
    failure.clear()
    failure["grouped_mm"] = ValueError("not an experts problem")  # not retried
    assert main(demo) == 1
    assert one_error_line(capsys) == (
        "freetoken: error: transformers' generation with the untouched model (the demo's reference, before freetoken "
        f"offloads it) failed: not an experts problem; `freetoken generate --model {tmp_path}` runs the offloaded "
        "model without a reference")
