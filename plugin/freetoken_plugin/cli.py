"""Command line: `freetoken demo` (the main job) and `freetoken generate`.

Arguments are checked before any model is built (a missing --model directory before transformers
is imported), and an error is one line on stderr with a non-zero exit status; --traceback shows
the full traceback instead."""
import argparse
import copy
import importlib.util
import math
import os
import re
import sys
import tempfile
import time
import traceback
from typing import Optional

import torch

from ft_ops.slot_pool import human_bytes

from . import bench_e2e, cli_routing
from .cli_routing import add_eviction_argument
from .offload import QUANTIZE_CHOICES

DEMO_TOP_K = 4  # experts per token of the built-in demo model


class _OnePrompt(argparse.Action):
    """generate's --prompt and --prompt-ids: a repeat is refused (argparse would keep the last one
    silently); `freetoken trace` is the command that takes several prompts."""

    def __call__(self, parser, namespace, values, option_string=None):
        if getattr(namespace, self.dest, None) is not None:
            parser.error(f"{option_string} given twice: generate continues one prompt (freetoken trace takes several)")
        setattr(namespace, self.dest, values)


def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


class _TokenClock:
    """A generate() streamer that notes when each new token reaches the host (generate hands it
    the tokens on the host, so each note follows the device's work for that token). With `handle`
    (an offloaded model's), it reads the admission counters at the first new token (the prompt is
    done) and at the end, for the hit rate of the decode steps alone; the read at the first token
    is left out of the decode time (the next step starts after it)."""

    def __init__(self, handle=None):
        self.times = []
        self._prompt_seen = False
        self.handle, self.decode_start, self.at_first_token, self.decode_hit_rate = handle, None, None, None

    def put(self, value):
        if not self._prompt_seen:  # the first put is the prompt
            self._prompt_seen = True
            return
        self.times.append(time.perf_counter())
        if len(self.times) == 1:
            if self.handle is not None:
                from freetoken_plugin.bench_e2e import admission_counts

                self.at_first_token = admission_counts(self.handle)
            self.decode_start = time.perf_counter()

    def end(self):
        if self.at_first_token is not None:
            from freetoken_plugin.bench_e2e import admission_counts

            distinct, hits = (now - then for now, then in zip(admission_counts(self.handle), self.at_first_token))
            self.decode_hit_rate = hits / distinct if distinct else None


def _link_bytes(handle) -> int:
    """Bytes the offloaded model has sent over the link so far, admissions and streamed prompts."""
    stats = handle.stats()
    return stats["admit"]["bytes_over_link"] + stats["stream"]["bytes_over_link"]


def _timed_generate(model, prompt, new_tokens, handle=None):
    """Greedy generation; returns (tokens, seconds to first token, decode tokens per second, or None
    when there is no decode step to time: a single new token is all prefill, decode hit rate, bytes
    over the link). Every figure comes from one timed generate() after a warm-up one, so they
    describe the same run. The last two are that run's (its decode steps' hit rate) with `handle`
    (an offloaded model's), else None."""
    kw = dict(do_sample=False, pad_token_id=0)
    with torch.no_grad():
        model.generate(prompt, max_new_tokens=2, min_new_tokens=2, **kw)  # warm-up
        _sync(prompt.device)
        sent_before = _link_bytes(handle) if handle is not None else None
        clock = _TokenClock(handle)
        t0 = time.perf_counter()
        out = model.generate(prompt, max_new_tokens=new_tokens, min_new_tokens=new_tokens, streamer=clock, **kw)
        _sync(prompt.device)
    first = clock.times[0] - t0
    decode_rate = (len(clock.times) - 1) / (clock.times[-1] - clock.decode_start) if len(clock.times) > 1 else None
    sent = _link_bytes(handle) - sent_before if handle is not None else None
    return out, first, decode_rate, clock.decode_hit_rate, sent


def _policy_name(handle) -> str:
    """The eviction policy the handle's slot pool applies, by name."""
    from ft_ops.policies import POLICIES

    return next(name for name, value in POLICIES.items() if value == handle.runtime.pool.policy)


def _rate(tokens_per_s: Optional[float]) -> str:
    return "-" if tokens_per_s is None else f"{tokens_per_s:.1f} tokens/s"


def _teacher_forced_logits(model, tokens, prompt_len):
    """Float32 logits of every generated step, given the tokens so far."""
    with torch.no_grad():
        return model(tokens).logits.float()[0, prompt_len - 1:-1]


# The logit difference that rounding explains, relative to the step's largest logit, where no exact
# reference is at hand: float32 models agree to ~1e-6; 16-bit ones to ~1e-2 for trained models (a
# random-weight model's small logits differ by more: the demo measures its own, see compare_greedy).
ROUNDING_RTOL = {torch.float32: 1e-4, torch.float64: 1e-8}
ROUNDING_RTOL_16BIT = 5e-2
# With exact logits: the offloaded model may be this many times as far from them as the reference
# model's own rounding took it (both round in the same dtype, with other summation orders).
ROUNDING_HEADROOM = 2.0


