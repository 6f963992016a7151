"""DBRX through the public API: transformers does not decorate its experts class (DbrxExperts, whose
`mlp` holds w1, v1, w2, each the experts' [I, H] blocks stacked as [E * I, H]), so freetoken
replaces the forward of the block that owns them (DbrxFFN: its router, its own top-k and
moe_normalize_expert_weights, the experts called in the decorated form). Greedy tokens, logits and
the block's outputs equal transformers' own model with the same weights (top-1, top-2, top-4; the
1-norm, the 2-norm and no normalisation of the routing weights; SiLU and GELU experts);
quantize="fp8" equals the model with its experts dequantized; load_model reads the checkpoints
save_pretrained writes (and an offloaded model saves) one expert block at a time; `freetoken trace`
records the routes transformers' blocks take; a DBRX that computes otherwise is refused in one line
and left unchanged."""
import copy
import json
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
from helpers import (DEVICES, assert_quantized_configs_refused, block_input, fail_while_switching,
                     generate, logits, prompts, refuse_host_pool, require)

transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "DbrxForCausalLM"):
    pytest.skip("this transformers has no DBRX", allow_module_level=True)

E, H, I = 8, 64, 32
DOCS = os.path.join(os.path.dirname(__file__), "..", "docs", "families.md")


def tiny_dbrx(layers: int = 2, d_model: int = H, ffn: int = I, top_k: int = 2, normalize=1.0, act: str = "silu",
              seed: int = 0):
    """A tiny random DbrxForCausalLM, weights at a trained model's scale so greedy tokens are
    decisive. clip_qkv is set: transformers 5.25's DbrxAttention clamps with min=max=None (a
    RuntimeError) when it is not; ffn_config's hidden_size is d_model (5.25 sets it so itself)."""
    config = transformers.DbrxConfig(
        d_model=d_model, n_heads=4, n_layers=layers, max_seq_len=64, vocab_size=128, pad_token_id=0,
        bos_token_id=1, eos_token_id=None,
        ffn_config=dict(hidden_size=d_model, ffn_hidden_size=ffn, moe_num_experts=E, moe_top_k=top_k,
                        moe_normalize_expert_weights=normalize, ffn_act_fn={"name": act}),
        attn_config=dict(kv_n_heads=2, rope_theta=10000.0, clip_qkv=8.0))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.manual_seed(seed)
        model = transformers.DbrxForCausalLM(config).eval()
    randomize(model, seed)
    return model


def require_transformers_dbrx() -> None:
    """Skip where transformers' own DBRX cannot run a model whose d_model differs from its experts'
    ffn_hidden_size (before transformers PR #47671 its router and experts read the one for the
    other and its expert GLU transposed its weights: there is no model to compare with; such a
    transformers' DBRX is refused, test_a_dbrx_that_computes_otherwise_is_refused...)."""
    try:
        with torch.no_grad():
            tiny_dbrx(layers=1)(torch.tensor([[1, 2, 3]]))
    except Exception as error:  # noqa: BLE001
        pytest.skip(f"transformers {transformers.__version__}'s DBRX does not run ({type(error).__name__}: {error})")


def ffn_blocks(model):
    return [m for m in model.modules() if type(m).__name__ == "DbrxFFN"]


def expert_weights(model) -> dict:
    return {k: v.clone() for k, v in model.state_dict().items() if ".experts." in k}


@pytest.mark.parametrize("top_k,normalize,act", [(2, 1.0, "silu"), (1, 1.0, "gelu"), (4, 2.0, "silu"),
                                                 (2, None, "silu")],
                         ids=["top2", "top1-gelu", "top4-2norm", "top2-unnormalized"])
