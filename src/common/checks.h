// Input validation shared by the CPU and CUDA kernels.
//
// Everything here looks only at metadata (dtype, device, shape, strides), never at tensor
// contents, so the CUDA path can call it without a host synchronization. Checks on values
// (expert ids in range, slot ids in range) live in the CPU kernels, where reading values is free.
#pragma once

#include <ATen/ATen.h>

#include "admitted_count.h"
#include "eviction_policy.h"

#include <cmath>
#include <string>
#include <vector>

namespace ft {

// The sizes of a slot pool's bookkeeping (docs/design.md, "Pool state").
struct PoolShape {
  int64_t layers;   // L
  int64_t experts;  // E
  int64_t slots;    // S
};

inline void check_same_device(const at::Tensor& t, const at::Tensor& ref, const char* name,
                              const char* ref_name) {
  TORCH_CHECK(t.device() == ref.device(), name, " is on ", t.device(), " but ", ref_name, " is on ",
              ref.device(), "; move them to the same device");
}

inline void check_dtype(const at::Tensor& t, at::ScalarType want, const char* name) {
  TORCH_CHECK(t.scalar_type() == want, name, " must be ", want, ", got ", t.scalar_type());
}

inline void check_index_dtype(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.scalar_type() == at::kInt || t.scalar_type() == at::kLong, name,
              " must be int32 or int64, got ", t.scalar_type());
}

inline PoolShape check_pool_state(const at::Tensor& slot_of, const at::Tensor& owner_of,
                                  const at::Tensor& last_use, const at::Tensor& clock) {
  check_dtype(slot_of, at::kInt, "slot_of");
  check_dtype(owner_of, at::kInt, "owner_of");
  check_dtype(last_use, at::kLong, "last_use");
  check_dtype(clock, at::kLong, "clock");
  TORCH_CHECK(slot_of.dim() == 2, "slot_of must be [layers, experts], got shape ", slot_of.sizes());
  TORCH_CHECK(owner_of.dim() == 1, "owner_of must be [slots], got shape ", owner_of.sizes());
  TORCH_CHECK(last_use.sizes() == owner_of.sizes(), "last_use must have the shape of owner_of ",
              owner_of.sizes(), ", got ", last_use.sizes());
  TORCH_CHECK(clock.numel() == 1, "clock must hold one element, got shape ", clock.sizes());
  TORCH_CHECK(slot_of.is_contiguous() && owner_of.is_contiguous() && last_use.is_contiguous() &&
                  clock.is_contiguous(),
              "slot_of, owner_of, last_use and clock must be contiguous (the kernels index them flat)");
  check_same_device(owner_of, slot_of, "owner_of", "slot_of");
  check_same_device(last_use, slot_of, "last_use", "slot_of");
  check_same_device(clock, slot_of, "clock", "slot_of");
  PoolShape shape{slot_of.size(0), slot_of.size(1), owner_of.size(0)};
  TORCH_CHECK(shape.experts > 0 && shape.layers > 0, "slot_of must not be empty, got shape ",
              slot_of.sizes());
  TORCH_CHECK(shape.layers * shape.experts < (int64_t{1} << 31),
              "layers * experts must fit in int32 (owner ids are int32), got ",
              shape.layers * shape.experts);
  return shape;
}

inline void check_layer(int64_t layer, const PoolShape& pool) {
  TORCH_CHECK(layer >= 0 && layer < pool.layers, "layer ", layer, " is out of range [0, ",
              pool.layers, ")");
}

inline void check_routed_ids(const at::Tensor& expert_ids, const at::Tensor& slot_of) {
  check_index_dtype(expert_ids, "expert_ids");
  check_same_device(expert_ids, slot_of, "expert_ids", "slot_of");
}

// Bytes of one row (a slot of a bank, an expert of host rows) of a contiguous [rows, ...] tensor, from
// its shape: stride(0) is not the row's length where the tensor has one row (torch ignores a size-1
// dimension's stride, so a column slice of a one-slot bank is "contiguous" with the parent's
// stride) or its rows are empty (stride 1 for zero bytes).
inline int64_t row_bytes(const at::Tensor& t) {
  return t.size(0) == 0 ? 0 : t.numel() / t.size(0) * static_cast<int64_t>(t.element_size());
}

// The expert count of a copy plan's host rows (host_rows[0] is [experts, ...]).
inline int64_t host_experts(at::TensorList host_rows) {
  TORCH_CHECK(!host_rows.empty(), "host_rows must hold at least one tensor");
  TORCH_CHECK(host_rows[0].dim() >= 1, "host_rows[0] has shape ", host_rows[0].sizes(),
              "; host rows are [experts, ...]");
  return host_rows[0].size(0);
}

