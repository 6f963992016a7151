"""What load_model reads of int4 (W4A16, symmetric) checkpoints, and how their linears' tensors
become int4 pool rows or dequantized weights.

Two families, each checked from config.json before anything is read:

- compressed-tensors "pack-quantized" (llm-compressor's W4A16 scheme; Kimi-K2-Thinking's INT4
  experts): per Linear `weight_packed` int32 [out, in/8], element j of a word in bits 4j..4j+3 as
  the unsigned code q + 8 (compressed_tensors' pack_to_int32: `(value + offset)`, `reshaped <<
  bit_shifts` with shifts 0, 4, ..., 28); `weight_scale` [out, ceil(in/G)] (or [out, 1]: the
  "channel" strategy) in the model's dtype (or float32); `weight_shape` int [2] = (out, in).
  Symmetric schemes store no zero point. Read as little-endian bytes, a word's byte b holds elements 2b (low nibble) and 2b + 1
  (high): the int4 pool's layout already, so the codes are copied as they are.
- GPTQ (quant_method "gptq", AutoGPTQ's and GPTQModel's packing): per Linear `qweight` int32
  [in/8, out], packed along the input dimension (qweight[r, o] holds inputs 8r + j of output o in
  bits 4j), `scales` float16 [ceil(in/G), out], `qzeros` int32 [ceil(in/G), out/8] (packed along
  the output),
  `g_idx` int32 [in] (the group of each input), w = scale * (q - zero). AutoGPTQ's format (v1,
  checkpoint_format "gptq") stores zero - 1, so a symmetric 4-bit checkpoint's every zero is 7 and
  means 8; GPTQModel's "gptq_v2" stores 8. Either way w = scale * (q - 8), the pool's code - 8:
  each expert's qweight is a permutation of bytes away from the pool's [out, in/2] rows (byte b of
  qweight[r, o] holds inputs 8r + 2b, 8r + 2b + 1: the pool's byte 4r + b of row o).

The loader puts every int4 linear under its weight's name as an Int4Entry (merge_entries): the
non-expert linears then load through load_tensor (dequantized to float32, then the compute dtype),
the experts' fill (expert_reading.fill_int4_layer) copies their codes and scales into the pool.

Group sizes: G comes from config.json (GPTQ's group_size, -1 meaning a row; compressed-tensors'
groups' group_size, or a row for strategy "channel"). Both families write ceil(in/G) scales a row,
the last group short where G does not divide in; a linear's scales must number that. A non-expert
linear dequantizes with its short last group; the int4 pool holds whole groups only, so an expert
whose input size is not a multiple of its G (nor below it: one group a row) is refused."""
import math
import re
import sys
from typing import Dict, List, Optional, Tuple

import torch

from ft_ops import formats

from .fp8_scales import check_finite_scales
from .safetensors_io import CheckpointError, Entry, load_tensor, read_into

CT, GPTQ = "compressed-tensors", "gptq"
_CT_PARTS = ("weight_packed", "weight_scale", "weight_shape")
_GPTQ_PARTS = ("qweight", "scales", "qzeros", "g_idx")
_GPTQ_ZEROS = {"gptq": 7, "gptq_v2": 8}  # the symmetric 4-bit zero point as each checkpoint_format stores it
READ_CT = ("load_model reads compressed-tensors FP8 weights ('float-quantized', 'naive-quantized') and int4 weights "
           "(format 'pack-quantized': 4-bit int, symmetric, strategy 'group' with a group size that is a multiple of "
           "32, or 'channel'; activations unquantized)")
READ_GPTQ = ("load_model reads GPTQ checkpoints with bits 4, sym true, desc_act false and a group_size that is a "
             "multiple of 32 (or -1), and per-module 'dynamic' entries that skip modules ('-:') or leave those "
             "four settings as they are")
_GPTQ_FORMAT_KEYS = ("bits", "group_size", "sym", "desc_act")  # what a positive dynamic entry may not change


