"""Offline eviction simulator: decode admission over a routing trace with pluggable policies.

One request per (token, layer): the distinct experts that token routed at that layer. All of a
request's experts must be resident together (the GEMMs read them from their slots), so the cache
holds at least top_k slots; every miss is admitted (fetch_fraction 1). The cache is the runtime's:
one pool of slots shared by all layers, each slot owned by at most one (layer, expert) pair. The
clock `now` advances by one per call, as the device's does. Misses are ranked as dedup_and_admit
ranks them (most routed first, then by expert id), the miss of rank r taking the r-th victim; a
slot hit or admitted by the call is never a victim.

Every policy is a small class with one interface (`Policy`: reset, begin_call, hit, take, admit,
end_call; `serve_call` runs one call through it).
The online ones keep one integer per slot, written only when the slot is hit or admitted, from
`now`, what the slot held and at most a small per-slot counter; victims come out in ascending
(key, slot) order, as the device takes them (src/cuda/admission_level.cuh: level by level, a level
being every slot that shares the smallest key left, in ascending slot order). `Result.levels`
counts the distinct keys the victims of a call came from: the levels the kernel walks, one
block-wide barrier per level after the first.

- `LRU`: the runtime's `eviction="lru"` (key = now on hit and admission, free slots 0), checked call by
  call against ft_ops.testing.cache_model.CacheModel in tests/test_eviction.py.
- `Belady`: the offline optimum (key = minus the index of the pair's next decode request: the
  resident pair used farthest in the future goes first).
- Candidates: `TokenLRU` (coarse stamps, one value per decode token), `FrequencyBonus` (coarse
  stamp plus a bonus per hit since admission), `Segmented` (probation and protected segments in
  disjoint key ranges, 2Q-like), `Opportunity` (the stored value is the LRU stamp; the key,
  derived from (stamp, now) when the stamps are loaded, orders slots by the decode turns of their
  layer they missed, oldest class first, most recent first within a class), `HitDensity` (the
  runtime's `eviction="hitdensity"`) and `Duel` (hit density's or LRU's victims, whichever of two
  shadow caches hit more of the recent decode calls: the runtime's default, `eviction="duel"`).
- `RoutingOracle`: on synthetic routing only, hit density's form with the generator's own
  probabilities: how much of Belady's lead any rule that learns them could reach.
- `SequenceOracle`: on recorded traces, hit density's form with each sequence's own statistics of
  every pair, counted over the whole sequence (its future included): a reference for rules that
  estimate one use probability per pair (not a bound: rates that follow a sequence's changes can
  do better).
tools/compare_eviction.py compares them; docs/performance.md ("Eviction: LRU against the optimum")
has the result.

Prompts: `requests_from_trace(..., prompts="skip")` replays decode steps only (the sequences one
after another through one cache); `prompts="stream"` also streams every prompt as full layers
(every expert of layer 0, then of layer 1, ...), each layer in chunks of min(experts, slots)
experts that must be resident together, as the layer streamer makes a layer resident; streamed
calls are not counted in the hit rate, but they go through the policy (with stream=True), so a
policy can keep them from flushing the decode set (issue 23, item 3): the candidates give a
streamed admission the lowest key above a free slot's and leave a streamed hit's key alone.
`stream_every` inserts such a streamed prompt (another request's prefill) every that many decode
tokens.
"""
import heapq
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

from .policies import hit_density_after_use

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
    """The interface. Per call the simulator (`serve_call`) calls `begin_call` with the call's
    pairs, `hit` for each routed pair that is resident,
    then, for each miss in rank order, `take` (the next victim: the eligible slot with the
    smallest key, and that key, the victim's level) and `admit` (the miss now owns that slot),
    then `end_call`. Slots in `touched` (hit or admitted by the call) are not eligible. `nxt` is
    the index of the pair's next decode request (only offline policies read it); `stream` whether
    the call is a streamed prompt layer."""
    name = "policy"
    future = False  # whether the policy reads `nxt` (offline)

    def begin_call(self, pairs: Sequence[int], now: int, stream: bool) -> None:
        """A call's pairs in rank order, before any of its hits (a policy that replays calls reads them)."""

    def reset(self, slots: int, layers: int) -> None:
        raise NotImplementedError

    def hit(self, slot: int, pair: int, now: int, stream: bool, nxt: int) -> None:
        raise NotImplementedError

    def take(self, now: int, touched) -> Tuple[int, int]:
        raise NotImplementedError

    def admit(self, slot: int, pair: int, now: int, stream: bool, level: int, nxt: int) -> None:
        raise NotImplementedError

    def end_call(self) -> None:
        pass

    def rule(self) -> str:
        """The key rule in one line (the class docstring's first paragraph)."""
        return " ".join((self.__doc__ or self.name).strip().split("\n\n")[0].split())