// banks[j] is [S, ...] on the pool's device; host_rows[j] is one layer's [E, ...] with the same
// row shape and dtype. Returns the number of slots S shared by all banks.
inline int64_t check_banks(at::TensorList banks, at::TensorList host_rows, int64_t experts,
                           const at::Tensor& pool_ref) {
  TORCH_CHECK(!banks.empty(), "banks must hold at least one weight bank");
  TORCH_CHECK(banks.size() == host_rows.size(), "got ", banks.size(), " banks but ",
              host_rows.size(), " host_rows; pass one host tensor per bank, in the same order");
  TORCH_CHECK(banks[0].dim() >= 1, "banks[0] has shape ", banks[0].sizes(), "; a bank is [slots, ...]");
  const int64_t slots = banks[0].size(0);
  for (size_t j = 0; j < banks.size(); ++j) {
    const auto& bank = banks[j];
    const auto& host = host_rows[j];
    TORCH_CHECK(bank.dim() >= 1 && host.dim() == bank.dim(), "banks[", j, "] has shape ",
                bank.sizes(), " and host_rows[", j, "] has shape ", host.sizes(),
                "; both must be [rows, ...] with the same number of dimensions");
    TORCH_CHECK(bank.size(0) == slots, "banks[", j, "] has ", bank.size(0),
                " slots but banks[0] has ", slots, "; every bank must have the same slot count");
    TORCH_CHECK(bank.sizes().slice(1) == host.sizes().slice(1), "banks[", j, "] rows have shape ",
                bank.sizes().slice(1), " but host_rows[", j, "] rows have shape ",
                host.sizes().slice(1));
    TORCH_CHECK(bank.scalar_type() == host.scalar_type(), "banks[", j, "] is ",
                bank.scalar_type(), " but host_rows[", j, "] is ", host.scalar_type());
    TORCH_CHECK(host.size(0) == experts, "host_rows[", j, "] has ", host.size(0),
                " rows but the pool has ", experts, " experts per layer; pass one layer's rows");
    TORCH_CHECK(bank.is_contiguous(), "banks[", j, "] must be contiguous (strides ", bank.strides(), ")");
    TORCH_CHECK(host.is_contiguous(), "host_rows[", j, "] must be contiguous (strides ", host.strides(), ")");
    check_same_device(bank, pool_ref, "a bank", "the pool state");
    if (bank.is_cuda()) {
      TORCH_CHECK(host.is_cpu() || host.is_cuda(), "host_rows[", j, "] must be a CPU tensor");
      if (host.is_cpu()) {
        TORCH_CHECK(host.is_pinned(), "host_rows[", j,
                    "] is pageable host memory; the device reads it directly, so pin it "
                    "(HostPool does, or tensor.pin_memory())");
      }
    } else {
      TORCH_CHECK(host.device() == bank.device(), "host_rows[", j, "] is on ", host.device(),
                  " but banks[", j, "] is on ", bank.device());
    }
  }
  return slots;
}

inline void check_copy_plan(const at::Tensor& copy_experts, const at::Tensor& copy_slots,
                            const at::Tensor& num_copies, const at::Tensor& bank0) {
  check_dtype(copy_experts, at::kInt, "copy_experts");
  check_dtype(copy_slots, at::kInt, "copy_slots");
  check_dtype(num_copies, at::kInt, "num_copies");
  TORCH_CHECK(copy_experts.dim() == 1 && copy_slots.sizes() == copy_experts.sizes(),
              "copy_experts and copy_slots must be 1-D of one length, got ", copy_experts.sizes(),
              " and ", copy_slots.sizes());
  TORCH_CHECK(num_copies.numel() == 1, "num_copies must hold one element, got shape ",
              num_copies.sizes());
  TORCH_CHECK(copy_experts.is_contiguous() && copy_slots.is_contiguous(),
              "copy_experts and copy_slots must be contiguous");
  check_same_device(copy_experts, bank0, "copy_experts", "banks");
  check_same_device(copy_slots, bank0, "copy_slots", "banks");
  check_same_device(num_copies, bank0, "num_copies", "banks");
}

