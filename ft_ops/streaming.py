"""LayerStreamer, the strategy for long prompts: whole MoE layers stream through two full-layer
regions of the slot pool, so the link (copy stream) and the GPU (compute stream) work at once.

Order, per region: the copy of a layer into a region waits for that region's release event
(recorded on the compute stream after the GEMMs that read the previous layer there); the compute
of a layer waits for its ready event (recorded on the copy stream after its copy). Region r holds
the layers with index % 2 == r. Streamed experts stay registered, so decode can hit them later.
"""
import warnings
from typing import Dict, List, Optional, Tuple

import torch

from . import ops
from ._extension import LIMITS
from .slot_pool import SlotPool, HostPool
from .sm_share import copy_kernel_sms

# The CUDA prefill GEMM (torch._grouped_mm, one group per slot of the bank it is given) takes
# fewer than 1,024 groups; a larger bank is computed window by window (1.2-1.4x the time of one
# window).
GROUPED_GEMM_MAX_SLOTS = LIMITS["grouped_gemm_max_slots"]


def choose_skip_resident(pool: SlotPool) -> bool:
    """Whether streaming should leave experts resident outside the regions where they are.

    With skip_resident the rows are moved by a kernel that reads pinned memory (~8 % below the
    copy engine on an H200); without it, each layer is one copy-engine
    transfer. Skipping pays when the slots outside the regions could hold more than ~8 % of a
    layer, spread over the other layers. Without it every expert of a streamed layer sits in its
    region, so the prefill GEMM reads the region (E slots) instead of the whole pool: on CUDA a
    pool of more than GROUPED_GEMM_MAX_SLOTS slots never skips, so its GEMM sees E groups rather
    than the whole bank in windows. (Whether skipping would pay there, fewer bytes over the link
    against a slower GEMM, has not been measured; with regions such pools reach 0.99 of the link
    bound.)"""
    E, S, L = pool.shape.experts, pool.slots, pool.shape.layers
    if pool.device.type == "cuda" and S > GROUPED_GEMM_MAX_SLOTS:
        return False
    regions = 2 if S >= 2 * E else 1
    others = max(1, L - regions) * E
    return (S - regions * E) / others > 0.08


