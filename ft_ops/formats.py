"""Expert formats: how one expert's weights sit in the host pool, in a slot and on the link.

A format is a property of the pools. Every bank of a pool is [rows, ...] with one row per expert;
the copy ops move rows as bytes whatever their dtype, so a slot holds an expert in its format and a
copy moves the format's bytes.

- dense: w13 [2I, H] (gate rows, then up rows) and w2 [H, I] in the compute dtype (bf16, fp16,
  float32), optional biases b13 [2I], b2 [H]. Ungated experts (no gate projection: Nemotron-H)
  hold the up rows alone, w13 [I, H] and b13 [I], in dense and fp8 pools.
- fp8: the layout of Hugging Face block-FP8 checkpoints (`quant_method: fp8`,
  `weight_block_size: [128, 128]`): w13 and w2 float8_e4m3fn, each with float32 scale_inv blocks
  of 128 x 128 (partial blocks at the edges), dequantized weight = fp8 * scale_inv of its block.
  Gate and up are blocked as the separate projections they are in checkpoints: w13's scale is
  [2 ceil(I/128), ceil(H/128)], gate's blocks then up's. Biases stay in the compute dtype.
- fp8_rows: FP8 weights with one float32 scale a row, the layout of compressed-tensors' "channel"
  strategy (llm-compressor's FP8_DYNAMIC checkpoints): w13 and w2 float8_e4m3fn as in fp8,
  w13_scale [2I] (gate's rows, then up's) and w2_scale [H], dequantized weight = fp8 * the scale of
  its row. A row scale has no exact place in fp8's 128 x 128 grid, and dequantizing the experts
  would double their bytes in host memory and on the link.
- mxfp4: the OCP microscaling FP4 of GPT-OSS checkpoints: w13 [2I, H/2] and w2 [H, I/2] uint8, two
  e2m1 values per byte (the low nibble holds the even element), values +-{0, 0.5, 1, 1.5, 2, 3, 4,
  6}; scales w13_scale [2I, H/32] and w2_scale [H, I/32] uint8 e8m0, one per 32 values of a row,
  2^(scale - 127). H and I must be multiples of 32. Rows are canonical (gate rows, then up rows):
  the checkpoint's interleaved gate/up rows are reordered when read (whole rows: nothing is
  expanded). Biases stay in the compute dtype.
- int4: symmetric 4-bit integers with a float32 scale per group of G values of a row, the layout
  GPTQ (`sym: true`) and compressed-tensors' W4A16 (`pack-quantized`, symmetric) checkpoints hold
  after unpacking: w13 [2I, H/2] and w2 [H, I/2] uint8, two 4-bit codes per byte (the low nibble
  holds the even element), value = (code - 8) * scale; scales w13_scale [2I, H/G] and w2_scale
  [H, I/G] float32 (the checkpoints' scales as stored: float16, bfloat16 or float32, each exact in
  float32; a value (code - 8) * scale is exact in float32 where the scale has at most 21
  significant bits, as float16 and bfloat16 ones do, and rounds once for a float32 scale). G is one group
  size for both banks, a multiple of 32 that divides H and I (the pool's `group`). Experts must be
  gated, as for mxfp4. Biases stay in the compute dtype. offload_experts(quantize="int4") makes
  float experts int4 by quantize_int4.
"""
import math
from dataclasses import dataclass
from typing import List, Tuple

import torch

DENSE, FP8, FP8_ROWS, MXFP4, INT4 = "dense", "fp8", "fp8_rows", "mxfp4", "int4"
FORMATS = (DENSE, FP8, FP8_ROWS, MXFP4, INT4)
FP8_FORMATS = (FP8, FP8_ROWS)  # float8_e4m3fn weights, with block or row scales

FP8_BLOCK = 128
FP8_DTYPE = torch.float8_e4m3fn
# The dtypes models and the expert kernels compute in.
COMPUTE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
FP8_MAX = 448.0  # largest finite float8_e4m3fn

MXFP4_GROUP = 32  # values per e8m0 scale
INT4_OFFSET = 8  # an int4 code c holds the integer c - 8
INT4_MAX = 7  # largest int4 value
PACKED_FORMATS = (MXFP4, INT4)  # two 4-bit values a byte
INT4_GROUPS = (128, 64, 32)  # the group sizes quantize="int4" takes, the default (the largest that fits) first
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


@dataclass(frozen=True)
class BankSpec:
    name: str
    row_shape: Tuple[int, ...]
    dtype: torch.dtype


