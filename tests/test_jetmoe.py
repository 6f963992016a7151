"""JetMoE through the public API: transformers does not decorate its experts (JetMoeMoE holds them as
two JetMoeParallelExperts of its own, input_linear [E, 2I, H] with the gate's rows first and
output_linear [E, H, I], beside its router and an output bias), so freetoken replaces the block's
forward: its own router (whose logits transformers records), the top-k and softmax of those
logits, the offloaded experts, the block's bias. Greedy tokens, logits, router logits and the
block's outputs equal transformers' own model with the same weights (top-1, top-2, top-3; SiLU and
GELU); quantize="fp8" equals the model with its experts dequantized; load_model reads the
checkpoints save_pretrained writes (and an offloaded model saves); `freetoken trace` records the
routes transformers' blocks take; a JetMoE that computes otherwise is refused in one line and left
unchanged. JetMoE's attention (JetMoeMoA, a mixture of attention heads) stays as transformers
computes it, on the GPU."""
import copy
import os
import warnings

import pytest
import torch

import freetoken_plugin
from families import randomize
from freetoken_plugin import CheckpointError
from freetoken_plugin.layouts import UnsupportedExperts, read_layout
from freetoken_plugin.offload import find_experts, routed_per_token
from freetoken_plugin.verify import TOLERANCE, difference
from ft_ops import formats
from ft_ops.activations import GELU, SILU
from helpers import (DEVICES, GENERATE_KW, assert_quantized_configs_refused, block_input, fail_while_switching,
                     generate, logits, prompts, refuse_host_pool, require)

transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "JetMoeForCausalLM"):
    pytest.skip("this transformers has no JetMoE", allow_module_level=True)

import transformers.models.jetmoe.modeling_jetmoe as modeling  # noqa: E402

E, H, I = 8, 64, 32
DOCS = os.path.join(os.path.dirname(__file__), "..", "docs", "families.md")