// The expert function of expert_gemm: a kind plus parameters (docs/ops.md, "expert_gemm"). With g and
// u the gate and up halves of w13 @ x + b13, in float32:
//   limit > 0:       g = min(g, limit), u = clamp(u, -limit, limit)    (gpt-oss, DeepSeek-V4 clamp first)
//                    with limit_after_act, g stays and the gate factor is clamped instead:
//                    act = min(lin(g) * phi(g), limit) * u               (Step3p7, BailingHybrid)
//   up_softcap > 0:  u = up_softcap * tanh(u / up_softcap)
//                    u = u + up_offset                                  (gpt-oss: (up + 1))
//   act = lin(g) * phi(g) * u, lin(g) = gate_softcap > 0 ? gate_softcap * tanh(g / gate_softcap) : g
//   phi(g): silu sigmoid(alpha g); gelu_tanh 0.5 (1 + tanh(sqrt(2/pi) (g + 0.044715 g^3)));
//           gelu 0.5 (1 + erf(g / sqrt(2))); relu [g > 0] (lin(g) phi(g) = max(g, 0))
// The softcap of the gate bounds only its linear factor: phi sees the (clamped) raw gate, as in
// Inkling2's soft-capped SwiGLU. A value of 0 turns limit and the softcaps off.
// Ungated experts (gated = false: w13 holds the up projection alone, I rows) take their up values as
// the gate too, g = u: with kind relu, act = max(u, 0) u = relu(u)^2 (Nemotron-H's experts).
enum class ActivationKind : int32_t { kSilu = 0, kGeluTanh = 1, kGelu = 2, kRelu = 3 };

struct ActivationParams {
  ActivationKind kind;
  float alpha;         // sigmoid slope of kind silu (1: SiLU, 1.702: gpt-oss); 1 for the gelu kinds
  float limit;         // clamp of gate (above) and up (both sides); 0: off
  float up_offset;     // added to up after the clamp and cap
  float gate_softcap;  // cap of the gate's linear factor; 0: off
  float up_softcap;    // cap of up; 0: off
  bool limit_after_act;  // the gate's clamp applies to lin(g) * phi(g), not to g
  bool gated;            // w13 holds gate and up rows (2I); false: up rows alone (I), g = u
};

inline ActivationParams parse_activation(c10::string_view kind, double alpha, double limit,
                                         double up_offset, double gate_softcap, double up_softcap,
                                         bool limit_after_act, bool gated) {
  ActivationParams p{};
  if (kind == "silu") {
    p.kind = ActivationKind::kSilu;
  } else if (kind == "gelu_tanh") {
    p.kind = ActivationKind::kGeluTanh;
  } else if (kind == "gelu") {
    p.kind = ActivationKind::kGelu;
  } else if (kind == "relu") {
    p.kind = ActivationKind::kRelu;
  } else if (kind == "swigluoai") {
    TORCH_CHECK(false, "'swigluoai' is a preset, not a kind: pass activation='silu', alpha=1.702, "
                "limit=7.0, up_offset=1.0 (ft_ops.activations.SWIGLUOAI, which ft_ops.expert_gemm "
                "accepts by name)");
  } else {
    TORCH_CHECK(false, "unknown activation '", std::string(kind),
                "'; expected one of 'silu', 'gelu_tanh', 'gelu', 'relu'");
  }
  // Finite, and kept by the kernels' float32: 0, or a magnitude in float32's normal range (a
  // smaller one would become 0, which turns a limit or cap off; a larger one infinity).
  const auto finite = [](double v) {
    const double m = std::fabs(v);
    return std::isfinite(v) && (m == 0.0 || (m >= 1.1754943508222875e-38 && m <= 3.4028234663852886e+38));
  };
  TORCH_CHECK(finite(alpha) && finite(limit) && finite(up_offset) && finite(gate_softcap) &&
                  finite(up_softcap),
              "activation parameters must be finite and fit float32 (0, or a magnitude in [1.2e-38, 3.4e38]), ",
              "got alpha=", alpha, ", limit=", limit, ", up_offset=", up_offset, ", gate_softcap=", gate_softcap,
              ", up_softcap=", up_softcap);
  TORCH_CHECK(p.kind == ActivationKind::kSilu || alpha == 1.0, "alpha scales the sigmoid of kind ",
              "'silu' only; kind '", std::string(kind), "' needs alpha=1, got ", alpha);
  TORCH_CHECK(limit >= 0.0, "limit must be >= 0 (0 turns the clamp off), got ", limit);
  TORCH_CHECK(!limit_after_act || limit > 0.0, "limit_after_act clamps the activated gate at limit, so it "
              "needs a limit > 0, got limit=", limit);
  TORCH_CHECK(gate_softcap >= 0.0 && up_softcap >= 0.0,
              "softcaps must be >= 0 (0 turns a cap off), got gate_softcap=", gate_softcap,
              " and up_softcap=", up_softcap);
  p.alpha = static_cast<float>(alpha);
  p.limit = static_cast<float>(limit);
  p.up_offset = static_cast<float>(up_offset);
  p.gate_softcap = static_cast<float>(gate_softcap);
  p.up_softcap = static_cast<float>(up_softcap);
  p.limit_after_act = limit_after_act;
  p.gated = gated;
  return p;
}

