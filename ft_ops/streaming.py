"""LayerStreamer, the strategy for long prompts: whole MoE layers stream through two full-layer
regions of the slot pool, so the link (copy stream) and the GPU (compute stream) work at once.

Order, per region: the copy of a layer into a region waits for that region's release event
(recorded on the compute stream after the GEMMs that read the previous layer there); the compute
of a layer waits for its ready event (recorded on the copy stream after its copy). Region r holds
the layers with index % 2 == r. Expert e of a streamed layer is always in slot first_slot + e, so
the prefill GEMM reads the region (E slots) with the expert ids as slots, whatever the pool's size.

With skip_resident (the default), an expert resident outside the regions is copied device to
device into the region (~4 TB/s) and stays where it is for decode; only the missing rows cross
the link. Which rows those are, the host learns once per pass (one read of the slot map, taken
before the pass's first copy): it tells the copy engine where each row comes from (row_sources),
and the op re-reads from the host any row the maps contradict.
"""
import warnings
from typing import Dict, List, Optional, Tuple

import torch

from . import ops
from .slot_pool import SlotPool, HostPool


class LayerStreamer:
    def __init__(self, pool: SlotPool, host: HostPool, skip_resident: bool = True):
        E, S = pool.shape.experts, pool.slots
        if S < E:
            raise ValueError(
                f"the slot pool has {S} slots but prefill streams whole layers of {E} experts: "
                f"use at least {E} slots (and {2 * E} to overlap transfer with compute)")
        self.pool, self.host = pool, host
        self.skip_resident = skip_resident
        self.regions = 2 if S >= 2 * E else 1
        if self.regions == 1:
            warnings.warn(
                f"slot pool of {S} slots holds one full layer of {E} experts: prefill streaming "
                f"is serialized (copy, then compute). {2 * E} slots let the next layer stream while "
                f"the current one computes.", stacklevel=3)
        self.on_cuda = pool.device.type == "cuda"
        self.copy_stream = torch.cuda.Stream(device=pool.device) if self.on_cuda else None
        # Per region: the event recorded after the last compute that read it.
        self.released: List[Optional[torch.cuda.Event]] = [None] * self.regions
        # Layers whose copy is queued: layer -> (ready event, rows read from the host (device)).
        self.in_flight: Dict[int, Tuple[Optional[torch.cuda.Event], torch.Tensor]] = {}
        self._region_views: Dict[int, List[Optional[torch.Tensor]]] = {}
        self._region_slots: Dict[int, torch.Tensor] = {}
        # The slot map as the host read it at the start of the pass (None: no pass open).
        self._slot_map: Optional[torch.Tensor] = None
        self._pass_open = False
        self.event_log: List[tuple] = []  # (kind, layer, region, event) when recording is on
        self.record_events = False

    def region_of(self, layer: int) -> int:
        return layer % self.regions

    def region_banks(self, layer: int) -> List[Optional[torch.Tensor]]:
        """w13, w2, b13, b2, w13_scale, w2_scale of the layer's region (views, E slots, expert e in
        row e; None where the format has no such bank)."""
        region = self.region_of(layer)
        views = self._region_views.get(region)
        if views is None:
            first, E = region * self.pool.shape.experts, self.pool.shape.experts
            pool = self.pool
            views = [None if t is None else t[first:first + E]
                     for t in (pool.w13, pool.w2, pool.b13, pool.b2, pool.w13_scale, pool.w2_scale)]
            self._region_views[region] = views
        return views

    def region_slots(self, layer: int) -> torch.Tensor:
        """The slots of the layer's experts during its compute: first_slot + e (int32 [E])."""
        region = self.region_of(layer)
        slots = self._region_slots.get(region)
        if slots is None:
            E = self.pool.shape.experts
            slots = torch.arange(region * E, (region + 1) * E, dtype=torch.int32, device=self.pool.device)
            self._region_slots[region] = slots
        return slots

    def begin(self) -> None:
        """Opens a pass (idempotent): the copy stream waits for the work queued so far (decode
        GEMMs and admissions that read and write the pool), and with skip_resident on CUDA the
        host reads the slot map (a sync: cheapest when called before the model's forward, as the
        plugin does, when nothing of the pass is queued yet)."""
        if self._pass_open:
            return
        self._pass_open = True
        if not self.on_cuda:
            return
        self.copy_stream.wait_stream(torch.cuda.current_stream(self.pool.device))
        if self.skip_resident:
            self._slot_map = self.pool.slot_of.cpu()

    def prefetch(self) -> None:
        """Opens a pass and queues the copies of the first layers (one per region), so the link
        works while the embedding and the first attention compute."""
        self.begin()
        for layer in range(min(self.regions, self.pool.shape.layers)):
            self._start(layer)

    def row_sources(self, layer: int) -> Optional[torch.Tensor]:
        """Where the copy engine takes each row of `layer`: the slot where the host saw it at the
        start of the pass when that lies outside the regions (the pass does not write there),
        else -1 (the host pool). None without a slot map (CPU, or no skip_resident)."""
        if self._slot_map is None:
            return None
        seen = self._slot_map[layer]
        outside = seen >= self.regions * self.pool.shape.experts
        return torch.where(outside, seen, torch.full_like(seen, -1)).contiguous()

    def _start(self, layer: int) -> None:
        """Queues the copy of `layer` into its region, after that region's release."""
        if layer in self.in_flight or not 0 <= layer < self.pool.shape.layers:
            return
        self.begin()
        region = self.region_of(layer)
        first_slot = region * self.pool.shape.experts
        if not self.on_cuda:
            self.in_flight[layer] = (None, self._copy(layer, first_slot))
            return
        with torch.cuda.stream(self.copy_stream):
            if self.released[region] is not None:
                self.copy_stream.wait_event(self.released[region])
            start = torch.cuda.Event(enable_timing=self.record_events)
            if self.record_events:
                start.record(self.copy_stream)
            from_host = self._copy(layer, first_slot)
            ready = torch.cuda.Event(enable_timing=self.record_events)
            ready.record(self.copy_stream)
        if self.record_events:
            self.event_log.append(("copy_start", layer, region, start))
            self.event_log.append(("copy_ready", layer, region, ready))
        self.in_flight[layer] = (ready, from_host)

    def _copy(self, layer: int, first_slot: int) -> torch.Tensor:
        """Queues the layer's copy; returns the rows that cross the link (on the device)."""
        pool, E = self.pool, self.pool.shape.experts
        # The other region is overwritten by the next layer while this one computes: this layer's
        # experts that sit there (decode put them there) move into this region.
        other = (1 - self.region_of(layer)) * E if self.regions == 2 else first_slot
        return ops.async_layer_copy(*pool.state, pool.banks, self.host.layer_rows(layer), layer, first_slot,
                                    self.skip_resident, other, other + E, pool.policy,
                                    self.row_sources(layer))

    def acquire(self, layer: int) -> torch.Tensor:
        """Makes the layer's region ready for the compute stream and returns the rows its copy read
        from the host (on the device); the next layer starts streaming into the other region."""
        self._start(layer)
        if self.regions == 2:
            self._start(layer + 1)
        ready, from_host = self.in_flight.pop(layer)
        if self.on_cuda:
            compute = torch.cuda.current_stream(self.pool.device)
            compute.wait_event(ready)
            from_host.record_stream(compute)
            if self.record_events:
                e = torch.cuda.Event(enable_timing=True)
                e.record(compute)
                self.event_log.append(("compute_start", layer, self.region_of(layer), e))
        return from_host

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
        """Closes the pass: orders later work on the compute stream after every queued copy
        (before decode admits into the pool) and drops prefetches nobody will use."""
        if self.on_cuda and self._pass_open:
            torch.cuda.current_stream(self.pool.device).wait_stream(self.copy_stream)
        self.in_flight.clear()
        self._slot_map = None
        self._pass_open = False
