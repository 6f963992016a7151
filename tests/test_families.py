"""Every transformers family whose experts are decorated with use_experts_implementation, found in
the installed transformers at collection time (tests/families.py): the plugin reads the function
the class computes, the offloaded model's greedy tokens equal the original's (float32, CPU, a cache
of one layer's experts), and one experts block, as it now runs, equals the original block (its
configured implementation and its class's own eager code) at normal and at 100x input scale, where
every clamp and softcap is far exceeded. Families freetoken cannot serve are refused with a clear
UnsupportedExperts and left unchanged; so are families whose experts are not decorated."""
import copy
import os
import warnings

import pytest
import torch
import transformers

import freetoken_plugin
from families import FAMILIES, UNDECORATED, Family, build, decorated_classes, is_of
from freetoken_plugin.layouts import UnsupportedExperts, read_layout
from freetoken_plugin.offload import find_experts
from freetoken_plugin.safetensors_io import CheckpointError
from freetoken_plugin.verify import difference, probe
from helpers import require

E = 8  # experts per layer of the tiny models
NEW_TOKENS = 4
DOCS = os.path.join(os.path.dirname(__file__), "..", "docs", "families.md")

CASES = [pytest.param(family, modeling, cls, id=cls) for family, modeling, cls in decorated_classes()]


def spec_of(family: str, experts_class: str) -> Family:
    spec = FAMILIES.get(experts_class)
    if spec is None:
        pytest.fail(f"transformers {transformers.__version__} has a decorated experts class freetoken has not checked: "
                    f"{experts_class} ({family}). Read what its experts compute (its _apply_gate, act_fn, flags), "
                    "then add it to FAMILIES in tests/families.py and to docs/families.md")
    return spec


def greedy(model, spec: Family) -> torch.Tensor:
    prompt = torch.randint(2, 100, (1, 8), generator=torch.Generator().manual_seed(1))
    torch.manual_seed(0)  # a model that draws noise (diffusion_gemma's canvas) draws the same both times
    with torch.no_grad():
        if spec.inputs == "generate":
            out = model.generate(prompt, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False)
            return getattr(out, "sequences", out)
        if spec.inputs == "embeds":
            embeds = model.get_input_embeddings()(prompt)
            return model(inputs_embeds=embeds, attention_mask=torch.ones_like(prompt)).logits.argmax(-1)
        return model(prompt).logits.argmax(-1)


def test_every_decorated_class_is_listed_once_and_the_list_has_no_stale_entry():
    found = [cls for _, _, cls in decorated_classes()]
    assert len(found) == len(set(found)), "two families define an experts class of the same name"
    assert found, "no decorated experts class found: has transformers moved its models?"
    missing = sorted(set(found) - set(FAMILIES))
    assert not missing, f"not in tests/families.py FAMILIES: {missing}"


@pytest.mark.parametrize("family,modeling,experts_class", CASES)
def test_family_is_exact_or_refused(family, modeling, experts_class):
    require("cpu", "expert_gemm")
    spec = spec_of(family, experts_class)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # deprecations of the tiny configs, the serialized-streaming note
        model = build(family, modeling, experts_class, spec)
        block = next(m for _, m in find_experts(model) if is_of(m, experts_class))
        if spec.refused:
            check_refused(model, spec)
            return
        layout = read_layout(block)
        assert layout.activation == spec.function, f"{experts_class}: read {layout.activation}, computes {spec.function}"
    check_offloaded_equals_original(model, block, layout, spec, experts_class)


def check_offloaded_equals_original(model, block, layout, spec: Family, what: str) -> None:
    """Offloads `model` on the CPU (a cache of one layer's experts): its greedy tokens equal the
    original's, and `block`, as it then runs, equals the original block (its configured
    implementation and its class's own eager code) at 1x and 100x input scale, where every clamp
    and softcap is far exceeded."""
    originals = {"configured": copy.deepcopy(block), "eager": copy.deepcopy(block)}
    originals["eager"].config._experts_implementation = "eager"  # the class's own forward
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        want = greedy(model, spec)
        freetoken_plugin.offload_experts(model, cache_slots=E, device="cpu", progress=False)
        got = greedy(model, spec)
    assert torch.equal(got, want), f"{what}: offloaded greedy tokens {got.tolist()} != {want.tolist()}"
    hidden, index, weights = probe(layout, seed=2)
    for scale in (1.0, 100.0):
        x = hidden * scale
        with torch.no_grad():
            offloaded = block(x, index, weights)
            for name, original in originals.items():
                diff = difference(offloaded, original(x, index, weights))
                assert diff < 1e-5, f"{what}: block differs from the {name} original by {diff:.2e} at {scale:g}x"