class LayerStreamer:
    def __init__(self, pool: SlotPool, host: HostPool, skip_resident: Optional[bool] = None):
        E, S = pool.shape.experts, pool.slots
        if S < E:
            raise ValueError(
                f"the slot pool has {S} slots but prefill streams whole layers of {E} experts: "
                f"use at least {E} slots (and {2 * E} to overlap transfer with compute)")
        self.pool, self.host = pool, host
        self.skip_resident = choose_skip_resident(pool) if skip_resident is None else skip_resident
        self.regions = 2 if S >= 2 * E else 1
        if self.regions == 1:
            warnings.warn(
                f"slot pool of {S} slots holds one full layer of {E} experts: prefill streaming "
                f"is serialized (copy, then compute). {2 * E} slots let the next layer stream while "
                f"the current one computes.", stacklevel=3)
        self.on_cuda = pool.device.type == "cuda"
        # SMs the layer copies take beside the GEMMs: the skip_resident kernel's grid (the copy
        # engine takes none); the prefill GEMM leaves them free (ft_ops/sm_share.py).
        self.copy_sms = copy_kernel_sms(layer_copy=True) if self.on_cuda and self.skip_resident else 0
        self.copy_stream = torch.cuda.Stream(device=pool.device) if self.on_cuda else None
        # Per region: the event recorded after the last compute that read it.
        self.released: List[Optional[torch.cuda.Event]] = [None] * self.regions
        # Layers whose copy is queued: layer -> (layer map, ready event, rows copied (device)).
        self.in_flight: Dict[int, Tuple[torch.Tensor, Optional[torch.cuda.Event], torch.Tensor]] = {}
        self._region_views: Dict[int, List[Optional[torch.Tensor]]] = {}
        self.event_log: List[tuple] = []  # (kind, layer, region, event) when recording is on
        self.record_events = False
        self._pass_open = False  # a copy of this pass is queued; finish() closes the pass

    def region_of(self, layer: int) -> int:
        return layer % self.regions

    @property
    def layers_in_their_regions(self) -> bool:
        """Without skip_resident, expert e of a streamed layer always sits in slot first_slot + e."""
        return not self.skip_resident

    def region_banks(self, layer: int) -> List[Optional[torch.Tensor]]:
        """w13, w2, b13, b2, w13_scale, w2_scale of the layer's region (views, E slots; None where
        the format has no such bank): indexed by expert id when layers_in_their_regions."""
        region = self.region_of(layer)
        views = self._region_views.get(region)
        if views is None:
            first, E = region * self.pool.shape.experts, self.pool.shape.experts
            pool = self.pool
            views = [None if t is None else t[first:first + E]
                     for t in (pool.w13, pool.w2, pool.b13, pool.b2, pool.w13_scale, pool.w2_scale)]
            self._region_views[region] = views
        return views

    def _start(self, layer: int) -> None:
        """Queues the copy of `layer` into its region, after that region's release."""
        if layer in self.in_flight or not 0 <= layer < self.pool.shape.layers:
            return
        region = self.region_of(layer)
        first_slot = region * self.pool.shape.experts
        if not self.on_cuda:
            layer_map, copied = self._copy(layer, first_slot)
            self.in_flight[layer] = (layer_map, None, copied)
            return
        if not self._pass_open:
            # The pass's first copy: the copy stream waits for everything queued before it on the
            # compute stream (decode GEMMs and admissions that read and write these slots).
            self.copy_stream.wait_stream(torch.cuda.current_stream(self.pool.device))
            self._pass_open = True
        with torch.cuda.stream(self.copy_stream):
            if self.released[region] is not None:
                self.copy_stream.wait_event(self.released[region])
            start = torch.cuda.Event(enable_timing=self.record_events)
            if self.record_events:
                start.record(self.copy_stream)
            layer_map, copied = self._copy(layer, first_slot)
            ready = torch.cuda.Event(enable_timing=self.record_events)
            ready.record(self.copy_stream)
        if self.record_events:
            self.event_log.append(("copy_start", layer, region, start))
            self.event_log.append(("copy_ready", layer, region, ready))
        self.in_flight[layer] = (layer_map, ready, copied)

    def _copy(self, layer: int, first_slot: int) -> Tuple[torch.Tensor, torch.Tensor]:
        """Queues the layer's copy; returns its expert-to-slot map and the rows that cross the link
        (both on the device)."""
        pool, E = self.pool, self.pool.shape.experts
        before = pool.slot_of[layer]
        if self.skip_resident:
            # Rows that stay: resident beyond the regions [0, regions * E), or already in their
            # own slot of this region.
            own = torch.arange(first_slot, first_slot + E, device=pool.device, dtype=torch.int32)
            outside = before >= self.regions * E
            copied = E - (outside | (before == own)).sum()
        else:
            copied = torch.full((), E, device=pool.device, dtype=torch.int64)
        # The other region is overwritten by the next layer while this one computes: this layer's
        # experts that sit there (decode put them there) must move into this region.
        other = (1 - self.region_of(layer)) * E if self.regions == 2 else first_slot
        layer_map = ops.async_layer_copy(*pool.state, pool.banks, self.host.layer_rows(layer), layer,
                                         first_slot, self.skip_resident, other, other + E)
        return layer_map, copied

    def acquire(self, layer: int) -> Tuple[torch.Tensor, torch.Tensor]:
        """The layer's expert-to-slot map, resident for the compute stream, and the rows its copy
        moved over the link; the next layer starts streaming into the other region."""
        self._start(layer)
        if self.regions == 2:
            self._start(layer + 1)
        layer_map, ready, copied = self.in_flight.pop(layer)
        if self.on_cuda:
            compute = torch.cuda.current_stream(self.pool.device)
            compute.wait_event(ready)
            layer_map.record_stream(compute)
            copied.record_stream(compute)
            if self.record_events:
                e = torch.cuda.Event(enable_timing=True)
                e.record(compute)
                self.event_log.append(("compute_start", layer, self.region_of(layer), e))
        return layer_map, copied

    def release(self, layer: int) -> None:
        """Marks the end of the compute that reads `layer`'s region (queued on the compute stream)."""
        if not self.on_cuda:
            return
        event = torch.cuda.Event(enable_timing=self.record_events)
        event.record(torch.cuda.current_stream(self.pool.device))
        self.released[self.region_of(layer)] = event
        if self.record_events:
            self.event_log.append(("release", layer, self.region_of(layer), event))

    def finish(self) -> None:
        """Orders later work on the compute stream after every queued copy (before decode admits
        into the pool) and drops prefetches nobody will use."""
        if self.on_cuda:
            torch.cuda.current_stream(self.pool.device).wait_stream(self.copy_stream)
        self.in_flight.clear()
        self._pass_open = False
