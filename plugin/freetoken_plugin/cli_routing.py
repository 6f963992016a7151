"""`freetoken trace` (record the routing of a greedy generation) and `freetoken replay` (run a
routing trace through the real runtime and kernels), for measuring decode under real misses."""
import argparse
import json
import os
from typing import List, Optional

import torch

from ft_ops.policies import DEFAULT_EVICTION, POLICIES


def comma_separated(text: str) -> str:
    """An option's comma-separated values with the spaces around each removed (an argparse type), so
    that "4, 8" and "lru, hitdensity" read as every list option reads them: 4,8 and lru,hitdensity."""
    return ",".join(item.strip() for item in text.split(","))


def add_eviction_argument(parser) -> None:
    """--eviction, the slot pool's eviction policy, for every command that builds a pool."""
    parser.add_argument("--eviction", default=DEFAULT_EVICTION, choices=sorted(POLICIES),
                        help=f"the slot pool's eviction policy (default {DEFAULT_EVICTION}; docs/ops.md, \"Eviction policies\")")


class _AppendInOrder(argparse._AppendAction):
    """Appends as "append" does, and records (option, value) in `prompt_order`, so that prompts
    given by --prompt and --prompt-ids keep the command line's order."""

    def __call__(self, parser, namespace, values, option_string=None):
        super().__call__(parser, namespace, values, option_string)
        order = list(getattr(namespace, "prompt_order", None) or [])
        setattr(namespace, "prompt_order", order + [(self.dest, values)])


def add_commands(sub, default_device: str) -> None:
    trace = sub.add_parser("trace", help="record the routed expert ids of a greedy generation into a trace file")
    trace.add_argument("--model", required=True, help="a local checkpoint directory")
    trace.add_argument("--prompt", action=_AppendInOrder, default=[],
                       help="text to continue (repeat for more sequences)")
    trace.add_argument("--prompt-ids", action=_AppendInOrder, default=[],
                       help="comma-separated token ids, for checkpoints without tokenizer files (repeatable)")
    trace.add_argument("--new-tokens", type=int, default=64, help="tokens to generate a sequence (default 64)")
    trace.add_argument("--out", required=True, help="the trace file to write (safetensors)")
    trace.add_argument("--device", default=default_device, help=f"cuda or cpu (default {default_device})")
    replay = sub.add_parser("replay", help="run a routing trace through the runtime; hit rate, link traffic, time per token")
    replay.add_argument("trace", help="a trace file written by `freetoken trace`")
    replay.add_argument("--cache-slots", required=True, type=comma_separated,
                        help="device cache size(s) in experts, comma-separated (e.g. 32,64,128)")
    replay.add_argument("--fetch-fraction", default="1.0",
                        help="share of the misses (decode, and prompts too short to stream) fetched over the link; "
                             "the rest are computed by the CPU share from host memory and not cached, so 0 is the "
                             "CPU-only strategy (nothing is ever cached); 'auto' divides each call's misses by this "
                             "machine's measured costs")
    replay.add_argument("--sequences", type=int, default=None, help="replay only the first N sequences of the trace")
    replay.add_argument("--device", default=default_device, help=f"cuda or cpu (default {default_device})")
    replay.add_argument("--hidden", type=int, default=None, help="expert hidden size (default: the trace's model)")
    replay.add_argument("--intermediate", type=int, default=None, help="expert intermediate size (default: the trace's)")
    add_eviction_argument(replay)
    replay.add_argument("--json", default=None, help="also write the rows to this JSON file")


class UsageError(ValueError):
    """A bad argument found once the trace or the model's config is read: the CLI exits with 2, as for
    the arguments it checks before any work."""


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "spiece.model")


def tokenizer_files_problem(model: str) -> Optional[str]:
    """Why --prompt cannot be read with checkpoint `model` (it has no tokenizer files), or None."""
    if any(os.path.isfile(os.path.join(model, f)) for f in TOKENIZER_FILES):
        return None
    return (f"--prompt needs the tokenizer files, which {model} lacks ({', '.join(TOKENIZER_FILES[:2])}, ...); "
            "give token ids with --prompt-ids 1,2,3")