def _relative(a, b):
    """Per step: the largest difference of a and b relative to b's largest logit."""
    return (a - b).abs().amax(dim=-1) / b.abs().amax(dim=-1).clamp_min(1e-30)


def compare_greedy(want, got, want_logits, got_logits, prompt_len, dtype=torch.float32, exact_logits=None):
    """(ok, verdict): identical tokens; or tokens equal up to the first step where the reference was
    a near tie (top-2 logits closer than the two models' logit difference there), after which a
    rounding difference may legitimately pick the other token (bf16). A near tie counts only while
    the offloaded model's logits agree with the reference to rounding: with `exact_logits` (the
    same model in float32 on the reference's tokens) while they are at most ROUNDING_HEADROOM times
    as far from the exact ones as the reference's own; without, within ROUNDING_RTOL of `dtype`. A
    model that computes something else may flip near ties too. Logits with an inf or NaN compare
    nothing (a damaged checkpoint's tokens are argmaxes of NaN, equal in both models)."""
    if not bool(torch.isfinite(want_logits).all()):
        return False, "NOT COMPARED: the reference's logits hold inf or NaN (check the model's weights)"
    if not bool(torch.isfinite(got_logits).all()):
        return False, "DIFFERENT: the offloaded model's logits hold inf or NaN"
    if torch.equal(got.cpu(), want.cpu()):
        return True, "identical"
    diff = (got[0, prompt_len:] != want[0, prompt_len:]).nonzero()
    first = int(diff[0]) if len(diff) else 0
    gap = (got_logits - want_logits).abs().amax(dim=-1)
    if exact_logits is not None:
        own = float(_relative(want_logits, exact_logits)[: first + 1].max())
        error = float(_relative(got_logits, exact_logits)[: first + 1].max())
        if error > ROUNDING_HEADROOM * own:
            return False, (f"DIFFERENT at step {first + 1} (logits {error:.1e} of their size from the float32 "
                           f"model's, {error / max(own, 1e-30):.1f}x the reference's own {own:.1e})")
    else:
        rtol = ROUNDING_RTOL.get(dtype, ROUNDING_RTOL_16BIT)
        worst = float(_relative(got_logits, want_logits)[: first + 1].max())
        if worst > rtol:
            return False, (f"DIFFERENT at step {first + 1} (logits differ by {worst:.1e} of their size, beyond "
                           f"{dtype}'s rounding)")
    top2 = want_logits.topk(2, dim=-1).values
    near_tie = (top2[:, 0] - top2[:, 1]) <= 2 * gap
    ties = near_tie[: first + 1].nonzero()
    if len(ties):
        return True, f"equal to a near tie at step {int(ties[0]) + 1}"
    return False, f"DIFFERENT at step {first + 1}"


def _float32_logits(model, tokens, prompt_len, device):
    """The reference model cast to float32 (in place), its logits on the reference's tokens: how far
    16-bit rounding alone moves them (a random-weight model's small logits move by several percent;
    GPT-OSS's by more). None, with a note, where the float32 weights do not fit beside the 16-bit
    ones: the fixed 16-bit tolerance judges then (compare_greedy)."""
    from freetoken_plugin.host_memory import available_host_bytes

    fallback = "tokens are judged by the fixed 16-bit tolerance"
    if getattr(model, "is_quantized", False):  # transformers keeps e.g. MXFP4 quantized on a GPU: no .float()
        print(f"[demo] the reference is quantized by transformers, so there is no float32 copy of it: {fallback}",
              flush=True)
        return None
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    free = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else available_host_bytes()
    if free is not None and free < 1.5 * weight_bytes:
        where = "the GPU" if device.type == "cuda" else "host memory"
        print(f"[demo] the float32 reference does not fit in {where}: {fallback}", flush=True)
        return None
    try:
        return _teacher_forced_logits(model.float(), tokens, prompt_len)
    except torch.OutOfMemoryError:  # (the caller frees the model before the offloaded run)
        print(f"[demo] the float32 reference ran out of memory: {fallback}", flush=True)
        return None


# The layer-shaped demo model: Qwen3-30B-A3B's MoE layers (128 experts of 2048 x 768, top-8, bf16;
# 9 MiB an expert), random weights, a few layers.
LAYER_SHAPE = dict(hidden=2048, experts=128, top_k=8, expert_intermediate=768)


def _shape_of(args, device_type: str) -> str:
    """The built-in model: --shape, else tiny on the CPU, with a checkpoint, or when --arch or
    --experts name the tiny model's architecture or size; else the Qwen3-30B-A3B-shaped layers."""
    if args.shape:
        return args.shape
    tiny_asked = args.arch is not None or args.experts is not None
    return "qwen3-30b-a3b" if device_type == "cuda" and not args.model and not tiny_asked else "tiny"