struct GemmShape {
  int64_t tokens;        // T
  int64_t top_k;         // K
  int64_t slots;         // S
  int64_t hidden;        // H
  int64_t intermediate;  // I
  bool gated;            // w13 holds gate and up rows (2I); false: the up rows alone (I)

  // w13's first up row: I, or 0 where the up rows are the gate's too.
  int64_t up_row() const { return gated ? intermediate : 0; }
};

// How expert_gemm's w13 and w2 hold their values: in hidden's dtype, FP8 with block scales or with
// row scales, MXFP4 or int4 (two 4-bit values a byte); check_gemm_weight_format
// (src/common/quantized_weights.h) tells it from the scales.
enum class WeightFormat { kDense, kFp8, kFp8Rows, kMxfp4, kInt4 };

inline bool is_fp8(WeightFormat format) { return format == WeightFormat::kFp8 || format == WeightFormat::kFp8Rows; }

// Two 4-bit values a byte: a row of C values is C / 2 bytes.
inline bool is_packed(WeightFormat format) { return format == WeightFormat::kMxfp4 || format == WeightFormat::kInt4; }

// Whether w13's rows and w2's columns (times `pack`: MXFP4 and int4 hold two values a byte) say the other
// gating than the call's: gate and up rows (2I) for an ungated call, or I rows for a gated one.
// Checked before anything else about the weights (the quantized formats' scale shapes too), so a
// mismatch is named as such.
inline void check_gating(const at::Tensor& w13, const at::Tensor& w2, int64_t pack, bool gated) {
  if (w13.dim() != 3 || w2.dim() != 3) return;  // the shape checks say what is wrong
  const int64_t inter = w2.size(2) * pack;
  if (inter == 0) return;  // no intermediate columns: neither gating can be told, and neither is wrong
  TORCH_CHECK(!(gated && w13.size(1) == inter), "w13 has ", w13.size(1), " rows, w2 ", inter,
              " intermediate columns: experts without a gate (w13 holding the up rows alone); pass gated=False "
              "(ft_ops: an ungated activation such as 'relu2'), or w13 with gate and up rows, [slots, ", 2 * inter,
              ", hidden]");
  TORCH_CHECK(gated || w13.size(1) != 2 * inter, "w13 has ", w13.size(1), " rows, twice w2's ", inter,
              " intermediate columns: gate and up rows; pass gated=True (a gated activation), or w13 with the up "
              "rows alone, [slots, ", inter, ", hidden]");
}