def argument_problem(args) -> Optional[str]:
    if args.command == "trace":
        if not args.prompt and not args.prompt_ids:
            return "give --prompt TEXT or --prompt-ids IDS (token ids, comma-separated)"
        if any(not p.strip() for p in args.prompt):
            return "--prompt is empty; give the text to continue"
        for ids in args.prompt_ids:
            if parse_ids(ids) is None:
                return f"--prompt-ids {ids!r}: expected comma-separated token ids (whole numbers >= 0, no empty item), e.g. 1,2,3"
        if args.new_tokens < 2:
            return (f"--new-tokens must be at least 2, got {args.new_tokens}: the last new token is not fed back, "
                    "so one new token records no decode step")
        out_dir = os.path.dirname(os.path.abspath(args.out))
        if not os.path.isdir(out_dir):
            return f"--out {args.out}: the directory {out_dir} does not exist"
        if os.path.isdir(args.out):
            return f"--out {args.out} is a directory; give the trace file's name, e.g. {os.path.join(args.out, 'trace.safetensors')}"
        why = cannot_write(out_dir)
        if why:
            return f"--out {args.out}: cannot write in {out_dir} ({why}); give a writable directory"
        if args.prompt and os.path.isdir(args.model):
            return tokenizer_files_problem(args.model)
    if args.command == "replay":
        if os.path.isdir(args.trace):
            return f"{args.trace} is a directory; pass a trace file that `freetoken trace` wrote"
        if not os.path.isfile(args.trace):
            return f"{args.trace}: no such trace file; record one with `freetoken trace`"
        try:
            slots = [int(s) for s in args.cache_slots.split(",")]
        except ValueError:
            return f"--cache-slots {args.cache_slots!r}: expected comma-separated slot counts, e.g. 32,64"
        if not slots or min(slots) < 1:
            return f"--cache-slots must be positive, got {args.cache_slots}"
        if args.fetch_fraction != "auto":
            try:
                fraction = float(args.fetch_fraction)
            except ValueError:
                fraction = -1.0
            if not 0.0 <= fraction <= 1.0:
                return f"--fetch-fraction must be in [0, 1] or auto, got {args.fetch_fraction}"
            args.fetch_fraction = fraction
        if args.sequences is not None and args.sequences < 1:
            return f"--sequences must be at least 1, got {args.sequences}"
        for name in ("hidden", "intermediate"):
            value = getattr(args, name)
            if value is not None and value < 1:
                return f"--{name} must be positive, got {value} (leave it out for the trace's model)"
        if args.json is not None:
            json_dir = os.path.dirname(os.path.abspath(args.json))
            if not os.path.isdir(json_dir):
                return f"--json {args.json}: the directory {json_dir} does not exist"
            if os.path.isdir(args.json):
                return f"--json {args.json} is a directory; give the report's file name, e.g. {os.path.join(args.json, 'replay.json')}"
            why = cannot_write(json_dir)
            if why:
                return f"--json {args.json}: cannot write in {json_dir} ({why}); give a writable directory"
    return None


def check_prompts(config, prompts: List[torch.Tensor], new_tokens: int) -> None:
    """Refuses (UsageError) token ids outside the model's vocabulary, and prompts that with the new
    tokens exceed its positions (generate would run far past them, for minutes), from the config."""
    config = config.get_text_config()
    vocab = config.vocab_size
    for ids in prompts:
        bad = ids[(ids < 0) | (ids >= vocab)]
        if bad.numel():
            raise UsageError(f"a prompt's token id {int(bad[0])} is outside the model's vocabulary (0 to {vocab - 1}): "
                             "give ids below it with --prompt-ids, or a tokenizer that matches the model")
    limit = getattr(config, "max_position_embeddings", None)
    # A RoPE scaling (YaRN, linear, dynamic) stretches the positions by its factor: the config keeps
    # the trained length (transformers 5: rope_parameters; before: rope_scaling).
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None)
    factor = rope.get("factor") if isinstance(rope, dict) and rope.get("rope_type", rope.get("type")) not in (
        None, "default") else None
    if limit is not None and isinstance(factor, (int, float)) and factor > 1:
        limit = int(limit * factor)
    longest = max(int(ids.numel()) for ids in prompts)
    if limit is not None and longest >= limit:
        raise UsageError(f"the prompt ({longest} tokens) leaves no room for new tokens in the model's {limit} "
                         f"positions; give a prompt of at most {limit - 1} tokens")
    if limit is not None and longest + new_tokens > limit:
        raise UsageError(f"--new-tokens {new_tokens}: the longest prompt ({longest} tokens) and the new tokens "
                         f"exceed the model's {limit} positions; give at most {max(limit - longest, 0)}")


