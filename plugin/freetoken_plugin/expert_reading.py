"""Reading one MoE layer's experts from a checkpoint's entries into the host pool, per stored
format: 16/32-bit experts (per expert, fused, or DBRX's experts split in rows; quantized to FP8 on
the way where asked), block-FP8 with its scale_inv blocks, compressed-tensors' FP8 with one scale a
row (into an fp8_rows pool), GPT-OSS's MXFP4 blocks and scales, and DeepSeek-V4's FP4-packed experts
(MXFP4's bytes, per expert), each tensor's header checked before any byte is read (load_model,
loader.py, calls the fill_* functions per layer); and the checks of the experts' entries and of FP8
scales that the loader also applies to the non-expert linears."""
import dataclasses
import functools
import math
import types
from typing import Dict, List, Optional

import torch

from ft_ops import formats
from ft_ops.slot_pool import ExpertShape, HostPool

from .checkpoint_names import checkpoint_name, reordered
from .int4_checkpoints import Int4Entry
from .fp8_scales import (BLOCK, CHANNEL, TENSOR, check_finite_scales, same_but_unit_dims, scale_kind, scale_problem,
                         strategies_of)
from .layouts import ExpertsLayout, fused_shapes, to_canonical
from .offload import quantize_into_host
from .safetensors_io import CheckpointError, Entry, check_floating, load_tensor, read_into, read_rows_into


# Per-expert checkpoint tensors: (gate, up, down) names; (up, down) for experts without a gate.
_PER_EXPERT_NAMES = (("gate_proj", "up_proj", "down_proj"), ("w1", "w3", "w2"))
_UNGATED_PER_EXPERT_NAMES = (("up_proj", "down_proj"),)
E8M0_NAN = 0xFF  # the e8m0 code of no scale (NaN in the OCP MX format; 2^128 read as an exponent)
E8M0_DTYPE = getattr(torch, "float8_e8m0fnu", None)  # (a torch without it reads no e8m0 tensor at all)


def per_expert_names(entries: Dict[str, Entry], prefix: str, gated: bool = True):
    """The (gate, up, down) tensor names of a per-expert checkpoint layout under `prefix` ((up, down)
    for experts without a gate), or None."""
    for names in _PER_EXPERT_NAMES if gated else _UNGATED_PER_EXPERT_NAMES:
        # (any of expert 0's tensors: one of them missing is then named as missing)
        if any(entries.get(f"{prefix}.0.{n}.weight") is not None for n in names):
            return names
    return None


def _first_expert_entries(entries: Dict[str, Entry], prefix: str, gated: bool = True):
    """(name, entry) of expert 0's per-expert tensors under `prefix` that the checkpoint holds."""
    names = per_expert_names(entries, prefix, gated) or ()
    return [(f"{prefix}.0.{n}.weight", entries[f"{prefix}.0.{n}.weight"]) for n in names
            if f"{prefix}.0.{n}.weight" in entries]


def _refuse_two_copies(entries, prefix: str, w13_name: str, gated: bool) -> None:
    """A layer stored both fused and per expert holds two versions of its experts: which is meant?"""
    first = _first_expert_entries(entries, prefix, gated)
    if first:
        fused = checkpoint_name(entries, f"{prefix}.{w13_name}")
        single = checkpoint_name(entries, first[0][0])
        raise CheckpointError(f"{prefix} holds its experts fused ({fused}) and also per expert ({single}, ...): "
                              f"two versions of the same weights; remove one of them from the checkpoint")


def _w13_rows(layout: ExpertsLayout, rows_per_projection: int) -> List[slice]:
    """The rows of w13 (or of its scale grid, `rows_per_projection` a projection) that each w13
    projection of a per-expert checkpoint fills: gate then up, or up alone."""
    if not layout.gated:
        return [slice(0, rows_per_projection)]
    return [slice(0, rows_per_projection), slice(rows_per_projection, 2 * rows_per_projection)]


def find_entry(entries: Dict[str, Entry], name: str) -> Optional[Entry]:
    """The entry of `name` (model_named_entries' names), noted as used."""
    entry = entries.get(name)
    if entry is not None and getattr(entries, "used", None) is not None:
        entries.used.add(name)
    return entry


