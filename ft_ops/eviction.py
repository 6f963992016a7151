"""Offline eviction simulator: decode admission over a routing trace with pluggable policies.

One request per (token, layer): the distinct experts that token routed at that layer. All of a
request's experts must be resident together (the GEMMs read them from their slots), so the cache
holds at least top_k slots; every miss is admitted (fetch_fraction 1). The cache is the runtime's:
one pool of slots shared by all layers, each slot owned by at most one (layer, expert) pair.

Every policy here is a per-slot integer key, written when its slot is hit or admitted, from the
call's clock value `now`, the key the slot had (and, for an admission, the key of the victim it
replaces) and what the policy keeps per slot (a small counter at most). Victims are the eligible
slots with the smallest keys, in ascending (key, slot) order, exactly as the device takes them
(src/cuda/admission_level.cuh: level by level, a level being all slots that share the smallest
key left, in ascending slot order); a slot hit or admitted by the call is not eligible. Misses
are ranked as dedup_and_admit ranks them (most routed first, then by expert id), the miss of rank
r taking the r-th victim. Free slots all hold the policy's `free_key`.

- `LRU` is the runtime's rule (stamp = now on hit and on admission, free slots 0); it is checked
  against ft_ops.testing.cache_model.CacheModel call by call in tests/test_eviction.py.
- `Belady` is the offline optimum: its key is minus the index of the pair's next decode request,
  so the victim is the resident pair used farthest in the future (never one of the current call).
- The candidates (`SegmentedLRU`, `FrequencyBonus`, `Clock2Q`) are recency + frequency rules that
  the level-based kernels can take as they are: the key is a function of (stamp, counter) with
  few distinct values per call. docs/performance.md ("Eviction: LRU against the optimum") has the
  comparison; tools/compare_eviction.py runs it.

Prompts: `requests_from_trace(..., prompts="skip")` replays decode steps only (the sequences one
after another through one cache); `prompts="stream"` also streams every prompt as full layers
(every expert of layer 0, then of layer 1, ...), each layer in chunks of min(experts, slots)
experts that must be resident together, as the layer streamer makes a layer resident; streamed
calls are not counted in the hit rate, but they go through the policy (with stream=True), so a
policy can keep them from flushing the decode set (issue 23, item 3). `stream_every` inserts such
a streamed prompt (another request's prefill) every that many decode tokens.
"""
import heapq
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

NEVER = 1 << 60  # the next-use index of a pair never requested again


@dataclass
class Requests:
    """The admission calls of a replay: per call its layer, its distinct experts as flat pair ids
    (layer * experts + expert) in admission rank order, and whether it is a streamed prompt layer."""
    layers: int
    experts: int
    layer_of: List[int]
    pairs: List[List[int]]
    stream: List[bool]
    _next_use: Optional[List[List[int]]] = field(default=None, repr=False)

    def __len__(self) -> int:
        return len(self.pairs)

    @property
    def max_call(self) -> int:
        """The most distinct experts one decode call routes."""
        return max((len(p) for p, s in zip(self.pairs, self.stream) if not s), default=0)

    @property
    def decode_calls(self) -> int:
        return sum(1 for s in self.stream if not s)

    def next_use(self) -> List[List[int]]:
        """Per call, aligned with its pairs: the index of the pair's next decode request, or NEVER
        when there is none, or when a streamed call requests the pair first (the stream brings it
        back without a counted miss, so holding it until then gains nothing)."""
        if self._next_use is None:
            upcoming: Dict[int, int] = {}
            out: List[List[int]] = [[]] * len(self.pairs)
            for i in range(len(self.pairs) - 1, -1, -1):
                pairs = self.pairs[i]
                out[i] = [upcoming.get(p, NEVER) for p in pairs]
                value = NEVER if self.stream[i] else i
                for p in pairs:
                    upcoming[p] = value
            self._next_use = out
        return self._next_use


