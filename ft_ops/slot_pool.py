"""The two memories of an offloaded model: HostPool (the authoritative expert weights, pinned
host memory, [L, E, ...] per bank) and SlotPool (the device cache shared by every MoE layer:
maps, LRU clock and weight banks)."""
import numbers
import struct
from dataclasses import dataclass
from typing import List, Optional

import torch

from . import formats
from .policies import (DEFAULT_EVICTION, DUEL, DUEL_SCORE, DUEL_WORDS, duel_counters, duel_next, new_policy_state, policy_id,
                       reset_policy_state, streams_stamped)
from .shadow_caches import ShadowCaches
from .progress import bar, done


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024


@dataclass(frozen=True)
class ExpertShape:
    """One pool's experts: L layers of E experts of hidden size H and intermediate size I, in an
    expert format (ft_ops/formats.py) with the model's compute dtype (hidden states, biases);
    gated experts hold gate and up rows (w13 2I rows), ungated ones up rows alone (I)."""
    layers: int
    experts: int
    hidden: int
    intermediate: int
    dtype: torch.dtype
    bias: bool
    format: str = formats.DENSE
    gated: bool = True
    group: int = 0  # int4: values per scale (formats.py); 0 for the other formats

    @property
    def dtype_fixed(self) -> bool:
        """Whether the experts compute in their own dtype only (bf16/float32 experts, and quantized
        ones' biases), rather than in the hidden states' (quantized experts without biases)."""
        return self.format == formats.DENSE or self.bias

    @property
    def bank_specs(self) -> List[formats.BankSpec]:
        return formats.bank_specs(self.format, self.hidden, self.intermediate, self.dtype, self.bias, self.gated,
                                  self.group)

    @property
    def flops_per_pair(self) -> int:
        """Multiply-adds times two of one routed pair: 2 H (w13's rows + I), 6 H I when gated."""
        return 2 * self.hidden * ((2 if self.gated else 1) + 1) * self.intermediate

    @property
    def expert_bytes(self) -> int:
        """Bytes of one expert in this format: what a slot holds and a copy moves."""
        return formats.expert_bytes(self.format, self.hidden, self.intermediate, self.dtype, self.bias, self.gated,
                                    self.group)


def _host_tensor(size, dtype: torch.dtype, pinned: bool) -> torch.Tensor:
    """Uninitialized host memory; pinned, it takes exactly its size (torch's pinned allocator
    rounds each block up to a power of two: a 36 GiB bank would take 64 GiB)."""
    if not pinned:
        return torch.empty(size, dtype=dtype)
    from . import _C

    return _C.pinned_empty(list(size), dtype)