// The quantized formats' scales were checked by check_gemm_weight_format; for MXFP4 and int4 the
// logical row length is twice the bytes of a row.
inline GemmShape check_gemm_inputs(const at::Tensor& hidden, const at::Tensor& slot_ids,
                                   const at::Tensor& weights, const at::Tensor& w13,
                                   const at::Tensor& w2, const c10::optional<at::Tensor>& b13,
                                   const c10::optional<at::Tensor>& b2,
                                   WeightFormat format = WeightFormat::kDense, bool gated = true) {
  const auto dtype = hidden.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf,
              "hidden must be float32, bfloat16 or float16, got ", dtype);
  TORCH_CHECK(hidden.dim() == 2, "hidden must be [tokens, hidden], got shape ", hidden.sizes());
  check_index_dtype(slot_ids, "slot_ids");
  TORCH_CHECK(slot_ids.dim() == 2 && slot_ids.size(0) == hidden.size(0),
              "slot_ids must be [tokens, top_k] with tokens = ", hidden.size(0), ", got shape ",
              slot_ids.sizes());
  TORCH_CHECK(weights.sizes() == slot_ids.sizes(), "weights must have the shape of slot_ids ",
              slot_ids.sizes(), ", got ", weights.sizes());
  TORCH_CHECK(at::isFloatingType(weights.scalar_type()), "weights must be floating point, got ",
              weights.scalar_type());
  TORCH_CHECK(w13.dim() == 3 && w2.dim() == 3, "w13 must be [slots, ", gated ? "2*" : "",
              "intermediate, hidden] and w2 [slots, hidden, intermediate], got shapes ", w13.sizes(), " and ",
              w2.sizes());
  const bool quantized = format != WeightFormat::kDense;
  const auto weight_dtype = is_fp8(format) ? at::kFloat8_e4m3fn : is_packed(format) ? at::kByte : dtype;
  TORCH_CHECK(w13.scalar_type() == weight_dtype && w2.scalar_type() == weight_dtype, "w13 and w2 must be ",
              weight_dtype, quantized ? " (w13_scale and w2_scale were given)" : " like hidden",
              ", got ", w13.scalar_type(), " and ", w2.scalar_type(),
              quantized ? "" : ((w13.scalar_type() == at::kFloat8_e4m3fn || w13.scalar_type() == at::kByte)
                                    ? "; quantized weights need w13_scale and w2_scale" : ""));
  // Logical columns: MXFP4 and int4 pack two values a byte.
  const int64_t pack = is_packed(format) ? 2 : 1;
  check_gating(w13, w2, pack, gated);
  const int64_t slots = w13.size(0);
  const int64_t hid = hidden.size(1);
  // Gated: gate rows then up rows; ungated: the up rows alone (the gate is the up projection).
  const int64_t parts = gated ? 2 : 1;
  TORCH_CHECK(w13.size(1) % parts == 0, "w13's second dimension (2*intermediate) must be even, got ",
              w13.size(1));
  const int64_t inter = w13.size(1) / parts;
  TORCH_CHECK(w13.size(2) * pack == hid, "w13 rows have length ", w13.size(2) * pack, " but hidden has ", hid,
              " features");
  TORCH_CHECK(w2.size(0) == slots && w2.size(1) == hid && w2.size(2) * pack == inter,
              "w2 must be [", slots, ", ", hid, ", ", inter / pack, "] to match w13 (", gated ? "gated: " : "ungated: ",
              w13.size(1), " = ", parts == 2 ? "2 x " : "", "intermediate rows) and hidden, got ", w2.sizes());
  TORCH_CHECK(hid > 0 && inter > 0, "expert_gemm needs hidden and intermediate sizes of at least 1, got ", hid,
              " and ", inter, " (w13 ", w13.sizes(), ", w2 ", w2.sizes(), ")");
  TORCH_CHECK(w13.stride(2) == 1 && w2.stride(2) == 1 && w13.stride(1) == w13.size(2) &&
                  w2.stride(1) == w2.size(2),
              "w13 and w2 rows must be contiguous within a slot (slices of a bank are fine), got strides ",
              w13.strides(), " and ", w2.strides());
  for (const auto* t : {&slot_ids, &weights, &w13, &w2}) {
    check_same_device(*t, hidden, "an input of expert_gemm", "hidden");
  }
  if (b13.has_value()) {
    TORCH_CHECK(b13->sizes() == at::IntArrayRef({slots, parts * inter}), "b13 must be [", slots,
                ", ", parts * inter, "], got ", b13->sizes());
    TORCH_CHECK(b13->scalar_type() == dtype, "b13 must be ", dtype, ", got ", b13->scalar_type());
    TORCH_CHECK(b13->stride(1) == 1, "b13 rows must be contiguous");
    check_same_device(*b13, hidden, "b13", "hidden");
  }
  if (b2.has_value()) {
    TORCH_CHECK(b2->sizes() == at::IntArrayRef({slots, hid}), "b2 must be [", slots, ", ", hid,
                "], got ", b2->sizes());
    TORCH_CHECK(b2->scalar_type() == dtype, "b2 must be ", dtype, ", got ", b2->scalar_type());
    TORCH_CHECK(b2->stride(1) == 1, "b2 rows must be contiguous");
    check_same_device(*b2, hidden, "b2", "hidden");
  }
  return GemmShape{hidden.size(0), slot_ids.size(1), slots, hid, inter, gated};
}

// expert_gemm's slot_map: int32 or int64 [E] on hidden's device, entries slots of the bank (-1: the
// expert is not in it).
inline void check_slot_map(const at::Tensor& slot_map, const at::Tensor& hidden) {
  check_index_dtype(slot_map, "slot_map");
  TORCH_CHECK(slot_map.dim() == 1, "slot_map must be 1-D [experts] (the slot of each expert id, -1: none), got shape ",
              slot_map.sizes());
  check_same_device(slot_map, hidden, "slot_map", "hidden");
}

