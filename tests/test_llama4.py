"""Llama 4 through the public API: its experts class is not decorated with transformers'
use_experts_implementation, so freetoken replaces the forward of its MoE block (Llama4TextMoe:
the router's sigmoid scores scale each routed copy of the input, transformers runs every expert
densely, a shared expert is added). Greedy tokens and the block's outputs equal transformers' own
model with the same weights, for top-1 (Llama 4's releases) and top-2 routing and MoE layers
interleaved with dense ones (Maverick); quantize="fp8"; load_model on the checkpoints
save_pretrained writes for the text model and the multimodal one (Meta's names); a block whose
forward computes otherwise is refused before anything changes."""
import copy
import gc
import pickle
import weakref
import warnings

import pytest
import torch

import freetoken_plugin
from families import _merge, randomize, tiny_kwargs
from freetoken_plugin.layouts import UnsupportedExperts
from freetoken_plugin.offload import find_experts
from freetoken_plugin.verify import TOLERANCE, difference
from ft_ops import formats
from helpers import DEVICES, fail_while_switching, require

transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "Llama4ForCausalLM"):
    pytest.skip("this transformers has no Llama 4", allow_module_level=True)

E = 8
KW = dict(max_new_tokens=6, min_new_tokens=6, do_sample=False)


def tiny_llama4(head: str = "Llama4ForCausalLM", layers: int = 2, **text):
    """A tiny random Llama 4 (`head`), weights at a trained model's scale so greedy tokens are
    decisive; `text` overrides its text config (num_experts_per_tok, interleave_moe_layer_step)."""
    cls = getattr(transformers, head)
    overrides = dict(num_hidden_layers=layers, intermediate_size_mlp=64, no_rope_layers=[1] * layers,
                     layer_types=None, num_local_experts=E, **text)
    kwargs = tiny_kwargs(cls.config_class)
    _merge(kwargs, dict(text_config=overrides) if "text_config" in kwargs else overrides)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.manual_seed(0)
        model = cls(cls.config_class(**kwargs)).eval()
    randomize(model, 0)
    return model


def moe_blocks(model):
    return [m for m in model.modules() if type(m).__name__ == "Llama4TextMoe"]


def prompt():
    return torch.randint(2, 100, (1, 8), generator=torch.Generator().manual_seed(1))


def generate(model):
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return model.generate(prompt(), **KW)


def block_outputs(block, tokens: int, scale: float, dtype=torch.float32, device="cpu"):
    x = torch.randn(tokens, block.hidden_dim, generator=torch.Generator().manual_seed(tokens)) * scale
    with torch.no_grad():
        return block(x.to(device=device, dtype=dtype))


@pytest.mark.parametrize("top_k,step", [(1, 1), (2, 1), (1, 2)], ids=["top1", "top2", "top1-interleaved"])
def test_offloaded_llama4_generates_its_tokens_and_keeps_its_weights(top_k, step):
    require("cpu", "expert_gemm")
    model = tiny_llama4(layers=2 * step, num_experts_per_tok=top_k, interleave_moe_layer_step=step)
    originals = [copy.deepcopy(b) for b in moe_blocks(model)]
    weights = {k: v.clone() for k, v in model.state_dict().items() if ".experts." in k}
    want = generate(model)
    handle = freetoken_plugin.offload_experts(model, cache_slots=E, device="cpu", progress=False)
    assert handle.runtime.shape.layers == 2 and handle.runtime.shape.experts == E
    assert torch.equal(generate(model), want)
    for block, original in zip(moe_blocks(model), originals):
        for tokens, scale in ((1, 1.0), (5, 1.0), (5, 100.0)):
            got, ref = block_outputs(block, tokens, scale), block_outputs(original, tokens, scale)
            assert difference(got[0], ref[0]) < 1e-5, f"{tokens} tokens at {scale}x"
            assert torch.equal(got[1], ref[1]), "the router logits are the block's second output"
    state = model.state_dict()
    assert all(torch.equal(state[k], v) for k, v in weights.items())
    stats = freetoken_plugin.stats(model)
    assert stats["admit"]["routed"] + stats["stream"]["routed"] > 0
    with pytest.raises(TypeError, match="an offloaded model cannot be pickled"):
        pickle.dumps(moe_blocks(model)[0])
    # The served blocks refer to nothing that refers back to them: `del` frees the pools.
    pool = weakref.ref(handle.runtime.host)
    del handle, block
    gc.disable()
    try:
        del model
        assert pool() is None, "a reference cycle kept the pools"
    finally:
        gc.enable()