def ranked(layer: int, ids: Sequence[int], experts: int) -> List[int]:
    """The distinct experts of a call as flat pair ids, most routed first, then by expert id
    (dedup_and_admit's order of admission)."""
    counts: Dict[int, int] = {}
    for e in ids:
        counts[e] = counts.get(e, 0) + 1
    return [layer * experts + e for e in sorted(counts, key=lambda e: (-counts[e], e))]


def requests_from_calls(layers: int, experts: int, calls: Sequence[Tuple[int, Sequence[int]]],
                        stream: Optional[Sequence[bool]] = None) -> Requests:
    """Requests from (layer, routed ids) calls (ids may repeat: they are deduplicated and ranked)."""
    flags = list(stream) if stream is not None else [False] * len(calls)
    return Requests(layers, experts, [l for l, _ in calls], [ranked(l, ids, experts) for l, ids in calls], flags)


def requests_from_trace(trace, prompts: str = "skip", stream_every: int = 0, max_tokens: int = 0) -> Requests:
    """The decode calls of every sequence of `trace` (a ft_ops.traces.Trace), in order. `prompts`:
    "skip" (decode only) or "stream" (each prompt streamed as full layers before its decode);
    `stream_every` > 0 also streams a prompt every that many decode tokens (any `prompts`);
    `max_tokens` > 0 keeps only the first that many decode tokens of each sequence."""
    if prompts not in ("skip", "stream"):
        raise ValueError(f"prompts must be 'skip' or 'stream', got {prompts!r}")
    L, E = trace.layers, trace.experts
    layer_of: List[int] = []
    pairs: List[List[int]] = []
    stream: List[bool] = []

    def streamed_prompt():
        for layer in range(L):
            layer_of.append(layer)
            pairs.append(list(range(layer * E, (layer + 1) * E)))
            stream.append(True)

    for i in range(len(trace.sequences)):
        steps = trace.decode_steps(i)
        if max_tokens:
            steps = steps[:max_tokens]
        if prompts == "stream":
            streamed_prompt()
        rows = steps.tolist()
        for t, row in enumerate(rows):
            if stream_every and t and t % stream_every == 0:
                streamed_prompt()
            for layer in range(L):
                layer_of.append(layer)
                pairs.append(ranked(layer, row[layer], E))
                stream.append(False)
    return Requests(L, E, layer_of, pairs, stream)


# --- policies ------------------------------------------------------------------------------------
class Policy:
    """A per-slot integer key. The simulator calls `reset(slots)`, then per call `hit` for each
    resident pair it routes and `admit` for each miss once its victim is chosen; the policy
    rewrites `key[slot]` (and whatever small per-slot state it keeps). `victim_key` is the key the
    victim slot had; `nxt` the index of the pair's next decode request (only Belady reads it);
    `stream` whether the call is a streamed prompt layer."""
    name = "policy"
    future = False   # whether the policy reads `nxt` (offline)
    free_key = 0     # the key of a free slot

    def reset(self, slots: int) -> None:
        self.key = [self.free_key] * slots

    def hit(self, slot: int, pair: int, now: int, stream: bool, nxt: int) -> None:
        raise NotImplementedError

    def admit(self, slot: int, pair: int, now: int, stream: bool, victim_key: int, nxt: int) -> None:
        raise NotImplementedError

    def rule(self) -> str:
        return self.__doc__.strip().splitlines()[0] if self.__doc__ else self.name


class LRU(Policy):
    """key = now on hit and on admission (streamed or not); free slots 0: the runtime's rule."""
    name = "LRU"

    def hit(self, slot, pair, now, stream, nxt):
        self.key[slot] = now

    def admit(self, slot, pair, now, stream, victim_key, nxt):
        self.key[slot] = now


class Belady(Policy):
    """key = -(index of the pair's next decode request): the farthest next use goes first (offline optimum)."""
    name = "Belady"
    future = True
    free_key = -(NEVER + 1)

    def hit(self, slot, pair, now, stream, nxt):
        self.key[slot] = -nxt

    def admit(self, slot, pair, now, stream, victim_key, nxt):
        self.key[slot] = -nxt