def test_offloaded_dbrx_is_transformers_model(top_k, normalize, act):
    require("cpu", "expert_gemm")
    require_transformers_dbrx()
    model = tiny_dbrx(top_k=top_k, normalize=normalize, act=act)
    layout = read_layout(find_experts(model)[0][1])
    assert (layout.experts, layout.hidden, layout.intermediate) == (E, H, I)
    assert layout.activation == {"silu": SILU, "gelu": GELU}[act] and layout.split == ("mlp.w1", "mlp.v1", "mlp.w2")
    assert routed_per_token(model.config) == top_k  # DBRX keeps it in ffn_config.moe_top_k
    originals = [copy.deepcopy(b) for b in ffn_blocks(model)]
    weights = expert_weights(model)
    want_tokens, want_logits = generate(model), logits(model)
    handle = freetoken_plugin.offload_experts(model, cache_slots=E, device="cpu", progress=False)
    assert handle.runtime.shape.layers == 2 and handle.runtime.shape.experts == E
    assert all(m.mlp.w1.numel() == 0 for _, m in find_experts(model)), "the module copies are freed"
    assert torch.equal(generate(model), want_tokens)
    assert difference(logits(model), want_logits) < 1e-5
    for block, original in zip(ffn_blocks(model), originals):
        for tokens, scale in ((1, 1.0), (5, 1.0), (5, 100.0)):
            with torch.no_grad():
                got, ref = block(block_input(tokens, scale, H)), original(block_input(tokens, scale, H))
            assert got.shape == ref.shape == (2, tokens, H)
            assert difference(got, ref) < 1e-5, f"{tokens} tokens at {scale}x"
    state = model.state_dict()  # the experts, from the host pool, in the module's own layout
    assert all(torch.equal(state[k], v) for k, v in weights.items())
    stats = freetoken_plugin.stats(model)
    assert stats["admit"]["routed"] + stats["stream"]["routed"] > 0


@pytest.mark.parametrize("device", DEVICES)
def test_dbrx_block_in_bfloat16(device):
    """The offloaded block in bfloat16 on `device` (decode kernels at 8 tokens, grouped at 96)
    against transformers' block in bfloat16, within bfloat16 rounding (the probe's tolerance)."""
    require(device, "expert_gemm")
    require_transformers_dbrx()
    model = tiny_dbrx().to(device=device, dtype=torch.bfloat16)
    original = copy.deepcopy(ffn_blocks(model)[-1])
    freetoken_plugin.offload_experts(model, cache_slots=2 * E, device=device, progress=False)
    block = ffn_blocks(model)[-1]
    for tokens in (4, 48):  # 2 sequences: 8 and 96 rows
        for scale in (1.0, 100.0):
            x = block_input(tokens, scale, H, torch.bfloat16, device)
            with torch.no_grad():
                diff = difference(block(x), original(x))
            assert diff <= TOLERANCE[torch.bfloat16], f"{2 * tokens} rows at {scale}x: {diff:.2e}"


def dequantized_reference():
    """tiny_dbrx() with every expert replaced by its block-FP8 round trip, quantized as freetoken
    quantizes them: gate and up as the two projections of w13 [E, 2I, H], down as w2 [E, H, I]."""
    reference = tiny_dbrx()
    with torch.no_grad():
        for _, experts in find_experts(reference):
            mlp = experts.mlp
            w13 = torch.cat([mlp.w1.view(E, I, H), mlp.v1.view(E, I, H)], dim=1)
            w2 = mlp.w2.view(E, I, H).transpose(1, 2)
            (q13, s13), (q2, s2) = formats.quantize_fp8(w13.float(), parts=2), formats.quantize_fp8(w2.float())
            d13, d2 = formats.dequantize_fp8(q13, s13, parts=2), formats.dequantize_fp8(q2, s2)
            mlp.w1.copy_(d13[:, :I].reshape(E * I, H))
            mlp.v1.copy_(d13[:, I:].reshape(E * I, H))
            mlp.w2.copy_(d2.transpose(1, 2).reshape(E * I, H))
    return reference


def test_dbrx_quantized_to_fp8_is_the_dequantized_model(tmp_path):
    """quantize="fp8", through offload_experts and through load_model from the float checkpoint:
    the model computes with the dequantized experts (greedy tokens and logits of the reference)."""
    require("cpu", "expert_gemm")
    require_transformers_dbrx()
    reference = dequantized_reference()
    want_tokens, want_logits = generate(reference), logits(reference)
    model = tiny_dbrx()
    assert not torch.equal(logits(model), want_logits), "the quantization changes the model (the test can fail)"
    model.save_pretrained(tmp_path)
    freetoken_plugin.offload_experts(model, cache_slots=E, device="cpu", quantize="fp8", progress=False)
    loaded = freetoken_plugin.load_model(str(tmp_path), cache_slots=E, device="cpu", quantize="fp8", progress=False)
    want_state = reference.state_dict()
    for offloaded in (model, loaded):
        assert freetoken_plugin.stats(offloaded)["pool"]["format"] == "fp8"
        assert torch.equal(generate(offloaded), want_tokens)
        assert difference(logits(offloaded), want_logits) < 1e-5
        state = offloaded.state_dict()  # the experts dequantized, in the module's layout
        assert all(torch.equal(state[k], v) for k, v in want_state.items() if ".experts." in k)