class Int4Scheme:
    """An int4 checkpoint's scheme: its family (CT or GPTQ), the group sizes its quantization_config
    names (0: a row, GPTQ's -1 or compressed-tensors' "channel") and, for GPTQ, the zero point its
    qzeros hold (7: AutoGPTQ's v1, 8: gptq_v2)."""

    def __init__(self, family: str, zero: Optional[int] = None, groups: Tuple[int, ...] = ()):
        self.family, self.zero, self.groups = family, zero, tuple(sorted(set(groups)))

    def group_of(self, inp: int, count: int) -> List[int]:
        """The group sizes (each at most `inp`: a G of a row or more is one group of the row) of the
        config's that give a row of `inp` values `count` scales (ceil(inp / G))."""
        return sorted({min(g or inp, inp) for g in self.groups if -(-inp // (g or inp)) == count})


def _word(nibble: int) -> int:
    """The int32 whose eight nibbles are all `nibble` (as torch reads it)."""
    value = sum(nibble << (4 * j) for j in range(8))
    return value - (1 << 32) if value >= 1 << 31 else value


def describes_ct_int4(quant: dict) -> bool:
    """Whether a compressed-tensors quantization_config stores packed integer weights (any group,
    or the top level, in format 'pack-quantized'): read as int4, or refused by int4's checks."""
    groups = quant.get("config_groups")
    stored = [quant.get("format")]
    if isinstance(groups, dict):
        stored += [g.get("format") for g in groups.values() if isinstance(g, dict)]
    return "pack-quantized" in stored


def ct_scheme(path: str, quant: dict) -> Int4Scheme:
    """The int4 scheme of a compressed-tensors 'pack-quantized' quantization_config, checked:
    raises CheckpointError in one line, naming what it does not read, for anything but symmetric
    4-bit integer weights by groups (a multiple of 32 values) or rows, stored packed, without
    activation quantization, act-order groups or transforms."""
    def refuse(what: str) -> CheckpointError:
        return CheckpointError(f"{path}: config.json's compressed-tensors quantization_config {what}; {READ_CT}")

    status = quant.get("quantization_status", "compressed")
    if status != "compressed":
        raise refuse(f"has quantization_status {status!r} (its weights are not stored compressed)")
    for key in ("kv_cache_scheme", "sparsity_config", "moe_sparsity_config", "transform_config"):
        if quant.get(key):
            raise refuse(f"has a {key}, which load_model does not apply")
    groups = quant.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise refuse("has no config_groups")
    sizes = []
    for name, group in groups.items():
        if not isinstance(group, dict):
            raise refuse(f"group {name!r} is not an object")
        weights = group.get("weights")
        if not isinstance(weights, dict):
            raise refuse(f"group {name!r} has no weights scheme (only activations quantized)")
        fmt = group.get("format") or quant.get("format")
        bits, kind = weights.get("num_bits"), weights.get("type")
        if fmt != "pack-quantized" or kind != "int" or bits != 4:
            raise refuse(f"group {name!r} has {bits}-bit {kind} weights in format {fmt!r} (int4 weights are 4-bit "
                         "int, stored 'pack-quantized'; a checkpoint's groups must all be int4)")
        if weights.get("symmetric", True) is not True:
            raise refuse(f"group {name!r} has asymmetric weights (zero points)")
        if weights.get("dynamic", False):
            raise refuse(f"group {name!r} has dynamic weight scales (computed at run time, not stored)")
        actorder = weights.get("actorder")
        if actorder not in (None, False, "weight", "static"):
            raise refuse(f"group {name!r} has actorder {actorder!r} (groups in activation order: weight_g_idx)")
        strategy = weights.get("strategy")
        if strategy == "group":
            size = weights.get("group_size")
            if not isinstance(size, int) or isinstance(size, bool) or size <= 0 or size % 32:
                raise refuse(f"group {name!r} has group_size {size!r}, which the int4 pool cannot take (a positive "
                             "multiple of 32)")
            sizes.append(size)
        elif strategy == "channel":
            sizes.append(0)
        else:
            raise refuse(f"group {name!r} has weight strategy {strategy!r}")
        for key in ("input_activations", "output_activations"):
            if group.get(key) is not None:
                raise refuse(f"group {name!r} quantizes its {key} (W4A16 leaves activations unquantized)")
    return Int4Scheme(CT, groups=sizes)


def gptq_scheme(path: str, quant: dict) -> Int4Scheme:
    """The scheme of a GPTQ quantization_config, checked: symmetric 4-bit, groups in order (desc_act
    false), a group size the int4 pool takes, AutoGPTQ's or gptq_v2's int32 packing; else one line.
    GPTQModel's per-module `dynamic` entries (regexes on module names, the first match applying):
    "-:" ones skip their modules, which are stored float (the per-tensor checks tell those from
    int4 linears); positive ones ("+:" or bare) load where they keep bits, group_size, sym and
    desc_act as the config has them, and are refused, named, where they change one."""
    def refuse(what: str) -> CheckpointError:
        return CheckpointError(f"{path}: config.json's GPTQ quantization_config {what}; {READ_GPTQ}")

    bits = quant.get("bits")
    if bits != 4:
        raise refuse(f"has bits {bits!r} (the int4 pool holds 4-bit weights)")
    if quant.get("sym", True) is not True:
        raise refuse("has sym false: asymmetric weights (zero points other than 8)")
    if quant.get("desc_act", False):
        raise refuse("has desc_act true: act-order groups (g_idx), which the int4 pool does not hold")
    size = quant.get("group_size", 128)
    if not isinstance(size, int) or isinstance(size, bool) or (size != -1 and (size <= 0 or size % 32)):
        raise refuse(f"has group_size {size!r}, which the int4 pool cannot take (a positive multiple of 32, or -1)")
    fmt = quant.get("checkpoint_format", quant.get("format", "gptq"))
    if fmt not in _GPTQ_ZEROS:
        raise refuse(f"has checkpoint_format {fmt!r} (load_model reads 'gptq' and 'gptq_v2')")
    if quant.get("pack_dtype", "int32") not in ("int32", "torch.int32"):
        raise refuse(f"has pack_dtype {quant.get('pack_dtype')!r} (load_model reads int32 words)")
    dynamic = quant.get("dynamic") or {}
    if not isinstance(dynamic, dict):
        raise refuse(f"has dynamic {dynamic!r}, not an object of per-module entries")
    base = {"bits": bits, "group_size": size, "sym": quant.get("sym", True), "desc_act": quant.get("desc_act", False)}
    for pattern, overrides in dynamic.items():
        try:  # (the per-tensor checks, not the patterns, tell int4 linears from float ones)
            re.compile(pattern.removeprefix("-:").removeprefix("+:"))
        except (re.error, AttributeError) as error:
            raise refuse(f"has dynamic entry {pattern!r}, which is not a regular expression ({error})") from None
        if pattern.startswith("-:"):  # skipped modules: stored float
            continue
        if not isinstance(overrides, dict):
            raise refuse(f"has dynamic entry {pattern!r} whose overrides {overrides!r} are not an object")
        changed = [k for k in _GPTQ_FORMAT_KEYS if k in overrides and overrides[k] != base[k]]
        if changed:
            said = ", ".join(f"{k} {overrides[k]!r} (not {base[k]!r})" for k in changed)
            raise refuse(f"has dynamic entry {pattern!r} overriding {said}: per-module quantization that load_model "
                         "does not read")
    return Int4Scheme(GPTQ, _GPTQ_ZEROS[fmt], (0 if size == -1 else size,))


class Int4Entry:
    """One linear's int4 weight as the checkpoint stores it (`parts`: its tensors' entries by
    suffix), standing under the weight's name: shape (out, in) and dtype (its scales') as the
    model's weight; load() dequantizes it (float32), codes_into / scales_into fill int4 pool rows."""

    def __init__(self, scheme: Int4Scheme, name: str, parts: Dict[str, Entry]):
        self.scheme, self.name, self.parts = scheme, name, parts
        if scheme.family == CT:
            packed, scale = parts["weight_packed"], parts["weight_scale"]
            self._need(packed.dtype == torch.int32 and len(packed.shape) == 2, "weight_packed",
                       "int32 [out, in/8]")
            out, inp = packed.shape[0], 8 * packed.shape[1]
            self._need(scale.dtype.is_floating_point and len(scale.shape) == 2 and scale.shape[0] == out
                       and scale.shape[1] > 0, "weight_scale", f"floating point [{out}, ceil(in/G)] (in = {inp})")
            shape = parts["weight_shape"]
            self._need(shape.dtype in (torch.int32, torch.int64) and tuple(shape.shape) == (2,), "weight_shape",
                       "int [2]")
            groups = scale.shape[1]
        else:
            qweight, scale = parts["qweight"], parts["scales"]
            self._need(qweight.dtype == torch.int32 and len(qweight.shape) == 2, "qweight", "int32 [in/8, out]")
            inp, out = 8 * qweight.shape[0], qweight.shape[1]
            self._need(scale.dtype.is_floating_point and len(scale.shape) == 2 and scale.shape[1] == out
                       and scale.shape[0] > 0, "scales", f"floating point [ceil(in/G), {out}] (in = {inp})")
            groups = scale.shape[0]
            zeros = parts.get("qzeros")
            self._need(zeros is not None and zeros.dtype == torch.int32 and out % 8 == 0
                       and tuple(zeros.shape) == (groups, out // 8), "qzeros",
                       f"int32 [{groups}, {out // 8}] (scales {list(scale.shape)}: {groups} groups of {out} outputs)")
            g_idx = parts.get("g_idx")
            if g_idx is not None:
                self._need(g_idx.dtype in (torch.int32, torch.int64) and tuple(g_idx.shape) == (inp,), "g_idx",
                           f"int [{inp}] (qweight {list(qweight.shape)}: {inp} inputs, 8 a row)")
        self.shape, self.dtype, self.path = (out, inp), scale.dtype, parts[_CT_PARTS[0] if scheme.family == CT
                                                                          else _GPTQ_PARTS[0]].path
        # G from the config: the scales number ceil(in / G), the last group short where G does not divide in
        sizes = scheme.group_of(inp, groups)
        said = ", ".join("a row" if g == 0 else str(g) for g in scheme.groups)
        self._need(len(sizes) > 0, self.scale_part, f"{self._scale_shape(out, 'ceil(in/G)')} for in = {inp} and the "
                   f"group sizes config.json's quantization_config gives ({said})")
        if len(sizes) > 1:
            raise CheckpointError(f"{self.stem}{self.scale_part} holds {groups} scales a row of {inp} values, which "
                                  f"the quantization_config's group sizes {sizes[0]} and {sizes[1]} both give: "
                                  "load_model cannot tell which groups they scale")
        self.group = sizes[0]  # (at most in: a G of a row or more is one group of the row)

    def _need(self, ok: bool, part: str, what: str) -> None:
        if not ok:
            entry = self.parts.get(part)
            held = f"{entry.dtype} {list(entry.shape)}" if entry is not None else "missing"
            raise CheckpointError(f"{self.stem}{part} is {held}, expected {what} ({self.scheme.family} int4)")

    @property
    def stem(self) -> str:
        return self.name[:-len("weight")]

    @property
    def scale_part(self) -> str:
        return "weight_scale" if self.scheme.family == CT else "scales"

    def _scale_shape(self, out: int, groups: str) -> str:
        return f"floating point [{out}, {groups}]" if self.scheme.family == CT else f"floating point [{groups}, {out}]"

    def check_whole_groups(self) -> None:
        """Refuses (one line) a linear whose input size its group size does not divide: its last
        group is short, and the int4 pool holds whole groups (experts; other linears dequantize)."""
        inp = self.shape[1]
        if inp % self.group:
            raise CheckpointError(f"{self.stem}{self.scale_part} groups rows of {inp} values by {self.group}, the last "
                                  f"group short ({inp % self.group} values): the int4 pool holds whole groups, so "
                                  "load_model reads int4 experts whose input sizes (the hidden and the experts' "
                                  "intermediate size) are multiples of their group size")

    def check_scales_finite(self) -> None:
        """Refuses scales with an inf or NaN, read (the scales alone: about 1/G of the codes' bytes
        as 16-bit values) in one pass without temporaries: their min and max (NaN propagates)."""
        scale = self._stored_scales()
        low, high = torch.aminmax(scale)
        if not (math.isfinite(float(low)) and math.isfinite(float(high))):
            check_finite_scales(scale, f"{self.stem}{self.scale_part}")

    def check_values(self) -> None:
        """What the small tensors hold, read (a few bytes a linear): compressed-tensors' weight_shape
        is (out, in); GPTQ's zero points are the symmetric one of its checkpoint_format and its
        g_idx is each input's group in order (i // G)."""
        out, inp = self.shape
        if self.scheme.family == CT:
            stored = [int(v) for v in load_tensor(self.parts["weight_shape"])]
            if stored != [out, inp]:
                raise CheckpointError(f"{self.stem}weight_shape is {stored}, but weight_packed holds [{out}, {inp}]: "
                                      "load_model reads int4 weights whose input size is a multiple of 8 (no padding)")
            return
        zeros = load_tensor(self.parts["qzeros"])
        want = _word(self.scheme.zero)
        if not bool((zeros == want).all()):
            bad = zeros[zeros != want][0].item() & 0xFFFFFFFF
            other = {_word(z) & 0xFFFFFFFF: f for f, z in _GPTQ_ZEROS.items() if z != self.scheme.zero}
            hint = (f" (the zeros of checkpoint_format {other[bad]!r}: set it in config.json's quantization_config)"
                    if bad in other else " (an asymmetric checkpoint)")
            raise CheckpointError(f"{self.stem}qzeros holds zero points 0x{bad:08x}, not the symmetric "
                                  f"{self.scheme.zero} of every nibble (0x{_word(self.scheme.zero) & 0xFFFFFFFF:08x}) "
                                  f"that sym true in checkpoint_format "
                                  f"{'gptq_v2' if self.scheme.zero == 8 else 'gptq'} stores{hint}; {READ_GPTQ}")
        if "g_idx" in self.parts:
            g_idx = load_tensor(self.parts["g_idx"])
            if not torch.equal(g_idx.long(), torch.arange(inp) // self.group):
                raise CheckpointError(f"{self.stem}g_idx is not each input's group in order (i // {self.group}): "
                                      f"act-order groups, which the int4 pool does not hold; {READ_GPTQ}")

    def codes_into(self, out: torch.Tensor) -> None:
        """The codes into `out` (uint8 [out, in/2], the pool's layout: two codes a byte, the low
        nibble the even input; a contiguous row block of the pool, or meta: shapes only)."""
        rows, inp = self.shape
        if tuple(out.shape) != (rows, inp // 2):
            raise CheckpointError(f"{self.name} is int4 [{rows}, {inp}], expected [{out.shape[0]}, {2 * out.shape[1]}] "
                                  "(the shape config.json gives: check its sizes, e.g. hidden_size and the experts' "
                                  "intermediate size, against the checkpoint)")
        if out.device.type == "meta":
            return
        if sys.byteorder != "little":  # (the int32 words' bytes are read as the pool's)
            raise CheckpointError("load_model reads int4 checkpoints on little-endian hosts")
        if self.scheme.family == CT:  # the bytes of the words are the pool's bytes
            read_into(self.parts["weight_packed"], out.view(torch.int32), f"{self.stem}weight_packed")
            return
        # GPTQ: qweight [in/8, out] as bytes [in/8, out, 4] -> the pool's [out, in/8, 4]: one
        # linear's codes at a time, moved whole bytes (a byte's two inputs are adjacent in both).
        qweight = load_tensor(self.parts["qweight"]).view(torch.uint8).view(inp // 8, rows, 4)
        out.view(rows, inp // 8, 4).copy_(qweight.permute(1, 0, 2))

    def scales_into(self, out: torch.Tensor) -> None:
        """The scales into `out` (float32 [out, in/G'] for a pool group G' dividing this linear's
        G: each scale repeated G / G' times, exact), refused where not finite."""
        rows, inp = self.shape
        cols = out.shape[-1]
        self.check_whole_groups()
        if out.shape[0] != rows or cols == 0 or inp % cols or self.group % (inp // cols):
            raise CheckpointError(f"{self.stem}{self.scale_part} groups {self.group} values, which the pool's groups "
                                  f"of {inp // max(cols, 1)} do not divide: load_model reads checkpoints whose experts "
                                  "all share one group size")
        if out.device.type == "meta":
            return
        scale = self._scales()
        out.copy_(scale.repeat_interleave(self.group // (inp // cols), dim=1))
        check_finite_scales(out, f"{self.stem}{self.scale_part}")

    def _stored_scales(self) -> torch.Tensor:
        """The scales as stored: [out, ceil(in/G)] (compressed-tensors) or [ceil(in/G), out] (GPTQ)."""
        return load_tensor(self.parts[self.scale_part])

    def _scales(self) -> torch.Tensor:
        """float32 [out, ceil(in/G)]: the stored values (float16, bfloat16 and float32 all convert
        exactly)."""
        if self.scheme.family == CT:
            return self._stored_scales().float()
        return self._stored_scales().float().T.contiguous()

    def load(self) -> torch.Tensor:
        """The weight it means, float32 [out, in]: (code - 8) * its group's scale, the last group
        short where G does not divide in (formats.dequantize_int4: exact for 16-bit scales, rounded
        once for float32 ones)."""
        rows, inp = self.shape
        codes = torch.empty(rows, inp // 2, dtype=torch.uint8)
        self.codes_into(codes)
        scales = self._scales()
        check_finite_scales(scales, f"{self.stem}{self.scale_part}")
        whole = inp // self.group * self.group
        if whole == inp:
            return formats.dequantize_int4(codes, scales)
        weight = torch.empty(rows, inp, dtype=torch.float32)  # whole groups, then the short one
        weight[:, :whole] = formats.dequantize_int4(codes[:, :whole // 2], scales[:, :-1])
        weight[:, whole:] = formats.dequantize_int4(codes[:, whole // 2:], scales[:, -1:])
        return weight


_FOREIGN = {CT: (".weight_zero_point", ".weight_g_idx", ".input_scale", ".input_zero_point", ".output_scale",
                 ".output_zero_point", ".weight_global_scale", ".input_global_scale"),
            GPTQ: ()}


def merge_entries(path: str, entries, scheme: Int4Scheme) -> None:
    """Replaces, in `entries` (the shards' tensors by checkpoint name), each int4 linear's tensors
    by one Int4Entry under `<linear>.weight`, their headers checked. Refuses tensors of schemes it
    does not apply (zero points, act-order g_idx, activation scales) by name, and a linear stored
    both as int4 and as a plain weight."""
    names = _CT_PARTS if scheme.family == CT else _GPTQ_PARTS
    read = READ_CT if scheme.family == CT else READ_GPTQ
    for name in entries:
        if name.endswith(_FOREIGN[scheme.family]):
            raise CheckpointError(f"{path}: {name} belongs to a scheme load_model does not apply (zero points, act-order "
                                  f"groups, activation scales); {read}")
    linears: Dict[str, Dict[str, Entry]] = {}
    for name in list(entries):
        stem, _, leaf = name.rpartition(".")
        if leaf in names:
            linears.setdefault(stem, {})[leaf] = entries.pop(name)
    for stem, parts in linears.items():
        weight = f"{stem}.weight"
        missing = [n for n in names[:3] if n not in parts]
        if missing:
            raise CheckpointError(f"{path}: the checkpoint holds {stem}.{sorted(parts)[0]} but lacks {stem}.{missing[0]} "
                                  f"({scheme.family} int4 weights are {', '.join(names[:3])})")
        if weight in entries:
            raise CheckpointError(f"{path}: the checkpoint holds {weight} and also its int4 form ({stem}."
                                  f"{names[0]}): two versions of the same weights; remove one of them")
        entries[weight] = Int4Entry(scheme, weight, parts)


def pool_group(w13: Int4Entry, w2: Int4Entry) -> int:
    """The int4 pool's group size for experts whose first gate (or up) and down projections are
    `w13` and `w2`: their common group (the largest that divides both: a row scale, the channel
    strategy's, is that group's scale repeated). Refuses one whose last group is short."""
    w13.check_whole_groups()
    w2.check_whole_groups()
    return math.gcd(w13.group, w2.group)