def _layer_shaped_demo(args, device) -> int:
    """A few Qwen3-30B-A3B-shaped bf16 layers with random weights: all resident, accelerate's offload
    (experts on the CPU, moved per forward) and freetoken with a cache smaller than the experts, in
    one run; the offloaded tokens are checked against the resident ones."""
    import types

    import freetoken_plugin
    from freetoken_plugin.bench_e2e import accelerate_offload, build_model
    from ft_ops import formats
    from ft_ops.slot_pool import ExpertShape

    _refuse_a_cache_too_small(args.cache_slots, ExpertShape(args.layers, LAYER_SHAPE["experts"], LAYER_SHAPE["hidden"],
                                                            LAYER_SHAPE["expert_intermediate"], torch.bfloat16, False,
                                                            formats.DENSE))
    prompt_tokens = args.prompt_tokens or 2048
    new_tokens = args.new_tokens or 32
    # build_model sizes the positions for the bench's sequences: here one prompt and its new tokens.
    shape = types.SimpleNamespace(layers=args.layers, prompts=str(prompt_tokens), turn=f"{prompt_tokens},{new_tokens}",
                                  decode_tokens=new_tokens, **LAYER_SHAPE)
    prompt = torch.randint(1, 32768, (1, prompt_tokens), generator=torch.Generator().manual_seed(0)).to(device)
    print(f"[demo] {args.layers} Qwen3-30B-A3B-shaped layers, random bf16 weights, on {device}: all resident",
          flush=True)
    model = build_model(shape, device)
    want, ttft_ref, rate_ref, _, _ = _timed_generate(model, prompt, new_tokens)
    want_logits = _teacher_forced_logits(model, want, prompt_tokens)
    exact_logits = _float32_logits(model, want, prompt_tokens, device)
    columns = {"all resident": (ttft_ref, rate_ref)}
    del model
    _free_memory()
    if device.type == "cuda":
        if importlib.util.find_spec("accelerate") is not None:
            print("[demo] accelerate offload (experts on the CPU)", flush=True)
            model = accelerate_offload(build_model(shape, device), args.layers, device)
            _, ttft_acc, rate_acc, _, _ = _timed_generate(model, prompt, min(new_tokens, 8))
            columns["accelerate offload"] = (ttft_acc, rate_acc)
            del model
            _free_memory()
    print("[demo] freetoken", flush=True)
    model = build_model(shape, device)
    handle = freetoken_plugin.offload_experts(model, cache_slots=args.cache_slots, device=device, progress=True,
                                              eviction=args.eviction)
    got, ttft, rate, hit, sent = _timed_generate(model, prompt, new_tokens, handle)
    got_logits = _teacher_forced_logits(model, want, prompt_tokens)
    same, verdict = compare_greedy(want, got, want_logits, got_logits, prompt_tokens, torch.bfloat16,
                                   exact_logits)
    rt = handle.runtime.shape
    print(f"\nfreetoken demo: {args.layers} MoE layers x {rt.experts} experts of {rt.expert_bytes / 2**20:.1f} MiB "
          f"(Qwen3-30B-A3B's shape), bf16, on {device}")
    where = "pinned host memory" if handle.runtime.host.is_pinned else "host memory"
    print(f"experts {handle.host_bytes / 2**30:.2f} GiB in {where}; device cache {handle.slots} slots "
          f"({handle.device_bytes / 2**30:.2f} GiB, {handle.slots / (rt.layers * rt.experts):.0%} of the experts, "
          f"{_policy_name(handle)} eviction); prompt {prompt_tokens} tokens, {new_tokens} new")
    names = ["freetoken", *columns]
    values = {"freetoken": (ttft, rate), **columns}
    print(f"\n{'':<22}" + "".join(f"{n:>20}" for n in names))
    print(f"{'time to first token':<22}" + "".join(f"{values[n][0] * 1e3:>17.1f} ms" for n in names))
    print(f"{'decode':<22}" + "".join(f"{_rate(values[n][1]):>20}" for n in names))
    print(f"{'decode hit rate':<22}{'-' if hit is None else f'{hit:.2f}':>20}")
    print(f"{'bytes over the link':<22}{f'{sent / 2**30:.2f} GiB':>20}")
    print(f"{'greedy tokens':<22}{verdict:>20}")
    print("\n(each column timed after a warm-up generation of the same prompt: freetoken's cache then holds the "
          "experts the warm-up kept)")
    return 0 if same else 1


def _free_memory() -> None:
    import gc

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _tiny_meta_model(arch: str, experts: int):
    """The built-in tiny model on the meta device: its shapes, no memory."""
    import transformers as tf

    from freetoken_plugin.tiny import tiny_config

    with torch.device("meta"):
        return tf.AutoModelForCausalLM.from_config(tiny_config(arch, experts=experts, top_k=DEMO_TOP_K))