def test_load_model_reads_dbrx_checkpoints(tmp_path):
    """The layout save_pretrained writes (transformer.blocks.<n>.ffn.experts.mlp.w1 / v1 / w2, each
    [E * I, H]; transformers renames nothing of DBRX's on load): load_model computes
    from_pretrained's logits and greedy tokens with a cache of one layer, every tensor read; the
    offloaded model's state_dict is the checkpoint's, and what it saves loads the same model."""
    require("cpu", "expert_gemm")
    require_transformers_dbrx()
    model = tiny_dbrx()
    model.save_pretrained(tmp_path / "ckpt")
    reference = transformers.DbrxForCausalLM.from_pretrained(tmp_path / "ckpt").eval()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loaded = freetoken_plugin.load_model(str(tmp_path / "ckpt"), cache_slots=E, device="cpu", progress=False)
    assert not [w for w in caught if "have no place" in str(w.message) or "has no place" in str(w.message)]
    assert type(loaded).__name__ == "DbrxForCausalLM"
    torch.testing.assert_close(logits(loaded), logits(reference), rtol=1e-5, atol=1e-5)
    assert torch.equal(generate(loaded), generate(reference))
    state = loaded.state_dict()
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())
    loaded.save_pretrained(tmp_path / "again")
    again = freetoken_plugin.load_model(str(tmp_path / "again"), cache_slots=E, device="cpu", progress=False)
    assert torch.equal(generate(again), generate(reference))


def test_load_model_reads_one_expert_block_at_a_time(tmp_path, monkeypatch):
    """The experts go from the files into the host pool one expert's [I, H] block at a time: no
    expert tensor is ever read whole (the host never holds a layer of experts besides the pool),
    and the blocks read are the checkpoint's, in place (the loaded model computes the original's)."""
    require("cpu", "expert_gemm")
    require_transformers_dbrx()
    import freetoken_plugin.expert_reading as reading
    import freetoken_plugin.loader as loader

    model = tiny_dbrx()
    model.save_pretrained(tmp_path)
    real_load, real_rows = reading.load_tensor, reading.read_rows_into
    blocks = []

    def load_tensor(entry):
        assert entry.shape != (E * I, H), "an expert tensor was read whole"
        return real_load(entry)

    def read_rows_into(entry, first, out, name=""):
        blocks.append((name, first, tuple(out.shape)))
        return real_rows(entry, first, out, name)

    for module in (loader, reading):  # the non-expert tensors, and the experts
        monkeypatch.setattr(module, "load_tensor", load_tensor)
    monkeypatch.setattr(reading, "read_rows_into", read_rows_into)
    loaded = freetoken_plugin.load_model(str(tmp_path), cache_slots=E, device="cpu", progress=False)
    assert len(blocks) == 2 * 3 * E and {shape for *_, shape in blocks} == {(I, H)}
    assert sorted(first for name, first, _ in blocks if name.endswith("blocks.0.ffn.experts.mlp.w2")) == \
        [e * I for e in range(E)]
    assert torch.equal(generate(loaded), generate(model))


@pytest.mark.slow
def test_dbrx_experts_are_never_held_twice_in_host_memory(tmp_path):
    """Peak resident memory of a process that loads a DBRX checkpoint whose experts are ~300 MB
    stays well below what a second copy of the experts would need (test_loader.py's rule)."""
    from helpers import assert_experts_loaded_once

    config = tiny_dbrx(layers=1).config
    config.n_layers, config.d_model, config.ffn_config.hidden_size = 3, 512, 512
    config.ffn_config.ffn_hidden_size, config.ffn_config.moe_num_experts = 256, 64
    torch.manual_seed(0)
    transformers.DbrxForCausalLM(config).save_pretrained(tmp_path, max_shard_size="100MB")
    assert_experts_loaded_once(tmp_path, 3 * 64 * 3 * 512 * 256 * 4, cache_slots=64)