def int4_groups_dividing(hidden: int, inter: int) -> List[int]:
    """The INT4_GROUPS that divide both sizes, largest first (quantize="int4" takes the first)."""
    return [g for g in INT4_GROUPS if hidden % g == 0 and inter % g == 0]


def check_int4_group(group: int, hidden: int, inter: int) -> None:
    """Refuses an int4 group size the kernels do not take: a multiple of 32 dividing H and I."""
    if group <= 0 or group % 32 or hidden % group or inter % group:
        raise ValueError(f"int4 experts need a group size that is a positive multiple of 32 dividing the hidden and "
                         f"intermediate sizes ({hidden} and {inter}), got {group}")


def bank_specs(fmt: str, hidden: int, inter: int, dtype: torch.dtype, bias: bool, gated: bool = True,
               group: int = 0) -> List[BankSpec]:
    """The banks of one expert in `fmt`, in the order every pool and copy uses: w13, w2, then the
    biases (if any), then the scales (the quantized formats). Ungated experts (gated=False) have I
    rows of w13, not 2I. `group`: int4's values per scale (the other formats take 0)."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown expert format {fmt!r}; expected one of {FORMATS}")
    if (fmt == INT4) != (group != 0):
        raise ValueError(f"int4 experts take a group size and the other formats none; got format {fmt!r} with "
                         f"group {group}")
    if fmt == INT4:
        check_int4_group(group, hidden, inter)
        specs = [BankSpec("w13", (2 * inter, hidden // 2), torch.uint8), BankSpec("w2", (hidden, inter // 2), torch.uint8)]
        if bias:
            specs += [BankSpec("b13", (2 * inter,), dtype), BankSpec("b2", (hidden,), dtype)]
        return specs + [BankSpec("w13_scale", (2 * inter, hidden // group), torch.float32),
                        BankSpec("w2_scale", (hidden, inter // group), torch.float32)]
    if fmt in PACKED_FORMATS and not gated:
        raise ValueError(f"{fmt} experts must be gated (gate and up rows); hold ungated experts dense or in fp8")
    if fmt == MXFP4:
        if hidden % MXFP4_GROUP or inter % MXFP4_GROUP:
            raise ValueError(f"MXFP4 experts need hidden and intermediate sizes that are multiples of {MXFP4_GROUP}, "
                             f"got {hidden} and {inter}")
        specs = [BankSpec("w13", (2 * inter, hidden // 2), torch.uint8), BankSpec("w2", (hidden, inter // 2), torch.uint8)]
        if bias:
            specs += [BankSpec("b13", (2 * inter,), dtype), BankSpec("b2", (hidden,), dtype)]
        return specs + [BankSpec("w13_scale", (2 * inter, hidden // MXFP4_GROUP), torch.uint8),
                        BankSpec("w2_scale", (hidden, inter // MXFP4_GROUP), torch.uint8)]
    weight_dtype = FP8_DTYPE if fmt in FP8_FORMATS else dtype
    parts = 2 if gated else 1  # w13: gate and up, or up alone
    specs = [BankSpec("w13", (parts * inter, hidden), weight_dtype), BankSpec("w2", (hidden, inter), weight_dtype)]
    if bias:
        specs += [BankSpec("b13", (parts * inter,), dtype), BankSpec("b2", (hidden,), dtype)]
    if fmt == FP8:
        specs += [BankSpec("w13_scale", fp8_scale_shape(parts * inter, hidden, parts=parts), torch.float32),
                  BankSpec("w2_scale", fp8_scale_shape(hidden, inter, parts=1), torch.float32)]
    if fmt == FP8_ROWS:
        specs += [BankSpec("w13_scale", (parts * inter,), torch.float32), BankSpec("w2_scale", (hidden,), torch.float32)]
    return specs


def fp8_scale_shape(rows: int, cols: int, parts: int = 1) -> Tuple[int, int]:
    """Scale blocks of a [rows, cols] weight whose rows are `parts` equal projections, each blocked
    on its own (w13: gate and up, parts=2)."""
    if rows % parts:
        raise ValueError(f"{rows} rows do not split into {parts} equal projections")
    return parts * math.ceil(rows // parts / FP8_BLOCK), math.ceil(cols / FP8_BLOCK)


def _blocked(w: torch.Tensor, block: int) -> Tuple[torch.Tensor, int, int]:
    """w [..., R, C] padded with zeros to whole blocks, viewed [..., R/b, b, C/b, b]."""
    rows, cols = w.shape[-2:]
    pr, pc = math.ceil(rows / block) * block - rows, math.ceil(cols / block) * block - cols
    if pr or pc:
        w = torch.nn.functional.pad(w, (0, pc, 0, pr))
    return w.reshape(*w.shape[:-2], w.shape[-2] // block, block, w.shape[-1] // block, block), rows, cols


class NonFiniteWeights(ValueError):
    """quantize_fp8's refusal of weights holding inf or NaN."""