def _check_tiny_model_fits(model, experts: int) -> None:
    """Refuses (exit 2) a tiny model (`model`: _tiny_meta_model's) the demo cannot hold in host
    memory, before building it: the demo keeps it three times (the reference, the model being
    offloaded, the host pool)."""
    from freetoken_plugin.host_memory import available_host_bytes

    total = sum(p.numel() for p in model.parameters())
    expert_share = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n) / max(1, total)
    needed = 3 * 4 * total  # float32
    available = available_host_bytes()
    if available is not None and needed > available:
        fit = max(DEMO_TOP_K, int(experts * 0.8 * available / needed / max(expert_share, 1e-9)))
        raise cli_routing.UsageError(f"--experts {experts}: the demo holds the tiny model three times, "
                                     f"{needed / 2**30:.1f} GiB, and this machine has {available / 2**30:.1f} GiB "
                                     f"available; give fewer experts (e.g. --experts {min(fit, experts - 1)})")


def _reference_model(reference_class, path: str, dtype: torch.dtype, checkpoint: str):
    """The unmodified model the demo compares with, as transformers loads it from `path`; refused
    where transformers leaves parameters newly initialized (tensor names it does not map, such as
    per-expert names some writers use for fused experts): a comparison with random weights would
    fail for nothing."""
    model, info = reference_class.from_pretrained(path, dtype=dtype, output_loading_info=True)
    missing = sorted(info.get("missing_keys") or [])
    if missing:
        raise RuntimeError(f"transformers' {reference_class.__name__}.from_pretrained leaves {len(missing)} "
                           f"parameter{'s' if len(missing) != 1 else ''} of {checkpoint} newly initialized (e.g. "
                           f"{missing[:2]}): it does not read the names the checkpoint stores them under, so the demo "
                           f"has no reference to compare with; `freetoken generate --model {checkpoint}` runs "
                           "load_model, which reads them, without one")
    return model.eval()


def _reference_generate(model, prompt, new_tokens: int, checkpoint: Optional[str]):
    """_timed_generate of the untouched model (the demo's reference), and None, or the experts
    implementations it was built with (e.g. "grouped_mm") where its experts ran with transformers'
    eager code instead. transformers' default, grouped_mm, refuses some shapes (its operands'
    strides must be multiples of 16 bytes: an expert intermediate size of 130 is not, in float32 or
    bf16); the class's eager code computes the same function one expert at a time, so the reference
    then runs with it, as freetoken's own probe of the class does (verify.module_forward), and says
    so. A failure with the eager code too, or one that is not a RuntimeError, is raised as
    transformers' run of the untouched model, in one line with what runs instead (`checkpoint`:
    the --model)."""
    remedy = (f"; `freetoken generate --model {checkpoint}` runs the offloaded model without a reference"
              if checkpoint else "")
    what = "transformers' generation with the untouched model (the demo's reference, before freetoken offloads it)"
    try:
        return _timed_generate(model, prompt, new_tokens), None
    except torch.OutOfMemoryError:
        raise
    except Exception as error:
        first = _one_line(error)
        get = getattr(model, "get_experts_implementation", None)  # (with its sub-configs': a VLM's text model)
        implementations = (set(get().values()) if callable(get)
                           else {getattr(model.config, "_experts_implementation", None)})
        grouped = sorted(i for i in implementations if i not in (None, "eager"))
        if not isinstance(error, RuntimeError) or not grouped:
            raise RuntimeError(f"{what} failed: {first}{remedy}") from error
        try:
            model.set_experts_implementation("eager")
            result = _timed_generate(model, prompt, new_tokens)
        except torch.OutOfMemoryError:
            raise
        except Exception as again:
            raise RuntimeError(f"{what} failed: {first} (experts_implementation {', '.join(grouped)}), and with its "
                               f"eager experts: {_one_line(again)}{remedy}") from again
        print(f"[demo] transformers' {', '.join(grouped)} experts refuse this model ({first}): the reference runs with "
              "its eager experts code (the same function, one expert at a time)", flush=True)
        return result, ", ".join(grouped)


def _refuse_a_cache_too_small(cache_slots, shape) -> None:
    """--cache-slots against the demo model's experts (`shape`, an ExpertShape), before its reference
    generation runs (minutes for a large checkpoint): offload_experts' own rule and message (a cache
    below one layer of experts cannot stream prompts), raised as its CacheSizeError (exit 2)."""
    if cache_slots is not None:
        from freetoken_plugin.offload import resolve_slots

        resolve_slots(shape.experts, shape.layers, shape.expert_bytes, cache_slots, None, stream_prefill=True)


def _tiny_expert_shape(model, dtype: torch.dtype):
    """The experts of the tiny model (`model`: _tiny_meta_model's) as an ExpertShape in `dtype`."""
    from freetoken_plugin.offload import find_experts, read_layouts
    from ft_ops import formats
    from ft_ops.slot_pool import ExpertShape

    found = find_experts(model)
    first = read_layouts(found)[0]
    return ExpertShape(len(found), first.experts, first.hidden, first.intermediate, dtype, first.bias, formats.DENSE,
                       gated=first.gated)