def test_freetoken_trace_records_dbrx_routing(tmp_path):
    """`freetoken trace` on a DBRX checkpoint records, for every token and layer, the experts
    transformers' own blocks pass to their experts (recorded here on the original model), in their
    order; the experts' shape comes from the pool (DBRX's config names no intermediate_size)."""
    require("cpu", "expert_gemm")
    require_transformers_dbrx()
    from helpers import trace_on_cpu

    model = tiny_dbrx(top_k=2)
    model.save_pretrained(tmp_path / "ckpt")
    seen = [[] for _ in ffn_blocks(model)]
    for i, block in enumerate(ffn_blocks(model)):
        block.experts.register_forward_pre_hook(lambda _, args, i=i: seen[i].append(args[1].reshape(-1, 2)))
    generate(model, torch.tensor([[5, 6, 7, 8]]))
    trace = trace_on_cpu(tmp_path / "ckpt", tmp_path / "trace.safetensors", new_tokens=6)
    assert (trace.layers, trace.experts, trace.top_k, trace.hidden, trace.intermediate) == (2, E, 2, H, I)
    want = torch.stack([torch.cat(s) for s in seen], dim=1)  # [tokens, layers, top_k]
    assert want.shape[0] == 4 + 6 - 1  # the last token is never fed back
    assert torch.equal(trace.sequences[0].long(), want)


# --- refusals ------------------------------------------------------------------------------------

def _glu_transposed(self, x, expert_w1, expert_v1, expert_w2):
    """DbrxExpertGLU.forward as transformers computed it before PR #47671 (5.x releases before it): the
    three matrix products with their transposes inverted (it runs only where d_model equals
    ffn_hidden_size)."""
    return (self.activation_fn(x.matmul(expert_w1)) * x.matmul(expert_v1)).matmul(expert_w2.t())


def _experts_unweighted(self, hidden_states, top_k_index, top_k_weights):
    """DbrxExperts.forward with every routing weight 1 (a different expert function)."""
    return self._original_forward(hidden_states, top_k_index, torch.ones_like(top_k_weights))


def _experts_rows_of_ffn_width(self, hidden_states, top_k_index, top_k_weights):
    """DbrxExperts.forward reading its input in rows of ffn_hidden_size (as transformers' did before
    PR #47671): it fails on rows of d_model."""
    return self._original_forward(hidden_states.reshape(-1, self.ffn_hidden_size), top_k_index, top_k_weights)


def _ffn_own_routing(self, hidden_states):
    """DbrxFFN.forward routing by its own top-k of the logits, the weights not normalised: not the
    routing its route_tokens_to_experts computes."""
    router_logits = self.router(hidden_states)
    weights, index = torch.topk(router_logits.softmax(dim=1), self.top_k, dim=-1)
    return self.experts(hidden_states, index, weights)


def _router_tuple(self, hidden_states):
    """DbrxRouter.forward as transformers 4's returned: (probabilities, top weights, top experts)."""
    logits = self.layer(hidden_states.view(-1, hidden_states.shape[-1]))
    weights, experts = torch.topk(logits.softmax(dim=-1), 2, dim=-1)
    return logits.softmax(dim=-1), weights, experts


REFUSALS = {
    # name: (class patched, its attribute, replacement, model kwargs, message (regex)). The square
    # model (d_model = ffn_hidden_size) and the refused activation are refused alike by a
    # transformers whose DBRX runs no other (before PR #47671); the others need one that does.
    "glu-transposed": ("DbrxExpertGLU", "forward", _glu_transposed, dict(d_model=I),
                       r"^DbrxExperts: the offloaded experts would differ from the module's own forward by .* at 1x"),
    "experts-unweighted": ("DbrxExperts", "forward", _experts_unweighted, {},
                           r"^DbrxExperts: the offloaded experts would differ from the module's own forward by"),
    "experts-fail": ("DbrxExperts", "forward", _experts_rows_of_ffn_width, {},
                     r"^DbrxExperts: its own forward fails on the probe of 8 tokens of 64 \(RuntimeError: .*\); this "
                     r"transformers' DbrxExperts computes otherwise"),
    "ffn-own-routing": ("DbrxFFN", "forward", _ffn_own_routing, {},
                        r"^DbrxFFN: the forward freetoken runs in its place differs from it by .* at 1x input scale"),
    "router-tuple": ("DbrxRouter", "forward", _router_tuple, {},
                     r"^DbrxFFN: the forward freetoken runs in its place fails on this transformers' DbrxFFN "
                     r"\((TypeError|AttributeError): "),
    "relu-experts": (None, None, None, dict(act="relu"),
                     r"^DbrxExperts \(mlp.activation_fn\) computes act_fn\(gate\) \* up with act_fn ReLU, which "
                     r"freetoken does not serve"),
}
ANY_TRANSFORMERS = {"glu-transposed", "relu-experts"}