def cannot_write(directory: str) -> Optional[str]:
    """Why a file cannot be written in `directory` (tried with a temporary file, removed at once:
    permissions alone do not tell, e.g. for root in /proc or /sys), or None where it can."""
    import tempfile

    try:
        with tempfile.NamedTemporaryFile(dir=directory, prefix=".freetoken-check-"):
            return None
    except OSError as error:
        return error.strerror or str(error)


def parse_ids(text: str) -> Optional[torch.Tensor]:
    """Comma-separated token ids (whole numbers >= 0) as a tensor, or None when the text holds none,
    an empty item (1,,2) or something else; a UsageError for an id beyond int64 (beyond every
    vocabulary)."""
    try:
        ids = [int(x) for x in text.split(",")]
    except ValueError:
        return None
    if ids and max(ids) >= 2**63:  # beyond int64: outside every vocabulary (torch.tensor would overflow)
        raise UsageError(f"--prompt-ids: token id {max(ids)} is outside the model's vocabulary")
    return torch.tensor(ids) if ids and min(ids) >= 0 else None


def trace_command(args) -> int:
    import freetoken_plugin
    from freetoken_plugin.tracing import record_trace

    import transformers as tf

    device = torch.device(args.device)
    tok = None
    if args.prompt:
        try:
            tok = tf.AutoTokenizer.from_pretrained(args.model)
        except Exception as error:
            raise UsageError(f"the tokenizer of {args.model} does not load ({' '.join(str(error).split())[:200]}); "
                             "give token ids with --prompt-ids 1,2,3") from error
    prompts: List[torch.Tensor] = []  # in the command line's order
    # The command line's order (_AppendInOrder); a namespace built otherwise: ids, then texts.
    order = getattr(args, "prompt_order", None) or (
        [("prompt_ids", v) for v in args.prompt_ids] + [("prompt", v) for v in args.prompt])
    for option, value in order:
        if option == "prompt_ids":
            prompts.append(parse_ids(value))
            continue
        ids = tok(value, return_tensors="pt").input_ids[0]
        if ids.numel() == 0:
            raise UsageError(f"the prompt {value!r} gives no token with {args.model}'s tokenizer (an empty "
                             "vocabulary?); give token ids with --prompt-ids 1,2,3")
        prompts.append(ids)

    check_prompts(tf.AutoConfig.from_pretrained(args.model), prompts, args.new_tokens)  # before the weights load
    model = freetoken_plugin.load_model(args.model, device=device, progress=False)
    trace = record_trace(model, prompts, args.new_tokens, source=os.path.abspath(args.model))
    trace.save(args.out)
    print(f"wrote {args.out}: {len(trace.sequences)} sequence(s), {trace.layers} MoE layers x top-{trace.top_k} of "
          f"{trace.experts} experts, {sum(s.shape[0] for s in trace.sequences)} tokens")
    steps = sum(trace.decode_steps(i).shape[0] for i in range(len(trace.sequences)))
    if steps < 2:  # replay's rule (replay_command): the first decode step is its warm-up
        print(f"note: it holds {steps} decode step; `freetoken replay` measures the steps after the first, so "
              "it needs a trace of 2 or more (--new-tokens 3 or more)")
    return 0