def fill_layer(entries, prefix: str, layout: ExpertsLayout, host: HostPool, layer: int) -> None:
    """Plain floating-point experts of one layer into the host pool: the module's fused layout
    (gate_up_proj, down_proj and their biases, converted once) or per-expert tensors. With banks on
    the meta device (the loader's dry run) it checks names, dtypes and shapes and reads nothing."""
    I, H, E = layout.intermediate, layout.hidden, layout.experts
    if find_entry(entries, f"{prefix}.gate_up_proj_blocks") is not None:
        raise CheckpointError(f"{prefix} is MXFP4 (gate_up_proj_blocks / _scales) but config.json has no MXFP4 "
                              "quantization_config; load_model reads MXFP4 experts of GPT-OSS checkpoints")
    if layout.split:
        _fill_split_layer(entries, prefix, layout, host, layer)
        return
    w13_name, w2_name, b13_name, b2_name = layout.param_names
    fused = find_entry(entries, f"{prefix}.{w13_name}")
    if fused is not None:  # the module's own layout: read one layer, convert it once
        _refuse_two_copies(entries, prefix, w13_name, layout.gated)
        check_floating(fused, f"{prefix}.{w13_name}")
        down = _require(entries, f"{prefix}.{w2_name}")
        # Tensors transformers transposes on load where their shape is not the module's
        # (Qwen3-VL-MoE's checkpoints: Transpose(1, 2) with check_dims), each on its own.
        stored_transposed = []
        for name, entry, want in zip((w13_name, w2_name), (fused, down),
                                     fused_shapes(E, H, I, layout.transposed, layout.gated)):
            shape = tuple(entry.shape)
            flip = (f"{prefix}.{name}" in getattr(entries, "transposed", ()) and shape != want
                    and shape == (want[0], want[2], want[1]))
            if shape != want and not flip:
                raise CheckpointError(f"{prefix}.{name} has shape {shape}, expected {want} (the "
                                      "shape config.json gives: check its sizes, e.g. hidden_size and the experts' "
                                      "intermediate size, against the checkpoint)")
            stored_transposed.append(flip)
        read = host.w13.device.type != "meta"
        biases = [None, None]
        if layout.bias:
            biases = [_load_bias(entries, f"{prefix}.{b13_name}", (E, (2 if layout.gated else 1) * I), read),
                      _load_bias(entries, f"{prefix}.{b2_name}", (E, H), read)]
        if not read:
            return
        gate_up, down_w = (load_tensor(e).transpose(1, 2) if flip else load_tensor(e)
                           for e, flip in zip((fused, down), stored_transposed))
        reorders = getattr(entries, "reordered", {})  # rows transformers reorders on load (Inkling2's)
        if f"{prefix}.{w13_name}" in reorders:
            gate_up = reordered(reorders[f"{prefix}.{w13_name}"], gate_up)
        if f"{prefix}.{w2_name}" in reorders:
            down_w = reordered(reorders[f"{prefix}.{w2_name}"], down_w)
        w13, w2, b13, b2 = to_canonical(gate_up, down_w, *biases, layout)
        host.w13[layer].copy_(w13)
        host.w2[layer].copy_(w2)
        if layout.bias:
            host.b13[layer].copy_(b13)
            host.b2[layer].copy_(b2)
        return
    if layout.paths:  # a module's own names (JetMoE's): its checkpoints have no per-expert form
        raise CheckpointError(f"no expert tensors for {prefix} in the checkpoint (looked for {prefix}.{w13_name} "
                              f"and {prefix}.{w2_name}, as the model holds them)")
    names = per_expert_names(entries, prefix, layout.gated)
    if names is not None:
        *w13_names, down_n = names
        for e in range(layout.experts):
            base = f"{prefix}.{e}"
            for n, rows in zip(w13_names, _w13_rows(layout, I)):
                read_into(_require(entries, f"{base}.{n}.weight"), host.w13[layer, e, rows], f"{base}.{n}.weight")
            read_into(_require(entries, f"{base}.{down_n}.weight"), host.w2[layer, e], f"{base}.{down_n}.weight")
        return
    raise CheckpointError(f"no expert tensors for {prefix} in the checkpoint (looked for {prefix}.{w13_name} "
                          f"and {_per_expert_hint(layout, prefix)})")


def _fill_split_layer(entries, prefix: str, layout: ExpertsLayout, host: HostPool, layer: int) -> None:
    """Experts of the split layout (layouts.py; DBRX's mlp.w1, mlp.v1, mlp.w2, each [E * I, H], as
    save_pretrained writes the module's tensors) into the host pool, one expert's [I, H] block at a
    time from the files: gate and up straight into their rows of w13 where the dtypes agree, down
    through a buffer of one block, transposed into w2 [H, I]. The host never holds more than one
    block besides the pool. With banks on the meta device it checks names, dtypes and shapes."""
    E, I, H = layout.experts, layout.intermediate, layout.hidden
    found = []
    for n in layout.split:
        name = f"{prefix}.{n}"
        entry = _require(entries, name)
        if tuple(entry.shape) != (E * I, H):
            raise CheckpointError(f"{name} has shape {tuple(entry.shape)}, expected {(E * I, H)} ({E} experts' "
                                  f"[{I}, {H}] blocks, the shape config.json gives: check its sizes, e.g. d_model and "
                                  "the experts' ffn_hidden_size, against the checkpoint)")
        found.append((name, entry))
    if host.w13.device.type == "meta":
        return
    (gate_n, gate), (up_n, up), (down_n, down) = found
    for e in range(E):
        first = e * I
        _read_block(gate, first, host.w13[layer, e, :I], gate_n)
        _read_block(up, first, host.w13[layer, e, I:], up_n)
        _read_block(down, first, host.w2[layer, e], down_n, transposed=True)


def _read_block(entry: Entry, first: int, out: torch.Tensor, name: str, transposed: bool = False) -> None:
    """Rows [first, first + rows) of a 2-D checkpoint tensor into `out` ([rows, cols], or [cols,
    rows] where `transposed`): straight from the file where out is a contiguous tensor of the
    entry's dtype, else through a buffer of the block."""
    rows = out.shape[1] if transposed else out.shape[0]
    if not transposed and out.dtype == entry.dtype and out.is_contiguous():
        read_rows_into(entry, first, out, name)
        return
    block = torch.empty(rows, entry.shape[1], dtype=entry.dtype)
    read_rows_into(entry, first, block, name)
    out.copy_(block.T if transposed else block)