// The pairs' slots of a call with a slot_map (checked), int64 of slot_ids' shape: slot_map[id] for
// ids in [0, E), -1 for the others (device ops, no host sync).
inline at::Tensor slots_through_map(const at::Tensor& slot_ids, const at::Tensor& slot_map) {
  const int64_t E = slot_map.numel();
  const auto ids = slot_ids.to(at::kLong);
  const auto none = at::scalar_tensor(-1, ids.options());
  if (E == 0) return none.expand(ids.sizes()).contiguous();
  const auto in_range = at::logical_and(ids >= 0, ids < E);
  const auto mapped =
      slot_map.to(at::kLong).index_select(0, ids.clamp(0, E - 1).reshape(-1)).reshape(ids.sizes());
  return at::where(in_range, mapped, none);
}

// Buffer region [first_slot, first_slot + E) inside the pool, and the reclaim range inside it too.
inline void check_stream_args(int64_t first_slot, int64_t reclaim_lo, int64_t reclaim_hi,
                              const PoolShape& pool) {
  TORCH_CHECK(pool.slots >= pool.experts, "the pool holds ", pool.slots, " slots, fewer than one layer's ",
              pool.experts, " experts: a layer copy needs a buffer region of one layer");
  // first_slot <= slots - E, not first_slot + E <= slots: a huge first_slot must not overflow.
  TORCH_CHECK(first_slot >= 0 && first_slot <= pool.slots - pool.experts, "buffer region of ", pool.experts,
              " slots from first_slot ", first_slot, " is outside the pool of ", pool.slots,
              " slots; first_slot must be in [0, ", pool.slots - pool.experts, "]");
  TORCH_CHECK(reclaim_lo >= 0 && reclaim_lo <= reclaim_hi && reclaim_hi <= pool.slots,
              "reclaim range [", reclaim_lo, ", ", reclaim_hi, ") must satisfy 0 <= lo <= hi <= ",
              pool.slots, " (pass 0, 0 to reclaim nothing)");
}

// Optional admission counters: int64, contiguous, at least [calls, routed, distinct, admitted].
inline void check_admission_stats(const c10::optional<at::Tensor>& stats, const at::Tensor& slot_of) {
  if (!stats.has_value()) return;
  check_dtype(*stats, at::kLong, "stats");
  TORCH_CHECK(stats->numel() >= 4, "stats must hold at least 4 counters (calls, routed, distinct, admitted), "
              "got shape ", stats->sizes());
  TORCH_CHECK(stats->is_contiguous(), "stats must be contiguous (the kernels add to its counters in place), got "
              "strides ", stats->strides(), "; pass a fresh torch.zeros(n, dtype=torch.int64)");
  check_same_device(*stats, slot_of, "stats", "slot_of");
}

inline EvictionPolicy check_policy(int64_t policy) {
  TORCH_CHECK(policy >= 0 && policy <= 3, "policy must be 0 (lru), 1 (opportunity), 2 (hitdensity) or 3 (duel), got ",
              policy);
  return static_cast<EvictionPolicy>(policy);
}

// The policy's own state: hit density keeps int64 [2 L E + S] beside the pool's maps, Duel the same
// and its duel::kWords (src/common/eviction_policy.h); the other policies keep none.
inline void check_policy_state(EvictionPolicy policy, const c10::optional<at::Tensor>& state, const at::Tensor& slot_of,
                               int64_t slots) {
  if (!keeps_hit_density(policy)) {
    TORCH_CHECK(!state.has_value(), "policy_state is hit density's or Duel's: pass policy=2 or 3 to use it, or None "
                "with policy ", static_cast<int64_t>(policy));
    return;
  }
  const bool duel = policy == EvictionPolicy::kDuel;
  TORCH_CHECK(state.has_value(), "policy ", static_cast<int64_t>(policy), duel ? " (duel)" : " (hitdensity)",
              " needs its policy_state (SlotPool(eviction=\"", duel ? "duel" : "hitdensity",
              "\") keeps one; ft_ops.policies.new_policy_state makes one)");
  const int64_t want = 2 * slot_of.numel() + slots + (duel ? duel::kWords : 0);
  const int64_t other = 2 * slot_of.numel() + slots + (duel ? 0 : duel::kWords);  // the other policy's size
  TORCH_CHECK(state->dim() == 1 && state->numel() == want, "policy_state must be an int64 tensor of 2 * layers * "
              "experts + slots", duel ? " + " : "", duel ? std::to_string(duel::kWords) : "", " = ", want,
              " entries, got shape ", state->sizes(),
              state->dim() == 1 && state->numel() == other ? (duel ? ": that is hit density's state, pass policy=2"
                                                                    : ": that is Duel's state, pass policy=3")
                                                           : "; ft_ops.policies.new_policy_state makes one");
  TORCH_CHECK(state->is_contiguous(), "policy_state must be contiguous (it is updated in place): pass the pool's own");
  TORCH_CHECK(state->scalar_type() == at::kLong, "policy_state must be int64 (ft_ops.policies.new_policy_state makes "
              "one), got ", state->scalar_type());
  TORCH_CHECK(state->device() == slot_of.device(), "policy_state is on ", state->device(), " but the pool is on ",
              slot_of.device(), "; keep it with the pool's maps");
}