@pytest.mark.parametrize("fetch_fraction", [0.5, 0.0, "auto"])
def test_llama4_of_top_k_2_leaves_misses_to_the_cpu(fetch_fraction):
    """Llama 4 hands its experts one route a row (the runtime's top_k is the config's): with
    misses left to the CPU share, its calls go to the worker padded, and the tokens stay."""
    require("cpu", "expert_gemm")
    model = tiny_llama4(layers=2, num_experts_per_tok=2)
    want = generate(model)
    freetoken_plugin.offload_experts(model, cache_slots=E, device="cpu", progress=False, fetch_fraction=fetch_fraction)
    assert torch.equal(generate(model), want)
    if fetch_fraction != "auto":  # "auto" may measure the CPU as not worth it here
        assert freetoken_plugin.stats(model)["admit"]["cpu_pairs"] > 0, "no miss went to the CPU"


@pytest.mark.parametrize("device", DEVICES)
def test_llama4_block_in_bfloat16(device):
    """The offloaded block in bfloat16 on `device` (decode kernels at 8 tokens, grouped at 96)
    against transformers' block in bfloat16, within bfloat16 rounding (the probe's tolerance)."""
    require(device, "expert_gemm")
    model = tiny_llama4(num_experts_per_tok=1).to(device=device, dtype=torch.bfloat16)
    original = copy.deepcopy(moe_blocks(model)[-1])
    freetoken_plugin.offload_experts(model, cache_slots=2 * E, device=device, progress=False)
    block = moe_blocks(model)[-1]
    for tokens in (8, 96):
        for scale in (1.0, 100.0):
            got = block_outputs(block, tokens, scale, torch.bfloat16, device)
            want = block_outputs(original, tokens, scale, torch.bfloat16, device)
            assert difference(got[0], want[0]) <= TOLERANCE[torch.bfloat16], f"{tokens} tokens at {scale}x"


def test_llama4_quantized_to_fp8_is_the_dequantized_model():
    """quantize="fp8" blocks gate and up of Llama 4's transposed [E, H, 2I] weights as the two
    projections of a checkpoint; the model then computes with the dequantized experts."""
    require("cpu", "expert_gemm")
    model = tiny_llama4()
    freetoken_plugin.offload_experts(model, cache_slots=E, device="cpu", quantize="fp8", progress=False)
    assert freetoken_plugin.stats(model)["pool"]["format"] == "fp8"
    got = generate(model)
    reference = tiny_llama4()
    with torch.no_grad():
        for module in reference.modules():
            if type(module).__name__ != "Llama4TextExperts":
                continue
            w13, w2 = module.gate_up_proj.transpose(1, 2), module.down_proj.transpose(1, 2)  # [E, 2I, H], [E, H, I]
            (q13, s13), (q2, s2) = formats.quantize_fp8(w13.float(), parts=2), formats.quantize_fp8(w2.float())
            module.gate_up_proj.copy_(formats.dequantize_fp8(q13, s13, parts=2).transpose(1, 2))
            module.down_proj.copy_(formats.dequantize_fp8(q2, s2).transpose(1, 2))
    assert torch.equal(got, generate(reference))