@pytest.mark.parametrize("device", [pytest.param("cpu", marks=pytest.mark.slow), pytest.param("cuda", marks=pytest.mark.cuda)])
@pytest.mark.parametrize("family,modeling,experts_class", CASES)
def test_family_block_in_bfloat16(device, family, modeling, experts_class):
    """The offloaded block in bfloat16 on `device` (on CUDA: the decode kernels at 8 tokens, the
    grouped kernels at 96) against the original block in bfloat16, at 1x and 100x input scale,
    within bfloat16 rounding (the probe's tolerance)."""
    require(device, "expert_gemm")
    spec = spec_of(family, experts_class)
    if spec.refused:
        pytest.skip(f"{experts_class} is refused (test_family_is_exact_or_refused)")
    from freetoken_plugin.verify import TOLERANCE

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = build(family, modeling, experts_class, spec).to(device=device, dtype=torch.bfloat16)
        block = next(m for _, m in find_experts(model) if is_of(m, experts_class))
        original = copy.deepcopy(block)
        freetoken_plugin.offload_experts(model, cache_slots=2 * E, device=device, progress=False)
    layout = read_layout(original)
    for tokens in (8, 96):
        hidden, index, weights = probe(layout, seed=3)
        repeat = -(-tokens // hidden.shape[0])
        hidden, index, weights = (t.repeat(repeat, 1)[:tokens] for t in (hidden, index, weights))
        hidden = hidden + 0.1 * torch.randn(hidden.shape, generator=torch.Generator().manual_seed(tokens))
        for scale in (1.0, 100.0):
            x = (hidden * scale).to(device=device, dtype=torch.bfloat16)
            idx, w = index.to(device), weights.to(device=device, dtype=torch.bfloat16)
            with torch.no_grad():
                diff = difference(block(x, idx, w), original(x, idx, w))
            assert diff <= TOLERANCE[torch.bfloat16], \
                f"{experts_class}: bf16 block differs by {diff:.2e} at {scale:g}x, {tokens} tokens on {device}"


@pytest.mark.parametrize("experts_class", ["Step3p7Experts", "BailingHybridExperts"])
def test_a_clamp_after_the_activation(experts_class):
    """transformers 5.25's Step3p7 and BailingHybrid clamp after the activation where a layer's
    swiglu_limits entry sets a limit: min(act(gate), L) * clamp(up, -L, L). Served exactly with one
    function per layer, whether every layer has the limit or some only (the block at 1x and 100x
    input scale, where the clamp bites, and greedy tokens)."""
    import importlib

    require("cpu", "expert_gemm")
    found = {cls: (family, modeling) for family, modeling, cls in decorated_classes()}
    if experts_class not in found:
        pytest.skip(f"no {experts_class} in transformers {transformers.__version__}")
    family, modeling = found[experts_class]
    if "_apply_gate" not in vars(getattr(importlib.import_module(f"transformers.models.{family}.{modeling}"),
                                         experts_class)):
        pytest.skip(f"transformers {transformers.__version__}'s {experts_class} has no limit")
    spec = FAMILIES[experts_class]

    def model_with_limits(*limits):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = build(family, modeling, experts_class, spec)
        blocks = [m for _, m in find_experts(model) if is_of(m, experts_class)]
        for block, limit in zip(blocks, limits):
            block.limit = limit  # what a swiglu_limits entry gives the layer
        return model, blocks

    for limits in ((0.5, 0.5), (None, 0.5)):  # the same limit on every layer, or on some only
        model, blocks = model_with_limits(*limits)
        layout = read_layout(blocks[-1])
        assert str(layout.activation) == "silu(limit=0.5, limit_after_act)"
        check_offloaded_equals_original(model, blocks[-1], layout, spec, f"{experts_class}, limits {limits}")


def check_refused(model, spec: Family) -> None:
    params = dict(model.named_parameters())
    state = {k: v.clone() for k, v in model.state_dict().items()}
    impl = model.config._experts_implementation
    with pytest.raises(UnsupportedExperts, match=spec.refused) as err:
        freetoken_plugin.offload_experts(model, device="cpu", progress=False)
    assert "\n" not in str(err.value)
    assert all(p is params[n] for n, p in model.named_parameters()), "a parameter was replaced"
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())
    assert model.config._experts_implementation == impl