class KeyPolicy(Policy):
    """A key written on hit and on admission (subclasses give `hit_key` and `admit_key`); victims
    in ascending (key, slot) order, found with a heap of (key, slot, version) entries."""
    free_key = 0

    def reset(self, slots, layers):
        self.layers = layers
        self.key = [self.free_key] * slots
        self.ver = [0] * slots
        self.heap = [(self.free_key, s, 0) for s in range(slots)]
        self.aside: List[tuple] = []
        self.rebuild_at = 4 * slots + 1024
        self.start(slots)

    def start(self, slots: int) -> None:
        """Per-slot state of the policy (counters), for a cache of `slots` slots."""

    def hit_key(self, slot, pair, now, stream, nxt) -> int:
        raise NotImplementedError

    def admit_key(self, slot, pair, now, stream, level, nxt) -> int:
        raise NotImplementedError

    def _set(self, slot, k):
        self.key[slot] = k
        v = self.ver[slot] = self.ver[slot] + 1
        heapq.heappush(self.heap, (k, slot, v))

    def hit(self, slot, pair, now, stream, nxt):
        k = self.hit_key(slot, pair, now, stream, nxt)
        if k != self.key[slot]:
            self._set(slot, k)

    def admit(self, slot, pair, now, stream, level, nxt):
        self._set(slot, self.admit_key(slot, pair, now, stream, level, nxt))

    def take(self, now, touched):
        heap, ver = self.heap, self.ver
        while heap:
            k, s, v = heapq.heappop(heap)
            if v != ver[s]:
                continue
            if s in touched:
                self.aside.append((k, s, v))
                continue
            return s, k
        raise RuntimeError("no eligible victim: the call routes more experts than the cache holds")

    def end_call(self):
        heap = self.heap
        for entry in self.aside:
            heapq.heappush(heap, entry)
        self.aside.clear()
        if len(heap) > self.rebuild_at:
            self.heap = [(k, s, v) for s, (k, v) in enumerate(zip(self.key, self.ver))]
            heapq.heapify(self.heap)


class LRU(KeyPolicy):
    """key = now on hit and on admission, streamed or not; free slots 0 (the runtime's `eviction="lru"`)."""
    name = "LRU"

    def hit_key(self, slot, pair, now, stream, nxt):
        return now

    def admit_key(self, slot, pair, now, stream, level, nxt):
        return now


class Belady(KeyPolicy):
    """key = -(index of the pair's next decode request): the resident pair used farthest in the
    future goes first (offline optimum; pairs a streamed prompt brings back first count as never
    used again)."""
    name = "Belady"
    future = True
    free_key = -(NEVER + 1)

    def hit_key(self, slot, pair, now, stream, nxt):
        return -nxt

    def admit_key(self, slot, pair, now, stream, level, nxt):
        return -nxt


STREAMED = 1  # the key (stamp) of a row a streamed prompt admitted: just above a free slot's 0


class TokenLRU(KeyPolicy):
    """key = 2 + now // period on decode hit and admission (a coarse stamp: one value per
    `period` calls, by default one decode token = `layers` calls); victims of the oldest period
    in ascending slot order; a streamed admission gets key 1, a streamed hit keeps its key."""
    name = "TokenLRU"

    def __init__(self, period: int = 0):
        self.period = period  # calls per stamp value; 0: the trace's layers

    def start(self, slots):
        self.p = self.period or self.layers

    def hit_key(self, slot, pair, now, stream, nxt):
        return self.key[slot] if stream else 2 + now // self.p

    def admit_key(self, slot, pair, now, stream, level, nxt):
        return STREAMED if stream else 2 + now // self.p