def _demo(args) -> int:
    """Builds a small MoE model of a real transformers architecture with random weights (or loads
    --model PATH), generates greedily, offloads its experts with a small cache, generates again,
    checks the tokens are identical and prints a table. On a GPU the built-in model is a few
    Qwen3-30B-A3B-shaped layers (--shape tiny for the small one), beside resident and accelerate."""
    import freetoken_plugin
    from freetoken_plugin.tiny import tiny_model

    device = torch.device(args.device)
    if _shape_of(args, device.type) == "qwen3-30b-a3b":
        if args.dtype not in (None, "bfloat16"):
            raise cli_routing.UsageError(f"--dtype {args.dtype}: the Qwen3-30B-A3B-shaped demo runs in bfloat16; "
                                         "leave --dtype out, or take the tiny model (--shape tiny) or a --model")
        return _layer_shaped_demo(args, device)
    args.prompt_tokens = args.prompt_tokens or 64
    args.new_tokens = args.new_tokens or 16
    args.arch = args.arch or "qwen3_moe"
    args.experts = args.experts or 16
    # The built-in model is tiny: float32 everywhere by default, so its tokens must match exactly. A
    # checkpoint runs in bf16 on the GPU by default, where near ties may flip (compare_greedy).
    if args.dtype is not None:
        dtype = getattr(torch, args.dtype)
    else:
        dtype = torch.bfloat16 if device.type == "cuda" and args.model else torch.float32
    if args.model:
        import transformers as tf

        from freetoken_plugin.loader import (check_checkpoint, checkpoint_formats, default_model_class,
                                             write_dequantized_copy)
        from ft_ops import formats

        if not sys.stderr.isatty():  # transformers' loading bar would leave carriage returns in a log
            tf.utils.logging.disable_progress_bar()
        shape = check_checkpoint(args.model, dtype)  # what load_model would refuse, refused before any weight loads
        _refuse_a_cache_too_small(args.cache_slots, shape)
        # The unmodified model gives the reference tokens; the offloaded one comes from load_model,
        # which reads the experts from the shards straight into the host pool.
        config = tf.AutoConfig.from_pretrained(args.model)
        cli_routing.check_prompts(config, [torch.zeros(args.prompt_tokens)], args.new_tokens)
        reference_class = default_model_class(args.model, config)  # the class load_model builds
        if {formats.FP8, formats.INT4} & set(checkpoint_formats(args.model, dtype)):
            # The reference: the checkpoint with its FP8 weights dequantized by the block rule
            # (transformers' CPU fallback gets partial edge blocks wrong), FP4 experts likewise,
            # int4 linears (GPTQ, pack-quantized) as codes times their group's scales.
            with tempfile.TemporaryDirectory() as reference:
                write_dequantized_copy(args.model, reference, dtype)
                model = _reference_model(reference_class, reference, dtype, args.model)
        else:
            model = _reference_model(reference_class, args.model, dtype, args.model)
        source = args.model
    else:
        from freetoken_plugin.tiny import tiny_config

        cli_routing.check_prompts(tiny_config(args.arch, experts=args.experts, top_k=DEMO_TOP_K),
                                  [torch.zeros(args.prompt_tokens)], args.new_tokens)
        shapes = _tiny_meta_model(args.arch, args.experts)
        _check_tiny_model_fits(shapes, args.experts)
        _refuse_a_cache_too_small(args.cache_slots, _tiny_expert_shape(shapes, dtype))
        model = tiny_model(args.arch, dtype=dtype, experts=args.experts, top_k=DEMO_TOP_K)
        source = f"{args.arch} (random weights, built-in config)"
    vocab = model.get_input_embeddings().weight.shape[0]  # (a VLM's config keeps it in text_config)
    prompt = torch.randint(1, vocab, (1, args.prompt_tokens), generator=torch.Generator().manual_seed(0))
    resident = model if args.model else copy.deepcopy(model)
    resident.to(device)
    (want, ttft_ref, rate_ref, _, _), refused_by = _reference_generate(resident, prompt.to(device), args.new_tokens,
                                                                   args.model)
    want_logits = _teacher_forced_logits(resident, want, args.prompt_tokens)
    # 16-bit models are judged against the same model in float32 (compare_greedy), as GPT-OSS's
    # logits round by more than a fixed tolerance allows.
    exact_logits = _float32_logits(resident, want, args.prompt_tokens, device) if dtype != torch.float32 else None
    del resident
    if args.model:
        del model
        model = freetoken_plugin.load_model(args.model, cache_slots=args.cache_slots, device=device, dtype=dtype,
                                            eviction=args.eviction)
        handle = model._freetoken_handle
    else:
        handle = freetoken_plugin.offload_experts(model, cache_slots=args.cache_slots, device=device,
                                                  progress=True, eviction=args.eviction)
    E = handle.runtime.shape.experts
    got, ttft, rate, hit, sent = _timed_generate(model, prompt.to(device), args.new_tokens, handle)
    got_logits = _teacher_forced_logits(model, want, args.prompt_tokens)
    same, verdict = compare_greedy(want, got, want_logits, got_logits, args.prompt_tokens, dtype, exact_logits)
    shape = handle.runtime.shape
    print(f"\nfreetoken demo: {source} on {device}, {dtype}")
    print(f"{shape.layers} MoE layers x {E} experts, expert {human_bytes(shape.expert_bytes)} ({shape.format}); "
          f"host pool {human_bytes(handle.host_bytes)}; device cache {handle.slots} slots "
          f"({human_bytes(handle.device_bytes)}, {handle.slots / (shape.layers * E):.0%} of the experts, "
          f"{_policy_name(handle)} eviction)")
    rows = [("time to first token", f"{ttft * 1e3:.1f} ms", f"{ttft_ref * 1e3:.1f} ms"),
            ("decode", _rate(rate), _rate(rate_ref)),
            ("decode hit rate", "-" if hit is None else f"{hit:.2f}", "-"),
            ("bytes over the link", human_bytes(sent), "-"),
            ("greedy tokens", verdict, f"{args.new_tokens} new")]
    width = max(18, *(len(a) + 2 for _, a, _ in rows))
    print(f"\n{'':<22}{'offloaded':>{width}}{'all resident':>18}")
    for name, a, b in rows:
        print(f"{name:<22}{a:>{width}}{b:>18}")
    if refused_by:
        print(f"\n(all resident: transformers' eager experts code, as its {refused_by} experts refuse this model)")
    return 0 if same else 1