@pytest.mark.parametrize("case", sorted(REFUSALS))
def test_a_dbrx_that_computes_otherwise_is_refused_and_left_unchanged(monkeypatch, tmp_path, case):
    """A DBRX whose classes compute otherwise than the ones freetoken reads (5.17's inverted GLU
    transposes among them) is refused in one line naming the class and what differs, by
    offload_experts and by load_model, and the model is left as it was: its parameters, its
    classes, its outputs."""
    require("cpu", "expert_gemm")
    if case not in ANY_TRANSFORMERS:
        require_transformers_dbrx()
    cls_name, attr, replacement, kwargs, match = REFUSALS[case]
    model = tiny_dbrx(**kwargs)
    model.save_pretrained(tmp_path)
    if cls_name is not None:
        import transformers.models.dbrx.modeling_dbrx as modeling

        cls = getattr(modeling, cls_name)
        monkeypatch.setattr(cls, "_original_forward", cls.forward, raising=False)
        monkeypatch.setattr(cls, attr, replacement)
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
    assert all("forward" not in vars(b) and "_freetoken_experts" not in vars(b.experts) for b in ffn_blocks(model))
    if want is not None:
        with torch.no_grad():
            assert torch.equal(model(prompts()).logits, want)
    with pytest.raises(UnsupportedExperts, match=match):
        freetoken_plugin.load_model(str(tmp_path), cache_slots=E, device="cpu", progress=False)


