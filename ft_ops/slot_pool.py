"""The two memories of an offloaded model: HostPool (the authoritative expert weights, pinned
host memory, [L, E, ...] per bank) and SlotPool (the device cache shared by every MoE layer:
maps, LRU clock and weight banks)."""
import math
from dataclasses import dataclass
from typing import List, Optional

import torch

from .progress import bar, done


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024


@dataclass(frozen=True)
class ExpertShape:
    layers: int
    experts: int
    hidden: int
    intermediate: int
    dtype: torch.dtype
    bias: bool

    @property
    def expert_bytes(self) -> int:
        elems = 3 * self.hidden * self.intermediate
        if self.bias:
            elems += 2 * self.intermediate + self.hidden
        return elems * torch.empty((), dtype=self.dtype).element_size()


class HostPool:
    """Expert weights of every MoE layer in the canonical layout, in (pinned) host memory:
    w13 [L, E, 2I, H] (gate rows, then up rows), w2 [L, E, H, I], optional b13 [L, E, 2I] and
    b2 [L, E, H]. Pinned memory is what lets the device read rows at the link's rate."""

    def __init__(self, w13: torch.Tensor, w2: torch.Tensor, b13: Optional[torch.Tensor] = None,
                 b2: Optional[torch.Tensor] = None):
        if w13.dim() != 4 or w2.dim() != 4:
            raise ValueError(f"w13 must be [L, E, 2I, H] and w2 [L, E, H, I], got {tuple(w13.shape)} and {tuple(w2.shape)}")
        layers, experts, two_i, hidden = w13.shape
        if w2.shape != (layers, experts, hidden, two_i // 2):
            raise ValueError(f"w2 must be {(layers, experts, hidden, two_i // 2)} to match w13, got {tuple(w2.shape)}")
        if (b13 is None) != (b2 is None):
            raise ValueError("pass both b13 and b2, or neither")
        self.w13, self.w2, self.b13, self.b2 = w13, w2, b13, b2
        self.shape = ExpertShape(layers, experts, hidden, two_i // 2, w13.dtype, b13 is not None)
        self.banks = [t for t in (w13, w2, b13, b2) if t is not None]
        # Per-layer views, built once: the decode path asks for them every call.
        self._layer_rows = [[t[layer] for t in self.banks] for layer in range(layers)]
        self._mapped_rows = {}  # device -> per-layer CUDA views of the pinned banks

    @classmethod
    def allocate(cls, shape: ExpertShape, pin: bool = True, progress: bool = False) -> "HostPool":
        """Uninitialized host tensors for `shape`, pinned when `pin` and CUDA is available (pinned
        memory is what the device reads at the link's rate; without CUDA there is nothing to pin)."""
        L, E, H, I = shape.layers, shape.experts, shape.hidden, shape.intermediate
        sizes = [(L, E, 2 * I, H), (L, E, H, I)] + ([(L, E, 2 * I), (L, E, H)] if shape.bias else [])
        pinned = pin and torch.cuda.is_available()
        total = sum(math.prod(s) for s in sizes) * torch.empty((), dtype=shape.dtype).element_size()
        what = f"{'pinned ' if pinned else ''}host pool ({human_bytes(total)})"
        tensors = [torch.empty(size, dtype=shape.dtype, pin_memory=pinned)
                   for size in bar(sizes, f"allocating the {what}", progress, unit="bank")]
        done(f"allocated the {what}", progress)
        return cls(*tensors)

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
    """The device cache: `slots` expert rows shared by every MoE layer, with the maps of
    docs/design.md ("Pool state"), all on `device`."""

    def __init__(self, shape: ExpertShape, slots: int, device):
        if slots < 1:
            raise ValueError(f"the slot pool needs at least one slot, got {slots}")
        self.shape = shape
        self.slots = slots
        self.device = torch.device(device)
        L, E, H, I = shape.layers, shape.experts, shape.hidden, shape.intermediate
        int_opts = dict(dtype=torch.int32, device=self.device)
        self.slot_of = torch.full((L, E), -1, **int_opts)
        self.owner_of = torch.full((slots,), -1, **int_opts)
        self.last_use = torch.zeros(slots, dtype=torch.int64, device=self.device)
        self.clock = torch.zeros(1, dtype=torch.int64, device=self.device)
        opts = dict(dtype=shape.dtype, device=self.device)
        self.w13 = torch.empty(slots, 2 * I, H, **opts)
        self.w2 = torch.empty(slots, H, I, **opts)
        self.b13 = torch.empty(slots, 2 * I, **opts) if shape.bias else None
        self.b2 = torch.empty(slots, H, **opts) if shape.bias else None
        self.state = (self.slot_of, self.owner_of, self.last_use, self.clock)
        self.banks = [t for t in (self.w13, self.w2, self.b13, self.b2) if t is not None]
        # The pool's tensors never move and are mutated in place: static addresses for
        # torch.compile, so CUDA graph trees neither copy them per replay nor refuse to capture
        # their in-place updates.
        for t in (*self.state, *self.banks):
            torch._dynamo.mark_static_address(t)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.banks)

    def invalidate(self) -> None:
        """Forgets every resident expert (e.g. after the host pool changed)."""
        self.slot_of.fill_(-1)
        self.owner_of.fill_(-1)
        self.last_use.zero_()