def quantizing_fill(shape: ExpertShape):
    """A fill of float checkpoint experts into an FP8 or int4 host pool: each layer is read as
    fill_layer reads it, into one float layer reused for every layer, then quantized expert by expert
    (offload.quantize_into_host, the rule of offload_experts(quantize=...))."""
    scratch = HostPool.allocate(dataclasses.replace(shape, layers=1, format=formats.DENSE, group=0), pin=False,
                                progress=False)

    def fill(entries, prefix: str, layout: ExpertsLayout, host: HostPool, layer: int) -> None:
        fill_layer(entries, prefix, layout, scratch, 0)
        try:
            quantize_into_host(host, layer, scratch.w13[0], scratch.w2[0], layout, prefix)
        except ValueError as error:  # the checkpoint's weights (inf or NaN): refused as the checkpoint's
            raise CheckpointError(str(error)) from None
        if layout.bias:
            host.b13[layer].copy_(scratch.b13[0])
            host.b2[layer].copy_(scratch.b2[0])
    return fill


def _read_scale(entry: Entry, out: torch.Tensor, name: str, strategies=frozenset()) -> None:
    """A scale_inv tensor into `out` (float32, a block grid or rows): also from bfloat16, or squeezed
    to fewer dimensions (as some transformers versions save them); where `strategies` allows it, one
    scale for the whole weight, the same in every block or row of `out`."""
    if TENSOR in strategies and math.prod(entry.shape) == 1 and math.prod(out.shape) != 1:
        if not entry.dtype.is_floating_point:
            raise CheckpointError(scale_problem(name, entry.dtype, entry.shape, tuple(out.shape)))
        if out.device.type != "meta":
            out.fill_(float(load_tensor(entry).reshape(())))
            check_finite_scales(out, name)
        return
    if entry.dtype == torch.float32 and tuple(entry.shape) == tuple(out.shape):
        read_into(entry, out, name)
        if out.device.type != "meta":  # the dry run reads nothing
            check_finite_scales(out, name)
        return
    if out.device.type == "meta":  # the dry run: the header's dtype and shape only
        if not entry.dtype.is_floating_point or not same_but_unit_dims(entry.shape, out.shape):
            raise CheckpointError(scale_problem(name, entry.dtype, entry.shape, tuple(out.shape)))
        return
    tensor = load_tensor(entry)
    if not tensor.dtype.is_floating_point or not same_but_unit_dims(tensor.shape, out.shape):
        raise CheckpointError(scale_problem(name, tensor.dtype, tensor.shape, tuple(out.shape)))
    out.copy_(tensor.reshape(out.shape))
    check_finite_scales(out, name)


def _refuse_blocks_across_gate_and_up(entry, name: str, inter: int, hidden: int) -> None:
    """Fused gate_up scales in the shape of one grid over the 2I rows, as transformers' FP8Experts
    holds and reads them (scale row r // 128 for row r; at least 2 rows): where I is not a multiple
    of 128 a block then holds gate and up rows under one scale, which the pool's format (gate and up
    blocked as the two projections they are) cannot hold exactly. Where I is 65 to 127 modulo 128
    (or below 65), gate and up blocked apart give the same shape, and the file does not say which it
    holds: refused as well."""
    across = (max(math.ceil(2 * inter / formats.FP8_BLOCK), 2), math.ceil(hidden / formats.FP8_BLOCK))
    if inter % formats.FP8_BLOCK == 0 or tuple(entry.shape[-2:]) != across:
        return
    if across != formats.fp8_scale_shape(2 * inter, hidden, parts=2):
        raise CheckpointError(f"{name} is {tuple(entry.shape)}: 128-row blocks across the gate/up boundary "
                              f"(one grid over the fused rows, intermediate size {inter}), which freetoken's FP8 "
                              "format (gate and up blocked apart) cannot hold exactly; load the float checkpoint it "
                              "was quantized from with load_model(path, quantize='fp8')")
    raise CheckpointError(f"{name} is {tuple(entry.shape)}: at intermediate size {inter} one grid of 128-row "
                          "blocks across the gate/up boundary (as transformers reads fused FP8 experts) and gate and "
                          "up blocked apart have this shape, and they scale different rows; freetoken cannot tell "
                          "which this file holds: load a per-expert FP8 checkpoint, or the float one with "
                          "load_model(path, quantize='fp8')")


def _read_fp8_into(entry: Entry, out: torch.Tensor, name: str) -> None:
    """FP8 weights into pool rows `out` (one expert's, or a fused layer's [E, rows, cols]), as
    stored, refused where they hold e4m3fn's NaN codes (0x7f, 0xff: every output they touch would be
    NaN; a checkpoint holds none unless damaged). The check is one pass over the bytes just read, an
    expert at a time (its temporaries one expert's size, not a fused layer's)."""
    read_into(entry, out, name)
    if out.device.type == "meta":  # the dry run reads nothing
        return
    for e, rows in enumerate(out if out.dim() == 3 else [out]):
        count = int(((rows.view(torch.uint8) | 0x80) == 0xFF).sum())
        if count:
            where = f" in expert {e}" if out.dim() == 3 else ""
            raise CheckpointError(f"{name} holds {count} FP8 NaN code{'s' if count != 1 else ''}{where}: the "
                                  "checkpoint is damaged")