# --- the simulator -------------------------------------------------------------------------------
@dataclass
class Result:
    policy: str
    slots: int
    hits: int = 0
    distinct: int = 0
    admitted: int = 0            # decode admissions (copies over the link)
    stream_admitted: int = 0     # admissions of streamed prompt layers
    miss_calls: int = 0          # calls (decode or stream chunks) that took victims
    levels: int = 0              # distinct keys among the victims, summed over those calls
    max_levels: int = 0          # the most distinct keys one call took victims from

    @property
    def hit_rate(self) -> float:
        return self.hits / self.distinct if self.distinct else 1.0

    @property
    def mean_levels(self) -> float:
        return self.levels / self.miss_calls if self.miss_calls else 0.0

    def as_dict(self) -> dict:
        return dict(policy=self.policy, slots=self.slots, hit_rate=round(self.hit_rate, 4), hits=self.hits,
                    distinct=self.distinct, admitted=self.admitted, stream_admitted=self.stream_admitted,
                    mean_levels=round(self.mean_levels, 3), max_levels=self.max_levels)


def simulate(policy: Policy, requests: Requests, slots: int, observe=None) -> Result:
    """Runs every call of `requests` through a cache of `slots` slots under `policy`.
    `observe(call_index, chunk, slot_ids, plan, policy, owner)`, when given, is called after each
    call (each chunk of a streamed layer) with the slots of the chunk's pairs and the (pair, slot)
    admissions, in rank order."""
    if slots < requests.max_call:
        raise ValueError(f"a cache of {slots} slots is below one call's {requests.max_call} routed experts")
    L, E = requests.layers, requests.experts
    slot_of = [-1] * (L * E)
    owner = [-1] * slots
    policy.reset(slots)
    key = policy.key
    ver = [0] * slots
    heap = [(k, s, 0) for s, k in enumerate(key)]
    heapq.heapify(heap)
    push, pop = heapq.heappush, heapq.heappop
    rebuild_at = 4 * slots + 1024
    next_use = requests.next_use() if policy.future else None
    res = Result(policy.name, slots)
    now = 0
    hit_fn, admit_fn = policy.hit, policy.admit
    for ci, call in enumerate(requests.pairs):
        is_stream = requests.stream[ci]
        nxt_all = next_use[ci] if next_use is not None else None
        step = min(len(call), slots) if is_stream else len(call)
        for lo in range(0, len(call), step or 1):
            chunk = call[lo:lo + step] if is_stream else call
            now += 1
            touched = set()
            missing = []
            for j, p in enumerate(chunk):
                s = slot_of[p]
                if s >= 0:
                    hit_fn(s, p, now, is_stream, nxt_all[lo + j] if nxt_all is not None else 0)
                    ver[s] += 1
                    push(heap, (key[s], s, ver[s]))
                    touched.add(s)
                else:
                    missing.append(j)
            if not is_stream:
                res.distinct += len(chunk)
                res.hits += len(chunk) - len(missing)
                res.admitted += len(missing)
            else:
                res.stream_admitted += len(missing)
            plan = []
            if missing:
                aside = []
                levels = set()
                for j in missing:
                    while True:
                        k, s, v = pop(heap)
                        if v != ver[s]:
                            continue
                        if s in touched:
                            aside.append((k, s, v))
                            continue
                        break
                    levels.add(k)
                    old = owner[s]
                    if old >= 0:
                        slot_of[old] = -1
                    p = chunk[j]
                    owner[s] = p
                    slot_of[p] = s
                    admit_fn(s, p, now, is_stream, k, nxt_all[lo + j] if nxt_all is not None else 0)
                    ver[s] += 1
                    push(heap, (key[s], s, ver[s]))
                    touched.add(s)
                    plan.append((p, s))
                for entry in aside:
                    push(heap, entry)
                res.miss_calls += 1
                res.levels += len(levels)
                if len(levels) > res.max_levels:
                    res.max_levels = len(levels)
            if len(heap) > rebuild_at:
                heap = [(key[s], s, ver[s]) for s in range(slots)]
                heapq.heapify(heap)
            if observe is not None:
                observe(ci, chunk, [slot_of[p] for p in chunk], plan, policy, owner)
    return res