@pytest.mark.parametrize("head", ["Llama4ForCausalLM", "Llama4ForConditionalGeneration"])
def test_load_model_reads_llama4_checkpoints(tmp_path, head):
    """The layout save_pretrained writes (fused experts.gate_up_proj [E, H, 2I]; the multimodal
    model's under language_model.model., as Meta's checkpoints name them, which load_model reads as
    from_pretrained's AutoModelForCausalLM does: the text model, its vision tower left out)."""
    require("cpu", "expert_gemm")
    model = tiny_llama4(head, num_experts_per_tok=1)
    model.save_pretrained(tmp_path)
    want = generate(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loaded = freetoken_plugin.load_model(str(tmp_path), cache_slots=E, device="cpu", progress=False)
    assert type(loaded).__name__ == "Llama4ForCausalLM"
    assert torch.equal(generate(loaded), want)


def _outputs_weighted(self, hidden_states):
    """Llama4TextMoe's forward as another model would compute it: the scores weight the experts'
    outputs, not their inputs."""
    hidden_states = hidden_states.reshape(-1, self.hidden_dim)
    router_scores, router_logits = self.router(hidden_states)
    routed_in = hidden_states.repeat(router_scores.shape[1], 1) * (router_scores.transpose(0, 1).reshape(-1, 1) > 0)
    routed_out = self.experts(routed_in) * router_scores.transpose(0, 1).reshape(-1, 1)
    out = self.shared_expert(hidden_states)
    out.add_(routed_out.reshape(router_scores.shape[1], -1, routed_out.shape[-1]).sum(dim=0))
    return out, router_logits


def _next_expert(self, hidden_states):
    """Llama4TextMoe's forward with every routed expert id one higher (modulo E)."""
    hidden_states = hidden_states.reshape(-1, self.hidden_dim)
    router_scores, router_logits = self.router(hidden_states)
    router_scores = router_scores.roll(1, dims=1)
    routed_in = hidden_states.repeat(router_scores.shape[1], 1) * router_scores.transpose(0, 1).reshape(-1, 1)
    routed_out = self.experts(routed_in)
    out = self.shared_expert(hidden_states)
    out.add_(routed_out.reshape(router_scores.shape[1], -1, routed_out.shape[-1]).sum(dim=0))
    return out, router_logits


def _logits_only(self, hidden_states):
    """A block whose router returns its logits alone (as transformers 4.51's did)."""
    return self.router.weight.new_zeros(1), None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("forward,match", [(_outputs_weighted, r"differs from it by .* at 1x input scale"),
                                           (_next_expert, r"differs from it by .* at 1x input scale"),
                                           (_logits_only, r"returns \[\(8, 64\), \(8, 8\)\] where the block returns \[\(1,\), 'NoneType'\]")],
                         ids=["outputs-weighted", "next-expert", "another-shape"])
def test_a_block_that_computes_otherwise_is_refused_and_left_unchanged(monkeypatch, tmp_path, dtype, forward, match):
    """A Llama4TextMoe whose forward is not the one freetoken replaces (the routing weight on the
    outputs, the experts shifted, another return shape) is refused in one line by offload_experts
    and load_model, in float32 and in bfloat16 (the check runs on a float32 copy), and the model is
    left as it was."""
    require("cpu", "expert_gemm")
    model = tiny_llama4(num_experts_per_tok=1).to(dtype)
    model.save_pretrained(tmp_path)
    monkeypatch.setattr(type(moe_blocks(model)[0]), "forward", forward)
    params = dict(model.named_parameters())
    with pytest.raises(UnsupportedExperts, match=r"^Llama4TextMoe: the forward freetoken runs in its place " + match) \
            as error:
        freetoken_plugin.offload_experts(model, cache_slots=E, device="cpu", progress=False)
    assert "\n" not in str(error.value) and "use such a transformers, or report it" in str(error.value)
    assert all(p is params[n] for n, p in model.named_parameters())
    assert all("forward" not in vars(b) for b in moe_blocks(model))
    with pytest.raises(UnsupportedExperts, match="Llama4TextMoe: the forward freetoken runs in its place"):
        freetoken_plugin.load_model(str(tmp_path), cache_slots=E, device="cpu", progress=False)


def test_a_call_without_tokens_returns_no_rows():
    require("cpu", "expert_gemm")
    model = tiny_llama4()
    original = copy.deepcopy(moe_blocks(model)[0])
    freetoken_plugin.offload_experts(model, cache_slots=E, device="cpu", progress=False)
    with torch.no_grad():
        got, want = moe_blocks(model)[0](torch.empty(0, 64)), original(torch.empty(0, 64))
    assert got[0].shape == want[0].shape == (0, 64)


def test_a_failure_while_switching_puts_every_block_back(monkeypatch):
    require("cpu", "expert_gemm")
    model = tiny_llama4()
    want = generate(model)
    params = dict(model.named_parameters())
    made = fail_while_switching(monkeypatch, 1)
    with pytest.raises(RuntimeError, match="injected failure"):
        freetoken_plugin.offload_experts(model, cache_slots=E, device="cpu", progress=False)
    assert made["n"] == 2
    assert all(p is params[n] for n, p in model.named_parameters())
    assert all("forward" not in vars(b) for b in moe_blocks(model)), "a block kept the replaced forward"
    assert all(not hasattr(m, "_freetoken_experts") for _, m in find_experts(model))
    assert torch.equal(generate(model), want)


@pytest.mark.slow  # seconds on two cores: in the slow set (pytest -m slow), which CI runs too
@pytest.mark.parametrize("device", DEVICES)
def test_compiled_llama4_decode_matches_eager(device):
    """torch.compile(fullgraph=True) of the offloaded block at one token (decode admits inside the
    graph) equals the eager block, step after step."""
    require(device, "dedup_and_admit")
    torch._dynamo.reset()
    eager = tiny_llama4(num_experts_per_tok=1).to(device)
    compiled = copy.deepcopy(eager)
    for model in (eager, compiled):
        freetoken_plugin.offload_experts(model, cache_slots=E, device=device, progress=False)
    step = torch.compile(moe_blocks(compiled)[0], fullgraph=True)
    gen = torch.Generator().manual_seed(3)
    for _ in range(4):
        x = torch.randn(1, 64, generator=gen).to(device)
        with torch.no_grad():
            got, want = step(x), moe_blocks(eager)[0](x)
        torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-6)