class FrequencyBonus(KeyPolicy):
    """key = 2 + now // period + bonus * min(hits, cap), hits: the slot's decode hits since its
    admission (a per-slot counter, 0 on admission); a streamed admission gets key 1, a streamed
    hit keeps its key and counter."""
    name = "FrequencyBonus"

    def __init__(self, period: int = 0, bonus: int = 1, cap: int = 3):
        self.period, self.bonus, self.cap = period, bonus, cap

    def start(self, slots):
        self.p = self.period or self.layers
        self.hits = [0] * slots

    def hit_key(self, slot, pair, now, stream, nxt):
        if stream:
            return self.key[slot]
        h = self.hits[slot] = min(self.hits[slot] + 1, self.cap)
        return 2 + now // self.p + self.bonus * h

    def admit_key(self, slot, pair, now, stream, level, nxt):
        self.hits[slot] = 0
        return STREAMED if stream else 2 + now // self.p


class Segmented(KeyPolicy):
    """Two segments (2Q / segmented LRU): key = 2 + now // period while the slot has no decode hit
    since its admission (probation), PROTECTED + 2 + now // period once it has one (protected,
    a disjoint key range above); probation goes first, each segment in its own recency order;
    a streamed admission gets key 1, a streamed hit keeps its key."""
    name = "Segmented"
    PROTECTED = 1 << 40

    def __init__(self, period: int = 0):
        self.period = period

    def start(self, slots):
        self.p = self.period or self.layers

    def hit_key(self, slot, pair, now, stream, nxt):
        return self.key[slot] if stream else self.PROTECTED + 2 + now // self.p

    def admit_key(self, slot, pair, now, stream, level, nxt):
        return STREAMED if stream else 2 + now // self.p


