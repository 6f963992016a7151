"""The scales of a checkpoint's FP8 weights (w = q * scale), by kind: a 128 x 128 block grid
(Hugging Face's block-FP8 `weight_scale_inv`, compressed-tensors' "block" strategy), one scale a
weight (compressed-tensors' "tensor") or one a row ("channel"). Which kinds a checkpoint may hold
comes from its config (`entries.fp8_scales`, set by the loader; block grids only by default). A
tensor scale is the same scale in every block or row, so it fills the FP8 pool's grid, or the
fp8_rows pool's rows, exactly; a row scale has no block grid, so experts with row scales go to an
fp8_rows pool (loader.py, expert_reading.py) and other linears with them are dequantized."""
import math
from typing import FrozenSet, Optional

import torch

from ft_ops import formats

from .safetensors_io import CheckpointError, load_tensor

BLOCK, TENSOR, CHANNEL = "block", "tensor", "channel"  # (compressed-tensors' strategy names)
BLOCKS_ONLY = frozenset({BLOCK})


def strategies_of(entries) -> FrozenSet[str]:
    """The scale kinds the checkpoint of `entries` may hold."""
    return getattr(entries, "fp8_scales", BLOCKS_ONLY)


def same_but_unit_dims(shape, want) -> bool:
    """Whether `shape` is `want` up to dimensions of size 1 (some transformers versions save scales
    squeezed): a transposed grid of the same size is not."""
    return [d for d in shape if d != 1] == [d for d in want if d != 1]


def scale_kind(scale_dtype: torch.dtype, scale_shape, weight_shape, strategies: FrozenSet[str],
               parts: int = 1) -> Optional[str]:
    """The kind of a scale tensor of `scale_shape` for an FP8 weight of `weight_shape` ([..., R, C]),
    among `strategies`, or None where it is none of them (or not floating point). A shape that is
    one kind's exactly is that kind; a squeezed one (dimensions of size 1 dropped or added, as some
    writers save scales) only where it fits one kind alone: a row scale [R, 1] squeezed is also a
    block grid [1, R] where R = ceil(C/128). One value is the same scale everywhere, whatever kind."""
    if not scale_dtype.is_floating_point:
        return None
    lead, (rows, cols) = tuple(weight_shape[:-2]), tuple(weight_shape[-2:])
    shape = tuple(scale_shape)
    shapes = {BLOCK: (*lead, *formats.fp8_scale_shape(rows, cols, parts)), CHANNEL: (*lead, rows, 1)}
    allowed = [k for k in (BLOCK, CHANNEL) if k in strategies]
    if math.prod(shape) == 1 and (TENSOR in strategies and not lead or
                                  any(math.prod(shapes[k]) == 1 for k in allowed)):
        return TENSOR if TENSOR in strategies and not lead else allowed[0]
    exact = [k for k in allowed if shape == shapes[k] or (k == CHANNEL and shape == (*lead, rows))]
    if exact:
        return exact[0]
    squeezed = [k for k in allowed if same_but_unit_dims(shape, shapes[k])]
    return squeezed[0] if len(squeezed) == 1 else None


def scale_problem(name: str, dtype: torch.dtype, shape, want, blocks: str = "",
                  strategies: FrozenSet[str] = BLOCKS_ONLY, rows: Optional[int] = None) -> str:
    """What is wrong with a scale tensor: its dtype (scales are any floating-point dtype, float32,
    bfloat16 or float8_e8m0fnu as checkpoints store them; integer codes, e.g. UE8M0 exponents saved
    as uint8, are not read) or its shape, against each kind the checkpoint may hold (`want`: the
    block grid; `rows`: the weight's rows, for the shape of row scales)."""
    if not dtype.is_floating_point:
        return (f"{name} is {dtype}: scales are read as floating point (float32, bfloat16, "
                f"float8_e8m0fnu, ...); save them as such (UE8M0 exponents as float8_e8m0fnu, not uint8)")
    kinds = [f"the block scales {tuple(want)}{blocks}"] if BLOCK in strategies or not strategies else []
    if TENSOR in strategies:
        kinds.append("one scale (tensor)")
    if CHANNEL in strategies:
        kinds.append("one scale a row (channel)" + (f" {(rows, 1)}" if rows is not None else ""))
    return f"{name} is {dtype} {tuple(shape)}, expected {' or '.join(kinds)}"


def check_finite_scales(scales: torch.Tensor, name: str) -> None:
    """Refuses scales with an inf or NaN: every weight they scale would compute NaN."""
    if not bool(torch.isfinite(scales).all()):
        bad = int((~torch.isfinite(scales)).sum())
        raise CheckpointError(f"{name} holds {bad} non-finite scale{'s' if bad != 1 else ''} (inf or NaN): "
                              "the checkpoint is damaged")


def dequantized(q: torch.Tensor, scale_entry, name: str, strategies: FrozenSet[str], dtype: torch.dtype,
                parts: int = 1) -> torch.Tensor:
    """FP8 weight `q` [..., R, C] times its scale (read from `scale_entry`, of any kind the
    checkpoint may hold), computed in float32 and rounded to `dtype` once."""
    scale = load_tensor(scale_entry)
    kind = scale_kind(scale.dtype, scale.shape, q.shape, strategies, parts)
    if kind is None:
        raise CheckpointError(scale_problem(name, scale.dtype, tuple(scale.shape),
                                            formats.fp8_scale_shape(*q.shape[-2:], parts), strategies=strategies,
                                            rows=q.shape[-2]))
    scale = scale.float()
    check_finite_scales(scale, name)
    if scale.numel() == 1:  # a tensor scale, or a one-value grid or row scale: the same scale everywhere
        return (q.float() * scale.reshape(())).to(dtype)
    if kind == BLOCK:
        return formats.dequantize_fp8(q, scale.reshape(*q.shape[:-2], *formats.fp8_scale_shape(*q.shape[-2:], parts)),
                                      parts, dtype)
    return (q.float() * scale.reshape(*q.shape[:-1], 1)).to(dtype)


def checked_dequantized(weight: torch.Tensor, name: str) -> torch.Tensor:
    """A dequantized weight, refused where it holds an FP8 NaN code or overflows its dtype."""
    if not bool(torch.isfinite(weight).all()):
        nan = int(torch.isnan(weight).sum())
        if nan:  # e4m3fn's NaN codes (0x7f, 0xff): every output the weight touches would be NaN
            raise CheckpointError(f"{name} holds {nan} FP8 NaN code{'s' if nan != 1 else ''}: the checkpoint is damaged")
        if weight.dtype == torch.float16:
            raise CheckpointError(f"{name} dequantizes to values beyond float16's range; load it with "
                                  "dtype=torch.bfloat16 or torch.float32")
        raise CheckpointError(f"{name} dequantizes to values beyond {weight.dtype}'s range: the checkpoint is damaged")
    return weight
