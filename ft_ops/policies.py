"""The slot pool's eviction policies, as `dedup_and_admit` and `async_layer_copy` take them (the
`policy` argument). docs/ops.md states them; ft_ops/eviction.py compares them offline.

- "lru" (0): victims in ascending (last_use, slot); streamed rows and the resident rows a stream
  keeps are stamped `now`.
- "opportunity" (1): the same stamps on decode hits and admissions, victims by the decode turns
  of their layer they missed (one call per layer per token), the most missed first, and within
  as many missed turns the most recently used first (its layer's next turn is the farthest). A
  stream stamps the rows it writes STREAMED (1) and leaves resident rows' stamps alone, so a
  prompt does not make its layers look recent. The pool's clock starts at 1.
- "hitdensity" (2): stamps and streams as "opportunity"; per (layer, expert) pair a state kept
  across evictions (the clock of its last decode use and two float32 estimates of how soon it is
  reused, `hit_density_after_use`), mirrored by the slot that holds it; victims by the least
  expected hits per slot-call until the pair's next turns (`hit_density_key`). The state lives in
  the pool's `policy_state` (int64 [2 L E + S], `new_policy_state`).
- "duel" (3): hit density's state, stamps and keys, or LRU's keys (the stamp) while an LRU cache of
  the pool's size would have hit more of the recent decode calls than a hit-density one: two shadow
  caches (ft_ops/shadow_caches.py) replay every admission call of the pool and count their hits into
  DUEL_WORDS more words of the policy state; each call folds the hits since the last call into a
  score (`duel_next`) and takes LRU's keys while it is above 0.
"""
import struct
from typing import Optional, Tuple

import numpy as np
import torch

LRU, OPPORTUNITY, HIT_DENSITY, DUEL = 0, 1, 2, 3
POLICIES = {"lru": LRU, "opportunity": OPPORTUNITY, "hitdensity": HIT_DENSITY, "duel": DUEL}
# The policy of every pool that names none: Duel takes hit density's victims, which hit the most on
# the calibrated and trained-model traces, except while LRU would have hit more (the random-weight
# model's trace, where hit density alone fell up to 5.4 points below LRU through the runtime); it
# stays within 0.3 point of LRU on every recorded trace (0.1 offline), and its shadows cost 2 % of
# compiled decode's tokens/s end to end (docs/performance.md, "Eviction" and "End to end").
DEFAULT_EVICTION = "duel"
STREAMED = 1  # the stamp of a streamed row under OPPORTUNITY and HIT_DENSITY

# HIT_DENSITY's constants (src/common/eviction_policy.h, namespace hit_density).
HD_B0, HD_D0 = np.float32(0.3), np.float32(64.0)
HD_KEEP_B, HD_NEW_B = np.float32(0.9), np.float32(0.1)
HD_KEEP_D, HD_NEW_D = np.float32(0.8), np.float32(0.2)
HD_KAPPA = np.float32(0.85)
HD_FLUSH_B = np.float32(2.0 ** -24)

# DUEL's words after hit density's state (src/common/eviction_policy.h, namespace duel): the LRU
# shadow's counters (calls, routed, distinct, admitted), the hit-density shadow's, the score (a
# double's bits), what the last call saw (the shadows' calls and each one's hits), a second copy of
# each shadow's counters and the count R of the pool's calls replayed in the shadows. A replay
# writes the copy its shadow did not write last, so the latest counters are copy R % 2.
DUEL_WORDS = 21
DUEL_LRU_COUNTERS, DUEL_DENSITY_COUNTERS, DUEL_SCORE = slice(0, 4), slice(4, 8), 8
DUEL_LRU_COUNTERS_ODD, DUEL_DENSITY_COUNTERS_ODD, DUEL_REPLAYS = slice(12, 16), slice(16, 20), 20
DUEL_GAMMA = 0.99


def policy_id(name: Optional[str]) -> int:
    """A policy's id from its name; None names the default (DEFAULT_EVICTION), as for the other
    options whose None means "the default"."""
    if name is None:
        name = DEFAULT_EVICTION
    if not isinstance(name, str) or name not in POLICIES:
        raise ValueError(f"unknown eviction policy {name!r}; expected one of {sorted(POLICIES)}")
    return POLICIES[name]


