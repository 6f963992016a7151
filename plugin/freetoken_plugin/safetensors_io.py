"""A minimal safetensors reader that copies a tensor's bytes from the file straight into a
destination tensor (e.g. a slice of the pinned host pool), so no second copy of the experts ever
exists in host memory. It also notices truncated shards before reading them."""
import json
import math
import os
import struct
from dataclasses import dataclass
from typing import Dict, Tuple

import torch

DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64,
          "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
          "BOOL": torch.bool}
# FP8 tensors are read (so a header names them) and then refused where a weight is expected.
for _name, _attr in (("F8_E4M3", "float8_e4m3fn"), ("F8_E5M2", "float8_e5m2"), ("F8_E8M0", "float8_e8m0fnu")):
    if hasattr(torch, _attr):
        DTYPES[_name] = getattr(torch, _attr)
FP8_DTYPES = {t for n, t in DTYPES.items() if n.startswith("F8_")}


class CheckpointError(ValueError):
    """The checkpoint cannot be read as asked (with what is wrong and where)."""


@dataclass(frozen=True)
class Entry:
    path: str
    dtype: torch.dtype
    shape: Tuple[int, ...]
    begin: int  # absolute file offsets
    end: int


MAX_HEADER_BYTES = 100 * 1024 * 1024  # the safetensors format's limit on a header


def read_header(path: str) -> Dict[str, Entry]:
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise CheckpointError(f"{path} is truncated: {size} bytes, too short for a safetensors header")
        (n,) = struct.unpack("<Q", raw)
        if n > MAX_HEADER_BYTES:  # safetensors' own limit: such a length is not a header's
            raise CheckpointError(f"{path} is not a safetensors file (its first 8 bytes give a header of {n} bytes); "
                                  "load_model reads safetensors shards")
        if 8 + n > size:
            raise CheckpointError(f"{path} is truncated: its header needs {8 + n} bytes but the file has {size}")
        try:
            header = json.loads(f.read(n))
        except (UnicodeDecodeError, ValueError):
            header = None
        if not isinstance(header, dict):
            raise CheckpointError(f"{path} is not a safetensors file (its header is not a JSON object); load_model "
                                  "reads safetensors shards")
    entries = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (begin, end) = meta["dtype"], tuple(int(d) for d in meta["shape"]), meta["data_offsets"]
            begin, end = int(begin), int(end)
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"{path} is not a safetensors file (the header's entry for {name} has no dtype, "
                                  "shape and data_offsets); load_model reads safetensors shards") from None
        if dtype not in DTYPES:
            raise CheckpointError(f"{path}: tensor {name} has dtype {dtype}, which load_model does not read; it reads "
                                  f"{', '.join(sorted(DTYPES))} tensors (float checkpoints, block-FP8 in F8_E4M3, "
                                  "GPT-OSS MXFP4 in U8)")
        numel = math.prod(shape)
        if any(d < 0 for d in shape) or begin < 0 or end - begin != numel * DTYPES[dtype].itemsize:
            raise CheckpointError(
                f"{path} has a damaged header: tensor {name} ({dtype}, shape {list(shape)}) is given bytes "
                f"[{begin}, {end}), not the {max(numel, 0) * DTYPES[dtype].itemsize} its shape takes; download or "
                "copy the shard again")
        entry = Entry(path, DTYPES[dtype], shape, 8 + n + begin, 8 + n + end)
        if entry.end > size:
            raise CheckpointError(
                f"{path} is truncated: tensor {name} needs bytes [{entry.begin}, {entry.end}) but the file has {size}; "
                "download or copy the shard again")
        entries[name] = entry
    spans = sorted((e.begin, e.end, name) for name, e in entries.items() if e.end > e.begin)
    for (_, end, first), (begin, _, second) in zip(spans, spans[1:]):
        if begin < end:
            raise CheckpointError(f"{path} has a damaged header: the bytes of tensors {first} and {second} overlap; "
                                  "download or copy the shard again")
    return entries