inline void check_admission_args(double fetch_fraction, int64_t protect_lo, int64_t protect_hi,
                                 int64_t slots) {
  TORCH_CHECK(fetch_fraction >= 0.0 && fetch_fraction <= 1.0, "fetch_fraction must be in [0, 1], got ",
              fetch_fraction);
  TORCH_CHECK(protect_lo >= 0 && protect_lo <= protect_hi && protect_hi <= slots,
              "protect range [", protect_lo, ", ", protect_hi, ") must satisfy 0 <= lo <= hi <= ",
              slots, " (pass 0, 0 to protect nothing)");
}

// The counters row the split's recopy_share reads (src/common/admitted_count.h): the call's stats
// when the split is on (CPU costs given) and the row has the CPU columns; nullptr otherwise.
inline const int64_t* split_counters(double cpu_expert_cost, const c10::optional<at::Tensor>& stats) {
  if (cpu_expert_cost <= 0.0 || !stats.has_value() || stats->numel() < kStatsSplitColumns) return nullptr;
  return stats->data_ptr<int64_t>();
}

// The link / CPU split's costs (src/common/admitted_count.h): both >= 0 and finite; with CPU costs
// the fraction is not used and must be 1.
inline void check_fetch_split(double fetch_fraction, double cpu_expert_cost, double cpu_call_cost) {
  TORCH_CHECK(std::isfinite(cpu_expert_cost) && std::isfinite(cpu_call_cost) && cpu_expert_cost >= 0.0 &&
                  cpu_call_cost >= 0.0,
              "cpu_expert_cost and cpu_call_cost must be finite and >= 0, got ", cpu_expert_cost, " and ",
              cpu_call_cost);
  TORCH_CHECK((cpu_expert_cost == 0.0 && cpu_call_cost == 0.0) || fetch_fraction == 1.0,
              "with CPU costs the split is chosen from them: pass fetch_fraction=1.0, got ", fetch_fraction);
}

// Everything dedup_and_admit checks before it reads a value, for both devices.
inline PoolShape check_admission_inputs(const at::Tensor& slot_of, const at::Tensor& owner_of,
                                        const at::Tensor& last_use, const at::Tensor& clock,
                                        int64_t layer, const at::Tensor& expert_ids,
                                        double fetch_fraction, int64_t protect_lo,
                                        int64_t protect_hi,
                                        const c10::optional<at::Tensor>& stats) {
  const PoolShape pool = check_pool_state(slot_of, owner_of, last_use, clock);
  check_layer(layer, pool);
  check_routed_ids(expert_ids, slot_of);
  check_admission_args(fetch_fraction, protect_lo, protect_hi, pool.slots);
  check_admission_stats(stats, slot_of);
  return pool;
}

// Duel's shadow caches, which dedup_and_admit replays the call in (ft_ops/shadow_caches.py): the
// LRU shadow's slot_of, owner_of, last_use and clock, then the hit-density shadow's and its policy
// state, each the pool's size on the pool's device. Only with policy 3 (duel), whose words count them.
constexpr int64_t kShadowTensors = 9;

// Whether two contiguous tensors' bytes overlap.
inline bool share_memory(const at::Tensor& a, const at::Tensor& b) {
  if (a.numel() == 0 || b.numel() == 0) return false;
  const char* a0 = static_cast<const char*>(a.data_ptr());
  const char* b0 = static_cast<const char*>(b.data_ptr());
  return a0 < b0 + b.numel() * b.element_size() && b0 < a0 + a.numel() * a.element_size();
}