def fill_fp8_layer(entries, prefix: str, layout: ExpertsLayout, host: HostPool, layer: int) -> None:
    """Block-FP8 experts of one layer straight into the FP8 host pool: the fused layout (gate_up_proj
    [E, 2I, H] with gate_up_proj_scale_inv) or the per-expert one (gate_proj.weight with
    weight_scale_inv, ...). Gate and up scales are per projection in both."""
    I, H = layout.intermediate, layout.hidden
    scale_rows = formats.fp8_scale_shape(I, H)[0]  # a projection's
    if layout.split or layout.paths:  # the undecorated families' layouts (DBRX's, JetMoE's)
        names = ", ".join(f"{prefix}.{n}" for n in (layout.split or layout.paths[:2]))
        raise CheckpointError(f"config.json's quantization_config says fp8, but these experts are held as "
                              f"{names}, a layout no block-FP8 checkpoint format defines (transformers' FP8 quantizer "
                              "leaves them unquantized); load the float checkpoint with load_model(path, "
                              "quantize='fp8'), which quantizes them as it reads them")
    w13_name, w2_name = layout.param_names[:2]
    cn = functools.partial(_name_in_checkpoint, entries)  # messages name the checkpoint's tensors
    fused = find_entry(entries, f"{prefix}.{w13_name}")
    if fused is not None:
        _refuse_two_copies(entries, prefix, w13_name, layout.gated)
        _require_fp8(fused, cn(f"{prefix}.{w13_name}"))
        if set(getattr(entries, "reordered", {})) & {f"{prefix}.{w13_name}", f"{prefix}.{w2_name}"}:
            raise CheckpointError(f"{checkpoint_name(entries, f'{prefix}.{w13_name}')} is block-FP8 with rows "
                                  "transformers reorders as it loads "
                                  "them, which moves rows across the scales' 128-row blocks; load_model reads fused "
                                  "block-FP8 experts as transformers' FP8 quantizer stores them: load the model with "
                                  "from_pretrained and call freetoken_plugin.offload_experts(model, cache_bytes=...)")
        transposed_shape = fused_shapes(layout.experts, H, I, True, layout.gated)[0]
        # (where H equals the rows, 2I or I, the two layouts have one shape: read as transformers' FP8 one)
        if (layout.transposed and tuple(fused.shape) == transposed_shape
                and transposed_shape != fused_shapes(layout.experts, H, I, False, layout.gated)[0]):
            raise CheckpointError(f"{cn(f'{prefix}.{w13_name}')} is block-FP8 in the transposed layout {tuple(fused.shape)} "
                                  "its module holds float experts in; load_model reads fused block-FP8 experts as "
                                  "transformers' FP8 quantizer stores them ([E, 2I, H]) or per expert: load the float "
                                  "checkpoint with load_model(path, quantize='fp8') instead")
        if layout.gated:
            _refuse_blocks_across_gate_and_up(_require_entry(entries, f"{prefix}.{w13_name}_scale_inv"),
                                              cn(f"{prefix}.{w13_name}_scale_inv"), I, H)
        _read_fp8_into(fused, host.w13[layer], cn(f"{prefix}.{w13_name}"))
        down = _require_entry(entries, f"{prefix}.{w2_name}")
        _require_fp8(down, cn(f"{prefix}.{w2_name}"))
        _read_fp8_into(down, host.w2[layer], cn(f"{prefix}.{w2_name}"))
        for name, scale in ((f"{prefix}.{w13_name}_scale_inv", host.w13_scale[layer]),
                            (f"{prefix}.{w2_name}_scale_inv", host.w2_scale[layer])):
            _read_scale(_require_entry(entries, name), scale, cn(name))
        return
    names = per_expert_names(entries, prefix, layout.gated)
    if names is not None:
        *w13_names, down_n = names
        for e in range(layout.experts):
            base = f"{prefix}.{e}"
            targets = [(n, host.w13[layer, e, rows], host.w13_scale[layer, e, scales]) for n, rows, scales in
                       zip(w13_names, _w13_rows(layout, I), _w13_rows(layout, scale_rows))]
            for n, w, s in targets + [(down_n, host.w2[layer, e], host.w2_scale[layer, e])]:
                entry = _require_entry(entries, f"{base}.{n}.weight")
                _require_fp8(entry, cn(f"{base}.{n}.weight"))
                _read_fp8_into(entry, w, cn(f"{base}.{n}.weight"))
                scale = _require_entry(entries, f"{base}.{n}.weight_scale_inv")
                if scale_kind(scale.dtype, scale.shape, entry.shape, strategies_of(entries)) == CHANNEL:
                    # (the pool's format comes from the first MoE layer's first expert: holds_row_scales)
                    raise CheckpointError(f"{cn(f'{base}.{n}.weight_scale_inv')} holds one scale a row "
                                          f"{tuple(scale.shape)}, while the first MoE layer's experts have block or "
                                          "tensor scales: their pool is FP8 and holds one format; load_model reads "
                                          "checkpoints whose experts all have one kind of scale")
                _read_scale(scale, s, cn(f"{base}.{n}.weight_scale_inv"), strategies_of(entries))
        return
    if find_entry(entries, f"{prefix}.gate_up_proj_blocks") is not None:
        raise CheckpointError(f"{prefix} holds MXFP4 experts (gate_up_proj_blocks / _scales) but config.json's "
                              "quantization_config says fp8: its quant_method should be 'mxfp4'")
    raise CheckpointError(f"no expert tensors for {prefix} in the checkpoint (looked for {prefix}.{w13_name} "
                          f"and {_per_expert_hint(layout, prefix)})")