def _generate(args) -> int:
    import transformers as tf

    from ft_ops import formats

    import freetoken_plugin
    from freetoken_plugin.loader import check_checkpoint, check_requantizing
    from freetoken_plugin.offload import quantized_format

    device = torch.device(args.device)
    shape = check_checkpoint(args.model)  # the checkpoint's own faults first: they are what a user must fix
    # load_model's refusal of experts quantized already, in the command line's words (a CheckpointError: exit 2)
    check_requantizing(args.model, shape.format, args.quantize, argument="--quantize")
    if args.quantize is not None and shape.format == formats.DENSE:  # sizes no int4 group divides, ungated experts
        try:
            quantized_format(args.quantize, shape.hidden, shape.intermediate, shape.gated, argument="--quantize")
        except ValueError as error:
            raise cli_routing.UsageError(str(error)) from None
    tok = None
    if args.prompt is not None:
        problem = cli_routing.tokenizer_files_problem(args.model)
        if problem:
            raise cli_routing.UsageError(problem)
        tok = tf.AutoTokenizer.from_pretrained(args.model)
        ids = tok(args.prompt, return_tensors="pt").input_ids  # before the model: a tokenizer without files
        if ids.shape[1] == 0:                                   # yields no token, and loading is long
            raise cli_routing.UsageError(f"the prompt {args.prompt!r} gives no token with {args.model}'s tokenizer "
                                         "(does the checkpoint have tokenizer files?); give token ids with "
                                         "--prompt-ids 1,2,3")
    else:
        ids = cli_routing.parse_ids(args.prompt_ids)[None]
    cli_routing.check_prompts(tf.AutoConfig.from_pretrained(args.model), [ids[0]], args.new_tokens)
    model = freetoken_plugin.load_model(args.model, cache_bytes=args.cache_bytes, cache_slots=args.cache_slots,
                                        device=device, eviction=args.eviction, quantize=args.quantize)
    ids = ids.to(device)
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=args.new_tokens, do_sample=False)
    new = out[0, ids.shape[1]:]
    print(tok.decode(new, skip_special_tokens=True) if tok is not None else ",".join(str(int(t)) for t in new))
    return 0


def _checkpoint_dir_problem(path: str) -> Optional[str]:
    if not os.path.exists(path):
        from freetoken_plugin.loader import looks_like_hub_id

        hub = (f": for a Hugging Face Hub id, download it first (hf download {path} --local-dir DIR)"
               if looks_like_hub_id(path) else "")
        return f"--model {path}: no such directory; pass a local checkpoint directory (config.json and safetensors shards){hub}"
    if not os.path.isdir(path):
        return f"--model {path}: is a file; pass a checkpoint directory (config.json and safetensors shards)"
    if not os.path.isfile(os.path.join(path, "config.json")):
        return f"--model {path}: has no config.json; pass a checkpoint directory saved by save_pretrained"
    return None