@pytest.mark.parametrize("family", sorted(UNDECORATED))
def test_undecorated_experts_are_refused_clearly(family):
    import importlib

    try:
        module = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    except ImportError:
        pytest.skip(f"no {family} in transformers {transformers.__version__}")
    head_name, overrides = UNDECORATED[family]
    head = getattr(module, head_name)
    from families import _merge, tiny_kwargs

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = head(head.config_class(**_merge(tiny_kwargs(head.config_class), dict(overrides)))).eval()
    params = dict(model.named_parameters())
    with pytest.raises(UnsupportedExperts, match="experts \\(.+\\) are not decorated with transformers' "
                                                 "use_experts_implementation, so freetoken cannot replace them"):
        freetoken_plugin.offload_experts(model, device="cpu", progress=False)
    assert all(p is params[n] for n, p in model.named_parameters())


def test_docs_list_every_family():
    with open(DOCS) as f:
        text = f.read()
    missing = [cls for cls in FAMILIES if f"`{cls}`" not in text]
    assert not missing, f"docs/families.md does not list {missing}"


def installed_family_model(experts_class: str):
    """(the tiny model, its Family) of a decorated class of the installed transformers; skips the
    test where that transformers has no such class."""
    require("cpu", "expert_gemm")
    found = {cls: (family, modeling) for family, modeling, cls in decorated_classes()}
    if experts_class not in found:
        pytest.skip(f"no {experts_class} in transformers {transformers.__version__}")
    spec = FAMILIES[experts_class]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return build(*found[experts_class], experts_class, spec), spec


@pytest.mark.parametrize("experts_class", ["MuseSparkExperts", "ErgoExpertProjections"])
def test_families_that_route_one_expert_a_row_leave_misses_to_the_cpu(experts_class):
    """MuseSpark and Ergo hand their experts one route a row (top_k 1 a call, the config's top_k
    rows a token), so the CPU share, started for the config's top_k, takes their calls padded:
    with half the misses left to the CPU (fetch_fraction 0.5) the greedy tokens are the original's."""
    model, spec = installed_family_model(experts_class)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        want = greedy(model, spec)
        freetoken_plugin.offload_experts(model, cache_slots=E, device="cpu", progress=False, fetch_fraction=0.5)
        got = greedy(model, spec)
    assert torch.equal(got, want), f"{experts_class}: {got.tolist()} != {want.tolist()}"
    assert freetoken_plugin.stats(model)["admit"]["cpu_pairs"] > 0, "no miss went to the CPU"


@pytest.mark.parametrize("experts_class", ["MuseSparkExperts", "ErgoExpertProjections"])
def test_a_norm_of_each_route_is_served_from_the_checkpoint_too(experts_class, tmp_path):
    """MuseSpark's post_expert_norm (has_post_expert_norm: the backend runs it on each route's
    output) and Ergo's (its class runs it around the dispatch) stay the module's: load_model reads
    them with the other non-expert tensors, and the loaded model's greedy tokens are the original's."""
    model, spec = installed_family_model(experts_class)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model.save_pretrained(tmp_path)
        want = greedy(model, spec)
        loaded = freetoken_plugin.load_model(str(tmp_path), cache_slots=E, device="cpu", progress=False)
    assert torch.equal(greedy(loaded, spec), want)
    norms = [m.post_expert_norm.weight for _, m in find_experts(loaded)]
    assert norms and all(n.numel() > 0 for n in norms), "the norms are the module's, loaded"
    # The demo's reference is the class load_model builds (MuseSpark's: its architectures' class,
    # which AutoModelForCausalLM does not map).
    from freetoken_plugin.cli import main

    assert main(["demo", "--device", "cpu", "--model", str(tmp_path), "--cache-slots", str(E), "--prompt-tokens", "8",
                 "--new-tokens", "4"]) == 0