def tiny_jetmoe(layers: int = 2, hidden: int = H, inter: int = I, top_k: int = 2, act: str = "silu", seed: int = 0):
    """A tiny random JetMoeForCausalLM, weights at a trained model's scale so greedy tokens are
    decisive."""
    config = transformers.JetMoeConfig(
        vocab_size=128, hidden_size=hidden, num_hidden_layers=layers, num_key_value_heads=2, kv_channels=16,
        intermediate_size=inter, num_local_experts=E, num_experts_per_tok=top_k, activation_function=act,
        max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.manual_seed(seed)
        model = transformers.JetMoeForCausalLM(config).eval()
    randomize(model, seed)
    return model


def moe_blocks(model):
    return [m for m in model.modules() if type(m).__name__ == "JetMoeMoE"]


def expert_weights(model) -> dict:
    return {k: v.clone() for k, v in model.state_dict().items() if ".mlp.input_linear." in k or ".mlp.output_linear." in k}


@pytest.mark.parametrize("top_k,act", [(2, "silu"), (1, "gelu"), (3, "silu")], ids=["top2", "top1-gelu", "top3"])
def test_offloaded_jetmoe_is_transformers_model(top_k, act):
    require("cpu", "expert_gemm")
    model = tiny_jetmoe(top_k=top_k, act=act)
    layout = read_layout(find_experts(model)[0][1])
    assert (layout.experts, layout.hidden, layout.intermediate) == (E, H, I)
    assert layout.activation == {"silu": SILU, "gelu": GELU}[act]
    assert layout.param_names[:2] == ("input_linear.weight", "output_linear.weight")
    assert routed_per_token(model.config) == top_k
    originals = [copy.deepcopy(b) for b in moe_blocks(model)]
    weights = expert_weights(model)
    with torch.no_grad():
        want_router = model(prompts(), output_router_logits=True).router_logits
    want_tokens, want_logits = generate(model), logits(model)
    handle = freetoken_plugin.offload_experts(model, cache_slots=E, device="cpu", progress=False)
    assert handle.runtime.shape.layers == 2 and handle.runtime.shape.experts == E
    assert all(m.input_linear.weight.numel() == 0 == m.output_linear.weight.numel() for _, m in find_experts(model))
    assert all(m.self_attention.experts.input_linear.weight.numel() > 0 for m in model.model.layers), \
        "the attention's experts (JetMoeMoA) stay the model's"
    assert torch.equal(generate(model), want_tokens)
    assert difference(logits(model), want_logits) < 1e-5
    with torch.no_grad():
        got_router = model(prompts(), output_router_logits=True).router_logits
    assert len(got_router) == len(want_router) >= 4  # each layer's attention router (5.17: twice) and its MoE router
    # (the second layer's routers read hidden states the first layer's MoE output rounded otherwise)
    assert all(difference(g, w) < 1e-5 for g, w in zip(got_router, want_router))
    assert torch.equal(got_router[0], want_router[0]) and torch.equal(got_router[1], want_router[1])
    for block, original in zip(moe_blocks(model), originals):
        for tokens, scale in ((1, 1.0), (5, 1.0), (5, 100.0)):
            with torch.no_grad():
                got, ref = block(block_input(tokens, scale, H)), original(block_input(tokens, scale, H))
            assert got.shape == ref.shape == (2, tokens, H)
            assert difference(got, ref) < 1e-5, f"{tokens} tokens at {scale}x"
    state = model.state_dict()  # the experts, from the host pool, in the module's own layout
    assert all(torch.equal(state[k], v) for k, v in weights.items())
    assert "model.layers.0.mlp.bias" in state and "model.layers.0.mlp.router.layer.weight" in state
    stats = freetoken_plugin.stats(model)
    assert stats["admit"]["routed"] + stats["stream"]["routed"] > 0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("device", DEVICES)
def test_jetmoe_block_in_half_precision(device, dtype):
    """The offloaded block in bfloat16 and float16 on `device` (decode kernels at 8 tokens, grouped
    at 96) against transformers' block in the same dtype, within its rounding (the probe's
    tolerance)."""
    require(device, "expert_gemm")
    model = tiny_jetmoe().to(device=device, dtype=dtype)
    original = copy.deepcopy(moe_blocks(model)[-1])
    freetoken_plugin.offload_experts(model, cache_slots=2 * E, device=device, progress=False)
    block = moe_blocks(model)[-1]
    for tokens in (4, 48):  # 2 sequences: 8 and 96 rows
        for scale in (1.0, 100.0 if dtype == torch.bfloat16 else 10.0):  # (float16 overflows at 100x)
            x = block_input(tokens, scale, H, dtype, device)
            with torch.no_grad():
                diff = difference(block(x), original(x))
            assert diff <= TOLERANCE[dtype], f"{2 * tokens} rows at {scale}x: {diff:.2e}"


def test_a_padded_batch_generates_transformers_tokens():
    """Two prompts of different lengths, left-padded with an attention mask, greedy: the offloaded
    model's tokens are the original's (the padding rows are routed too and must not leak)."""
    require("cpu", "expert_gemm")
    model = tiny_jetmoe()
    ids = torch.tensor([[0, 0, 0, 5, 6, 7], [9, 10, 11, 12, 13, 14]])
    mask = (ids != 0).long()
    kwargs = dict(attention_mask=mask, pad_token_id=0, **GENERATE_KW)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        want = model.generate(ids, **kwargs)
        freetoken_plugin.offload_experts(model, cache_slots=E, device="cpu", progress=False)
        assert torch.equal(model.generate(ids, **kwargs), want)


def dequantized_reference():
    """tiny_jetmoe() with every expert replaced by its block-FP8 round trip, quantized as freetoken
    quantizes them: gate and up as the two projections of input_linear [E, 2I, H]."""
    reference = tiny_jetmoe()
    with torch.no_grad():
        for block in moe_blocks(reference):
            for weight, parts in ((block.input_linear.weight, 2), (block.output_linear.weight, 1)):
                q, s = formats.quantize_fp8(weight.float(), parts=parts)
                weight.copy_(formats.dequantize_fp8(q, s, parts=parts))
    return reference


def test_jetmoe_quantized_to_fp8_is_the_dequantized_model(tmp_path):
    """quantize="fp8", through offload_experts and through load_model from the float checkpoint:
    the model computes with the dequantized experts (greedy tokens and logits of the reference)."""
    require("cpu", "expert_gemm")
    reference = dequantized_reference()
    want_tokens, want_logits = generate(reference), logits(reference)
    model = tiny_jetmoe()
    assert not torch.equal(logits(model), want_logits), "the quantization changes the model (the test can fail)"
    model.save_pretrained(tmp_path)
    freetoken_plugin.offload_experts(model, cache_slots=E, device="cpu", quantize="fp8", progress=False)
    loaded = freetoken_plugin.load_model(str(tmp_path), cache_slots=E, device="cpu", quantize="fp8", progress=False)
    want_state = expert_weights(reference)
    for offloaded in (model, loaded):
        assert freetoken_plugin.stats(offloaded)["pool"]["format"] == "fp8"
        assert torch.equal(generate(offloaded), want_tokens)
        assert difference(logits(offloaded), want_logits) < 1e-5
        state = offloaded.state_dict()  # the experts dequantized, in the module's layout
        assert all(torch.equal(state[k], v) for k, v in want_state.items())


def test_load_model_reads_jetmoe_checkpoints(tmp_path):
    """The layout save_pretrained writes (model.layers.<n>.mlp.input_linear.weight [E, 2I, H],
    output_linear.weight [E, H, I], beside mlp.bias and mlp.router.layer.weight): load_model computes
    from_pretrained's logits and greedy tokens with a cache of one layer, every tensor read (the
    block's bias and router among the non-expert weights); the offloaded model's state_dict is the
    checkpoint's, and what it saves loads the same model."""
    require("cpu", "expert_gemm")
    model = tiny_jetmoe()
    model.save_pretrained(tmp_path / "ckpt")
    reference = transformers.JetMoeForCausalLM.from_pretrained(tmp_path / "ckpt").eval()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loaded = freetoken_plugin.load_model(str(tmp_path / "ckpt"), cache_slots=E, device="cpu", progress=False)
    assert not [w for w in caught if "have no place" in str(w.message) or "has no place" in str(w.message)]
    assert type(loaded).__name__ == "JetMoeForCausalLM"
    torch.testing.assert_close(logits(loaded), logits(reference), rtol=1e-5, atol=1e-5)
    assert torch.equal(generate(loaded), generate(reference))
    state = loaded.state_dict()
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())
    loaded.save_pretrained(tmp_path / "again")
    again = freetoken_plugin.load_model(str(tmp_path / "again"), cache_slots=E, device="cpu", progress=False)
    assert torch.equal(generate(again), generate(reference))