def quantize_fp8(w: torch.Tensor, parts: int = 1) -> Tuple[torch.Tensor, torch.Tensor]:
    """Block-FP8 quantization of w [..., R, C] as transformers' quantizer does it, with partial
    blocks at the edges: per 128 x 128 block, scale = 448 / amax (1 for an all-zero block),
    q = clamp(w * scale, -448, 448) cast to e4m3 (round to nearest even), scale_inv = 1 / scale.
    Refuses weights with inf or NaN, and blocks whose amax is so small (below ~1.3e-36) that the
    scale overflows: the rule would make them NaN. With parts > 1, the rows are that many
    projections blocked on their own (w13: gate, up).
    Returns (q float8_e4m3fn [..., R, C], scale_inv float32 [..., parts * ceil(R/parts/128), ceil(C/128)])."""
    if parts > 1:
        pieces = [quantize_fp8(p, 1) for p in w.chunk(parts, dim=-2)]
        return torch.cat([q for q, _ in pieces], dim=-2), torch.cat([s for _, s in pieces], dim=-2)
    # In the weights' own dtype until the product (a block's largest magnitude is one of its values,
    # so exact in any float dtype; the product promotes to float32): two reductions and one
    # float32 pass, where a copy to float32 first took three more (a bf16 model's loading time).
    if w.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        w = w.float()  # (float64: the rule's float32, a value beyond its range becoming inf, refused below)
    blocks, rows, cols = _blocked(w, FP8_BLOCK)
    dims = (-3, -1)
    amax = torch.maximum(blocks.amax(dim=dims), -blocks.amin(dim=dims)).float()  # NaN and inf propagate
    if w.device.type != "meta" and not bool(torch.isfinite(amax).all()):
        raise NonFiniteWeights("quantize_fp8: the weights hold inf or NaN, and a block's scale would turn all of its "
                         "128 x 128 values into NaN; find them with torch.isfinite on each expert weight and fix the "
                         "model before quantizing")
    scale = torch.where(amax > 0, FP8_MAX / torch.where(amax > 0, amax, torch.ones_like(amax)),
                        torch.ones_like(amax))
    if w.device.type != "meta" and not bool(torch.isfinite(scale).all()):
        smallest = float(amax[~torch.isfinite(scale)].min())
        raise ValueError(f"quantize_fp8: a 128 x 128 block's largest magnitude is {smallest:.1e}, so its scale "
                         f"448 / amax overflows float32 and the rule would turn the block's zeros into NaN (the rest "
                         f"into 0); values below {FP8_MAX / torch.finfo(torch.float32).max:.1e} are zero at any "
                         "precision FP8 keeps: set them to zero before quantizing")
    q = (blocks * scale[..., :, None, :, None]).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    q = q.reshape(*q.shape[:-4], q.shape[-4] * FP8_BLOCK, q.shape[-2] * FP8_BLOCK)[..., :rows, :cols]
    return q.contiguous(), (1.0 / scale).float()


