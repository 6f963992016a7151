"""The shadow caches of the "duel" eviction policy (ft_ops/policies.py): two caches of the pool's
size that hold only slot maps, one evicting by LRU and one by hit density, replay every admission
call of the pool right after it. Each counts its (calls, routed, distinct, admitted) in the pool's
Duel words, from which the pool's next admission call tells which of the two would have hit
more (docs/ops.md, "Eviction policies"). Streamed prompt layers reach only the real pool.

The pool's dedup_and_admit replays its call in them when given `tensors` (its `shadows`): on CUDA
two more blocks of the same launch, which copy nothing and count their calls in copies of their
counters that the pool's block of the launch does not use, so the replay costs no launch, no
block waits for another and no host sync; a CUDA graph captures it with the call."""
import torch

from .policies import (DUEL_DENSITY_COUNTERS, DUEL_DENSITY_COUNTERS_ODD, DUEL_LRU_COUNTERS, DUEL_LRU_COUNTERS_ODD,
                       DUEL_REPLAYS, DUEL_WORDS, HIT_DENSITY, new_policy_state, reset_policy_state)


class ShadowCaches:
    def __init__(self, layers: int, experts: int, slots: int, device, pool_policy_state: torch.Tensor):
        self.layers, self.experts, self.slots = layers, experts, slots

        def maps(first_clock: int):
            return (torch.full((layers, experts), -1, dtype=torch.int32, device=device),
                    torch.full((slots,), -1, dtype=torch.int32, device=device),
                    torch.zeros(slots, dtype=torch.int64, device=device),
                    torch.full((1,), first_clock, dtype=torch.int64, device=device))

        # Hit density's clock starts at 1, as a pool's does (no call stamps the streamed stamp).
        self.lru, self.density = maps(0), maps(1)
        self.density_state = new_policy_state(HIT_DENSITY, layers, experts, slots, device)
        # The shadows' counters are Duel words of the pool's policy state, which the replay writes
        # and the pool's next call reads, so no copy joins them. No view of them is kept (the
        # counters properties make new tensors): a compiled step whose inputs held both the state
        # and views of it would alias them (AOTAutograd's synthetic base), and CUDA graph trees
        # skip such a graph.
        self.pool_policy_state = pool_policy_state
        # A shadow's hits are its distinct experts minus those it admitted, so a miss it had no slot
        # for (a call of more distinct experts than the pool has slots) would count as a hit. Such
        # a call leaves max(0, distinct - slots) of its misses out in either shadow (each may evict
        # any slot but the call's own hits), so the score, which takes their difference, is exact;
        # the hit rates subtract this sum of them.
        self.unadmittable = torch.zeros(1, dtype=torch.int64, device=device)

    @property
    def lru_counters(self) -> torch.Tensor:
        """The LRU shadow's latest (calls, routed, distinct, admitted), from the pool's Duel words (a
        new tensor on their device: no host sync)."""
        return self._latest(DUEL_LRU_COUNTERS, DUEL_LRU_COUNTERS_ODD)

    @property
    def density_counters(self) -> torch.Tensor:
        """The hit-density shadow's latest counters."""
        return self._latest(DUEL_DENSITY_COUNTERS, DUEL_DENSITY_COUNTERS_ODD)

    def _latest(self, even: slice, odd: slice) -> torch.Tensor:
        words = self.pool_policy_state[-DUEL_WORDS:]
        return torch.where(words[DUEL_REPLAYS] % 2 == 1, words[odd], words[even])

    @property
    def tensors(self):
        """The shadows as dedup_and_admit takes them (its `shadows`): the LRU shadow's slot_of,
        owner_of, last_use and clock, the hit-density shadow's and its policy state. With
        `unadmittable`, every tensor a replay updates in place (static addresses for torch.compile)."""
        return (*self.lru, *self.density, self.density_state)

    def count_unadmittable(self, expert_ids: torch.Tensor) -> None:
        """After a replayed call: adds the misses of it that no shadow slot could take."""
        if expert_ids.numel() > self.slots:  # only then can a call's distinct experts outnumber the slots
            self.unadmittable += (distinct_experts(expert_ids, self.experts) - self.slots).clamp(min=0)

    def reset(self) -> None:
        """Empty shadows (the pool's reset zeroes their counters with its Duel words)."""
        for shadow, first_clock in ((self.lru, 0), (self.density, 1)):
            slot_of, owner_of, last_use, clock = shadow
            slot_of.fill_(-1)
            owner_of.fill_(-1)
            last_use.zero_()
            clock.fill_(first_clock)
        reset_policy_state(self.density_state, self.layers, self.experts, self.slots)
        self.unadmittable.zero_()


def distinct_experts(expert_ids: torch.Tensor, experts: int) -> torch.Tensor:
    """How many distinct ids in [0, experts) a call routes (a device scalar: no host sync)."""
    ids = expert_ids.reshape(-1).long()
    index = torch.where((ids >= 0) & (ids < experts), ids, experts)  # others into a bin not counted
    present = torch.zeros(experts + 1, dtype=torch.int64, device=ids.device).scatter_(0, index, 1)
    return present[:experts].sum()