class HostPool:
    """Expert weights of every MoE layer in (pinned) host memory, one tensor [L, E, ...] per bank of
    the format (ft_ops/formats.py): w13 [L, E, 2I, H] (gate rows, then up rows; [L, E, I, H], the up
    rows alone, for ungated experts), w2 [L, E, H, I], optional b13 [L, E, 2I] (or I) and b2
    [L, E, H], and for the quantized formats w13_scale and w2_scale. Pinned memory is what lets the
    device read rows at the link's rate.

    The format follows from w13's dtype: float8_e4m3fn (FP8: block scales [L, E, rows/128, cols/128],
    or row scales [L, E, rows], fp8_rows) and uint8 (two 4-bit values a byte: MXFP4 with uint8 e8m0
    scales, int4 with float32 group scales [L, E, rows, cols/G]) weights need their scales, and
    `dtype` (the compute dtype; default: the biases', else bfloat16) since the weights do not tell it."""

    def __init__(self, w13: torch.Tensor, w2: torch.Tensor, b13: Optional[torch.Tensor] = None,
                 b2: Optional[torch.Tensor] = None, w13_scale: Optional[torch.Tensor] = None,
                 w2_scale: Optional[torch.Tensor] = None, dtype: Optional[torch.dtype] = None):
        if w13.dim() != 4 or w2.dim() != 4:
            raise ValueError(f"w13 must be [L, E, 2I, H] and w2 [L, E, H, I], got {tuple(w13.shape)} and {tuple(w2.shape)}")
        if w13.dtype != w2.dtype:
            raise ValueError(f"w13 is {w13.dtype} but w2 is {w2.dtype}; both banks hold one format")
        fmt = {formats.FP8_DTYPE: formats.FP8, torch.uint8: formats.MXFP4}.get(w13.dtype, formats.DENSE)
        if fmt == formats.FP8 and w13_scale is not None and w13_scale.dim() == 3:
            fmt = formats.FP8_ROWS  # one scale a row: [L, E, rows]
        if fmt == formats.MXFP4 and w13_scale is not None and w13_scale.dtype == torch.float32:
            fmt = formats.INT4  # float32 group scales: int4 codes, not e2m1
        pack = 2 if fmt in formats.PACKED_FORMATS else 1  # two 4-bit values a byte
        layers, experts, w13_rows, hidden = *w13.shape[:3], w13.shape[3] * pack
        # w2 gives I; w13 holds 2I rows (gate and up) or I (ungated: the up rows alone).
        inter = w2.shape[3] * pack
        if w2.shape[:3] != (layers, experts, hidden) or w13_rows not in (inter, 2 * inter):
            raise ValueError(f"w2 must be {(layers, experts, hidden, w13_rows // 2 // pack)} to match w13 (or "
                             f"{(layers, experts, hidden, w13_rows // pack)} for ungated experts), got {tuple(w2.shape)}")
        if (b13 is None) != (b2 is None):
            raise ValueError("pass both b13 and b2, or neither")
        if fmt != formats.DENSE:
            if w13_scale is None or w2_scale is None:
                raise ValueError(f"{w13.dtype} experts ({fmt}) need w13_scale and w2_scale")
            dtype = dtype or (b13.dtype if b13 is not None else torch.bfloat16)
        else:
            if w13_scale is not None or w2_scale is not None:
                raise ValueError(f"scales were given but the weights are {w13.dtype}, not float8_e4m3fn")
            if dtype is not None and dtype != w13.dtype:
                raise ValueError(f"dense weights are {w13.dtype}, so the compute dtype is too (got dtype={dtype})")
            if w13.dtype not in (torch.float32, torch.bfloat16, torch.float16):
                raise ValueError(f"expert weights are {w13.dtype}; the pools hold float32, bfloat16 or float16 (or "
                                 "float8_e4m3fn / uint8 MXFP4 blocks with their scales): convert them first, e.g. "
                                 "w13.float()")
            dtype = w13.dtype
        group = 0
        if fmt == formats.INT4:
            group = formats.int4_group_of(w13, w13_scale)
            formats.check_int4_group(group, hidden, inter)
        self.shape = ExpertShape(layers, experts, hidden, inter, dtype, b13 is not None, fmt, gated=w13_rows == 2 * inter,
                                 group=group)
        given = dict(w13=w13, w2=w2, b13=b13, b2=b2, w13_scale=w13_scale, w2_scale=w2_scale)
        for spec in self.shape.bank_specs:
            t = given[spec.name]
            want = (layers, experts, *spec.row_shape)
            if tuple(t.shape) != want or t.dtype != spec.dtype:
                raise ValueError(f"{spec.name} must be {spec.dtype} {list(want)} for this pool, got {t.dtype} {list(t.shape)}")
        self.w13, self.w2, self.b13, self.b2 = w13, w2, b13, b2
        self.w13_scale, self.w2_scale = w13_scale, w2_scale
        self.banks = [given[spec.name] for spec in self.shape.bank_specs]
        # Per-layer views, built once: the admission path asks for them every call.
        self._layer_rows = [[t[layer] for t in self.banks] for layer in range(layers)]
        self._mapped_rows = {}  # device -> per-layer CUDA views of the pinned banks

    @classmethod
    def allocate(cls, shape: ExpertShape, pin: bool = True, progress: bool = False) -> "HostPool":
        """Uninitialized host tensors for `shape`, pinned when `pin` and CUDA is available (pinned
        memory is what the device reads at the link's rate; without CUDA there is nothing to pin)."""
        pinned = pin and torch.cuda.is_available()
        total = shape.expert_bytes * shape.layers * shape.experts
        what = f"{'pinned ' if pinned else ''}host pool ({human_bytes(total)})"
        tensors = {spec.name: _host_tensor((shape.layers, shape.experts, *spec.row_shape), spec.dtype, pinned)
                   for spec in bar(shape.bank_specs, f"allocating the {what}", progress, unit="bank")}
        done(f"allocated the {what}", progress)
        return cls(**tensors, dtype=shape.dtype)

    def layer_rows(self, layer: int) -> List[torch.Tensor]:
        """One layer's host rows per bank, in the order of SlotPool.banks."""
        return self._layer_rows[layer]

    def device_layer_rows(self, layer: int, device: torch.device) -> List[torch.Tensor]:
        """One layer's rows as CUDA tensors that alias the pinned host memory (ft_ops._C.mapped_view):
        the copy kernels read them over the link exactly like the pinned rows, and a compiled graph
        sees only CUDA tensors, so CUDA graph trees do not skip it for a CPU input. Marked as static
        addresses: they never move, so CUDA graphs need not copy them."""
        rows = self._mapped_rows.get(device)
        if rows is None:
            if not self.is_pinned:
                raise ValueError("the host pool must be pinned for a CUDA slot pool to read it "
                                 "(HostPool.allocate(..., pin=True) or tensor.pin_memory())")
            from . import _C

            index = device.index if device.index is not None else torch.cuda.current_device()
            mapped = [_C.mapped_view(t, index) for t in self.banks]
            rows = [[t[layer] for t in mapped] for layer in range(self.shape.layers)]
            for views in rows:
                for v in views:
                    torch._dynamo.mark_static_address(v)
            self._mapped_rows[device] = rows
        return rows[layer]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.banks)

    @property
    def is_pinned(self) -> bool:
        return all(t.is_pinned() for t in self.banks)


