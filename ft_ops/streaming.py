"""LayerStreamer, the strategy for long prompts: whole MoE layers stream through two full-layer
regions of the slot pool, so the link (copy stream) and the GPU (compute stream) work at once.

Order, per region: the copy of a layer into a region waits for that region's release event
(recorded on the compute stream after the GEMMs that read the previous layer there); the compute
of a layer waits for its ready event (recorded on the copy stream after its copy). Region r holds
the layers with index % 2 == r. Expert e of a streamed layer is always in slot first_slot + e, so
the prefill GEMM reads the region (E slots) with the expert ids as slots, whatever the pool's size.

With skip_resident (the default), an expert resident outside the regions is copied device to
device into the region (at device bandwidth, not the link's) and stays where it is for decode; only
the rows not resident outside the regions cross the link. Which rows those are, the host learns once per pass (one read of the slot map, taken
before the pass's first copy): it tells the copy engine where each row comes from (row_sources),
and the op re-reads from the host any row the maps contradict.

A pool that holds every expert (S >= L E) streams each layer into a region of its own, its home
(slots l E .. l E + E - 1): nothing is ever overwritten by another layer, a row that decode
admitted into a later layer's home or beyond L E moves home device to device (one in an earlier
layer's home was evicted when that layer streamed, and crosses the link again), and once every
layer has streamed a prompt sends nothing. The copies run on the copy engines ahead of the compute, as with two regions
(without a home, such a pool's first prompt admitted every expert through the SM copy kernel,
serialized with the GEMMs: 1.2x the link bound on the H200).

A prompt also fills the pool's free slots outside the regions (never evicting): once a layer's
region is ready, its most-routed experts that were not resident get rows in free slots, copied from
the region on the compute stream, the free slots spread evenly over the layers. The next turn sends
fewer rows and decode starts with each layer's hottest experts resident.
"""
from typing import Dict, List, Optional, Tuple

import torch