def policy_name(policy: int) -> str:
    """The name of a policy id ("hitdensity" for 2)."""
    return next(name for name, pid in POLICIES.items() if pid == policy)


def streams_stamped(policy: int) -> bool:
    """Whether streamed rows are stamped STREAMED and kept rows keep their stamps (the pool's clock
    then starts at 1, so that no call stamps 1)."""
    return policy in (OPPORTUNITY, HIT_DENSITY, DUEL)


def keeps_hit_density(policy: int) -> bool:
    """Whether the policy keeps hit density's per-pair state and slot mirrors."""
    return policy in (HIT_DENSITY, DUEL)


def duel_next(words) -> Tuple[list, bool]:
    """DUEL's words after a call's start, from the DUEL_WORDS words before it, and whether the call
    takes LRU's keys: if the shadows replayed a call since the last (the LRU shadow's call counter
    moved), score = 0.99 score + (the LRU shadow's new hits - the hit-density shadow's), a shadow's
    hits being its distinct minus its admitted; LRU's keys while the score is above 0."""
    w = [int(x) for x in words]
    lru, density = duel_counters(w)
    calls = lru[0]
    lru_hits, density_hits = lru[2] - lru[3], density[2] - density[3]
    score = struct.unpack("<d", struct.pack("<q", w[DUEL_SCORE]))[0]
    if calls != w[9]:
        score = DUEL_GAMMA * score + float((lru_hits - w[10]) - (density_hits - w[11]))
    w[DUEL_SCORE] = struct.unpack("<q", struct.pack("<d", score))[0]
    w[9:12] = [calls, lru_hits, density_hits]
    return w, score > 0.0


def duel_counters(words) -> Tuple[list, list]:
    """The shadows' latest (calls, routed, distinct, admitted), LRU's then hit density's, from
    DUEL's words: copy R % 2 after the pool's R replayed calls."""
    w = [int(x) for x in words]
    odd = w[DUEL_REPLAYS] % 2 == 1
    return (w[DUEL_LRU_COUNTERS_ODD] if odd else w[DUEL_LRU_COUNTERS],
            w[DUEL_DENSITY_COUNTERS_ODD] if odd else w[DUEL_DENSITY_COUNTERS])


def duel_count_replay(words, shadow: int, routed: int, distinct: int, admitted: int) -> None:
    """A shadow's replay of a call (0 LRU, 1 hit density) counted into DUEL's words (a list or
    tensor, in place): its counters' copy with the fewer calls (the odd one on a tie) becomes the
    other plus (1, routed, distinct, admitted)."""
    even, odd = ((DUEL_LRU_COUNTERS, DUEL_LRU_COUNTERS_ODD) if shadow == 0
                 else (DUEL_DENSITY_COUNTERS, DUEL_DENSITY_COUNTERS_ODD))
    latest, other = (odd, even) if int(words[odd][0]) > int(words[even][0]) else (even, odd)
    c = [int(x) for x in words[latest]]
    new = [c[0] + 1, c[1] + routed, c[2] + distinct, c[3] + admitted]
    if isinstance(words, list):
        words[other] = new
    else:
        words[other] = torch.tensor(new, dtype=words.dtype, device=words.device)