def fill_fp8_rows_layer(entries, prefix: str, layout: ExpertsLayout, host: HostPool, layer: int) -> None:
    """FP8 experts with one scale a row (compressed-tensors' "channel" strategy, per expert:
    gate_proj.weight with weight_scale [rows, 1], ...) straight into the fp8_rows host pool: the FP8
    bytes as stored, the scales as float32 (exact from bf16 and float16). An expert with one scale
    for its weight (tensor) fills each of its rows with it, exactly; block scales have no place in
    the pool. With banks on the meta device it checks names, dtypes and shapes and reads nothing."""
    I = layout.intermediate
    cn = functools.partial(_name_in_checkpoint, entries)  # messages name the checkpoint's tensors
    names = per_expert_names(entries, prefix, layout.gated)
    if names is None or layout.split or layout.paths:
        w13_name = layout.param_names[0]
        stored = find_entry(entries, f"{prefix}.{w13_name}")
        held = f"{cn(f'{prefix}.{w13_name}')} ({stored.dtype})" if stored is not None else "no per-expert tensors"
        raise CheckpointError(f"{prefix} holds {held}: load_model reads the FP8 experts of compressed-tensors "
                              f"checkpoints per expert, as llm-compressor saves them ({_per_expert_hint(layout, prefix)} "
                              "with weight_scale)")
    *w13_names, down_n = names
    for e in range(layout.experts):
        base = f"{prefix}.{e}"
        targets = [(n, host.w13[layer, e, rows], host.w13_scale[layer, e, rows])
                   for n, rows in zip(w13_names, _w13_rows(layout, I))]
        for n, weight, scale in targets + [(down_n, host.w2[layer, e], host.w2_scale[layer, e])]:
            _read_row_scaled(entries, f"{base}.{n}", weight, scale)


def _read_row_scaled(entries, linear: str, weight: torch.Tensor, scale: torch.Tensor) -> None:
    """One projection's FP8 weight (`linear`.weight) into its rows of the pool, `weight` [rows,
    cols], and its row or tensor scale into `scale` [rows] float32."""
    cn = functools.partial(_name_in_checkpoint, entries)
    wname, sname = f"{linear}.weight", f"{linear}.weight_scale_inv"
    entry = _require_entry(entries, wname)
    _require_fp8(entry, cn(wname))  # (an unquantized expert is named as such, not by its missing scale)
    _read_fp8_into(entry, weight, cn(wname))  # (before the scale: a weight of the wrong shape is named as such)
    scale_entry = _require_entry(entries, sname)
    strategies = strategies_of(entries)
    kind = scale_kind(scale_entry.dtype, scale_entry.shape, entry.shape, strategies)
    if kind is None:
        raise CheckpointError(scale_problem(cn(sname), scale_entry.dtype, scale_entry.shape,
                                            formats.fp8_scale_shape(*entry.shape), strategies=strategies,
                                            rows=entry.shape[0]))
    if kind == BLOCK:  # (the pool's format comes from the first MoE layer's first expert: holds_row_scales)
        raise CheckpointError(f"{cn(sname)} holds block scales {tuple(scale_entry.shape)}, while the first MoE "
                              "layer's experts have one scale a row: their pool is fp8_rows and holds one format; "
                              "load_model reads checkpoints whose experts all have one kind of scale")
    _read_scale(scale_entry, scale, cn(sname), strategies)  # (a tensor scale fills every row)


def _per_expert_hint(layout: ExpertsLayout, prefix: str) -> str:
    """The per-expert tensor names the loader looks for, for a message."""
    return f"{prefix}.<e>.gate_proj.weight / .w1.weight" if layout.gated else f"{prefix}.<e>.up_proj.weight"