def test_freetoken_trace_records_llama4_routing(tmp_path):
    """`freetoken trace` on a Llama 4 checkpoint: its routers' choices, every token and MoE layer."""
    from helpers import trace_on_cpu

    model = tiny_llama4(layers=4, num_experts_per_tok=2, interleave_moe_layer_step=2)
    model.save_pretrained(tmp_path / "ckpt")
    trace = trace_on_cpu(tmp_path / "ckpt", tmp_path / "trace.safetensors", new_tokens=3)
    assert trace.layers == 2 and trace.experts == E and trace.top_k == 2
    assert trace.sequences[0].shape[0] == 4 + 3 - 1  # the last token is never fed back
    # The recorded prompt routing is the model's own: its first MoE layer's router on the prompt.
    logits = []
    moe_blocks(model)[0].router.register_forward_hook(lambda _, args, output: logits.append(output[1]))
    with torch.no_grad():
        model(torch.tensor([[5, 6, 7, 8]]))
    want = torch.topk(logits[0], 2, dim=1).indices
    assert torch.equal(trace.sequences[0][:4, 0].long().sort(-1).values, want.sort(-1).values)


def test_a_router_of_another_kind_is_refused_not_raised(monkeypatch):
    """A router returning its logits alone (transformers 4.51's Llama4Router) makes the block's
    code fail as freetoken would run it: refused in one line naming the class, not raised as the
    unpacking's own error."""
    require("cpu", "expert_gemm")
    model = tiny_llama4()
    router = type(moe_blocks(model)[0].router)
    monkeypatch.setattr(router, "forward", lambda self, hidden_states: torch.nn.functional.linear(hidden_states,
                                                                                                  self.weight))
    with pytest.raises(UnsupportedExperts, match=r"^Llama4TextMoe: the forward freetoken runs in its place fails on "
                                                 r"this transformers' Llama4TextMoe \(ValueError: "):
        freetoken_plugin.offload_experts(model, cache_slots=E, device="cpu", progress=False)
    assert all("forward" not in vars(b) for b in moe_blocks(model))