def test_a_model_that_keeps_its_embeddings_in_float32_offloads_in_bfloat16(tmp_path):
    """Ergo's class keeps its embeddings (and norms) in float32 whatever the dtype it is loaded in
    (_keep_in_fp32_modules_strict); its layers pass bfloat16 to the experts, so a bf16 model as
    from_pretrained loads it offloads, and computes as the same model resident."""
    original, _ = installed_family_model("ErgoExpertProjections")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        original.save_pretrained(tmp_path)
        model = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.bfloat16)
        assert model.get_input_embeddings().weight.dtype == torch.float32
        prompt = torch.randint(2, 100, (1, 8), generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            want = model(prompt).logits
        freetoken_plugin.offload_experts(model, cache_slots=E, device="cpu", progress=False)
        with torch.no_grad():
            got = model(prompt).logits
    assert difference(got, want) <= 4e-2


def test_a_subclass_that_computes_its_experts_itself_is_refused():
    """A subclass of a decorated class whose forward never reaches transformers' experts dispatch
    would agree with itself in the probe check (both sides run the module's own forward) and then
    run on freed weights: refused, and the model left unchanged."""
    require("cpu", "expert_gemm")
    found = {cls: (family, modeling) for family, modeling, cls in decorated_classes()}
    model = build(*found["Qwen3MoeExperts"], "Qwen3MoeExperts", FAMILIES["Qwen3MoeExperts"])
    base = next(type(m) for m in model.modules() if type(m).__name__ == "Qwen3MoeExperts")

    class OwnLoop(base):
        def forward(self, hidden, top_k_index, top_k_weights):
            out = torch.zeros_like(hidden)
            for k in range(top_k_index.shape[1]):
                e = top_k_index[:, k]
                gate, up = torch.bmm(self.gate_up_proj[e], hidden[:, :, None])[..., 0].chunk(2, dim=-1)
                out += top_k_weights[:, k, None] * torch.bmm(self.down_proj[e], (torch.nn.functional.gelu(gate) * up)[:, :, None])[..., 0]
            return out

    for m in model.modules():
        if type(m) is base:
            m.__class__ = OwnLoop
    params = dict(model.named_parameters())
    with pytest.raises(UnsupportedExperts, match="OwnLoop's forward computes no route through transformers' experts "
                                                 "dispatch"):
        freetoken_plugin.offload_experts(model, cache_slots=E, device="cpu", progress=False)
    assert all(p is params[n] for n, p in model.named_parameters())


@pytest.mark.parametrize("experts_class", ["Inkling2Experts", "Inkling2LoopExperts", "MistralLarge4TextExperts",
                                          "Step3p7Experts", "Ernie4_5_VLMoeMoeExperts"])
def test_load_model_converts_stored_tensors_as_transformers_does(experts_class, tmp_path):
    """transformers moves some stored tensors' values as it loads them: Inkling2's experts (gate
    and up rows alternating), Mistral-Large-4's and Step3p7's vision projections (PermuteForRope),
    Inkling2's padded unembedding (its first rows), ERNIE-4.5-VL's experts (a layer's first half
    the text experts, the second half the vision experts). load_model does the same: every tensor
    of the loaded model's state equals the original's, its host pool holds the experts
    offload_experts takes from the original, and the logits agree."""
    model, spec = installed_family_model(experts_class)
    prompt = torch.randint(2, 100, (1, 8), generator=torch.Generator().manual_seed(1))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model.save_pretrained(tmp_path)
        loaded = freetoken_plugin.load_model(str(tmp_path), cache_slots=E, device="cpu", progress=False)
        with torch.no_grad():
            want, got = model(prompt).logits, loaded(prompt).logits
        state, original = loaded.state_dict(), model.state_dict()
        outside = [n for n in original if ".experts." not in n]
        differ = [n for n in original if n in state and not torch.equal(state[n], original[n])]
        assert not differ, f"{experts_class}: {differ[:4]} differ from the original's"
        assert [n for n in outside if n not in state] == [], "tensors missing from the loaded model"
        assert difference(got, want) <= 1e-5, difference(got, want)
        freetoken_plugin.offload_experts(model, cache_slots=E, device="cpu", progress=False)
    pools = [m._freetoken_handle.runtime.host for m in (loaded, model)]
    assert all(torch.equal(getattr(pools[0], w), getattr(pools[1], w)) for w in ("w13", "w2")), "experts differ"


@pytest.mark.slow  # 14 s: two models saved twice and read back
@pytest.mark.parametrize("experts_class", ["Qwen3VLMoeTextExperts", "Qwen3MoeExperts"])
def test_save_pretrained_of_an_offloaded_model_writes_what_the_resident_model_writes(experts_class, tmp_path):
    """save_pretrained transposes Qwen3-VL-MoE's experts back to the checkpoint's layout unless a
    tensor has its parameter's shape: the offloaded model's parameters report their shapes, so it
    writes the experts as the resident model does (the tiny config's gate_up_proj is square, where
    a transposed tensor was read back silently as other weights)."""
    model, spec = installed_family_model(experts_class)
    cls = type(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model.save_pretrained(tmp_path / "resident")
        want = model.state_dict()
        names = [n for n in want if ".experts." in n]
        freetoken_plugin.offload_experts(model, cache_slots=E, device="cpu", progress=False)
        assert all(model.get_parameter(n).shape == want[n].shape for n in names)
        model.save_pretrained(tmp_path / "offloaded")
        back = cls.from_pretrained(tmp_path / "offloaded").state_dict()
    from safetensors import safe_open

    for name in names:
        assert torch.equal(back[name], want[name]), f"{name} read back differs from the original"
    (written,), (resident,) = ([os.path.join(tmp_path, d, f) for f in os.listdir(tmp_path / d) if f.endswith(".safetensors")]
                               for d in ("offloaded", "resident"))
    with safe_open(written, "pt") as a, safe_open(resident, "pt") as b:
        assert sorted(a.keys()) == sorted(b.keys())
        for key in a.keys():
            assert torch.equal(a.get_tensor(key), b.get_tensor(key)), f"{key} is written otherwise"


def saved_family_checkpoint(experts_class: str, path):
    """The tiny model of a family saved to `path` in one shard: (the model, the shard's tensors, a
    function that writes tensors in its place), for a test that edits a checkpoint."""
    from safetensors.torch import load_file, save_file

    model, _ = installed_family_model(experts_class)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model.save_pretrained(path)
    (shard,) = [os.path.join(path, f) for f in os.listdir(path) if f.endswith(".safetensors")]
    return model, load_file(shard), lambda tensors: save_file(tensors, shard, metadata={"format": "pt"})


def test_a_tensor_converted_under_its_own_name_is_converted(tmp_path):
    """A checkpoint that stores Inkling2's padded unembedding as `lm_head.weight`, the module's own
    name: transformers cuts it to the vocabulary under that name too, and so does load_model."""
    model, tensors, write = saved_family_checkpoint("Inkling2Experts", tmp_path)
    padded = tensors.pop("model.llm.unembed.weight")
    assert padded.shape[0] > model.lm_head.weight.shape[0], "the tiny model's unembedding is not padded"
    write(dict(tensors, **{"lm_head.weight": padded}))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        want = type(model).from_pretrained(tmp_path).lm_head.weight
        loaded = freetoken_plugin.load_model(str(tmp_path), cache_slots=E, device="cpu", progress=False)
    assert torch.equal(loaded.lm_head.weight, want) and torch.equal(want, model.lm_head.weight)


def test_a_quantized_inkling2_loop_checkpoint_is_refused_before_any_tensor_is_read(tmp_path):
    """Inkling2-Loop's float checkpoints load (transformers passes a lone expert tensor through its
    dequantization); its NVFP4 ones (the weight with its scales) would need that dequantization,
    which load_model does not do: refused in one line, naming the way that works."""
    _, tensors, write = saved_family_checkpoint("Inkling2LoopExperts", tmp_path)
    weight = next(n for n in tensors if n.endswith("mlp.experts.w13_weight"))
    tensors[weight + "_scale"] = torch.ones(tensors[weight].shape[:2] + (1,))
    write(tensors)
    with pytest.raises(CheckpointError, match=r"transformers computes .*_scale.*Inkling2LoopDequantizeExperts.*"
                                               r"from_pretrained and call freetoken_plugin.offload_experts") as error:
        freetoken_plugin.load_model(str(tmp_path), cache_slots=E, device="cpu", progress=False)
    assert "\n" not in str(error.value)


def test_block_fp8_experts_with_reordered_rows_are_refused(tmp_path):
    """Inkling2's experts as block-FP8 (its checkpoint's names, the rows transformers de-interleaves,
    scales per 128 x 128 block): de-interleaving rows would move them across the scales' blocks,
    so load_model refuses in one line, naming the checkpoint's tensor."""
    import json

    _, tensors, write = saved_family_checkpoint("Inkling2Experts", tmp_path)
    for name in [n for n in tensors if n.endswith((".experts.w13_weight", ".experts.w2_weight"))]:
        experts, rows, columns = tensors[name].shape
        tensors[name] = tensors[name].to(torch.float8_e4m3fn)
        tensors[name + "_scale_inv"] = torch.ones(experts, -(-rows // 128), -(-columns // 128))
    write(tensors)
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"mlp.experts.w13_weight is block-FP8 with rows transformers reorders"
                                               r".*from_pretrained and call freetoken_plugin.offload_experts") as error:
        freetoken_plugin.load_model(str(tmp_path), cache_slots=E, device="cpu", progress=False)
    assert "\n" not in str(error.value)