def test_a_trace_of_the_original_model_knows_its_experts():
    """record_trace on JetMoE as transformers built it (no offloading; its block names no
    num_experts): the expert count is the weights' even where the highest expert is never routed."""
    from freetoken_plugin.tracing import record_trace

    model = tiny_jetmoe(top_k=1)
    with torch.no_grad():
        for block in moe_blocks(model):
            w = block.router.layer.weight  # the last expert's logit is the mean of two others': it never wins
            w[E - 1] = (w[0] + w[1]) / 2
    trace = record_trace(model, [torch.tensor([5, 6, 7])], new_tokens=2)
    assert trace.experts == E and int(trace.sequences[0].max()) < E - 1
    assert (trace.layers, trace.top_k, trace.hidden, trace.intermediate) == (2, 1, H, I)


def test_freetoken_trace_records_jetmoe_routing(tmp_path):
    """`freetoken trace` on a JetMoE checkpoint records, for every token and layer, the experts
    transformers' own blocks route to (recorded here from the original model's routers), in their
    order."""
    require("cpu", "expert_gemm")
    from helpers import trace_on_cpu

    model = tiny_jetmoe(top_k=2)
    model.save_pretrained(tmp_path / "ckpt")
    seen = [[] for _ in moe_blocks(model)]
    for i, block in enumerate(moe_blocks(model)):
        block.router.register_forward_hook(lambda _, args, out, i=i: seen[i].append(out[4].topk(2, dim=1).indices))
    generate(model, torch.tensor([[5, 6, 7, 8]]))
    trace = trace_on_cpu(tmp_path / "ckpt", tmp_path / "trace.safetensors", new_tokens=6)
    assert (trace.layers, trace.experts, trace.top_k, trace.hidden, trace.intermediate) == (2, E, 2, H, I)
    want = torch.stack([torch.cat(s) for s in seen], dim=1)  # [tokens, layers, top_k]
    assert want.shape[0] == 4 + 6 - 1  # the last token is never fed back
    assert torch.equal(trace.sequences[0].long(), want)


# --- refusals ------------------------------------------------------------------------------------

def _moe_unnormalized(self, layer_input):
    """JetMoeMoE.forward with each route weighted by the softmax over every expert (not over the k
    chosen): another routing than freetoken's."""
    bsz, length, emb_size = layer_input.size()
    x = layer_input.reshape(-1, emb_size)
    _, batch_index, _, expert_size, logits = self.router(x)
    experts = torch.arange(len(expert_size)).repeat_interleave(torch.tensor(expert_size))
    gates = logits.softmax(dim=1)[batch_index, experts].to(x.dtype)
    h = self.input_linear(x[batch_index], expert_size).chunk(2, dim=-1)
    out = self.output_linear(self.activation(h[0]) * h[1], expert_size) * gates[:, None]
    return torch.zeros_like(x).index_add(0, batch_index, out).view(bsz, length, emb_size) + self.bias