inline void check_shadows(EvictionPolicy policy, const c10::optional<at::TensorList>& shadows,
                          const at::Tensor& slot_of, const at::Tensor& owner_of, const at::Tensor& last_use,
                          const at::Tensor& clock, const c10::optional<at::Tensor>& policy_state,
                          const PoolShape& pool) {
  if (!shadows.has_value()) return;
  TORCH_CHECK(policy == EvictionPolicy::kDuel, "shadows are Duel's shadow caches: pass policy=3 (duel) with them, "
              "or None with policy ", static_cast<int64_t>(policy));
  const at::TensorList s = *shadows;
  TORCH_CHECK(static_cast<int64_t>(s.size()) == kShadowTensors, "shadows must be ", kShadowTensors, " tensors (the LRU "
              "shadow's slot_of, owner_of, last_use, clock, then the hit-density shadow's and its policy_state; "
              "ft_ops.shadow_caches.ShadowCaches.tensors), got ", s.size());
  for (int shadow = 0; shadow < 2; ++shadow) {
    const PoolShape mine = check_pool_state(s[4 * shadow], s[4 * shadow + 1], s[4 * shadow + 2], s[4 * shadow + 3]);
    TORCH_CHECK(mine.layers == pool.layers && mine.experts == pool.experts && mine.slots == pool.slots,
                "shadows[", 4 * shadow, ":", 4 * shadow + 4, "] hold a cache of ", mine.layers, " x ", mine.experts,
                " pairs and ", mine.slots, " slots; a shadow is the pool's size (", pool.layers, " x ", pool.experts,
                ", ", pool.slots, " slots)");
    check_same_device(s[4 * shadow], slot_of, "a shadow's slot_of", "the pool's slot_of");
  }
  check_policy_state(EvictionPolicy::kHitDensity, s[8], s[4], pool.slots);
  // The three caches' blocks write their own tensors at once (CUDA): none may share memory.
  const at::Tensor pool_tensors[] = {slot_of, owner_of, last_use, clock, *policy_state};
  const char* pool_names[] = {"slot_of", "owner_of", "last_use", "clock", "policy_state"};
  for (int64_t i = 0; i < kShadowTensors; ++i) {
    for (int j = 0; j < 5; ++j) {
      TORCH_CHECK(!share_memory(s[i], pool_tensors[j]), "shadows[", i, "] shares memory with the pool's ",
                  pool_names[j], ": a shadow holds tensors of its own (ft_ops.shadow_caches.ShadowCaches makes them)");
    }
    for (int64_t j = 0; j < i; ++j) {
      TORCH_CHECK(!share_memory(s[i], s[j]), "shadows[", i, "] shares memory with shadows[", j,
                  "]: a shadow holds tensors of its own (ft_ops.shadow_caches.ShadowCaches makes them)");
    }
  }
}

// async_layer_copy's optional row_sources: a CPU int32 [E] of slots or -1, with skip_resident.
inline void check_row_sources(const c10::optional<at::Tensor>& row_sources, bool skip_resident,
                              const PoolShape& pool) {
  if (!row_sources.has_value()) return;
  const at::Tensor& r = *row_sources;
  TORCH_CHECK(skip_resident, "row_sources says where resident rows are copied from: pass it with "
              "skip_resident=True, or leave it out");
  TORCH_CHECK(r.device().is_cpu() && r.scalar_type() == at::kInt && r.dim() == 1 &&
                  r.numel() == pool.experts && r.is_contiguous(),
              "row_sources must be a contiguous CPU int32 tensor of ", pool.experts,
              " entries (one per expert of the layer), got ", r.is_contiguous() ? "" : "a non-contiguous ",
              r.scalar_type(), " ", r.sizes(), " on ", r.device());
  const int32_t* v = r.data_ptr<int32_t>();
  for (int64_t e = 0; e < pool.experts; ++e) {
    TORCH_CHECK(v[e] >= -1 && v[e] < pool.slots, "row_sources[", e, "] is ", v[e],
                ": each entry is a slot in [0, ", pool.slots, ") or -1 (the host pool)");
  }
}

// Everything async_layer_copy checks, for both devices.
inline PoolShape check_layer_copy_inputs(const at::Tensor& slot_of, const at::Tensor& owner_of,
                                         const at::Tensor& last_use, const at::Tensor& clock,
                                         at::TensorList banks, at::TensorList host_rows,
                                         int64_t layer, int64_t first_slot, int64_t reclaim_lo,
                                         int64_t reclaim_hi, bool skip_resident,
                                         const c10::optional<at::Tensor>& row_sources) {
  const PoolShape pool = check_pool_state(slot_of, owner_of, last_use, clock);
  check_layer(layer, pool);
  const int64_t bank_slots = check_banks(banks, host_rows, pool.experts, slot_of);
  TORCH_CHECK(bank_slots == pool.slots, "banks have ", bank_slots, " slots but owner_of has ",
              pool.slots);
  check_stream_args(first_slot, reclaim_lo, reclaim_hi, pool);
  check_row_sources(row_sources, skip_resident, pool);
  return pool;
}

}  // namespace ft