from . import ops, user_warnings
from .policies import STREAMED
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
        # Every layer at home when the pool holds them all; else two regions taken in turn.
        self.home = S >= pool.shape.layers * E
        self.regions = pool.shape.layers if self.home else 2 if S >= 2 * E else 1
        self.on_cuda = pool.device.type == "cuda"
        if self.regions == 1 and not self.home and self.on_cuda:
            # (On the CPU every copy runs before the compute that follows it anyway.)
            user_warnings.warn(
                f"slot pool of {S} slots holds one full layer of {E} experts: prefill streaming "
                f"is serialized (copy, then compute). {2 * E} slots let the next layer stream while "
                f"the current one computes.")
        self.copy_stream = torch.cuda.Stream(device=pool.device) if self.on_cuda else None
        # Per region: the event recorded after the last compute that read it.
        self.released: List[Optional[torch.cuda.Event]] = [None] * self.regions
        # Layers whose copy is queued: layer -> (ready event, rows read from the host (device)).
        self.in_flight: Dict[int, Tuple[Optional[torch.cuda.Event], torch.Tensor]] = {}
        self._region_views: Dict[int, List[Optional[torch.Tensor]]] = {}
        self._region_slots: Dict[int, torch.Tensor] = {}
        # The slot map as the host read it at the start of the pass (None: no pass open), and the
        # free slots outside the regions that the pass may still fill (keep).
        self._slot_map: Optional[torch.Tensor] = None
        self._outside_on_device: Optional[torch.Tensor] = None
        self._free_outside: List[int] = []
        self._pass_open = False
        self._pass_generation = -1  # the pool's generation when the pass opened
        # The share of the model's (layer, expert) pairs that the last pass found resident outside
        # the regions and so did not send again, from the slot map that pass read anyway: the
        # stream-or-admit choice reads it on the host, never the device. 0 until a pass with
        # skip_resident has opened, for the pool's generation it was read in only, and with a home
        # region per layer: there a resident row costs a pass nothing either, a long prompt still
        # wants the region's GEMM and a short call admission's, which the shape rule alone decides.
        self._resident_share = 0.0
        self._share_generation = -1
        self._acquired: Optional[int] = None  # the last layer acquired in this pass
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
        GEMMs and admissions that read and write the pool), and with skip_resident the host reads
        the slot map (on CUDA a sync: cheapest when called before the model's forward, as the
        plugin does, when nothing of the pass is queued yet) and lists the free slots outside the
        regions (a pass writes outside the regions only into these, when it keeps experts)."""
        if self._pass_open:
            return
        self._pass_open = True
        self._pass_generation = self.pool.generation
        if self.on_cuda:
            self.copy_stream.wait_stream(torch.cuda.current_stream(self.pool.device))
        if self.skip_resident:
            self._slot_map = self.pool.slot_of.to("cpu", copy=True)  # a copy on the CPU too
            regions_end = self.regions * self.pool.shape.experts
            outside = self._slot_map >= regions_end
            taken = torch.zeros(self.pool.slots, dtype=torch.bool)
            taken[self._slot_map[outside].long()] = True
            self._free_outside = (~taken[regions_end:]).nonzero().flatten().add(regions_end).tolist()
            self._resident_share = 0.0 if self.home else float(outside.float().mean())
            self._share_generation = self.pool.generation
            # For keeping (on the compute stream): through pinned memory, so the copy never waits.
            if self.on_cuda:
                outside = outside.pin_memory()
            self._outside_on_device = outside.to(self.pool.device, non_blocking=True)

    def resident_share(self) -> float:
        """The share of the model's experts the last pass did not send again (see __init__), or 0
        when the pool was invalidated since; a host value, no device read."""
        return self._resident_share if self._share_generation == self.pool.generation else 0.0

    def prefetch(self) -> None:
        """Opens a pass and queues the copies of the first layers (one per region), so the link
        works while the embedding and the first attention compute."""
        self.begin()
        for layer in range(min(2, self.regions, self.pool.shape.layers)):
            self._start(layer)

    def opened_and_unused(self) -> bool:
        """A pass is open, no layer of it has been acquired yet and the pool was not invalidated
        since it opened: its prefetched copies stand."""
        return self._pass_open and self._acquired is None and self._pass_generation == self.pool.generation

    def row_sources(self, layer: int) -> Optional[torch.Tensor]:
        """Where the copy engine takes each row of `layer`: the slot where the host saw it at the
        start of the pass when that lies outside the regions (a pass writes there only into free
        slots), else -1 (the host pool). None without skip_resident."""
        if self._slot_map is None:
            return None
        seen = self._slot_map[layer]
        E = self.pool.shape.experts
        if self.home:
            # At home: the row's own slot (in place), or a slot this pass has not overwritten yet
            # (later layers' homes, the slots beyond L E). A row in an earlier layer's home was
            # evicted when that layer streamed, and one elsewhere in its own home when this layer's
            # map was rewritten: both come from the host, in runs on the copy engines.
            own = torch.arange(layer * E, (layer + 1) * E, dtype=seen.dtype)
            hintable = (seen == own) | (seen >= (layer + 1) * E)
        else:
            hintable = seen >= self.regions * E
        return torch.where(hintable, seen, torch.full_like(seen, -1)).contiguous()

    def _keep(self, layer: int, top_k_index: torch.Tensor) -> None:
        """Keeps `layer`'s hottest experts (see the module docstring): its most-routed experts that
        were not resident outside the regions at the start of the pass get rows in free slots
        outside the regions, copied from the region, and are registered there instead of in the
        region, stamped 1 (the first victims of a later miss, under every policy: a prompt's rows
        never push out decode's). The slots are the host's (free when the pass began; at most the
        free slots left divided by the layers left), so nothing is evicted, no clock ticks and no
        other layer's maps are touched: it runs on the compute stream, once the layer's region is
        ready, beside the copy stream's map updates of other layers. No host sync.

        Why nothing overlaps (keep that true when changing the streamer): the copy of l ran before
        the copy of l + 1 on the one copy stream and moved every layer-l expert out of l + 1's
        region; each layer is copied at most once per pass; the hints and the free list come from
        the one snapshot taken at begin(), so hinted slots (occupied then) and these targets (free
        then) never meet, and no copy writes outside its region during a pass."""
        pool, E = self.pool, self.pool.shape.experts
        if self._slot_map is None or not self._free_outside or self.home:
            return  # at home every expert stays resident already
        outside = self._slot_map[layer] >= self.regions * E
        n = min(len(self._free_outside) // (pool.shape.layers - layer), E - int(outside.sum()))
        if n <= 0:
            return
        slots, self._free_outside = self._free_outside[:n], self._free_outside[n:]
        device = pool.device
        targets = torch.tensor(slots, dtype=torch.int32)
        targets = (targets.pin_memory() if self.on_cuda else targets).to(device, non_blocking=True)
        routed = top_k_index.reshape(-1).long()
        # Routed pairs per expert; ids outside [0, E) (not routed) count in bin E. scatter_add_:
        # torch.bincount on CUDA reads the maximum on the host.
        routed = torch.where((routed >= 0) & (routed < E), routed, E)
        counts = torch.zeros(E + 1, dtype=torch.int32, device=device)
        counts.scatter_add_(0, routed, torch.ones_like(routed, dtype=torch.int32))
        counts = counts[:E]
        counts.masked_fill_(self._outside_on_device[layer], -1)  # resident outside: never chosen
        ids = counts.topk(n).indices
        first = self.region_of(layer) * E
        # The rows first (expert e is row e of the region), then the maps.
        ops.copy_experts(pool.banks, [bank[first:first + E] for bank in pool.banks], ids.to(torch.int32), targets,
                         torch.full((1,), n, dtype=torch.int32, device=device))
        kept = targets.long()
        pool.owner_of.index_fill_(0, ids + first, -1)
        pool.last_use.index_fill_(0, ids + first, 0)
        pool.slot_of[layer].index_copy_(0, ids, targets)
        pool.owner_of.index_copy_(0, kept, (ids + layer * E).to(torch.int32))
        pool.last_use.index_fill_(0, kept, STREAMED)

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
        if self.home:
            # Every copy of this layer's experts elsewhere moves home (its slot is freed).
            lo, hi = 0, pool.slots
        else:
            # The other region is overwritten by the next layer while this one computes: this
            # layer's experts that sit there (decode put them there) move into this region.
            lo = (1 - self.region_of(layer)) * E if self.regions == 2 else first_slot
            hi = lo + E
        return ops.async_layer_copy(*pool.state, pool.banks, self.host.layer_rows(layer), layer, first_slot,
                                    self.skip_resident, lo, hi, pool.policy, self.row_sources(layer))

    def acquire(self, layer: int, top_k_index: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Makes the layer's region ready for the compute stream and returns the rows its copy read
        from the host (on the device); with the layer's routing, keeps its hottest experts; the
        next layer starts streaming into the other region."""
        if self._acquired is not None and layer <= self._acquired:
            # A forward that raised part way left its pass open: its queued copies are not this
            # forward's (a layer queued ahead may have been overwritten since). Start over.
            self.finish()
        self._acquired = layer
        self._start(layer)
        ready, from_host = self.in_flight.pop(layer)
        if self.on_cuda:
            compute = torch.cuda.current_stream(self.pool.device)
            compute.wait_event(ready)
            from_host.record_stream(compute)
        if top_k_index is not None:
            self._keep(layer, top_k_index)
        if self.regions >= 2:
            self._start(layer + 1)
        if self.on_cuda and self.record_events:
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
        self._slot_map = self._outside_on_device = None
        self._free_outside = []
        self._pass_open = False
        self._acquired = None
