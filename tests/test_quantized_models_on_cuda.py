"""FP8 and MXFP4 models on CUDA through the public API, end to end: a block-FP8 checkpoint (per-expert
and fused experts, dimensions that are not multiples of 128), compressed-tensors FP8 checkpoints
(block, tensor and row scales), a GPT-OSS MXFP4 checkpoint, a
DeepSeek-V4 checkpoint (FP8 linears, FP4 experts) and offload_experts(quantize="fp8") generate on
the GPU the greedy tokens of the same model computed on the CPU in float32 with its experts
dequantized. The cache holds fewer slots than the model's
experts, so decode admits and evicts, and the 40-token prompt streams where the rates the runtime
measures choose it (prompt-sized calls admit otherwise, also exactly); compiled decode (CUDA graphs,
a static cache) gives the eager tokens up to a near tie. The checkpoints are the CPU tests' writers."""
import copy

import pytest
import torch

import freetoken_plugin
from freetoken_plugin.cli import _teacher_forced_logits, compare_greedy
from freetoken_plugin.tiny import tiny_model
from helpers import greedy_tokens, require
from test_fp8_plugin import quantized_reference
from test_loader_compressed_tensors import write_compressed_tensors_checkpoint
from test_loader_fp8 import random_qwen3_moe, write_fp8_checkpoint
from test_mxfp4 import write_mxfp4_checkpoint

pytestmark = pytest.mark.cuda
STEPS = 6


def greedy(model, prompt):
    """The greedy tokens of `prompt` on the model's device, on the CPU."""
    return greedy_tokens(model, prompt.to(model.device), STEPS).cpu()


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float().cpu() - want.float()).norm() / want.float().norm())


def logits(model, tokens):
    with torch.no_grad():
        return model(tokens.to(model.device)).logits.float().cpu()


def step_logits(model, prompt, **kw):
    """Greedy tokens and each generated step's logits ([steps, vocab], float32, on the CPU)."""
    with torch.no_grad():
        out = model.generate(prompt.to(model.device), max_new_tokens=STEPS, min_new_tokens=STEPS, do_sample=False,
                             output_logits=True, return_dict_in_generate=True, **kw)
    return out.sequences.cpu(), torch.stack(out.logits, 1)[0].float().cpu()


def check_compiled_decode(model, prompt, reference) -> None:
    """Compiled decode (CUDA graphs, a static cache) gives eager's tokens, up to a near tie of
    eager's (the demo's rule, compare_greedy): bf16 rounds otherwise in inductor's fused kernels,
    so a near tie may flip, but only where the compiled logits are as close to the float32
    reference's as eager's (within its headroom)."""
    from transformers import CompileConfig

    tokens, eager = step_logits(model, prompt)
    config = CompileConfig(fullgraph=True, mode="reduce-overhead")
    for _ in range(2):  # the first run compiles and captures, the second replays the graphs
        compiled_tokens, compiled = step_logits(model, prompt, cache_implementation="static", compile_config=config)
    exact = _teacher_forced_logits(reference, tokens, prompt.shape[1])
    same, verdict = compare_greedy(tokens, compiled_tokens, eager, compiled, prompt.shape[1], torch.bfloat16, exact)
    assert same, f"compiled decode: {verdict}"


def check_against(reference, loaded, prompt, got, want, dtype, compiled: bool = True) -> None:
    """float32: the logits within rounding of the CPU reference and the same greedy tokens.
    bfloat16: the logits within twice the distance of the reference itself run in bfloat16 (on the
    CPU, transformers' own code) to its float32 logits; and, where `compiled`, compiled decode gives
    eager's tokens (up to a near tie)."""
    error = relative_error(logits(loaded, want), logits(reference, want))
    if dtype == torch.float32:
        assert error < 1e-4
        assert torch.equal(got, want)
        return
    resident = copy.deepcopy(reference).to(torch.bfloat16)
    assert error < 2 * relative_error(logits(resident, want), logits(reference, want)) + 1e-3
    if compiled:
        check_compiled_decode(loaded, prompt, reference)