def _parallel_experts_transposed(self, inputs, expert_size):
    """JetMoeParallelExperts.forward reading each square expert weight transposed (input_linear's
    where the hidden size is twice the experts' intermediate size): another expert function."""
    outputs = [torch.nn.functional.linear(x, self.weight[i].T if self.input_size == self.output_size else self.weight[i])
               for i, x in enumerate(inputs.split(expert_size, dim=0))]
    return torch.cat(outputs, dim=0)


def _router_two_outputs(self, hidden_states):
    """JetMoeTopKGating.forward returning two values, as another version might."""
    return self.layer(hidden_states).float(), None


REFUSALS = {
    # name: (class patched, replacement, model kwargs, message (regex))
    "moe-unnormalized": ("JetMoeMoE", _moe_unnormalized, {},
                         r"^JetMoeMoE: the forward freetoken runs in its place differs from it by .* at 1x input scale"),
    "experts-transposed": ("JetMoeParallelExperts", _parallel_experts_transposed, dict(hidden=2 * I),
                           r"^JetMoeMoE: the offloaded experts would differ from the module's own forward by .* at 1x"),
    "router-two-outputs": ("JetMoeTopKGating", _router_two_outputs, {},
                           r"^JetMoeMoE: the forward freetoken runs in its place fails on this transformers' JetMoeMoE "
                           r"\((ValueError|IndexError|TypeError): "),
    "relu-experts": (None, None, dict(act="relu"),
                     r"^JetMoeMoE \(activation\) computes act_fn\(gate\) \* up with act_fn ReLU, which freetoken "
                     r"does not serve"),
}


@pytest.mark.parametrize("case", sorted(REFUSALS))
def test_a_jetmoe_that_computes_otherwise_is_refused_and_left_unchanged(monkeypatch, tmp_path, case):
    """A JetMoE whose classes compute otherwise than the ones freetoken reads is refused in one line
    naming the class and what differs, by offload_experts and by load_model, and the model is left
    as it was: its parameters, its classes, its outputs."""
    require("cpu", "expert_gemm")
    cls_name, replacement, kwargs, match = REFUSALS[case]
    model = tiny_jetmoe(**kwargs)
    model.save_pretrained(tmp_path)
    if cls_name is not None:
        monkeypatch.setattr(getattr(modeling, cls_name), "forward", replacement)
    params = dict(model.named_parameters())
    classes = {n: type(m) for n, m in model.named_modules()}
    try:
        with torch.no_grad():
            want = model(prompts()).logits
    except Exception:  # noqa: BLE001 (the router of another kind: the model itself does not run)
        want = None
    with pytest.raises(UnsupportedExperts, match=match) as error:
        freetoken_plugin.offload_experts(model, cache_slots=E, device="cpu", progress=False)
    assert "\n" not in str(error.value)
    assert all(p is params[n] for n, p in model.named_parameters())
    assert {n: type(m) for n, m in model.named_modules()} == classes
    assert all("forward" not in vars(b) and "_freetoken_experts" not in vars(b) for b in moe_blocks(model))
    if want is not None:
        with torch.no_grad():
            assert torch.equal(model(prompts()).logits, want)
    with pytest.raises(UnsupportedExperts, match=match):
        freetoken_plugin.load_model(str(tmp_path), cache_slots=E, device="cpu", progress=False)