def replay_command(args) -> int:
    from ft_ops.replay import replay
    from ft_ops.traces import Trace, reuse_and_skew

    try:
        trace = Trace.load(args.trace)
    except Exception as error:
        raise UsageError(" ".join(str(error).split())) from error  # Trace.load says what the file is not
    if args.sequences is not None:
        if args.sequences > len(trace.sequences):
            raise UsageError(f"--sequences {args.sequences}: {args.trace} holds {len(trace.sequences)} sequence(s); "
                             f"give at most {len(trace.sequences)} or leave it out")
        trace = trace.first(args.sequences)
    if not (args.hidden or trace.hidden) or not (args.intermediate or trace.intermediate):
        raise UsageError(f"{args.trace} does not record the experts' shape (a synthetic trace?): give --hidden H "
                         "--intermediate I")
    # The host pool replay fills with random bf16 experts (w13 and w2: 3 x hidden x intermediate
    # values an expert), checked against the machine's memory before it is allocated.
    from freetoken_plugin.host_memory import available_host_bytes

    hidden, inter = args.hidden or trace.hidden, args.intermediate or trace.intermediate
    need = trace.layers * trace.experts * 3 * hidden * inter * 2
    available = available_host_bytes()
    if available is not None and need > available:
        raise UsageError(f"experts of hidden {hidden} x intermediate {inter}: the replay's host pool of {trace.layers} x "
                         f"{trace.experts} of them needs {need / 2**30:.3g} GiB and this machine has "
                         f"{available / 2**30:.1f} GiB available; check --hidden / --intermediate")
    steps = [trace.decode_steps(i).shape[0] for i in range(len(trace.sequences))]
    if sum(steps) - min(1, steps[0] if steps else 0) < 1:  # the first decode step warms up, unmeasured
        raise UsageError(f"{args.trace} holds {sum(steps)} decode step(s), and replay measures the steps after the "
                         "first: record it with --new-tokens 3 or more")
    sizes = [int(s) for s in args.cache_slots.split(",")]
    for slots in sizes:  # all of them before the first replay
        if slots < trace.top_k:
            raise UsageError(f"--cache-slots {slots}: below one layer call's {trace.top_k} routed experts (top-"
                             f"{trace.top_k}), which a call holds at once; give at least {trace.top_k}")
        if slots > trace.layers * trace.experts:
            raise UsageError(f"--cache-slots {slots}: more than the trace's {trace.layers} x {trace.experts} experts; "
                             f"give at most {trace.layers * trace.experts} (every expert cached)")
    shape = reuse_and_skew(trace)
    print(f"{args.trace}: {len(trace.sequences)} sequence(s), {trace.layers} layers x {trace.experts} experts, "
          f"top-{trace.top_k}, eviction {args.eviction}; decode reuse {shape['reuse']:.3f}, top-10% share {shape['top10_share']:.3f}")
    rows = []
    for slots in sizes:
        rows.append(replay(trace, slots, fetch_fraction=args.fetch_fraction, device=args.device,
                           hidden=args.hidden, intermediate=args.intermediate, eviction=args.eviction))
    columns = ["slots", "cache_share", "hit_rate", "copied_rows_per_token", "MB_over_link_per_token",
               "cpu_rows_per_token", "ms_per_token"]
    widths = [max(len(c), *(len(str(r[c])) for r in rows)) for c in columns]
    print("  ".join(c.rjust(w) for c, w in zip(columns, widths)))
    for r in rows:
        print("  ".join(str(r[c]).rjust(w) for c, w in zip(columns, widths)))
    if args.json:  # whole or not at all: a Ctrl-C while writing leaves no half report
        part = f"{args.json}.part"
        try:
            with open(part, "w") as f:
                json.dump(dict(trace=args.trace, routing=shape, eviction=args.eviction, rows=rows), f, indent=1)
            os.replace(part, args.json)
        except BaseException:
            if os.path.exists(part):
                os.remove(part)
            raise
    return 0