class SlotPool:
    """The device cache: `slots` expert rows shared by every MoE layer, in the host pool's format,
    with the maps of docs/design.md ("Pool state"), all on `device`. `eviction` names the policy
    every admission and layer copy of this pool applies (ft_ops/policies.py). `admits=False` (a
    runtime whose calls admit no expert: fetch_fraction 0) keeps no Duel shadows, as no call of it
    takes a victim."""

    def __init__(self, shape: ExpertShape, slots: int, device, eviction: str = DEFAULT_EVICTION, admits: bool = True):
        self.policy = policy_id(eviction)
        if isinstance(slots, bool) or not isinstance(slots, numbers.Integral):
            raise TypeError(f"slots must be a whole number of expert slots (an int), got {slots!r}")
        slots = int(slots)
        if slots < 1:
            raise ValueError(f"the slot pool needs at least one slot, got {slots}")
        try:
            device = torch.device(device)
        except (RuntimeError, TypeError):
            raise ValueError(f"device {device!r} is not a device torch knows; use 'cpu', 'cuda' or 'cuda:N'") from None
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"device {device}: this torch ({torch.__version__}) has no usable CUDA; use device='cpu' "
                             "or a CUDA build of torch on a machine with a GPU")
        from ._extension import LIMITS

        if slots > LIMITS["max_slots"]:
            raise ValueError(f"a slot pool of {slots} slots is more than dedup_and_admit serves "
                             f"({LIMITS['max_slots']}); use fewer, larger experts per slot or a smaller cache")
        self.shape = shape
        self.slots = slots
        self.device = torch.device(device)
        self.generation = 0  # bumped by invalidate()
        L, E = shape.layers, shape.experts
        int_opts = dict(dtype=torch.int32, device=self.device)
        self.slot_of = torch.full((L, E), -1, **int_opts)
        self.owner_of = torch.full((slots,), -1, **int_opts)
        self.last_use = torch.zeros(slots, dtype=torch.int64, device=self.device)
        # Under "opportunity" and "hitdensity" the stamp 1 marks streamed rows, so no call may
        # stamp 1: the clock starts there and the first call stamps 2.
        self.clock = torch.full((1,), 1 if streams_stamped(self.policy) else 0, dtype=torch.int64, device=self.device)
        # "hitdensity" keeps per (layer, expert) pair what it learned of its reuse, across evictions.
        self.policy_state = new_policy_state(self.policy, L, E, slots, self.device)
        # "duel" keys by what two shadow caches of the pool's size would have hit; a pool that holds
        # every expert never evicts, nor one that admits nothing, so they keep none (the score stays 0).
        self.shadows = (ShadowCaches(L, E, slots, self.device, self.policy_state)
                        if self.policy == DUEL and slots < L * E and admits else None)
        bank = {spec.name: torch.empty((slots, *spec.row_shape), dtype=spec.dtype, device=self.device)
                for spec in shape.bank_specs}
        self.w13, self.w2 = bank["w13"], bank["w2"]
        self.b13, self.b2 = bank.get("b13"), bank.get("b2")
        self.w13_scale, self.w2_scale = bank.get("w13_scale"), bank.get("w2_scale")
        self.state = (self.slot_of, self.owner_of, self.last_use, self.clock)
        self.banks = [bank[spec.name] for spec in shape.bank_specs]  # the host pool's order
        # The pool's tensors never move and are mutated in place: static addresses for
        # torch.compile, so CUDA graph trees neither copy them per replay nor refuse to capture
        # their in-place updates.
        shadow_tensors = (*self.shadows.tensors, self.shadows.unadmittable) if self.shadows is not None else ()
        for t in (*self.state, *self.banks, *([self.policy_state] if self.policy_state is not None else []),
                  *shadow_tensors):
            torch._dynamo.mark_static_address(t)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.banks)

    def invalidate(self) -> None:
        """Forgets every resident expert (e.g. after the host pool changed), hit density's history
        of each pair and Duel's shadows and score. A streamed pass opened before (its first copies
        queued) is not used after this (LayerStreamer.opened_and_unused)."""
        self.generation += 1
        self.slot_of.fill_(-1)
        self.owner_of.fill_(-1)
        self.last_use.zero_()
        reset_policy_state(self.policy_state, self.shape.layers, self.shape.experts, self.slots)
        if self.shadows is not None:
            self.shadows.reset()

    def duel_summary(self) -> Optional[dict]:
        """Under "duel" (None otherwise): the score, which keys the next admission call takes, and
        the shadows' calls and hit rates (reads the device: a host sync)."""
        if self.policy != DUEL:
            return None
        words, lru_keys = duel_next(self.policy_state[-DUEL_WORDS:].tolist())
        lru, density = duel_counters(words)

        unadmittable = int(self.shadows.unadmittable) if self.shadows is not None else 0

        def rate(counters):  # hits: distinct less admitted, less the misses no slot could take
            return round((counters[2] - counters[3] - unadmittable) / counters[2], 4) if counters[2] else None

        return dict(score=struct.unpack("<d", struct.pack("<q", words[DUEL_SCORE]))[0],
                    next_keys="lru" if lru_keys else "hitdensity", shadow_calls=lru[0],
                    lru_shadow_hit_rate=rate(lru), hitdensity_shadow_hit_rate=rate(density))

    def shadows_of_call(self, expert_ids: torch.Tensor):
        """dedup_and_admit's `shadows` for a call of this pool: under "duel" its shadow caches, which
        replay the call (None under the other policies, or for a call that routes no id, which the
        offline model does not count either)."""
        if self.shadows is None or expert_ids.numel() == 0:
            return None
        return self.shadows.tensors

    def after_admission(self, expert_ids: torch.Tensor) -> None:
        """Called after each dedup_and_admit of this pool that passed shadows_of_call's shadows:
        the misses of a call of more distinct experts than slots that no shadow could take."""
        if self.shadows is not None and expert_ids.numel() > 0:
            self.shadows.count_unadmittable(expert_ids)