def victim_key(last_use: int, now: int, layers: int, policy: int, estimates: Tuple = (HD_B0, HD_D0)) -> int:
    """The order victims are taken in (ascending, then by slot). LRU: the stamp. OPPORTUNITY, with
    a = now - 1 - last_use: now - L floor(a / L) + (a mod L); HIT_DENSITY: hit_density_key with the
    slot's mirrored `estimates` (B, D); free slots (0) and streamed rows (1) first. (DUEL keys as
    LRU or as HIT_DENSITY, by duel_next: pass the one its call takes.)"""
    if policy not in (LRU, OPPORTUNITY, HIT_DENSITY):
        raise ValueError(f"victim_key takes LRU, OPPORTUNITY or HIT_DENSITY, got {policy} (a DUEL call keys as one "
                         "of LRU and HIT_DENSITY: duel_next says which)")
    if policy == LRU or last_use <= STREAMED:
        return last_use
    if policy == HIT_DENSITY:
        return hit_density_key(last_use, now, layers, *estimates)
    a = now - 1 - last_use
    return now - layers * (a // layers) + a % layers


def hit_density_after_use(b, d, stamp: int, now: int, layers: int) -> Tuple[np.float32, np.float32]:
    """A pair's (B, D) after a decode use at clock `now`, last used at `stamp` (0: never): with
    g = max(0, (now - stamp) // L - 1) turns of its layer missed, B = 0.9 B + 0.1 [g == 0] (0 below
    2^-24) and, if g >= 1, D = 0.8 D + 0.2 g; every float32 operation rounded on its own."""
    b, d = np.float32(b), np.float32(d)
    if stamp == 0:
        return b, d
    g = max(0, (now - stamp) // layers - 1)
    b = np.float32(np.float32(HD_KEEP_B * b) + (HD_NEW_B if g == 0 else np.float32(0)))
    if b < HD_FLUSH_B:
        b = np.float32(0)
    if g >= 1:
        d = np.float32(np.float32(HD_KEEP_D * d) + np.float32(HD_NEW_D * np.float32(g)))
    return b, d


def hit_density_key(last_use: int, now: int, layers: int, b, d) -> int:
    """HIT_DENSITY's key of an eligible slot (last_use < now) whose pair has estimates (B, D): with
    a = now - last_use, m = a // L turns missed, t = L - a % L calls to its next turn,
    q0 = B if m == 0 else 1 / max(D, 0.85 m), q1 = 1 / max(D, 0.85 (m + 1)):
    2 + the float32 bits of (q0 + (1 - q0) q1) / (t + (1 - q0) L)."""
    if last_use <= STREAMED:
        return last_use
    f = np.float32
    a = now - last_use
    m, r = a // layers, a % layers
    mf, t, lf = f(m), f(layers - r), f(layers)
    b, d = f(b), f(d)
    q0 = b if m == 0 else f(f(1) / max(d, f(HD_KAPPA * mf)))
    q1 = f(f(1) / max(d, f(HD_KAPPA * f(mf + f(1)))))
    miss = f(f(1) - q0)
    density = f(f(q0 + f(miss * q1)) / f(t + f(miss * lf)))
    return int(density.view(np.uint32)) + 2


def pack_estimates(b, d) -> int:
    """One int64 word: B's float32 bits in the low half, D's in the high half."""
    lo = struct.unpack("<I", struct.pack("<f", float(np.float32(b))))[0]
    hi = struct.unpack("<I", struct.pack("<f", float(np.float32(d))))[0]
    word = (hi << 32) | lo
    return word - (1 << 64) if word >= 1 << 63 else word


def unpack_estimates(word: int) -> Tuple[np.float32, np.float32]:
    u = word & ((1 << 64) - 1)
    b = struct.unpack("<f", struct.pack("<I", u & 0xFFFFFFFF))[0]
    d = struct.unpack("<f", struct.pack("<I", u >> 32))[0]
    return np.float32(b), np.float32(d)


def new_policy_state(policy: int, layers: int, experts: int, slots: int, device) -> Optional[torch.Tensor]:
    """The pool's policy state: None but for HIT_DENSITY, whose int64 [2 L E + S] holds the pairs'
    clocks (0), then the pairs' estimates and the slots' mirrors, each (B0, D0) packed, and DUEL,
    which adds its DUEL_WORDS words (0: no shadow call seen, score 0.0)."""
    if not keeps_hit_density(policy):
        return None
    extra = DUEL_WORDS if policy == DUEL else 0
    state = torch.empty((2 * layers * experts + slots + extra,), dtype=torch.int64)
    reset_policy_state(state, layers, experts, slots)
    return state.to(device)


def reset_policy_state(state: Optional[torch.Tensor], layers: int, experts: int, slots: int) -> None:
    """Forgets every pair's history (in place), and Duel's score and counters."""
    if state is not None:
        pairs = layers * experts
        state.fill_(pack_estimates(HD_B0, HD_D0))
        state[:pairs].zero_()
        state[2 * pairs + slots:].zero_()