def _argument_problem(args) -> Optional[str]:
    """What is wrong with the arguments, in one line, or None; looks at no model."""
    if args.command == "bench":
        return bench_e2e.argument_problem(args)
    if args.command in ("trace", "replay"):
        problem = cli_routing.argument_problem(args)
        if problem is None and args.command == "trace":
            problem = _checkpoint_dir_problem(args.model)
        return problem
    if args.model:
        problem = _checkpoint_dir_problem(args.model)
        if problem:
            return problem
    if args.new_tokens is not None and args.new_tokens < 1:
        return f"--new-tokens must be at least 1, got {args.new_tokens}"
    if args.command == "demo":
        if args.shape == "qwen3-30b-a3b" and args.model:
            return "--shape and --model: the shape is the built-in model's; a checkpoint brings its own"
        if args.model and (args.arch is not None or args.experts is not None):
            given = "--arch" if args.arch is not None else "--experts"
            return f"{given} and --model: {given} sets the built-in tiny model; a checkpoint brings its own"
        # The device string is checked later (resolve_device): its type is the part before ':'.
        if args.layers is not None and _shape_of(args, args.device.split(":")[0]) != "qwen3-30b-a3b":
            return ("--layers sets the qwen3-30b-a3b shape's layers (--shape qwen3-30b-a3b, the default on a GPU); "
                    "the tiny model's layers are fixed")
        args.layers = 4 if args.layers is None else args.layers
        if args.layers < 1:
            return f"--layers must be at least 1, got {args.layers}"
        if args.prompt_tokens is not None and args.prompt_tokens < 1:
            return f"--prompt-tokens must be at least 1 (an empty prompt has nothing to continue), got {args.prompt_tokens}"
        if not args.model and args.experts is not None and args.experts < DEMO_TOP_K:
            return (f"--experts {args.experts} is below the demo model's top-k of {DEMO_TOP_K}: every token is routed to "
                    f"{DEMO_TOP_K} experts, so give at least {DEMO_TOP_K}")
        if args.cache_slots is not None and args.cache_slots < 1:
            return f"--cache-slots must be positive, got {args.cache_slots}; give at least one MoE layer's experts"
    else:
        if (args.prompt is None) == (args.prompt_ids is None):
            return "give --prompt TEXT or --prompt-ids IDS (token ids, comma-separated), one of them"
        if args.prompt is not None and not args.prompt.strip():
            return "--prompt is empty; give the text to continue"
        if args.prompt_ids is not None and cli_routing.parse_ids(args.prompt_ids) is None:
            return f"--prompt-ids {args.prompt_ids!r}: expected comma-separated token ids (whole numbers >= 0, no empty item), e.g. 1,2,3"
        if args.cache_slots is not None and args.cache_slots < 1:
            return f"--cache-slots must be positive, got {args.cache_slots}; give at least one MoE layer's experts"
    return None


_BYTE_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
               "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(text: str) -> int:
    """A size in bytes: a whole number (4096, 1e9), or a number with a unit (16GiB, 1.5 GB, 512MiB)."""
    if text.strip().startswith("-"):
        raise argparse.ArgumentTypeError(f"{text!r}: a size must be positive (e.g. 16GiB)")
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*", text)
    unit = match and _BYTE_UNITS.get(match.group(2).lower())
    if not unit:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size: give bytes (e.g. 1e9), or a number with KiB, MiB, "
                                         "GiB, KB, MB or GB (e.g. 16GiB)")
    size = float(match.group(1)) * unit
    if size == 0:
        raise argparse.ArgumentTypeError(f"{text!r}: a size must be positive (e.g. 16GiB)")
    if size < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is less than one byte: a size must be positive (e.g. 16GiB)")
    if not math.isfinite(size):
        raise argparse.ArgumentTypeError(f"{text!r} is too large a size: give bytes, or a number with a unit "
                                         "(e.g. 16GiB)")
    if unit == 1 and not size.is_integer():  # (with a larger unit, a fraction of it is rounded down to bytes)
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of bytes: give whole bytes (e.g. 1e9), or a "
                                         "number with a unit (e.g. 1.5GiB)")
    return int(size)


class _Parser(argparse.ArgumentParser):
    """argparse with its errors in one line, as every other error of the command line (no usage
    block before it; --help shows the usage)."""

    def error(self, message):
        hint = f"{self.prog} --help lists the options"
        if message.endswith("expected one argument"):
            # argparse reads a value that starts with '-' (other than a plain negative number) as an option.
            hint = f"a value that starts with '-' reads as an option: write --option=VALUE; {hint}"
        self.exit(2, f"{self.prog}: error: {' '.join(message.split())} ({hint})\n")