def dequantize_fp8(q: torch.Tensor, scale_inv: torch.Tensor, parts: int = 1,
                   dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """w[r, c] = float(q[r, c]) * scale_inv[block of (r, c)], computed in float32 (float64 when
    dtype is float64), for q [..., R, C]; the inverse of quantize_fp8 up to its rounding. Row
    scales (fp8_rows: scale_inv [..., R], one rank fewer than q) give q[r, c] * scale_inv[r]."""
    if scale_inv.dim() == q.dim() - 1:
        compute = torch.float64 if dtype == torch.float64 else torch.float32
        return (q.to(compute) * scale_inv.to(compute)[..., None]).to(dtype)
    if parts > 1:
        qs, ss = q.chunk(parts, dim=-2), scale_inv.chunk(parts, dim=-2)
        return torch.cat([dequantize_fp8(a, b, 1, dtype) for a, b in zip(qs, ss)], dim=-2)
    compute = torch.float64 if dtype == torch.float64 else torch.float32
    rows, cols = q.shape[-2:]
    s = scale_inv.to(compute).repeat_interleave(FP8_BLOCK, dim=-2).repeat_interleave(FP8_BLOCK, dim=-1)
    return (q.to(compute) * s[..., :rows, :cols]).to(dtype)


def quantize_fp8_rows(w: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """FP8 with one scale a row (the fp8_rows format), for tests and synthetic pools: per row of
    w [..., R, C], scale = amax / 448 (1 for an all-zero row) and q = clamp(w / scale, -448, 448)
    cast to e4m3 (round to nearest even), in float32. Refuses weights with inf or NaN.
    Returns (q float8_e4m3fn [..., R, C], scale float32 [..., R])."""
    w = w.float()
    amax = w.abs().amax(dim=-1)
    if w.device.type != "meta" and not bool(torch.isfinite(amax).all()):
        raise NonFiniteWeights("quantize_fp8_rows: the weights hold inf or NaN, which a row's scale would spread to "
                               "the whole row; fix the model before quantizing")
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (w / scale[..., None]).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q.contiguous(), scale


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """MXFP4 rows [..., R, C/2] uint8 (two e2m1 values a byte, the low nibble first) with e8m0
    scales [..., R, C/32] uint8 -> [..., R, C]: value * 2^(scale - 127), exact in float32."""
    compute = torch.float64 if dtype == torch.float64 else torch.float32
    lut = torch.tensor(E2M1_VALUES, dtype=compute, device=blocks.device)
    b = blocks.to(torch.int64)
    values = torch.stack([lut[b & 0x0F], lut[b >> 4]], dim=-1).flatten(-2)  # [..., R, C]
    exponent = scales.to(torch.int64) - 127
    factor = torch.ldexp(torch.ones(exponent.shape, dtype=compute, device=blocks.device), exponent)
    return (values * factor.repeat_interleave(MXFP4_GROUP, dim=-1)).to(dtype)


def quantize_mxfp4(w: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """A simple MXFP4 quantization of w [..., R, C] (C a multiple of 32), for tests and synthetic
    pools: per group of 32, scale 2^(floor(log2(amax)) - 2) (6 * 2^-2 * 2^floor(log2 amax) covers
    amax), each value rounded to the nearest e2m1 value (ties to the lower magnitude code). Returns
    (blocks [..., R, C/2] uint8, scales [..., R, C/32] uint8)."""
    *lead, rows, cols = w.shape
    if cols % MXFP4_GROUP:
        raise ValueError(f"MXFP4 groups 32 values of a row: {cols} columns are not a multiple of 32")
    if w.device.type != "meta" and not bool(torch.isfinite(w).all()):
        raise ValueError("quantize_mxfp4: the weights hold inf or NaN, which MXFP4 cannot represent")
    groups = w.float().reshape(*lead, rows, cols // MXFP4_GROUP, MXFP4_GROUP)
    amax = groups.abs().amax(-1)
    exponent = torch.where(amax > 0, torch.floor(torch.log2(amax.clamp_min(1e-38))) - 2, torch.full_like(amax, -127))
    exponent = exponent.clamp(-127, 127)
    scaled = groups / torch.ldexp(torch.ones_like(exponent), exponent.int())[..., None]
    # The nearest magnitude, a tie to the lower code: the midpoints between consecutive magnitudes
    # as bucket boundaries (bucketize puts a value equal to a boundary in the lower bucket).
    magnitudes = E2M1_VALUES[:8]
    midpoints = torch.tensor([(a + b) / 2 for a, b in zip(magnitudes, magnitudes[1:])], device=w.device)
    codes = torch.bucketize(scaled.abs().contiguous(), midpoints)
    codes = codes | ((scaled < 0) & (codes > 0)).to(torch.int64) << 3
    codes = codes.reshape(*lead, rows, cols)
    blocks = (codes[..., 0::2] | (codes[..., 1::2] << 4)).to(torch.uint8)
    return blocks, (exponent + 127).to(torch.uint8)


def expert_bytes(fmt: str, hidden: int, inter: int, dtype: torch.dtype, bias: bool, gated: bool = True,
                 group: int = 0) -> int:
    """Bytes of one expert in `fmt`: what a slot holds and a copy moves."""
    return sum(math.prod(s.row_shape) * torch.empty((), dtype=s.dtype).element_size()
               for s in bank_specs(fmt, hidden, inter, dtype, bias, gated, group))


def int4_group_of(codes: torch.Tensor, scales: torch.Tensor) -> int:
    """The group size of int4 codes [..., R, C/2] with scales [..., R, C/G]."""
    cols = 2 * codes.shape[-1]
    if scales.shape[-1] == 0 or cols % scales.shape[-1]:
        raise ValueError(f"int4 scales {list(scales.shape)} do not group rows of {cols} values evenly")
    return cols // scales.shape[-1]


def dequantize_int4(codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """int4 rows [..., R, C/2] uint8 (two codes a byte, the low nibble first) with float32 scales
    [..., R, C/G] -> [..., R, C]: (code - 8) * the scale of its group, computed in float32 (float64
    when dtype is float64), then rounded to dtype. In float32 the product is exact where the scale
    has at most 21 significant bits (float16 and bfloat16 scales: |code - 8| <= 8 takes 3 more) and
    rounds once to nearest for a float32 scale; in float64 it is exact. Memory: the nibbles as
    uint8 (half a byte a value each) and the result in the compute dtype, scaled in place (no
    int64 temporaries, no scale expanded to the row)."""
    compute = torch.float64 if dtype == torch.float64 else torch.float32
    group = int4_group_of(codes, scales)
    *lead, rows, half = codes.shape
    codes = codes.view(torch.uint8) if codes.dtype != torch.uint8 else codes
    values = torch.empty(*lead, rows, half, 2, dtype=compute, device=codes.device)
    values[..., 0] = codes & 0x0F  # (uint8 nibbles, converted as they are written)
    values[..., 1] = codes >> 4
    values = values.view(*lead, rows, 2 * half)
    values.sub_(INT4_OFFSET)  # exact: small integers
    values.view(*lead, rows, 2 * half // group, group).mul_(scales.to(compute).unsqueeze(-1))
    return values.to(dtype)


def quantize_int4(w: torch.Tensor, group: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int4 quantization of w [..., R, C] by groups of `group` values of a row, the rule of
    GPTQ's quantizer with `sym: true` without its error correction (round to nearest;
    offload_experts(quantize="int4") and synthetic pools): scale = 2 amax / 15 (the group's 16
    levels spread over [-amax, amax]), q = clamp(round(w / scale), -8, 7) (ties to even; amax itself
    rounds to 8 and is clamped to 7, as GPTQ clamps it). The scale is kept as a float16 value in
    float32, as checkpoints' float16 scales read (so every dequantized value is exact in float32),
    rounded up where float16 would round it down (its subnormals included), so that no value
    rounds past -8 or 7 + 1/2; an all-zero group gets scale 1. Returns (codes [..., R, C/2] uint8,
    scales [..., R, C/group] float32). Refuses inf, NaN and weights a float16 scale cannot reach
    (|w| > 7.5 x 65504)."""
    *lead, rows, cols = w.shape
    if group <= 0 or cols % group or group % 2:
        raise ValueError(f"int4 groups of {group} values do not divide rows of {cols} values")
    groups = w.to(torch.float32, copy=True).reshape(*lead, rows, cols // group, group)  # (changed in place below)
    # max |w| of each group from its extremes (NaN where a group holds one, inf where it holds inf),
    # without an |w| temporary of w's size: a third of the quantizer's time on 2 cores.
    low, high = torch.aminmax(groups, dim=-1)
    amax = torch.maximum(high, low.neg())
    levels = 2 * INT4_OFFSET - 1  # 15 steps between -amax and amax
    if w.device.type != "meta" and amax.numel():
        largest = float(amax.max())
        if not math.isfinite(largest) or bool(amax.isnan().any()):
            raise NonFiniteWeights("quantize_int4: the weights hold inf or NaN, which int4 cannot represent")
        if 2 * largest / levels > 65504.0:
            raise ValueError(f"quantize_int4: a weight of magnitude {largest:.4g} is beyond what int4 with a float16 "
                             f"scale reaches ({levels / 2:g} x 65504)")
    # (floored at float16's smallest subnormal: 2 amax / 15 of a float32-subnormal amax is 0)
    exact = torch.where(amax > 0, (2 * amax / levels).clamp_min(2.0 ** -24), torch.ones_like(amax))
    half = exact.half()
    up = (half.view(torch.int16) + 1).view(torch.float16)  # the next float16 above (positive values)
    scale = torch.where(half.float() < exact, up, half).float()
    # In place on the float32 copy (one temporary of w's size): round, clamp, offset, then codes.
    q = groups.div_(scale[..., None]).round_().clamp_(-INT4_OFFSET, INT4_MAX).add_(INT4_OFFSET).to(torch.uint8)
    q = q.reshape(*lead, rows, cols)
    return q[..., 0::2] | (q[..., 1::2] << 4), scale