def fill_mxfp4_layer(entries, prefix: str, layout: ExpertsLayout, host: HostPool, layer: int) -> None:
    """GPT-OSS MXFP4 experts of one layer straight into the MXFP4 host pool: gate_up_proj_blocks
    [E, 2I, H/32, 16] and _scales [E, 2I, H/32] (rows interleaved gate, up, gate, ...), down_proj_*
    [E, H, I/32, ...], biases. One expert at a time through a buffer of its rows, which are put in
    canonical order (gate rows, then up rows): whole rows move, nothing is expanded."""
    I, H = layout.intermediate, layout.hidden
    names = {"gate_up_proj_blocks": (2 * I, H // 32, 16), "gate_up_proj_scales": (2 * I, H // 32),
             "down_proj_blocks": (H, I // 32, 16), "down_proj_scales": (H, I // 32)}
    found = {}  # dense experts under an mxfp4 config were refused by _checked_skeleton already
    for n, row_shape in names.items():
        entry = _require_entry(entries, f"{prefix}.{n}")
        if entry.dtype != torch.uint8 or tuple(entry.shape) != (layout.experts, *row_shape):
            raise CheckpointError(f"{prefix}.{n} is {entry.dtype} {list(entry.shape)}, expected uint8 "
                                  f"{[layout.experts, *row_shape]}")
        found[n] = entry
    gate_up = torch.empty(2 * I, H // 2, dtype=torch.uint8, device=host.w13.device)  # meta in the dry run
    gate_up_scales = torch.empty(2 * I, H // 32, dtype=torch.uint8, device=host.w13.device)
    for e in range(layout.experts):
        read_rows_into(found["gate_up_proj_blocks"], e, gate_up.view(1, 2 * I, H // 32, 16), f"{prefix}.gate_up_proj_blocks")
        read_rows_into(found["gate_up_proj_scales"], e, gate_up_scales.view(1, 2 * I, H // 32), f"{prefix}.gate_up_proj_scales")
        host.w13[layer, e, :I].copy_(gate_up[0::2])
        host.w13[layer, e, I:].copy_(gate_up[1::2])
        host.w13_scale[layer, e, :I].copy_(gate_up_scales[0::2])
        host.w13_scale[layer, e, I:].copy_(gate_up_scales[1::2])
    read_into(found["down_proj_blocks"], host.w2[layer].view(layout.experts, H, I // 32, 16), f"{prefix}.down_proj_blocks")
    read_into(found["down_proj_scales"], host.w2_scale[layer], f"{prefix}.down_proj_scales")
    if host.w13_scale.device.type != "meta":
        for name, scales in (("gate_up_proj_scales", host.w13_scale[layer]), ("down_proj_scales", host.w2_scale[layer])):
            if int(scales.max()) == E8M0_NAN:  # the largest code: a max is cheaper than a compare
                raise CheckpointError(f"{prefix}.{name} holds e8m0 scale 0xFF, which is NaN: the checkpoint is damaged")
    if layout.bias:
        read = host.b13.device.type != "meta"
        b13 = _load_bias(entries, f"{prefix}.gate_up_proj_bias", (layout.experts, 2 * I), read)
        b2 = _load_bias(entries, f"{prefix}.down_proj_bias", (layout.experts, H), read)
        if read:
            host.b13[layer, :, :I].copy_(b13[:, 0::2])
            host.b13[layer, :, I:].copy_(b13[:, 1::2])
            host.b2[layer].copy_(b2)


def fill_packed_fp4_layer(entries, prefix: str, layout: ExpertsLayout, host: HostPool, layer: int) -> None:
    """DeepSeek-V4's FP4-packed experts of one layer straight into the MXFP4 host pool: per expert
    w1 / w3 / w2 (gate, up, down; or gate_proj / up_proj / down_proj) int8 [out, in/2], two e2m1
    values a byte with the low nibble the even column, and their weight_scale_inv (stored as
    `.scale`) float8_e8m0fnu [out, in/32], one power of two per 32 values: MXFP4's bytes, copied as
    they are. Gate and up are separate tensors, so they fill the pool's gate and up rows directly."""
    I = layout.intermediate
    if layout.split or layout.paths:  # the undecorated families' layouts (DBRX's, JetMoE's)
        names = ", ".join(f"{prefix}.{n}" for n in (layout.split or layout.paths[:2]))
        raise CheckpointError(f"config.json's quantization_config has expert_dtype 'fp4', but these experts are held "
                              f"as {names}, a layout no FP4 checkpoint format defines; load the float checkpoint")
    cn = functools.partial(_name_in_checkpoint, entries)  # messages name the checkpoint's tensors
    for fused in (f"{prefix}.{layout.param_names[0]}", f"{prefix}.gate_up_proj_blocks"):
        if find_entry(entries, fused) is not None:
            raise CheckpointError(f"config.json's quantization_config has expert_dtype 'fp4' (DeepSeek-V4's FP4 experts, "
                                  f"one int8 tensor a projection and expert), but the checkpoint holds {cn(fused)}; "
                                  "GPT-OSS's MXFP4 experts need quant_method 'mxfp4', fused FP8 experts expert_dtype 'fp8'")
    names = per_expert_names(entries, prefix, layout.gated)
    if names is None:
        raise CheckpointError(f"no expert tensors for {prefix} in the checkpoint (looked for "
                              f"{_per_expert_hint(layout, prefix)}, int8 FP4 pairs)")
    *w13_names, down_n = names
    for e in range(layout.experts):
        base = f"{prefix}.{e}"
        targets = [(n, host.w13[layer, e, rows], host.w13_scale[layer, e, rows])
                   for n, rows in zip(w13_names, _w13_rows(layout, I))]
        for n, w, s in targets + [(down_n, host.w2[layer, e], host.w2_scale[layer, e])]:
            name, scale_name = f"{base}.{n}.weight", f"{base}.{n}.weight_scale_inv"
            weight, scale = _require_entry(entries, name), find_entry(entries, scale_name)
            if weight.dtype == torch.uint8:
                raise CheckpointError(f"{cn(name)} is torch.uint8: FP4-packed experts are int8 tensors, as transformers "
                                      "reads them (GPT-OSS's uint8 MXFP4 blocks are gate_up_proj_blocks under "
                                      "quant_method 'mxfp4')")
            if weight.dtype != torch.int8:
                raise CheckpointError(f"{cn(name)} is {weight.dtype}, but this checkpoint's experts are FP4-packed "
                                      "(config.json's expert_dtype 'fp4', or int8 experts beside this one) and one host "
                                      "pool holds one format: if no expert is FP4, remove expert_dtype 'fp4' from "
                                      "config.json; a checkpoint that mixes formats loads with transformers' "
                                      "from_pretrained(path, quantization_config=FineGrainedFP8Config(dequantize=True)), "
                                      "then offload_experts(model, cache_bytes=...)")
            if scale is None:
                raise CheckpointError(f"the checkpoint lacks the scales of {cn(name)} ({cn(name)[:-len('weight')]}scale)")
            if scale.dtype != E8M0_DTYPE:
                raise CheckpointError(f"{cn(scale_name)} is {scale.dtype}: the scales of FP4 experts are float8_e8m0fnu, "
                                      "one power of two per 32 values")
            read_into(weight, w.view(torch.int8), cn(name))  # the bytes as they are
            read_into(scale, s.view(scale.dtype), cn(scale_name))
            if s.device.type != "meta" and int(s.max()) == E8M0_NAN:  # the largest code: a max is cheaper than a compare
                raise CheckpointError(f"{cn(scale_name)} holds e8m0 code 0xFF, which is NaN: the checkpoint is damaged")


def holds_packed_fp4(entries, prefix: str, layout: ExpertsLayout) -> bool:
    """Whether the experts under `prefix` are stored per expert as int8 FP4 pairs (DeepSeek-V4's)."""
    return any(entry.dtype == torch.int8 for _, entry in _first_expert_entries(entries, prefix, layout.gated))


def holds_row_scales(entries, prefix: str, layout: ExpertsLayout) -> bool:
    """Whether expert 0 under `prefix` is stored per expert with row scales (compressed-tensors'
    channel strategy), where the checkpoint's config allows them."""
    strategies = strategies_of(entries)
    if CHANNEL not in strategies:
        return False
    for name, entry in _first_expert_entries(entries, prefix, layout.gated):
        scale = entries.get(name + "_scale_inv")
        if scale is not None and scale_kind(scale.dtype, scale.shape, entry.shape, strategies) == CHANNEL:
            return True
    return False


def fill_int4_layer(entries, prefix: str, layout: ExpertsLayout, host: HostPool, layer: int) -> None:
    """int4 experts of one layer (compressed-tensors' pack-quantized or GPTQ linears per expert:
    gate_proj / up_proj / down_proj, or w1 / w3 / w2, each an Int4Entry) straight into the int4 host
    pool: compressed-tensors' codes as stored (their int32 words' bytes are the pool's), GPTQ's
    moved a byte at a time from [in/8, out] words into the pool's [out, in/2] rows, one linear at a
    time; the scales as float32 (as stored: float16, bfloat16 and float32 convert exactly), repeated
    where the pool's group is finer than the linear's (row scales). With banks on the meta device
    (the dry run) it checks names, shapes, whole groups and what the small tensors hold (GPTQ's zero
    points and group order, every scale finite), and reads no codes."""
    I = layout.intermediate
    cn = functools.partial(_name_in_checkpoint, entries)
    if layout.split or layout.paths:  # the undecorated families' layouts (DBRX's, JetMoE's)
        names = ", ".join(f"{prefix}.{n}" for n in (layout.split or layout.paths[:2]))
        raise CheckpointError(f"the checkpoint's quantization_config is int4, but these experts are held as {names}, "
                              "a layout no int4 checkpoint format defines; load the float checkpoint")
    fused = find_entry(entries, f"{prefix}.{layout.param_names[0]}")
    names = per_expert_names(entries, prefix, layout.gated)
    if names is None or fused is not None:
        held = f"{cn(f'{prefix}.{layout.param_names[0]}')} ({fused.dtype})" if fused is not None else "no per-expert tensors"
        raise CheckpointError(f"{prefix} holds {held}: load_model reads int4 experts per expert, as GPTQ and "
                              f"llm-compressor save them ({_per_expert_hint(layout, prefix)} as qweight / scales / "
                              "qzeros, or weight_packed / weight_scale / weight_shape)")
    *w13_names, down_n = names
    dry_run = host.w13.device.type == "meta"
    for e in range(layout.experts):
        base = f"{prefix}.{e}"
        targets = [(n, host.w13[layer, e, rows], host.w13_scale[layer, e, rows])
                   for n, rows in zip(w13_names, _w13_rows(layout, I))]
        for n, weight, scale in targets + [(down_n, host.w2[layer, e], host.w2_scale[layer, e])]:
            entry = _require_entry(entries, f"{base}.{n}.weight", " (an int4 linear: qweight, scales and qzeros, or "
                                   "weight_packed, weight_scale and weight_shape)")
            if not isinstance(entry, Int4Entry):
                raise CheckpointError(f"{cn(f'{base}.{n}.weight')} is {entry.dtype}, but this checkpoint's quantization_config "
                                      "makes its experts int4 and one host pool holds one format: load_model needs "
                                      "every expert int4 "
                                      "(experts left unquantized by an ignore list or modules_to_not_convert are not "
                                      "read); quantize every expert, or load a float checkpoint")
            entry.codes_into(weight)
            entry.scales_into(scale)
            if dry_run:  # (refusals before the pool exists: the small tensors' values, the scales finite)
                entry.check_values()
                entry.check_scales_finite()


def experts_fill(fmt: str, linears: str):
    """The fill function of a checkpoint whose experts are `fmt` and other linears `linears`
    (MXFP4 experts beside block-FP8 linears: DeepSeek-V4's FP4-packed ones)."""
    if fmt == formats.INT4:
        return fill_int4_layer
    if fmt == formats.MXFP4:
        return fill_packed_fp4_layer if linears == formats.FP8 else fill_mxfp4_layer
    if fmt == formats.FP8_ROWS:  # compressed-tensors' FP8 experts with row scales
        return fill_fp8_rows_layer
    return fill_fp8_layer if fmt == formats.FP8 else fill_layer


def refuse_unquantized_mxfp4(entries, prefix: str, others_mxfp4: bool = False) -> None:
    """Refuses experts that are plain tensors in a checkpoint whose config.json says mxfp4 (where
    `others_mxfp4`, other layers' experts are MXFP4: a partly quantized checkpoint), and a layer that
    holds both MXFP4 blocks and a plain copy of the same weights (which one is meant?)."""
    if find_entry(entries, f"{prefix}.gate_up_proj_blocks") is not None:
        for dense in (f"{prefix}.gate_up_proj", f"{prefix}.down_proj"):
            entry = find_entry(entries, dense)
            if entry is not None:
                raise CheckpointError(f"{prefix} holds MXFP4 experts (gate_up_proj_blocks / _scales) and also {dense} "
                                      f"({entry.dtype} {list(entry.shape)}): two versions of the same weights; "
                                      f"remove {dense} from the checkpoint (or its _blocks / _scales)")
        return
    first = _first_expert_entries(entries, prefix)
    dense = f"{prefix}.gate_up_proj" if find_entry(entries, f"{prefix}.gate_up_proj") is not None else (
        first[0][0] if first else None)
    if dense is not None:
        entry = find_entry(entries, dense)
        if others_mxfp4:
            raise CheckpointError(f"{dense} is {entry.dtype} {list(entry.shape)} while other layers' experts are MXFP4: "
                                  "load_model's host pool holds one format; load this checkpoint with transformers' "
                                  "from_pretrained(path, quantization_config=Mxfp4Config(dequantize=True)) and call "
                                  "freetoken_plugin.offload_experts(model, ...)")
        raise CheckpointError(f"config.json's quantization_config says mxfp4, but {dense} is {entry.dtype} "
                              f"{list(entry.shape)}: MXFP4 experts are GPT-OSS's gate_up_proj_blocks / _scales; "
                              "remove the quantization_config of a checkpoint that is not MXFP4")


def _load_bias(entries, name: str, want, read: bool = True) -> Optional[torch.Tensor]:
    """An expert bias tensor, checked: floating point of shape `want` (read unless `read` is False)."""
    entry = _require_entry(entries, name)
    if not entry.dtype.is_floating_point or tuple(entry.shape) != tuple(want):
        raise CheckpointError(f"{name} is {entry.dtype} {list(entry.shape)}, expected a floating-point bias "
                              f"{list(want)}")
    return load_tensor(entry) if read else None


def check_experts(entries, experts, layouts, shape: ExpertShape, linears: str = formats.DENSE) -> None:
    """The checkpoint's experts (every format) checked from the shards' headers before the host pool
    is allocated: every layer goes through its fill function with a host pool on the meta device,
    which checks names, dtypes and shapes and reads nothing."""
    fill = experts_fill(shape.format, linears)
    meta = types.SimpleNamespace(w13=None, w2=None, w13_scale=None, w2_scale=None, b13=None, b2=None)
    for spec in shape.bank_specs:
        setattr(meta, spec.name, torch.empty((shape.layers, shape.experts, *spec.row_shape), dtype=spec.dtype,
                                             device="meta"))
    for layer, (prefix, _) in enumerate(experts):
        fill(entries, prefix, layouts[layer], meta, layer)


def _name_in_checkpoint(entries, name: str) -> str:
    """The checkpoint's own name of the tensor the model calls `name`, for messages. A missing one
    is named as its nearest stored sibling is renamed (a missing scale after its weight, one
    expert's missing w1 after its w3: checkpoints store them side by side)."""
    if find_entry(entries, name) is not None:
        return checkpoint_name(entries, name)
    original = getattr(entries, "original", {})
    weight = name[:-len("_scale_inv")]
    if name.endswith("_scale_inv") and find_entry(entries, weight) is not None:
        stored = checkpoint_name(entries, weight)
        # DeepSeek-V4's checkpoints name a weight's scales `<linear>.scale`, compressed-tensors'
        # `<linear>.weight_scale`
        for spelling, ending in (("scale", ".scale"), ("weight_scale", ".weight_scale")):
            if stored.endswith(".weight") and any(n.endswith("weight_scale_inv") and o.endswith(ending)
                                                  for n, o in original.items()):
                return stored[:-len("weight")] + spelling
        return stored + "_scale_inv"
    parent = name
    while "." in parent:
        parent = parent.rsplit(".", 1)[0]
        for model_name, stored in original.items():
            rest = model_name[len(parent):]
            if model_name.startswith(parent + ".") and stored.endswith(rest):
                return stored[:len(stored) - len(rest)] + name[len(parent):]
    return name


def _require_entry(entries, name: str, held_as: str = "") -> Entry:
    """The entry of `name`, or a one-line refusal naming it (and `held_as`: how such a weight is stored)."""
    entry = find_entry(entries, name)
    if entry is None:
        raise CheckpointError(f"the checkpoint lacks {_name_in_checkpoint(entries, name)}{held_as}")
    return entry


def _require_fp8(entry: Entry, name: str) -> None:
    if entry.dtype != formats.FP8_DTYPE:
        raise CheckpointError(f"{name} is {entry.dtype} in an FP8 checkpoint, whose experts share one pool: "
                              "load_model needs every expert in float8_e4m3fn with its scales (experts left "
                              "unquantized, by modules_to_not_convert or a compressed-tensors ignore list, are not "
                              "read); quantize every expert of the checkpoint, or load a bf16 copy and call "
                              "offload_experts(model, quantize='fp8')")


def _require(entries, name: str) -> Entry:
    """The entry of an expert weight, which must be there and be a plain floating-point tensor."""
    entry = find_entry(entries, name)
    if entry is None:
        raise CheckpointError(f"the checkpoint lacks {_name_in_checkpoint(entries, name)}")
    check_floating(entry, checkpoint_name(entries, name))
    return entry