class Opportunity(Policy):
    """Victims by missed routing turns: the stored value is the LRU stamp (now on decode hit and
    admission; 1 on a streamed admission, kept on a streamed hit); at each call, a slot's age is
    a = now - 1 - stamp, its class m = a // layers (the decode turns of its layer it missed: one
    call per layer per token), and the key is (-m, -stamp): the class that missed the most turns
    first (LRU across classes), and within a class the most recently used first (its next turn is
    the farthest). Free slots first, then streamed rows, in ascending slot order; ties (one stamp)
    in ascending slot order.

    On the device the key is derived where the stamps are loaded (`device_key`; the pool's clock
    starts at 1 there, so that no call stamps 1): for a stamp >= 2, key = now - layers * (a //
    layers) + a % layers (= stamp + 1 + 2 * (a % layers)), between 3 and now + layers; 0 for a free
    slot, 1 for a streamed row. Distinct stamps give distinct keys, so a call walks one level per
    distinct stamp among its victims, as LRU does. Here `stamp[slot]` holds that device stamp
    (the simulator's now + 1)."""
    name = "Opportunity"

    @staticmethod
    def device_key(last_use: int, now: int, layers: int) -> int:
        """The key the kernel computes from a slot's last_use at call `now` (device clock: the
        simulator's now + 1); 0 for a free slot, 1 for a streamed row."""
        if last_use <= STREAMED:
            return last_use
        a = now - 1 - last_use
        return now - layers * (a // layers) + a % layers

    def reset(self, slots, layers):
        self.layers = layers
        self.stamp = [0] * slots
        self.free = list(range(slots))  # ascending: a heap already
        self.members: Dict[int, set] = {}
        self.stamps: List[int] = []       # heap of the stamps that have members (lazy)
        self.in_heap: set = set()
        self.order: List[Tuple[int, int]] = []  # the current call's victims still to give, reversed
        self.popped: List[int] = []
        self.call = -1

    def _place(self, slot, t):
        old = self.stamp[slot]
        if old:
            bucket = self.members[old]
            bucket.discard(slot)
            if not bucket:
                del self.members[old]
        self.stamp[slot] = t
        bucket = self.members.get(t)
        if bucket is None:
            self.members[t] = {slot}
            if t not in self.in_heap:
                self.in_heap.add(t)
                heapq.heappush(self.stamps, t)
        else:
            bucket.add(slot)

    def hit(self, slot, pair, now, stream, nxt):
        if not stream:
            self._place(slot, now + 1)  # the device stamp: its clock is one ahead, so that 1 means streamed

    def admit(self, slot, pair, now, stream, level, nxt):
        self._place(slot, STREAMED if stream else now + 1)

    def take(self, now, touched):
        if self.call != now:
            self.call, self.order = now, []
        if self.free:
            return heapq.heappop(self.free), 0
        while not self.order:
            self._next_class(now + 1, touched)
        return self.order.pop()

    def _next_class(self, cur, touched):
        stamps, members = self.stamps, self.members
        while stamps and stamps[0] not in members:
            self.in_heap.discard(heapq.heappop(stamps))
        if not stamps or stamps[0] >= cur:
            raise RuntimeError("no eligible victim: the call routes more experts than the cache holds")
        oldest = stamps[0]
        if oldest == STREAMED:
            hi = STREAMED
        else:
            hi = cur - 1 - ((cur - 1 - oldest) // self.layers) * self.layers  # the class's newest stamp
        cls = []
        while stamps and stamps[0] <= hi:
            t = heapq.heappop(stamps)
            self.in_heap.discard(t)
            if t in members:
                cls.append(t)
        self.popped.extend(cls)
        order = []
        for t in reversed(cls):  # the newest stamp of the class first
            order.extend((s, t) for s in sorted(members[t]) if s not in touched)
        order.reverse()
        self.order = order

    def end_call(self):
        for t in self.popped:
            if t in self.members and t not in self.in_heap:
                self.in_heap.add(t)
                heapq.heappush(self.stamps, t)
        self.popped.clear()
        self.order = []


DEFAULT_HIT_DENSITY = (0.9, 0.8, 0.85, 0.3, 64.0)  # the runtime's "hitdensity" (src/common/eviction_policy.h)


class HitDensity(Policy):
    """Victims by the lowest hit density over the next two turns of their layer: per (layer, expert)
    pair the kernel keeps the clock of its last decode use, B (the share of its uses followed by a
    use at the very next turn of its layer, an average with weight 0.1 on the newest) and D (the mean
    gap, in missed turns, of its other reuses, weight 0.2 on the newest); starting values B = 0.3,
    D = 64. A slot whose pair was last used a = now - last_use calls ago has missed m = a // L turns
    and its next turn is t = L - a % L calls away; it is used at that turn with probability
    q0 = B if m == 0 else 1 / max(D, 0.85 m), at the one after with q1 = 1 / max(D, 0.85 (m + 1)),
    and its key is the float32 bit pattern of (q0 + (1 - q0) q1) / (t + (1 - q0) L) plus 2 (expected
    hits per slot-call until then). Free slots (0) and streamed rows (1) first; ties in ascending
    slot order.

    State on the device: last_use per slot as today (0 free, 1 a streamed row: async_layer_copy
    writes 1 and leaves the stamps of resident rows alone, so the pool's clock starts at 1), and per
    pair an int64 stamp and two float32 (B, D), mirrored per slot (two float32, or one word of two
    halves) when the slot is hit or admitted, so the kernel keys a slot from its own row. Update on a
    decode hit or admission of pair p at clock now (float32, each product and sum rounded): if p was
    used before, g = max(0, (now - stamp_p) // L - 1) turns missed; B = 0.9 B + 0.1 [g == 0]; if
    g >= 1, D = 0.8 D + 0.2 g; then stamp_p = now and last_use = now. A streamed admission writes
    last_use = 1 and leaves the pair's state alone; a streamed hit changes nothing. Keys are always
    32 bits (the float of a value in (0, 1] is below 2^30); one level per distinct key among the
    victims (about one per victim: keys rarely tie).
    """
    name = "HitDensity"

    def __init__(self, gamma_b: float = 0.9, gamma_d: float = 0.8, kappa: float = 0.85,
                 b0: float = 0.3, d0: float = 64.0, shift: int = 0):
        self.params = (gamma_b, gamma_d, kappa, b0, d0)
        self.shift = shift  # keep only the top 32 - shift bits of the float (coarser keys, fewer levels)

    def reset(self, slots, layers):
        import numpy as np
        f = np.float32
        gb, gd, kappa, b0, d0 = self.params
        self.np, self.layers = np, layers
        self.gb, self.gb1, self.gd, self.gd1 = f(gb), f(1 - gb), f(gd), f(1 - gd)
        self.kappa, self.b0, self.d0 = f(kappa), f(b0), f(d0)
        self.stamp = np.zeros(slots, np.int64)        # last_use: 0 free, 1 streamed, else the device clock
        self.sb = np.full(slots, self.b0, np.float32)  # the owner's (B, D), mirrored per slot
        self.sd = np.full(slots, self.d0, np.float32)
        self.pair: Dict[int, tuple] = {}              # pair -> (stamp, B, D)
        self.call, self.order, self.pos = -1, None, 0

    def _use(self, slot, pair, t):
        st, b, d = self.pair.get(pair, (0, self.b0, self.d0))
        if self.params == DEFAULT_HIT_DENSITY:  # the runtime's rule (ft_ops/policies.py), bit for bit
            b, d = hit_density_after_use(b, d, st, t, self.layers)
        elif st:
            f = self.np.float32
            g = max(0, (t - st) // self.layers - 1)
            b = self.gb * b + self.gb1 * f(g == 0)
            if g >= 1:
                d = self.gd * d + self.gd1 * f(g)
        self.pair[pair] = (t, b, d)
        self.stamp[slot], self.sb[slot], self.sd[slot] = t, b, d

    def hit(self, slot, pair, now, stream, nxt):
        if not stream:
            self._use(slot, pair, now + 1)  # the device clock: one ahead, so that 1 means streamed

    def admit(self, slot, pair, now, stream, level, nxt):
        if stream:
            self.stamp[slot] = STREAMED
        else:
            self._use(slot, pair, now + 1)

    @staticmethod
    def device_keys(last_use, b, d, now: int, layers: int, kappa: float = 0.85, shift: int = 0):
        """The keys the kernel computes (numpy arrays of last_use, B and D per slot; `now` the device
        clock): float32 arithmetic, each operation rounded on its own (no fused multiply-add), as
        __fmul_rn / __fadd_rn / __fdiv_rn give on the GPU."""
        import numpy as np
        f = np.float32
        a = now - last_use
        m = a // layers
        t = (layers - a % layers).astype(np.float32)
        k = f(kappa)
        mf = m.astype(np.float32)
        q0 = np.where(m == 0, b, f(1) / np.maximum(d, k * mf)).astype(np.float32)
        q1 = (f(1) / np.maximum(d, k * (mf + f(1)))).astype(np.float32)
        miss = f(1) - q0
        hd = ((q0 + miss * q1) / (t + miss * f(layers))).astype(np.float32)
        key = (hd.view(np.uint32).astype(np.int64) >> shift) + 2
        return np.where(last_use <= STREAMED, last_use, key)

    def victim_keys(self, now):
        """Every slot's key at this call (the device's)."""
        return self.device_keys(self.stamp, self.sb, self.sd, now + 1, self.layers, float(self.kappa), self.shift)

    def take(self, now, touched):
        if self.call != now:
            keys = self.victim_keys(now)
            idx = self.np.argsort(keys, kind="stable")  # ascending (key, slot)
            self.call, self.keys, self.order, self.pos = now, keys, idx.tolist(), 0
        order = self.order
        while self.pos < len(order):
            s = order[self.pos]
            self.pos += 1
            if s not in touched:
                return s, int(self.keys[s])
        raise RuntimeError("no eligible victim: the call routes more experts than the cache holds")

    def end_call(self):
        self.call = -1


def serve_call(policy: Policy, slot_of: Dict[int, int], owner: List[int], pairs: Sequence[int], now: int,
               stream: bool, nxt: Optional[Sequence[int]] = None) -> Tuple[int, List[Tuple[int, int]], set]:
    """One call (distinct pairs in rank order) through a cache: its hits, then each miss in rank
    order takes the policy's next victim and is admitted there. `slot_of` maps the resident pairs to
    their slots, `owner` each slot to its pair (-1: free); both are updated. Returns the hits, the
    admissions as (pair, slot) in rank order, and the victims' levels."""
    policy.begin_call(pairs, now, stream)
    touched, missing = set(), []
    for j, p in enumerate(pairs):
        s = slot_of.get(p, -1)
        if s >= 0:
            policy.hit(s, p, now, stream, nxt[j] if nxt is not None else 0)
            touched.add(s)
        else:
            missing.append(j)
    plan, levels = [], set()
    for j in missing:
        s, level = policy.take(now, touched)
        levels.add(level)
        old = owner[s]
        if old >= 0:
            del slot_of[old]
        p = pairs[j]
        owner[s], slot_of[p] = p, s
        policy.admit(s, p, now, stream, level, nxt[j] if nxt is not None else 0)
        touched.add(s)
        plan.append((p, s))
    if missing:
        policy.end_call()
    return len(pairs) - len(missing), plan, levels


class _ShadowCache:
    """A cache of the same size replaying decode calls under its own policy, for Duel: only its
    slot maps, the policy's state and its own clock (one tick a replayed call, as the runtime's
    shadows count: ft_ops/shadow_caches.py), and the hits it would have had."""

    def __init__(self, policy: Policy, slots: int, layers: int):
        self.policy, self.owner, self.slot_of, self.now = policy, [-1] * slots, {}, 0
        policy.reset(slots, layers)

    def replay(self, pairs: Sequence[int]) -> int:
        self.now += 1
        return serve_call(self.policy, self.slot_of, self.owner, pairs, self.now, False)[0]


class Duel(HitDensity):
    """Hit density's victims, or LRU's while an LRU cache of the same size would have hit more of the
    recent calls: two shadow caches, one evicting by LRU and one by hit density, replay every decode
    call after it is served (streamed prompt layers reach only the real cache); a score, decayed by
    `gamma` each call, adds the LRU shadow's hits minus the hit-density shadow's; a call whose score
    is above 0 takes its victims in ascending (last use, slot) (free, then streamed rows, then the
    least recently used), otherwise by hit density's keys.

    The runtime's "duel" policy (ft_ops/policies.py; a test checks that the ops hit exactly as this
    does): its state is hit density's plus the shadows', each a slot map, its policy's state and its
    own clock, which only replayed calls advance. The ops read the shadows' hits as counters and
    keep the score as a double, which is what this float is."""
    name = "Duel"

    def __init__(self, gamma: float = 0.99):
        super().__init__()
        self.gamma = gamma

    def reset(self, slots, layers):
        super().reset(slots, layers)
        self.shadows = (_ShadowCache(LRU(), slots, layers), _ShadowCache(HitDensity(), slots, layers))
        self.shadow_hits = [0, 0]  # LRU's, hit density's
        self.score, self.served = 0.0, []

    def _replay_served(self):
        if self.served:
            lru, hd = (shadow.replay(self.served) for shadow in self.shadows)
            self.shadow_hits[0] += lru
            self.shadow_hits[1] += hd
            self.score = self.gamma * self.score + (lru - hd)
        self.served = []

    def begin_call(self, pairs, now, stream):
        """The previous decode call is served: both shadows replay it before this call's victims."""
        self._replay_served()
        if not stream:
            self.served = list(pairs)

    def flush(self) -> None:
        """Replays the last call served in the shadows (the next call's begin_call does it otherwise)."""
        self._replay_served()

    def victim_keys(self, now):
        if self.score > 0:
            return self.stamp.copy()  # LRU's keys: last use (0 free, 1 streamed)
        return super().victim_keys(now)


class RoutingOracle(Policy):
    """Hit density's form with the true probabilities of synthetic routing
    (ft_ops.synthetic_routing): a reference for the online rules, not one the runtime could run (it
    reads the generator's popularity of every expert, which no model publishes). A pair comes back
    at its layer's next turn with qz = 1 - (1 - p)^(k (1 - r)) (p its Zipf probability, r the repeat
    probability, k the top-k), or with r + (1 - r) qz if its layer's last turn used it; its key is
    the expected hits per slot-call over its next two turns, (q0 + (1 - q0) qz) / (t + (1 - q0) L),
    t the calls to its next turn. Free slots, then streamed rows first; ties in ascending slot order.
    """
    name = "RoutingOracle"

    def __init__(self, popularity, repeat: float, top_k: int):
        import numpy as np
        p = np.asarray(popularity, dtype=np.float64)  # [layers, experts]
        self.np, self.experts = np, p.shape[1]
        self.qz = (1.0 - (1.0 - p) ** (top_k * (1.0 - repeat))).ravel()
        self.qp = repeat + (1.0 - repeat) * self.qz

    def reset(self, slots, layers):
        np = self.np
        if layers * self.experts != self.qz.size:
            raise ValueError(f"the popularity covers {self.qz.size} pairs, the trace {layers} x {self.experts}")
        self.layers = layers
        self.owner = np.full(slots, -1, np.int64)
        self.streamed = np.zeros(slots, bool)
        self.last_use = np.full(self.qz.size, -1, np.int64)  # per pair: the call of its last decode use
        self.layer_turn = np.full(layers, -2, np.int64)      # per layer: the call of its last decode turn
        self.layer_now, self.order = 0, None

    def begin_call(self, pairs, now, stream):
        self.layer_now = pairs[0] // self.experts
        if not stream:
            self.layer_turn[self.layer_now] = now
            self.last_use[list(pairs)] = now

    def hit(self, slot, pair, now, stream, nxt):
        if not stream:  # a decode hit makes a streamed row a decode row (begin_call records the use)
            self.streamed[slot] = False

    def admit(self, slot, pair, now, stream, level, nxt):
        self.owner[slot], self.streamed[slot] = pair, stream

    def keys(self):
        np, L = self.np, self.layers
        pair = np.maximum(self.owner, 0)
        layer = pair // self.experts
        t = (layer - self.layer_now) % L
        t = np.where(t == 0, L, t).astype(np.float64)
        q0 = np.where(self.last_use[pair] == self.layer_turn[layer], self.qp[pair], self.qz[pair])
        key = (q0 + (1.0 - q0) * self.qz[pair]) / (t + (1.0 - q0) * L)
        return np.where(self.owner < 0, -2.0, np.where(self.streamed, -1.0, key))

    def take(self, now, touched):
        if self.order is None:
            self.key_now = self.keys()
            self.order, self.pos = self.np.argsort(self.key_now, kind="stable").tolist(), 0
        while self.pos < len(self.order):
            s = self.order[self.pos]
            self.pos += 1
            if s not in touched:
                return s, float(self.key_now[s])
        raise RuntimeError("no eligible victim: the call routes more experts than the cache holds")

    def end_call(self):
        self.order = None


class SequenceOracle(RoutingOracle):
    """RoutingOracle's key with each sequence's own per-pair statistics in place of a generator's: a
    reference for recorded traces, not a rule any runtime could run (it counts the sequence's
    future). Over the decode steps of the sequence being replayed, per pair, qp = P(used at its
    layer's turn | used at the turn before) and qz = P(used | not used at the turn before), smoothed
    as (n + 0.25) / (d + 0.5) and (n + 0.025) / (d + 0.5); the key, the free slots and streamed rows
    as RoutingOracle's. The tables switch when the replay's decode calls reach the next sequence:
    the replay must be requests_from_trace(trace) of the same trace (every decode step of every
    sequence, in order); more decode calls than the trace holds are refused."""
    name = "SequenceOracle"

    def __init__(self, trace):
        import numpy as np
        self.np, self.experts = np, trace.experts
        layers, experts = trace.layers, trace.experts
        self.tables, self.ends, calls = [], [], 0
        for i in range(len(trace.sequences)):
            steps = trace.decode_steps(i).numpy()  # [tokens, layers, top_k]
            used = np.zeros((steps.shape[0], layers * experts), bool)
            token = np.arange(steps.shape[0])[:, None]
            for layer in range(layers):
                used[token, layer * experts + steps[:, layer, :]] = True
            before, after = used[:-1], used[1:]
            qp = ((before & after).sum(0) + 0.25) / (before.sum(0) + 0.5)
            qz = ((~before & after).sum(0) + 0.025) / ((~before).sum(0) + 0.5)
            self.tables.append((qz, qp))
            calls += steps.shape[0] * layers
            self.ends.append(calls)

    def reset(self, slots, layers):
        self.sequence, self.decode_calls = 0, 0
        self.qz, self.qp = self.tables[0]
        super().reset(slots, layers)

    def begin_call(self, pairs, now, stream):
        if not stream:
            while self.sequence + 1 < len(self.tables) and self.decode_calls >= self.ends[self.sequence]:
                self.sequence += 1
                self.qz, self.qp = self.tables[self.sequence]
            if self.decode_calls >= self.ends[-1]:
                raise ValueError(f"the replay has more decode calls than the trace's {self.ends[-1]}: "
                                 "replay requests_from_trace of the trace the oracle counted")
            self.decode_calls += 1
        super().begin_call(pairs, now, stream)


CANDIDATES = (TokenLRU, FrequencyBonus, Segmented, Opportunity, HitDensity, Duel)


def policies() -> List[Policy]:
    """LRU, the candidates (default parameters) and Belady, in table order."""
    return [LRU()] + [c() for c in CANDIDATES] + [Belady()]


# --- the simulator -------------------------------------------------------------------------------
@dataclass
class Result:
    policy: str
    slots: int
    hits: int = 0
    distinct: int = 0
    admitted: int = 0            # decode admissions (copies over the link)
    stream_admitted: int = 0     # admissions of streamed prompt layers
    miss_calls: int = 0          # decode calls that took victims
    levels: int = 0              # distinct victim keys (levels the kernel walks) per such call, summed
    max_levels: int = 0          # the most levels one call took victims from

    @property
    def hit_rate(self) -> float:
        return self.hits / self.distinct if self.distinct else 1.0

    @property
    def mean_levels(self) -> float:
        return self.levels / self.miss_calls if self.miss_calls else 0.0

    def as_dict(self) -> dict:
        return dict(policy=self.policy, slots=self.slots, hit_rate=self.hit_rate, hits=self.hits,
                    distinct=self.distinct, admitted=self.admitted, stream_admitted=self.stream_admitted,
                    miss_calls=self.miss_calls, mean_levels=round(self.mean_levels, 3), max_levels=self.max_levels)


def simulate(policy: Policy, requests: Requests, slots: int, observe=None) -> Result:
    """Runs every call of `requests` through a cache of `slots` slots under `policy`.
    `observe(call_index, chunk, slot_ids, plan, owner)`, when given, is called after each call (each
    chunk of a streamed layer) with the slots of the chunk's pairs, its admissions as (pair, slot)
    in rank order, and the owner (flat pair id or -1) of every slot."""
    if slots < requests.max_call:
        raise ValueError(f"a cache of {slots} slots is below one call's {requests.max_call} routed experts")
    slot_of: Dict[int, int] = {}
    owner = [-1] * slots
    policy.reset(slots, requests.layers)
    next_use = requests.next_use() if policy.future else None
    res = Result(policy.name, slots)
    now = 0
    for ci, call in enumerate(requests.pairs):
        is_stream = requests.stream[ci]
        nxt_all = next_use[ci] if next_use is not None else None
        step = min(len(call), slots) if is_stream else max(1, len(call))
        for lo in range(0, len(call), step):
            chunk = call[lo:lo + step] if is_stream else call
            nxt = nxt_all[lo:lo + len(chunk)] if nxt_all is not None else None
            now += 1
            hits, plan, levels = serve_call(policy, slot_of, owner, chunk, now, is_stream, nxt)
            if is_stream:
                res.stream_admitted += len(plan)
            else:
                res.distinct += len(chunk)
                res.hits += hits
                res.admitted += len(plan)
                if plan:  # a streamed layer is copied by async_layer_copy, not the level kernels
                    res.miss_calls += 1
                    res.levels += len(levels)
                    res.max_levels = max(res.max_levels, len(levels))
            if observe is not None:
                observe(ci, chunk, [slot_of.get(p, -1) for p in chunk], plan, owner)
    return res