def test_jetmoe_blocks_holding_more_or_other_shapes_are_refused():
    """What the layout does not describe is refused by name, before anything changes: a tensor
    besides the experts' weights, the router and the bias; an output_linear of another shape;
    weights of two dtypes."""
    require("cpu", "expert_gemm")
    cases = []
    model = tiny_jetmoe()
    moe_blocks(model)[0].input_linear.bias = torch.nn.Parameter(torch.zeros(E, 2 * I))
    cases.append((model, r"^JetMoeMoE holds tensors besides its expert weights, its router and its bias "
                         r"\(input_linear.bias\)"))
    model = tiny_jetmoe()
    experts = moe_blocks(model)[-1].output_linear
    experts.weight = torch.nn.Parameter(experts.weight.detach()[:, : H // 2].clone())
    cases.append((model, r"^JetMoeMoE: output_linear.weight is \(8, 32, 32\), expected \(8, 64, 32\)"))
    model = tiny_jetmoe()
    experts = moe_blocks(model)[0].output_linear
    experts.weight = torch.nn.Parameter(experts.weight.detach().double())
    cases.append((model, r"^JetMoeMoE: weights are torch.float32, torch.float64"))
    for model, match in cases:
        params = dict(model.named_parameters())
        with pytest.raises(UnsupportedExperts, match=match) as error:
            freetoken_plugin.offload_experts(model, cache_slots=E, device="cpu", progress=False)
        assert "\n" not in str(error.value)
        assert all(p is params[n] for n, p in model.named_parameters())


def test_a_block_freetoken_would_serve_otherwise_is_refused_and_left_unchanged():
    """A subclass of JetMoeMoE (it may compute otherwise) and a forward set on a JetMoeMoE instance
    (serving the block would set it aside) are refused in one line naming the block, before
    anything changes."""
    require("cpu", "expert_gemm")

    class WrappedMoE(modeling.JetMoeMoE):
        pass

    model = tiny_jetmoe()
    subclassed = WrappedMoE.__new__(WrappedMoE)
    subclassed.__dict__.update(model.model.layers[0].mlp.__dict__)
    model.model.layers[0].mlp = subclassed
    wrapped = tiny_jetmoe()
    block = wrapped.model.layers[1].mlp
    block.forward = lambda layer_input, _f=block.forward: _f(layer_input)
    for model, match in ((model, r"^WrappedMoE at model\.layers\.0\.mlp is a subclass of JetMoeMoE but is not "
                                 r"JetMoeMoE"),
                         (wrapped, r"^JetMoeMoE at model\.layers\.1\.mlp has a forward set on the instance")):
        params = dict(model.named_parameters())
        want = logits(model)
        with pytest.raises(UnsupportedExperts, match=match) as error:
            freetoken_plugin.offload_experts(model, cache_slots=E, device="cpu", progress=False)
        assert "\n" not in str(error.value)
        assert all(p is params[n] for n, p in model.named_parameters())
        assert torch.equal(logits(model), want)


def test_a_failure_while_switching_puts_every_block_back(monkeypatch):
    require("cpu", "expert_gemm")
    model = tiny_jetmoe()
    want = logits(model)
    params = dict(model.named_parameters())
    classes = {n: type(m) for n, m in model.named_modules()}
    made = fail_while_switching(monkeypatch, 1)
    with pytest.raises(RuntimeError, match="injected failure"):
        freetoken_plugin.offload_experts(model, cache_slots=E, device="cpu", progress=False)
    assert made["n"] == 2
    assert all(p is params[n] for n, p in model.named_parameters())
    assert {n: type(m) for n, m in model.named_modules()} == classes, "a block kept its served class"
    assert all("forward" not in vars(b) and not hasattr(b, "_freetoken_experts") for b in moe_blocks(model))
    assert torch.equal(logits(model), want)


def test_a_quantized_jetmoe_checkpoint_is_refused_from_the_headers(tmp_path, monkeypatch):
    """Before the host pool exists: a block-FP8 or MXFP4 config.json (no checkpoint format defines
    JetMoE's experts in either, and transformers' FP8 quantizer leaves them unquantized), with the
    way that works; an output_linear of another shape, named."""
    from safetensors.torch import load_file, save_file

    tiny_jetmoe().save_pretrained(tmp_path)
    refuse_host_pool(monkeypatch)
    file = os.path.join(tmp_path, "model.safetensors")
    tensors = load_file(file)
    gate_up = tensors.pop("model.layers.0.mlp.input_linear.weight")
    save_file(tensors, file, metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"^no expert tensors for model.layers.0.mlp in the checkpoint \(looked "
                                              r"for model.layers.0.mlp.input_linear.weight and "
                                              r"model.layers.0.mlp.output_linear.weight, as the model holds them\)$"):
        freetoken_plugin.load_model(str(tmp_path), cache_slots=E, device="cpu", progress=False)
    tensors["model.layers.0.mlp.input_linear.weight"] = gate_up
    good = tensors["model.layers.1.mlp.output_linear.weight"]
    tensors["model.layers.1.mlp.output_linear.weight"] = good[:, :-8].contiguous()
    save_file(tensors, file, metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"^model.layers.1.mlp.output_linear.weight has shape \(8, 56, 32\), "
                                              r"expected \(8, 64, 32\)"):
        freetoken_plugin.load_model(str(tmp_path), cache_slots=E, device="cpu", progress=False)
    tensors["model.layers.1.mlp.output_linear.weight"] = good
    save_file(tensors, file, metadata={"format": "pt"})
    assert_quantized_configs_refused(
        tmp_path, r"input_linear.weight, .*output_linear.weight, a layout no block-FP8 checkpoint format defines .* "
                  r"load_model\(path, quantize='fp8'\)",
        r"mxfp4, but JetMoeMoE keeps gate rows then up rows", cache_slots=E)


def test_docs_list_jetmoe_as_served():
    with open(DOCS) as f:
        text = f.read()
    served, _, refused = text.partition("## Refused, and why")
    assert "`JetMoeMoE`" in served
    assert "`jetmoe`" not in refused
