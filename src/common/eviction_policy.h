// The slot pool's eviction policies (ft_ops/policies.py), shared by the CPU and CUDA kernels. No
// torch headers here, so the CUDA admission kernels can include it.
#pragma once

#include <cstdint>
#include <cstring>

#include "admitted_count.h"  // FT_HOST_DEVICE

namespace ft {

enum class EvictionPolicy : int64_t { kLru = 0, kOpportunity = 1, kHitDensity = 2, kDuel = 3 };

// Whether the policy keeps hit density's per-pair state and mirrors (hit density, and Duel, which
// keys by it unless its shadows say LRU).
constexpr bool keeps_hit_density(EvictionPolicy p) { return p == EvictionPolicy::kHitDensity || p == EvictionPolicy::kDuel; }

// A streamed row's stamp under kOpportunity (the pool's clock starts at 1, so no call stamps it).
constexpr int64_t kStreamedStamp = 1;

// The bits of `v` as a value of type To of the same size (std::bit_cast, for device code too:
// a copy of a register's bytes compiles to a move).
template <typename To, typename From>
FT_HOST_DEVICE inline To same_bits(From v) {
  static_assert(sizeof(To) == sizeof(From), "same_bits reinterprets a value of one size");
  To out;
  memcpy(&out, &v, sizeof(out));
  return out;
}

// A slot's victim key (victims in ascending (key, slot)): LRU, the stamp; opportunity, with
// a = now - 1 - last_use (one call per layer per decode token), now - L floor(a / L) + (a mod L):
// the most missed turns of its layer first, and among those the most recently used (its next turn
// is the farthest); free slots (0) and streamed rows (1) first. Keys stay below now + layers.
// Only for eligible slots (last_use < now): C++ division truncates, so a < 0 would not give the
// reference's (floored) key. Under kOpportunity the pool's clock must have started at 1.
FT_HOST_DEVICE inline int64_t victim_key(int64_t last_use, int64_t now, int64_t layers, bool opportunity) {
  if (!opportunity || last_use <= kStreamedStamp) return last_use;
  const int64_t a = now - 1 - last_use;
  return now - layers * (a / layers) + a % layers;
}

// --- hit density (ft_ops/policies.py, HIT_DENSITY; the offline model is ft_ops/eviction.py's HitDensity) ---
// Per (layer, expert) pair the policy keeps the clock of its last decode use and two float32
// estimates: B, the share of its uses followed by a use at the very next turn of its layer, and D,
// the mean gap, in missed turns, of its other reuses. The slot that holds the pair mirrors (B, D),
// so the kernels key a slot from its own row. Layout of the policy's state (int64 [2 L E + S]):
// [0, L E) the pairs' clocks (0: never used in decode), [L E, 2 L E) the pairs' estimates, then the
// slots' mirrors; an estimate word holds B's float bits in its low half and D's in its high half.
// Every float operation is rounded on its own (no fused multiply-add), so the CPU, the GPU and
// numpy agree bit for bit.
namespace hit_density {

constexpr float kB0 = 0.3f, kD0 = 64.0f;      // a pair's estimates before its first reuse
constexpr float kKeepB = 0.9f, kNewB = 0.1f;  // B's running average: weight 0.1 on the newest use
constexpr float kKeepD = 0.8f, kNewD = 0.2f;  // D's: weight 0.2 on the newest gap
constexpr float kKappa = 0.85f;               // a pair that missed m turns is used with probability <= 1 / (0.85 m)
constexpr float kFlushB = 5.9604645e-8f;      // 2^-24: a smaller B is 0 (never subnormal: GPUs flush those)

FT_HOST_DEVICE inline float fmax2(float a, float b) { return a > b ? a : b; }
FT_HOST_DEVICE inline float to_float(int64_t v) {
#if defined(__CUDA_ARCH__)
  return __ll2float_rn(v);
#else
  return static_cast<float>(v);
#endif
}


struct Estimates {
  float b, d;
};

FT_HOST_DEVICE inline int64_t pack(Estimates e) {
  return static_cast<int64_t>((static_cast<uint64_t>(same_bits<uint32_t>(e.d)) << 32) | same_bits<uint32_t>(e.b));
}
FT_HOST_DEVICE inline Estimates unpack(int64_t w) {
  const uint64_t u = static_cast<uint64_t>(w);
  return Estimates{same_bits<float>(static_cast<uint32_t>(u)), same_bits<float>(static_cast<uint32_t>(u >> 32))};
}

// The estimates of a pair used in decode at clock `now`, last used at `stamp` (0: never), with
// L layers (one call per layer per token): g = (now - stamp) / L - 1 turns of its layer missed in
// between (at least 0); B moves toward [g == 0], D toward g when g >= 1.
// after_turns takes (now - stamp) / L from its caller (the kernels compute it without a 64-bit
// division); after_use divides.
FT_HOST_DEVICE inline Estimates after_turns(Estimates e, int64_t stamp, int64_t turns) {
  if (stamp == 0) return e;
  const int64_t g = turns >= 1 ? turns - 1 : 0;
  float b = add_rn(mul_rn(kKeepB, e.b), g == 0 ? kNewB : 0.0f);
  if (b < kFlushB) b = 0.0f;
  const float d = g >= 1 ? add_rn(mul_rn(kKeepD, e.d), mul_rn(kNewD, to_float(g))) : e.d;
  return Estimates{b, d};
}

FT_HOST_DEVICE inline Estimates after_use(Estimates e, int64_t stamp, int64_t now, int64_t layers) {
  return after_turns(e, stamp, stamp == 0 ? 0 : (now - stamp) / layers);
}

// The victim key of an eligible slot (stamp < now) under hit density: free slots (0) and streamed
// rows (1) as their stamp; otherwise, with a = now - stamp calls since its pair's last use,
// m = a / L turns of its layer missed and its next turn t = L - a % L calls away, the pair is used at
// that turn with probability q0 = B (m = 0) or 1 / max(D, 0.85 m), at the one after with
// q1 = 1 / max(D, 0.85 (m + 1)), and the key is 2 + the float bits of its expected hits per
// slot-call until then, (q0 + (1 - q0) q1) / (t + (1 - q0) L): the least dense first. Keys are
// below 2^30 + 2. `quotient` and `remainder` are a / L and a % L (the kernels compute them without
// a 64-bit division).
FT_HOST_DEVICE inline uint32_t key_from_age(int64_t quotient, int64_t remainder, Estimates e, int64_t layers) {
  const float mf = to_float(quotient);
  const float t = to_float(layers - remainder);
  const float q0 = quotient == 0 ? e.b : div_rn(1.0f, fmax2(e.d, mul_rn(kKappa, mf)));
  const float q1 = div_rn(1.0f, fmax2(e.d, mul_rn(kKappa, add_rn(mf, 1.0f))));
  const float miss = add_rn(1.0f, -q0);
  const float density = div_rn(add_rn(q0, mul_rn(miss, q1)), add_rn(t, mul_rn(miss, to_float(layers))));
  return same_bits<uint32_t>(density) + 2u;
}

FT_HOST_DEVICE inline int64_t key(int64_t stamp, int64_t now, int64_t layers, Estimates e) {
  if (stamp <= kStreamedStamp) return stamp;
  const int64_t a = now - stamp;
  return key_from_age(a / layers, a % layers, e, layers);
}

}  // namespace hit_density

// --- Duel (ft_ops/policies.py, DUEL; the offline model is ft_ops/eviction.py's Duel) ---
// Hit density's state and keys, or LRU's keys (the stamp) while an LRU cache of the pool's size
// would have hit more of the recent decode calls than a hit-density one. Two shadow caches (maps
// only, ft_ops/shadow_caches.py) replay every admission call of the pool right after it, each
// counting (calls, routed, distinct, admitted) in the Duel words, which follow hit density's state
// in the policy state (int64 [2 L E + S + kWords]). A call first folds the shadows' hits since the
// last call into a score, decayed by kGamma a call, and takes LRU's keys while it is above 0.
// dedup_and_admit replays the call in the shadows when given them (on the GPU in the same launch).
namespace duel {

constexpr int64_t kWords = 21;
// Word offsets in the Duel words. Each shadow keeps its counters in two copies: its replay writes
// the copy it did not write last (the other's counters plus its call), so a launch's shadow blocks
// never write the copy its pool block uses, and no block waits for another. After R replays the
// latest copies are copy R % 2 (both start at 0, so copy 0 is the latest after none); the pool
// keeps R (kReplays) and uses copy R % 2. That holds while copy R % 2 has more calls than the
// other, or as many with R even: every state these rules make from zeros (the CPU kernel checks it). Between them the score (a double's bits) and what the
// last call saw of the shadows (calls, then each one's hits = distinct - admitted).
constexpr int64_t kLruCounters = 0, kDensityCounters = 4, kScore = 8, kSeenCalls = 9, kSeenLruHits = 10,
                  kSeenDensityHits = 11, kLruCountersOdd = 12, kDensityCountersOdd = 16, kReplays = 20;
constexpr double kGamma = 0.99;

// Shadow `shadow`'s (0 LRU, 1 hit density) counters, copy `copy` (0 or 1).
FT_HOST_DEVICE inline int64_t counters_at(int shadow, int copy) {
  return copy == 0 ? (shadow == 0 ? kLruCounters : kDensityCounters)
                   : (shadow == 0 ? kLruCountersOdd : kDensityCountersOdd);
}

struct Next {
  int64_t score_bits, calls, lru_hits, density_hits;
  bool lru_keys;  // this call takes LRU's keys
};

// The call's score and what it has seen, from the words before it (the shadows' latest counters,
// copy R % 2): if the shadows replayed a call since the last (their call counter moved), score =
// kGamma score + (the LRU shadow's new hits - the hit-density shadow's); each product and sum
// rounded alone, as Python's floats are. Every word is read unconditionally and the copy selected,
// so on the GPU the loads go out together (one round trip) rather than the replay count's load
// ordering the rest after it. The copy a shadow block of the same launch may be writing is among
// them, and its value is discarded: the call's result depends only on words no other block writes.
FT_HOST_DEVICE inline Next next(const int64_t* w) {
  int64_t v[kWords];
#pragma unroll
  for (int i = 0; i < kWords; ++i) v[i] = w[i];
  const bool odd = (v[kReplays] & 1) != 0;
  const int64_t calls = odd ? v[kLruCountersOdd] : v[kLruCounters];
  const int64_t lru_hits = odd ? v[kLruCountersOdd + 2] - v[kLruCountersOdd + 3] : v[kLruCounters + 2] - v[kLruCounters + 3];
  const int64_t density_hits = odd ? v[kDensityCountersOdd + 2] - v[kDensityCountersOdd + 3]
                                   : v[kDensityCounters + 2] - v[kDensityCounters + 3];
  const double score = same_bits<double>(v[kScore]);
  const int64_t delta = (lru_hits - v[kSeenLruHits]) - (density_hits - v[kSeenDensityHits]);
  const double moved = add_rn(mul_rn(kGamma, score), static_cast<double>(delta));
  const double next_score = calls != v[kSeenCalls] ? moved : score;
  return Next{same_bits<int64_t>(next_score), calls, lru_hits, density_hits, next_score > 0.0};
}

// The pool's words after its call: the score, what it saw and, if the call was replayed in the
// shadows, one more replay.
FT_HOST_DEVICE inline void store(int64_t* w, const Next& n, bool replayed) {
  w[kScore] = n.score_bits;
  w[kSeenCalls] = n.calls;
  w[kSeenLruHits] = n.lru_hits;
  w[kSeenDensityHits] = n.density_hits;
  if (replayed) w[kReplays] += 1;
}

// A shadow's replay of a call: its counters' copy with the fewer calls (copy 1 on a tie, which only
// the first replay meets) becomes the other copy plus (1, routed, distinct, admitted). Only the
// shadow writes its copies, so reading both is not a race.
FT_HOST_DEVICE inline void count_replay(int64_t* w, int shadow, int64_t routed, int64_t distinct, int64_t admitted) {
  int64_t* even = w + counters_at(shadow, 0);
  int64_t* odd = w + counters_at(shadow, 1);
  const bool odd_is_latest = odd[0] > even[0];
  const int64_t* latest = odd_is_latest ? odd : even;
  int64_t* next = odd_is_latest ? even : odd;
  const int64_t c0 = latest[0] + 1, c1 = latest[1] + routed, c2 = latest[2] + distinct, c3 = latest[3] + admitted;
  next[0] = c0;
  next[1] = c1;
  next[2] = c2;
  next[3] = c3;
}

// A slot's mirrored estimates while a Duel call takes LRU's keys: no valid estimate word is
// negative (D >= 1 is a positive float in the high half), so the kernels key such a slot by its stamp.
constexpr int64_t kLruKeys = -1;

}  // namespace duel

}  // namespace ft