def test_dbrx_experts_holding_more_or_other_shapes_are_refused():
    """What the split layout does not describe is refused by name, before anything changes: a
    tensor besides w1, v1, w2; a w2 that is not the experts' [I, H] blocks; weights of two dtypes."""
    require("cpu", "expert_gemm")
    cases = []
    model = tiny_dbrx()
    find_experts(model)[0][1].mlp.b1 = torch.nn.Parameter(torch.zeros(E * I))
    cases.append((model, r"^DbrxExperts holds tensors besides its expert weights \(mlp.b1\)"))
    model = tiny_dbrx()
    mlp = find_experts(model)[-1][1].mlp
    mlp.w2 = torch.nn.Parameter(mlp.w2.detach()[:, : H // 2].clone())
    cases.append((model, r"^DbrxExperts: mlp.w2 is \(256, 32\), expected \(256, 64\)"))
    model = tiny_dbrx()
    mlp = find_experts(model)[0][1].mlp
    mlp.v1 = torch.nn.Parameter(mlp.v1.detach().double())
    cases.append((model, r"^DbrxExperts: weights are torch.float32, torch.float64"))
    for model, match in cases:
        params = dict(model.named_parameters())
        with pytest.raises(UnsupportedExperts, match=match) as error:
            freetoken_plugin.offload_experts(model, cache_slots=E, device="cpu", progress=False)
        assert "\n" not in str(error.value)
        assert all(p is params[n] for n, p in model.named_parameters())


def test_a_failure_while_switching_puts_every_block_back(monkeypatch):
    require("cpu", "expert_gemm")
    require_transformers_dbrx()
    model = tiny_dbrx()
    want = logits(model)
    params = dict(model.named_parameters())
    classes = {n: type(m) for n, m in model.named_modules()}
    made = fail_while_switching(monkeypatch, 1)
    with pytest.raises(RuntimeError, match="injected failure"):
        freetoken_plugin.offload_experts(model, cache_slots=E, device="cpu", progress=False)
    assert made["n"] == 2
    assert all(p is params[n] for n, p in model.named_parameters())
    assert {n: type(m) for n, m in model.named_modules()} == classes, "a block kept its served class"
    assert all("forward" not in vars(b) for b in ffn_blocks(model))
    assert all(not hasattr(m, "_freetoken_experts") for _, m in find_experts(model))
    assert torch.equal(logits(model), want)


def test_checkpoints_dbrx_cannot_be_read_from_are_refused_from_the_headers(tmp_path, monkeypatch):
    """Before the host pool exists: a w2 of another shape (named, with the shape config.json
    gives), and a block-FP8 or MXFP4 config.json (no checkpoint format defines DBRX's experts in
    either, and transformers' FP8 quantizer leaves them unquantized), with the way that works."""
    from safetensors.torch import load_file, save_file

    tiny_dbrx().save_pretrained(tmp_path)
    refuse_host_pool(monkeypatch)
    file = os.path.join(tmp_path, "model.safetensors")
    tensors = load_file(file)
    good = tensors["transformer.blocks.1.ffn.experts.mlp.w2"]
    tensors["transformer.blocks.1.ffn.experts.mlp.w2"] = good[:-I].contiguous()
    save_file(tensors, file, metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"^transformer.blocks.1.ffn.experts.mlp.w2 has shape \(224, 64\), "
                                              r"expected \(256, 64\)"):
        freetoken_plugin.load_model(str(tmp_path), cache_slots=E, device="cpu", progress=False)
    tensors["transformer.blocks.1.ffn.experts.mlp.w2"] = good
    save_file(tensors, file, metadata={"format": "pt"})
    assert_quantized_configs_refused(
        tmp_path, r"a layout no block-FP8 checkpoint format defines .* load_model\(path, quantize='fp8'\)",
        r"mxfp4, but DbrxExperts holds its experts as mlp.w1, mlp.v1, mlp.w2", cache_slots=E)


def test_docs_list_dbrx_as_served():
    with open(DOCS) as f:
        text = f.read()
    served, _, refused = text.partition("## Refused, and why")
    assert "`DbrxFFN`, `DbrxExperts`" in served
    assert "`dbrx`" not in refused


def test_a_block_freetoken_would_serve_otherwise_is_refused_and_left_unchanged():
    """A subclass of DbrxFFN (even one that overrides nothing: it may compute otherwise, and would
    be left holding its experts) and a forward set on a DbrxFFN instance (serving the block would
    set it aside) are refused in one line naming the block, before anything changes; accelerate's
    hook, which serving handles, is not refused."""
    require("cpu", "expert_gemm")
    import transformers.models.dbrx.modeling_dbrx as modeling

    class WrappedFFN(modeling.DbrxFFN):
        pass

    model = tiny_dbrx()
    subclassed = WrappedFFN.__new__(WrappedFFN)
    subclassed.__dict__.update(model.transformer.blocks[0].ffn.__dict__)
    model.transformer.blocks[0].ffn = subclassed
    wrapped = tiny_dbrx()
    block = wrapped.transformer.blocks[1].ffn
    block.forward = lambda hidden_states, _f=block.forward: _f(hidden_states)
    for model, match in ((model, r"^WrappedFFN at transformer\.blocks\.0\.ffn holds DbrxExperts but is not DbrxFFN"),
                         (wrapped, r"^DbrxFFN at transformer\.blocks\.1\.ffn has a forward set on the instance")):
        params = dict(model.named_parameters())
        want = logits(model)
        with pytest.raises(UnsupportedExperts, match=match) as error:
            freetoken_plugin.offload_experts(model, cache_slots=E, device="cpu", progress=False)
        assert "\n" not in str(error.value)
        assert all(p is params[n] for n, p in model.named_parameters())
        assert torch.equal(logits(model), want)
    # Every block subclassed: the same refusal (not "no experts").
    model = tiny_dbrx(layers=1)
    subclassed = WrappedFFN.__new__(WrappedFFN)
    subclassed.__dict__.update(model.transformer.blocks[0].ffn.__dict__)
    model.transformer.blocks[0].ffn = subclassed
    with pytest.raises(UnsupportedExperts, match=r"^WrappedFFN at transformer\.blocks\.0\.ffn holds DbrxExperts"):
        freetoken_plugin.offload_experts(model, cache_slots=E, device="cpu", progress=False)


def test_a_checkpoint_routing_more_experts_than_it_has_is_refused_naming_moe_top_k(tmp_path):
    require("cpu", "expert_gemm")
    tiny_dbrx(layers=1).save_pretrained(tmp_path)
    with open(tmp_path / "config.json") as f:
        config = json.load(f)
    config["ffn_config"]["moe_top_k"] = E + 1
    with open(tmp_path / "config.json", "w") as f:
        json.dump(config, f)
    with pytest.raises(CheckpointError, match=rf"config.json: {E + 1} experts per token \(moe_top_k\), but "
                                              rf"moe_num_experts is {E}"):
        freetoken_plugin.load_model(str(tmp_path), cache_slots=E, device="cpu", progress=False)