@pytest.mark.filterwarnings("ignore:slot pool of 12 slots holds one full layer")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("fused", [False, True], ids=["per-expert", "fused"])
def test_fp8_checkpoint_on_cuda_generates_the_dequantized_models_tokens(tmp_path, fused, dtype):
    require("cuda", "expert_gemm")
    ref = write_fp8_checkpoint(random_qwen3_moe(160, dense=96, inter=192), tmp_path, fused)
    prompt = torch.randint(1, 512, (1, 40), generator=torch.Generator().manual_seed(11))
    want = greedy(ref, prompt)
    # 12 slots for 2 layers of 8 experts: one streaming region, decode misses and evicts.
    loaded = freetoken_plugin.load_model(str(tmp_path), cache_slots=12, device="cuda", dtype=dtype, progress=False)
    assert loaded._freetoken_handle.stats()["pool"]["format"] == "fp8"
    check_against(ref, loaded, prompt, greedy(loaded, prompt), want, dtype)


@pytest.mark.filterwarnings("ignore:slot pool of 12 slots holds one full layer")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("strategy,pool", [("block", "fp8"), ("tensor", "fp8"), ("channel", "fp8_rows")])
def test_compressed_tensors_checkpoint_on_cuda_generates_the_dequantized_models_tokens(tmp_path, strategy, pool, dtype):
    require("cuda", "expert_gemm")
    ref = write_compressed_tensors_checkpoint(random_qwen3_moe(160, dense=96, inter=192), tmp_path, (strategy,))
    prompt = torch.randint(1, 512, (1, 40), generator=torch.Generator().manual_seed(17))
    want = greedy(ref, prompt)
    loaded = freetoken_plugin.load_model(str(tmp_path), cache_slots=12, device="cuda", dtype=dtype, progress=False)
    assert loaded._freetoken_handle.stats()["pool"]["format"] == pool
    check_against(ref, loaded, prompt, greedy(loaded, prompt), want, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_gpt_oss_mxfp4_checkpoint_on_cuda_generates_transformers_tokens(tmp_path, dtype):
    require("cuda", "expert_gemm")
    import transformers as tf

    write_mxfp4_checkpoint(tiny_model("gpt_oss", experts=8), tmp_path)
    # transformers dequantizes the MXFP4 experts (exact in bfloat16) on the CPU: the reference.
    reference = tf.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval().float()
    prompt = torch.randint(1, 512, (1, 40), generator=torch.Generator().manual_seed(13))
    want = greedy(reference, prompt)
    # 20 slots for 3 layers of 8 experts: two regions for the prompt, 4 free slots for decode.
    loaded = freetoken_plugin.load_model(str(tmp_path), cache_slots=20, device="cuda", dtype=dtype, progress=False)
    assert loaded._freetoken_handle.stats()["pool"]["format"] == "mxfp4"
    check_against(reference, loaded, prompt, greedy(loaded, prompt), want, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_deepseek_v4_fp4_checkpoint_on_cuda_generates_the_dequantized_models_tokens(tmp_path, dtype):
    require("cuda", "expert_gemm")
    pytest.importorskip("transformers.models.deepseek_v4")
    from test_loader_fp4_experts import reference_model, tiny_v4, write_v4_checkpoint

    reference = reference_model(write_v4_checkpoint(tiny_v4(), tmp_path / "v4"))
    prompt = torch.randint(2, reference.config.vocab_size, (1, 40), generator=torch.Generator().manual_seed(17))
    want = greedy(reference, prompt)
    # 12 slots for 2 layers of 8 experts: one streaming region, decode misses and evicts.
    loaded = freetoken_plugin.load_model(str(tmp_path / "v4"), cache_slots=12, device="cuda", dtype=dtype,
                                         progress=False)
    assert loaded._freetoken_handle.stats()["pool"]["format"] == "mxfp4"
    # No compiled decode: transformers' static cache has no layers of DeepSeek-V4's compressed
    # attention (KeyError 'heavily_compressed_attention' in 5.17).
    check_against(reference, loaded, prompt, greedy(loaded, prompt), want, dtype, compiled=False)


@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v3"])
def test_quantize_fp8_on_cuda_equals_quantize_then_dequantize(arch):
    require("cuda", "expert_gemm")
    model = tiny_model(arch, experts=8)
    ref = quantized_reference(model)  # float32, on the CPU
    prompt = torch.randint(1, 512, (1, 40), generator=torch.Generator().manual_seed(17))
    want = greedy(ref, prompt)
    offloaded = copy.deepcopy(model).to("cuda")
    handle = freetoken_plugin.offload_experts(offloaded, cache_slots=20, device="cuda", progress=False, quantize="fp8")
    assert handle.stats()["pool"]["format"] == "fp8"
    check_against(ref, offloaded, prompt, greedy(offloaded, prompt), want, torch.float32)