def _parser():
    from freetoken_plugin.tiny import ARCHES

    default_device = "cuda" if torch.cuda.is_available() else "cpu"
    parser = _Parser(prog="freetoken", description="Offloaded Mixture-of-Experts inference")
    parser.add_argument("--traceback", action="store_true",
                        help="show the full traceback of an error (before or after the command)")
    sub = parser.add_subparsers(dest="command", required=True)
    parser.commands = sub.choices  # each command's parser, for errors about its own options
    demo = sub.add_parser("demo", help="offload a small MoE model and check its greedy tokens against the original")
    demo.add_argument("--arch", choices=ARCHES, default=None, help="the tiny model's architecture (default qwen3_moe)")
    demo.add_argument("--model", help="a local checkpoint directory instead of the built-in random model")
    demo.add_argument("--device", default=default_device, help=f"cuda or cpu (default {default_device})")
    demo.add_argument("--experts", type=int, default=None,
                      help=f"experts per layer of the tiny model (default 16, >= {DEMO_TOP_K})")
    demo.add_argument("--cache-slots", type=int, default=None, help="device cache size in experts (default 2E + E/4)")
    demo.add_argument("--shape", choices=["tiny", "qwen3-30b-a3b"], default=None,
                      help="the built-in model: tiny (float32, the default on the CPU) or a few Qwen3-30B-A3B-shaped "
                           "bf16 layers beside resident and accelerate (the default on a GPU)")
    demo.add_argument("--layers", type=int, default=None, help="MoE layers of the qwen3-30b-a3b shape (default 4)")
    demo.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default=None,
                      help="the model's dtype (default float32, and bfloat16 for a --model on a GPU)")
    demo.add_argument("--prompt-tokens", type=int, default=None, help="default 64 (tiny) or 2048")
    demo.add_argument("--new-tokens", type=int, default=None, help="default 16 (tiny) or 32")
    add_eviction_argument(demo)
    gen = sub.add_parser("generate", help="generate text from a local checkpoint with offloaded experts")
    gen.add_argument("--model", required=True, help="a local checkpoint directory (config.json, safetensors, tokenizer)")
    gen.add_argument("--prompt", default=None, action=_OnePrompt, help="the text to continue")
    gen.add_argument("--prompt-ids", default=None, action=_OnePrompt,
                     help="or token ids, comma-separated (checkpoints without tokenizer files; prints ids)")
    gen.add_argument("--device", default=default_device, help=f"cuda or cpu (default {default_device})")
    size = gen.add_mutually_exclusive_group()
    size.add_argument("--cache-bytes", type=parse_bytes, default=None,
                      help="device cache size: bytes (e.g. 1e9) or with a unit (e.g. 16GiB; default 2E + E/4 experts)")
    size.add_argument("--cache-slots", type=int, default=None,
                      help="or the device cache size in experts (at least one layer's experts: prefill streams a layer)")
    gen.add_argument("--new-tokens", type=int, default=64, help="tokens to generate (default 64)")
    gen.add_argument("--quantize", choices=list(QUANTIZE_CHOICES), default=None,
                     help="quantize a float checkpoint's experts as they are read: fp8 (block-FP8: half the host "
                          "memory, the cache holds twice the experts) or int4 (a scale per 128 values, or 64 or 32 "
                          "where 128 does not divide the sizes; int4-g32, int4-g64, int4-g128 name the group; "
                          "about a quarter of bf16's memory)")
    add_eviction_argument(gen)
    cli_routing.add_commands(sub, default_device)
    bench_e2e.add_command(sub)
    for command in sub.choices.values():  # after the command too (freetoken demo --traceback)
        command.add_argument("--traceback", action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    return parser


def _one_line(error: BaseException) -> str:
    return " ".join(str(error).split()) or type(error).__name__


def _one_line_warning(message, category, filename, lineno, line=None) -> str:
    return f"freetoken: warning: {' '.join(str(message).split())}\n"


def main(argv=None) -> int:
    import warnings

    before = warnings.formatwarning
    warnings.formatwarning = _one_line_warning  # the command line's warnings read as its errors: one line
    try:
        return _main(argv)
    finally:
        warnings.formatwarning = before


def _main(argv) -> int:
    parser = _parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        # Options after the command are the command's: its parser names them, so the hint points at
        # its --help (freetoken demo --help); options before it are freetoken's own.
        words = list(sys.argv[1:] if argv is None else argv)
        before = words.index(args.command) > words.index(unknown[0]) if unknown[0] in words else False
        owner = parser if before else parser.commands[args.command]
        owner.error(f"unrecognized arguments: {' '.join(unknown)}")
    from freetoken_plugin.offload import resolve_device

    try:
        # First: the other checks (bench's host memory for one) depend on where the run goes.
        args.device = str(resolve_device(args.device, "--device"))
    except ValueError as error:
        print(f"freetoken: error: {_one_line(error)}", file=sys.stderr)
        return 2
    try:
        problem = _argument_problem(args)
    except cli_routing.UsageError as error:
        problem = _one_line(error)
    if problem:
        print(f"freetoken: error: {problem}", file=sys.stderr)
        return 2
    try:
        commands = {"demo": _demo, "generate": _generate, "trace": cli_routing.trace_command,
                    "replay": cli_routing.replay_command, "bench": bench_e2e.run}
        return commands[args.command](args)
    except KeyboardInterrupt:  # Ctrl-C: one line, and the shell's status for SIGINT
        if args.traceback:
            traceback.print_exc()
        print("freetoken: interrupted", file=sys.stderr)
        return 130
    except Exception as error:  # one line for the user; --traceback for the developer (same exit status)
        from freetoken_plugin.offload import CacheSizeError, UnsupportedExperts

        if args.traceback:
            traceback.print_exc()
        else:
            message = _one_line(error)
            if isinstance(error, CacheSizeError):  # the Python API's words for the command line's flags
                message = re.sub(r"\bcache_(bytes|slots)[= ]", lambda m: f"--cache-{m.group(1)} ", message)
                message = message.replace(", or (in Python) pass stream_prefill=False", "")
            print(f"freetoken: error: {message}", file=sys.stderr)
        from freetoken_plugin.safetensors_io import CheckpointError

        # A checkpoint the loader refuses is a bad --model (its headers are checked before any work).
        bad_argument = (cli_routing.UsageError, CacheSizeError, CheckpointError, UnsupportedExperts)
        return 2 if isinstance(error, bad_argument) else 1


if __name__ == "__main__":
    sys.exit(main())