def check_floating(entry: Entry, name: str) -> None:
    """Refuses a tensor that is not a plain floating-point weight where the model expects one:
    converting an integer (quantized) or FP8 tensor would silently compute another model."""
    if entry.dtype in FP8_DTYPES:
        raise CheckpointError(f"{name} is {entry.dtype} (FP8) in a checkpoint whose config.json has no FP8 "
                              "quantization_config; load_model reads FP8 weights of block-FP8 checkpoints "
                              "(quant_method 'fp8', weight_block_size [128, 128], with weight_scale_inv)")
    if not entry.dtype.is_floating_point:
        raise CheckpointError(f"{name} is {entry.dtype}, where the model expects a floating-point weight "
                              "(float32, bfloat16, float16); load_model reads quantized experts of block-FP8 and "
                              "GPT-OSS MXFP4 checkpoints, as their config.json's quantization_config says")


def read_into(entry: Entry, out: torch.Tensor, name: str = "") -> None:
    """Copies the tensor into `out` (a contiguous CPU tensor of the same shape), reading the file
    straight into out's memory when the dtypes agree, converting through a temporary otherwise."""
    if tuple(out.shape) != entry.shape:
        raise CheckpointError(f"{name or entry.path}: checkpoint shape {entry.shape}, expected {tuple(out.shape)} "
                              "(the shape config.json gives: check its sizes, e.g. hidden_size and the experts' "
                              "intermediate size, against the checkpoint)")
    if out.device.type == "meta":  # a check from the header alone (the loader's dry run): nothing to read
        return
    if out.dtype != entry.dtype or not out.is_contiguous() or out.device.type != "cpu":
        tmp = torch.empty(entry.shape, dtype=entry.dtype)
        read_into(entry, tmp, name)
        out.copy_(tmp)
        return
    buf = out.view(torch.uint8).reshape(-1).numpy() if out.numel() else None
    want = entry.end - entry.begin
    if buf is None or want == 0:
        return
    with open(entry.path, "rb", buffering=0) as f:
        f.seek(entry.begin)
        got = f.readinto(memoryview(buf))
    if got != want:
        raise CheckpointError(f"{entry.path}: read {got} of {want} bytes of {name}; the shard is truncated")


def read_rows_into(entry: Entry, first: int, out: torch.Tensor, name: str = "") -> None:
    """Copies rows [first, first + len(out)) of the tensor's leading dimension into `out` (a
    contiguous CPU tensor of the entry's dtype and row shape), straight from the file."""
    if out.dtype != entry.dtype or tuple(out.shape[1:]) != tuple(entry.shape[1:]) or not out.is_contiguous():
        raise CheckpointError(f"{name or entry.path}: rows of {entry.dtype} {entry.shape[1:]} do not fit "
                              f"{out.dtype} {tuple(out.shape[1:])}")
    if first < 0 or first + out.shape[0] > entry.shape[0]:
        raise CheckpointError(f"{name or entry.path}: rows [{first}, {first + out.shape[0]}) outside {entry.shape[0]}")
    if out.device.type == "meta":  # a check from the header alone: nothing to read
        return
    row_bytes = (entry.end - entry.begin) // max(1, entry.shape[0])
    want = row_bytes * out.shape[0]
    if want == 0:
        return
    buf = out.view(torch.uint8).reshape(-1).numpy()
    with open(entry.path, "rb", buffering=0) as f:
        f.seek(entry.begin + first * row_bytes)
        got = f.readinto(memoryview(buf))
    if got != want:
        raise CheckpointError(f"{entry.path}: read {got} of {want} bytes of {name}; the shard is truncated")


def load_tensor(entry: Entry) -> torch.Tensor:
    if not isinstance(entry, Entry):  # computed from stored tensors (checkpoint_names.ComputedEntry)
        return entry.load()
    out = torch.empty(entry.shape, dtype=entry.dtype)
    read_into(entry, out)
    return out
