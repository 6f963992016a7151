"""A plain-Python model of the slot cache (lists and dicts, no torch), independent of both the
kernels and ft_ops/testing/reference.py, for the property-based tests."""
import math
import struct

from ..policies import (DUEL, DUEL_WORDS, HD_B0, HD_D0, HIT_DENSITY, LRU, STREAMED, hit_density_after_use,
                        streams_stamped, victim_key)
from typing import Dict, List, Tuple


class CacheModel:
    def __init__(self, layers: int, experts: int, slots: int, policy: int = 0):
        self.layers, self.experts, self.slots, self.policy = layers, experts, slots, policy
        self.slot_of: Dict[Tuple[int, int], int] = {}
        self.owner: List[Tuple[int, int] | None] = [None] * slots
        self.last_use = [0] * slots
        self.clock = 1 if streams_stamped(policy) else 0  # then no call stamps STREAMED
        # HIT_DENSITY: per pair (clock of its last decode use, B, D), per slot its owner's (B, D).
        self.pair_state: Dict[Tuple[int, int], tuple] = {}
        self.estimates = [(HD_B0, HD_D0)] * slots
        # DUEL: the DUEL_WORDS words after hit density's state (the shadows' counters, which a test
        # sets as it likes, then the score's bits, what the last call saw, the counters' second
        # copies and the replay count, whose parity says which copy is the latest).
        self.duel_words = [0] * DUEL_WORDS

    def _duel_takes_lru_keys(self) -> bool:
        """DUEL at a call's start: folds the shadows' hits since the last call into the score."""
        w = self.duel_words
        lru, density = (w[12:16], w[16:20]) if w[20] % 2 else (w[0:4], w[4:8])  # the latest copies
        lru_hits, density_hits = lru[2] - lru[3], density[2] - density[3]
        score = struct.unpack("<d", struct.pack("<q", w[8]))[0]
        if lru[0] != w[9]:
            score = 0.99 * score + ((lru_hits - w[10]) - (density_hits - w[11]))
        w[8] = struct.unpack("<q", struct.pack("<d", score))[0]
        w[9], w[10], w[11] = lru[0], lru_hits, density_hits
        return score > 0

    def _used(self, key: Tuple[int, int], slot: int) -> None:
        if self.policy not in (HIT_DENSITY, DUEL):
            return
        stamp, b, d = self.pair_state.get(key, (0, HD_B0, HD_D0))
        b, d = hit_density_after_use(b, d, stamp, self.clock, self.layers)
        self.pair_state[key] = (self.clock, b, d)
        self.estimates[slot] = (b, d)

    def _release(self, slot: int) -> None:
        if self.owner[slot] is not None:
            del self.slot_of[self.owner[slot]]
        self.owner[slot] = None
        self.last_use[slot] = 0

    def _assign(self, key: Tuple[int, int], slot: int) -> None:
        self.owner[slot] = key
        self.slot_of[key] = slot
        self.last_use[slot] = self.clock

    def admit(self, layer: int, ids: List[int], fetch_fraction: float, lo: int, hi: int):
        self.clock += 1
        key_policy = self.policy
        if self.policy == DUEL:
            key_policy = LRU if self._duel_takes_lru_keys() else HIT_DENSITY
        counts: Dict[int, int] = {}
        for e in ids:
            counts[e] = counts.get(e, 0) + 1
        missing = []
        for e in counts:
            if (layer, e) in self.slot_of:
                self.last_use[self.slot_of[(layer, e)]] = self.clock
                self._used((layer, e), self.slot_of[(layer, e)])
            else:
                missing.append(e)
        missing.sort(key=lambda e: (-counts[e], e))
        want = max(0, min(len(missing), math.floor(len(missing) * fetch_fraction + 0.5)))
        free = [s for s in range(self.slots) if self.last_use[s] < self.clock and not lo <= s < hi]
        free.sort(key=lambda s: (victim_key(self.last_use[s], self.clock, self.layers, key_policy,
                                            self.estimates[s]), s))
        plan = []
        for e, v in zip(missing[:want], free):
            self._release(v)
            self._assign((layer, e), v)
            self._used((layer, e), v)
            plan.append((e, v))
        slot_ids = [self.slot_of.get((layer, e), -1) for e in ids]
        return slot_ids, plan

    def layer_copy(self, layer: int, first_slot: int, skip_resident: bool, reclaim=(0, 0)):
        """async_layer_copy's maps; returns the layer's slot map after it and the experts whose
        rows it reads from the host (without row_sources)."""
        self.clock += 1
        for e in range(self.experts):
            s = first_slot + e
            if self.owner[s] is not None and not (skip_resident and self.owner[s] == (layer, e)):
                self._release(s)
        from_host = []
        for e in range(self.experts):
            cur = self.slot_of.get((layer, e))
            if cur is None or not skip_resident:
                from_host.append(e)  # else copied from slot cur (or already there)
            reclaimed = cur is not None and reclaim[0] <= cur < reclaim[1] and cur != first_slot + e
            if skip_resident and cur is not None and not reclaimed:
                if self.policy == LRU:
                    self.last_use[cur] = self.clock
                continue
            if cur is not None:
                self._release(cur)
            self._assign((layer, e), first_slot + e)
            if streams_stamped(self.policy):
                self.last_use[first_slot + e] = STREAMED
        return [self.slot_of[(layer, e)] for e in range(self.experts)], from_host

    def slot_map(self) -> List[List[int]]:
        return [[self.slot_of.get((l, e), -1) for e in range(self.experts)] for l in range(self.layers)]

    def owner_ids(self) -> List[int]:
        return [-1 if o is None else o[0] * self.experts + o[1] for o in self.owner]