def test_load_model_builds_the_multimodal_class_when_asked(tmp_path):
    """model_class=Llama4ForConditionalGeneration keeps the vision tower (read from the checkpoint,
    no tensor left unread): text generation equals the original multimodal model's. A class of
    another architecture, or something that is not a model class, is refused before reading."""
    require("cpu", "expert_gemm")
    model = tiny_llama4("Llama4ForConditionalGeneration", num_experts_per_tok=1)
    model.save_pretrained(tmp_path)
    want = generate(model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loaded = freetoken_plugin.load_model(str(tmp_path), cache_slots=E, device="cpu", progress=False,
                                             model_class=transformers.Llama4ForConditionalGeneration)
    assert isinstance(loaded, transformers.Llama4ForConditionalGeneration)
    assert type(loaded).__name__ == "Llama4ForConditionalGeneration"  # the subclass whose forward holds the lock
    assert not [w for w in caught if "have no place" in str(w.message)], "every tensor has a place"
    state = loaded.state_dict()
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items() if k.startswith("vision_model."))
    assert torch.equal(generate(loaded), want)
    text = freetoken_plugin.load_model(str(tmp_path), cache_slots=E, device="cpu", progress=False,
                                       model_class=transformers.Llama4ForCausalLM)  # built from its text config
    assert isinstance(text, transformers.Llama4ForCausalLM) and torch.equal(generate(text), want)
    assert not isinstance(text, transformers.Llama4ForConditionalGeneration)
    with pytest.raises(freetoken_plugin.CheckpointError, match="model_class MixtralForCausalLM is built from a "
                                                              "MixtralConfig, but the checkpoint's config.json is a "
                                                              "Llama4Config"):
        freetoken_plugin.load_model(str(tmp_path), device="cpu", progress=False,
                                    model_class=transformers.MixtralForCausalLM)
    with pytest.raises(TypeError, match="model_class must be a transformers model class"):
        freetoken_plugin.load_model(str(tmp_path / "missing"), device="cpu", progress=False, model_class="llama4")


def test_block_fp8_experts_in_llama4s_transposed_layout_are_refused_with_the_way_that_works(tmp_path):
    """A block-FP8 checkpoint whose fused experts keep the module's transposed [E, H, 2I] layout is
    refused from the headers (load_model reads fused FP8 experts as transformers' quantizer stores
    them), naming the float checkpoint with quantize="fp8" as the way."""
    import os

    from safetensors.torch import load_file

    from test_loader_fp8 import save_fp8_checkpoint

    model = tiny_llama4()
    model.save_pretrained(tmp_path)
    tensors = {}
    for name, t in load_file(os.path.join(tmp_path, "model.safetensors")).items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            tensors[name], tensors[name + "_scale_inv"] = formats.quantize_fp8(t.float())
        else:
            tensors[name] = t
    save_fp8_checkpoint(tensors, tmp_path)
    with pytest.raises(freetoken_plugin.CheckpointError, match=r"gate_up_proj is block-FP8 in the transposed layout "
                                                              r"\(8, 64, 128\).*load_model\(path, quantize='fp8'\)"):
        freetoken_plugin.load_model(str(tmp_path), cache_slots=E, device="cpu", progress=False)
