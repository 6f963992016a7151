// CUDA kernel of expert_gemm, two paths chosen by token count.
//
// Decode (few tokens): two launches that read the selected slot rows in place, memory-bound.
//   gate_up: on tensor cores for bf16/fp16 weights in whole 16-row tiles (decode_tensor_core.cuh,
//     the pairs routed to a slot as the mma's columns), otherwise with FMAs (decode_fma.cuh);
//     then down_combine_kernel (decode_fma.cuh), the weighted combine in a fixed order.
// Prefill (many tokens, bf16): pairs are sorted by slot on the device (no host sync), the
//   offsets found by searchsorted, and the two products run as grouped tensor-core GEMMs
//   (at::_grouped_mm, CUTLASS on sm90) straight on the bank, with the slots as groups; a fused
//   bias+activation kernel sits between them and a combine kernel gathers each token's top-k rows
//   (grouped_steps.cuh). _grouped_mm takes fewer than 1,024 groups: larger banks are cut into
//   windows of 1,023 slots (src/common/windowed_grouped.h), each a sub-bank view with its own two
//   products.
// FP8 weights (w13_scale and w2_scale given, 128 x 128 blocks or one a row): the decode kernels
//   of decode_fp8.cuh, dequantizing in registers. MXFP4 weights: those of decode_mxfp4.cuh, likewise. A prompt-sized
//   call given a slot_map (a layer's experts: the slot of each expert id) dequantizes the map's
//   experts into a scratch bank a window at a time (dequantize.h; at most
//   limits::kDequantizeWindowBytes) and runs the windowed grouped path on them.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>
#include <type_traits>
#include <utility>

#include "../common/checks.h"
#include "../common/quantized_weights.h"
#include "../common/limits.h"
#include "../common/windowed_grouped.h"
#include "cuda_utils.cuh"
#include "decode_fma.cuh"
#include "dependent_launch.cuh"
#include "decode_fp8.cuh"
#include "decode_mxfp4.cuh"
#include "decode_tensor_core.cuh"
#include "dequantize.h"
#include "grouped_steps.cuh"

namespace ft::cuda {
namespace {

// Calls f(scalar_t{}) for the three dtypes expert_gemm accepts (checked before).
template <typename F>
void dispatch_dtype(at::ScalarType dtype, F&& f) {
  switch (dtype) {
    case at::kFloat: return f(float{});
    case at::kHalf: return f(at::Half{});
    case at::kBFloat16: return f(at::BFloat16{});
    default: TORCH_CHECK(false, "expert_gemm: unsupported dtype ", dtype);
  }
}

// Calls f(std::bool_constant<flag>{}): for kernels that take a flag as a template parameter.
template <typename F>
void with_flag(bool flag, F&& f) {
  if (flag) {
    f(std::true_type{});
  } else {
    f(std::false_type{});
  }
}

// Calls f(std::bool_constant<gated>{}): the gate_up kernels take whether the experts are gated as a
// template parameter (activation.cuh, up_row_of).
template <typename F>
void with_gated(bool gated, F&& f) {
  with_flag(gated, std::forward<F>(f));
}

bool grouped_path_applies(const at::Tensor& hidden, const GemmShape& shape) {
  if (hidden.scalar_type() != at::kBFloat16) return false;  // _grouped_mm's tensor-core dtype
  if (shape.tokens < limits::kGroupedGemmMinTokens) return false;
  if (shape.hidden % 8 != 0 || shape.intermediate % 8 != 0) return false;  // 16-byte rows
  int major = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, hidden.get_device()));
  return major >= 9;  // CUTLASS grouped GEMM in _grouped_mm
}

void decode_path(const at::Tensor& hidden, const at::Tensor& slots, const at::Tensor& weights,
                 const at::Tensor& w13, const at::Tensor& w2, const c10::optional<at::Tensor>& b13,
                 const c10::optional<at::Tensor>& b2, const DeviceActivation& act, const GemmShape& shape,
                 at::Tensor& out) {
  const int64_t K = shape.top_k, H = shape.hidden, I = shape.intermediate;
  // Tokens per launch pair: at most kDecodeChunk, and few enough that the chunk's slot ids fit
  // the shared-memory stage of gate_up_act_kernel.
  const int64_t chunk = std::max<int64_t>(1, std::min<int64_t>(kDecodeChunk, 8192 / K));
  auto act_buf = at::empty({std::min(shape.tokens, chunk) * K, I},
                           hidden.options().dtype(at::kFloat));
  dispatch_dtype(hidden.scalar_type(), [&](auto tag) {
    using scalar_t = decltype(tag);
    constexpr int V = Vec16<scalar_t>::kElems;
    const bool vector = H % V == 0 && I % V == 0 && aligned16(hidden.data_ptr()) &&
                        hidden.stride(0) % V == 0 && aligned16(w13.data_ptr()) &&
                        w13.stride(0) % V == 0 && aligned16(w2.data_ptr()) && w2.stride(0) % V == 0;
    // 16-bit weights in whole tiles go to the tensor-core kernel (decode_tensor_core.cuh).
    const bool tensor_cores = vector && tensor_core_decode_applies(H, I);
    const scalar_t* b13_ptr = b13 ? b13->data_ptr<scalar_t>() : nullptr;
    const scalar_t* b2_ptr = b2 ? b2->data_ptr<scalar_t>() : nullptr;
    const int64_t b13_stride = b13 ? b13->stride(0) : 0;
    const int64_t b2_stride = b2 ? b2->stride(0) : 0;
    for (int64_t t0 = 0; t0 < shape.tokens; t0 += chunk) {
      const int64_t tokens = std::min(chunk, shape.tokens - t0);
      const int64_t pairs = tokens * K;
      const scalar_t* x = hidden.data_ptr<scalar_t>() + t0 * hidden.stride(0);
      const int32_t* s = slots.data_ptr<int32_t>() + t0 * K;
      const float* w = weights.data_ptr<float>() + t0 * K;
      scalar_t* o = out.data_ptr<scalar_t>() + t0 * out.stride(0);
      const dim3 grid1((I + kWarpsPerBlock - 1) / kWarpsPerBlock, pairs);
      const dim3 grid2((H + kDownRows - 1) / kDownRows, tokens);
      const size_t smem1 = pairs * sizeof(int32_t);
      const auto launch = [&](auto vector_tag, auto gated_tag) {
        constexpr bool kVector = decltype(vector_tag)::value, kGated = decltype(gated_tag)::value;
        bool on_tensor_cores = false;
        if constexpr (kVector && !std::is_same_v<scalar_t, float>) {
          if (tensor_cores) {
            gate_up_act_mma_kernel<scalar_t, kGated>
                <<<dim3(I / kMmaRows, pairs), kMmaThreads, smem1, current_stream()>>>(
                x, hidden.stride(0), s, pairs, K, shape.slots, w13.data_ptr<scalar_t>(), w13.stride(0),
                b13_ptr, b13_stride, H, I, act, act_buf.data_ptr<float>());
            on_tensor_cores = true;
          }
        }
        if (!on_tensor_cores) {
          gate_up_act_kernel<scalar_t, kVector, kGated><<<grid1, kThreads, smem1, current_stream()>>>(
              x, hidden.stride(0), s, pairs, K, shape.slots, w13.data_ptr<scalar_t>(), w13.stride(0), b13_ptr,
              b13_stride, H, I, act, act_buf.data_ptr<float>());
        }
        FT_CHECK_LAUNCH();
        // A dependent launch: it is scheduled while gate_up finishes and prefetches its rows.
        launch_dependent(down_combine_kernel<scalar_t, kVector>, grid2, dim3(kThreads), 0,
                         static_cast<const float*>(act_buf.data_ptr<float>()), s, w, K, shape.slots,
                         static_cast<const scalar_t*>(w2.data_ptr<scalar_t>()), w2.stride(0), b2_ptr, b2_stride, H, I,
                         o, out.stride(0));
        FT_CHECK_LAUNCH();
      };
      with_gated(shape.gated, [&](auto gated_tag) {
        if (vector) {
          launch(std::true_type{}, gated_tag);
        } else {
          launch(std::false_type{}, gated_tag);
        }
      });
    }
  });
}

// FP8 weights, block or row scales (any token count): the decode kernels of decode_fp8.cuh,
// dequantizing in registers. A prompt-sized bf16 call given a slot_map takes
// dequantized_grouped_path instead.
void fp8_decode_path(const at::Tensor& hidden, const at::Tensor& slots, const at::Tensor& weights,
                     const at::Tensor& w13, const at::Tensor& w2, const at::Tensor& s13, const at::Tensor& s2,
                     const c10::optional<at::Tensor>& b13, const c10::optional<at::Tensor>& b2,
                     const DeviceActivation& act, const GemmShape& shape, at::Tensor& out) {
  const int64_t K = shape.top_k, H = shape.hidden, I = shape.intermediate;
  const int64_t chunk = std::max<int64_t>(1, std::min<int64_t>(kDecodeChunk, 8192 / K));
  auto act_buf = at::empty({std::min(shape.tokens, chunk) * K, I}, hidden.options().dtype(at::kFloat));
  const auto* w13_ptr = reinterpret_cast<const uint8_t*>(w13.data_ptr());
  const auto* w2_ptr = reinterpret_cast<const uint8_t*>(w2.data_ptr());
  const bool row_scales = s13.dim() == 2;  // (check_gemm_weight_format: both banks alike)
  dispatch_dtype(hidden.scalar_type(), [&](auto tag) {
    using scalar_t = decltype(tag);
    // The mma kernel loads 16 hidden values and 16 weight bytes per lane: 16-byte aligned rows.
    // It multiplies the hidden state in f16, exact for 16-bit hidden states only: float32 ones take
    // the FMA kernel, which keeps them in float32.
    const bool tensor_cores = !std::is_same_v<scalar_t, float> && fp8_tensor_core_decode_applies(H, I) &&
                              aligned16(hidden.data_ptr()) &&
                              (hidden.stride(0) * int64_t(sizeof(scalar_t))) % 16 == 0 && aligned16(w13_ptr) &&
                              w13.stride(0) % 16 == 0;
    const bool vector_down = I % 16 == 0 && aligned16(w2_ptr) && w2.stride(0) % 16 == 0;
    const scalar_t* b13_ptr = b13 ? b13->data_ptr<scalar_t>() : nullptr;
    const scalar_t* b2_ptr = b2 ? b2->data_ptr<scalar_t>() : nullptr;
    const int64_t b13_stride = b13 ? b13->stride(0) : 0;
    const int64_t b2_stride = b2 ? b2->stride(0) : 0;
    for (int64_t t0 = 0; t0 < shape.tokens; t0 += chunk) {
      const int64_t tokens = std::min(chunk, shape.tokens - t0);
      const int64_t pairs = tokens * K;
      const scalar_t* x = hidden.data_ptr<scalar_t>() + t0 * hidden.stride(0);
      const int32_t* s = slots.data_ptr<int32_t>() + t0 * K;
      const float* w = weights.data_ptr<float>() + t0 * K;
      scalar_t* o = out.data_ptr<scalar_t>() + t0 * out.stride(0);
      const size_t smem1 = pairs * sizeof(int32_t);
      with_gated(shape.gated, [&](auto gated_tag) {
        constexpr bool kGated = decltype(gated_tag)::value;
        bool on_tensor_cores = false;
        if constexpr (!std::is_same_v<scalar_t, float>) {  // (tensor_cores is false for float32)
          with_flag(row_scales, [&](auto rows_tag) {
            constexpr bool kRowScales = decltype(rows_tag)::value;
            if (tensor_cores && fp8_one_token_gate_up_applies(tokens, H, I)) {
              gate_up_act_fp8_one_token_kernel<scalar_t, kGated, kRowScales>
                  <<<dim3(I / kMmaRows, pairs), kMmaThreads, size_t(H / 2) * sizeof(uint32_t), current_stream()>>>(
                      x, s, shape.slots, w13_ptr, w13.stride(0), s13.data_ptr<float>(), s13.stride(0), b13_ptr,
                      b13_stride, H, I, act, act_buf.data_ptr<float>());
              on_tensor_cores = true;
            } else if (tensor_cores) {
              const int64_t smem = fp8_mma_gate_up_smem(pairs);
              if (smem > 32 * 1024) {  // beside ~8.4 KB of static shared memory: more than 48 KiB needs opting in
                // To the largest size a launch takes (a chunk has at most 8,192 pairs unless top_k is
                // larger), so that calls of other sizes on other host threads never lower it between
                // another call's set and launch.
                const int64_t largest = fp8_mma_gate_up_smem(std::max<int64_t>(pairs, 8192));
                C10_CUDA_CHECK(cudaFuncSetAttribute(gate_up_act_fp8_mma_kernel<scalar_t, kGated, kRowScales>,
                                                    cudaFuncAttributeMaxDynamicSharedMemorySize,
                                                    static_cast<int>(largest)));
              }
              gate_up_act_fp8_mma_kernel<scalar_t, kGated, kRowScales>
                  <<<dim3(I / kMmaRows, pairs), kMmaThreads, static_cast<size_t>(smem), current_stream()>>>(
                      x, hidden.stride(0), s, pairs, K, shape.slots, w13_ptr, w13.stride(0), s13.data_ptr<float>(),
                      s13.stride(0), b13_ptr, b13_stride, H, I, act, act_buf.data_ptr<float>());
              on_tensor_cores = true;
            }
          });
        }
        if (!on_tensor_cores) {
          with_flag(row_scales, [&](auto rows_tag) {
            gate_up_act_fp8_kernel<scalar_t, kGated, decltype(rows_tag)::value>
                <<<dim3((I + kWarpsPerBlock - 1) / kWarpsPerBlock, pairs), kThreads, smem1, current_stream()>>>(
                    x, hidden.stride(0), s, pairs, K, shape.slots, w13_ptr, w13.stride(0), s13.data_ptr<float>(),
                    s13.stride(0), b13_ptr, b13_stride, H, I, act, act_buf.data_ptr<float>());
          });
        }
      });
      FT_CHECK_LAUNCH();
      if constexpr (!std::is_same_v<scalar_t, float>) {
        // The down projection on tensor cores, a block per (16 hidden rows, token) (a dependent
        // launch: its warps load their first rows while gate_up finishes).
        if (vector_down && fp8_rows_mma_down_applies(K, H, I)) {
          with_flag(row_scales, [&](auto rows_tag) {
            launch_dependent(down_combine_fp8_rows_mma_kernel<scalar_t, decltype(rows_tag)::value>,
                             dim3(H / kMmaRows, tokens), dim3(kFp8RowsDownWarps * 32 * kFp8RowsDownSplit),
                             static_cast<size_t>(fp8_rows_mma_down_smem(I)),
                             static_cast<const float*>(act_buf.data_ptr<float>()), s, w, K, shape.slots, w2_ptr,
                             w2.stride(0), static_cast<const float*>(s2.data_ptr<float>()), s2.stride(0), b2_ptr,
                             b2_stride, H, I, o, out.stride(0));
          });
          FT_CHECK_LAUNCH();
          continue;
        }
      }
      const dim3 grid2((H + kDownRows - 1) / kDownRows, tokens);
      // A dependent launch: it is scheduled while gate_up finishes and prefetches its rows.
      with_flag(vector_down, [&](auto vector_tag) {
        with_flag(row_scales, [&](auto rows_tag) {
          launch_dependent(
              down_combine_fp8_kernel<scalar_t, decltype(vector_tag)::value, decltype(rows_tag)::value>, grid2,
              dim3(kThreads), 0, static_cast<const float*>(act_buf.data_ptr<float>()), s, w, K, shape.slots, w2_ptr,
              w2.stride(0), static_cast<const float*>(s2.data_ptr<float>()), s2.stride(0), b2_ptr, b2_stride,
              H, I, o, out.stride(0));
        });
      });
      FT_CHECK_LAUNCH();
    }
  });
}

// Whether an MXFP4 scale bank allows 2-byte loads of a row's scale pairs (rows of an even number
// of groups): the bank and its slot stride are 2-byte aligned.
bool scale_pairs_aligned(const at::Tensor& scale) {
  return reinterpret_cast<uintptr_t>(scale.data_ptr()) % 2 == 0 && scale.stride(0) % 2 == 0;
}

// MXFP4 weights (any token count): the decode kernels of decode_mxfp4.cuh, dequantizing in
// registers; a prompt-sized bf16 call given a slot_map takes dequantized_grouped_path instead.
void mxfp4_decode_path(const at::Tensor& hidden, const at::Tensor& slots, const at::Tensor& weights,
                       const at::Tensor& w13, const at::Tensor& w2, const at::Tensor& s13, const at::Tensor& s2,
                       const c10::optional<at::Tensor>& b13, const c10::optional<at::Tensor>& b2,
                       const DeviceActivation& act, const GemmShape& shape, at::Tensor& out) {
  const int64_t K = shape.top_k, H = shape.hidden, I = shape.intermediate;
  const Mxfp4Codes::PerScale per_scale{kMxfp4Group};  // a scale a 32-value group
  const int64_t chunk = std::max<int64_t>(1, std::min<int64_t>(kDecodeChunk, 8192 / K));
  auto act_buf = at::empty({std::min(shape.tokens, chunk) * K, I}, hidden.options().dtype(at::kFloat));
  const auto* w13_ptr = reinterpret_cast<const uint8_t*>(w13.data_ptr());
  const auto* w2_ptr = reinterpret_cast<const uint8_t*>(w2.data_ptr());
  const auto* s13_ptr = reinterpret_cast<const uint8_t*>(s13.data_ptr());
  const auto* s2_ptr = reinterpret_cast<const uint8_t*>(s2.data_ptr());
  dispatch_dtype(hidden.scalar_type(), [&](auto tag) {
    using scalar_t = decltype(tag);
    // Rows are whole 16-byte groups (H and I are multiples of 32, checked): only the slot bases
    // and the hidden rows decide whether 16-byte loads are allowed.
    const bool vector = aligned16(hidden.data_ptr()) && (hidden.stride(0) * int64_t(sizeof(scalar_t))) % 16 == 0 &&
                        aligned16(w13_ptr) && w13.stride(0) % 16 == 0 && aligned16(w2_ptr) && w2.stride(0) % 16 == 0;
    // 16-bit hidden states in whole 16-row tiles: gate_up on tensor cores, 64 columns a step where
    // the rows are whole 64-column spans and a row's scale pairs 2-byte aligned (2-byte loads).
    const bool tensor_cores = !std::is_same_v<scalar_t, float> && mxfp4_tensor_core_decode_applies(I);
    const bool wide_gate_up = tensor_cores && mxfp4_wide_tensor_core_decode_applies(H, I) &&
                              scale_pairs_aligned(s13);
    // The down mma kernel takes act in f16 as gate_up's mma kernels take the hidden state: with
    // 16-bit hidden states only. It loads 8 bytes of a w2 row and 2 bytes of a scale row at a time;
    // it reads no hidden state, so the hidden rows' alignment does not matter to it.
    const bool tensor_core_down = !std::is_same_v<scalar_t, float> && aligned16(w2_ptr) && w2.stride(0) % 16 == 0 &&
                                  scale_pairs_aligned(s2) && mxfp4_tensor_core_down_applies(H, I);
    // The down mma kernel's partial sums and per-tile counters (zeroed by gate_up), per launch.
    const int64_t chunk_tokens = std::min(shape.tokens, chunk);
    const int64_t partial_words = tensor_core_down ? chunk_tokens * mxfp4_down_partial_words(H, K) : 0;
    const int64_t counter_words = tensor_core_down ? chunk_tokens * mxfp4_down_counter_words(H) : 0;
    auto down_buf = at::empty({partial_words + counter_words}, hidden.options().dtype(at::kInt));
    auto* partial_sums = reinterpret_cast<float*>(down_buf.data_ptr<int32_t>());
    auto* counters =
        tensor_core_down ? reinterpret_cast<unsigned*>(down_buf.data_ptr<int32_t>() + partial_words) : nullptr;
    const auto counter_words_of = [&](int64_t tokens) {
      return tensor_core_down ? tokens * mxfp4_down_counter_words(H) : int64_t(0);
    };
    const scalar_t* b13_ptr = b13 ? b13->data_ptr<scalar_t>() : nullptr;
    const scalar_t* b2_ptr = b2 ? b2->data_ptr<scalar_t>() : nullptr;
    const int64_t b13_stride = b13 ? b13->stride(0) : 0;
    const int64_t b2_stride = b2 ? b2->stride(0) : 0;
    for (int64_t t0 = 0; t0 < shape.tokens; t0 += chunk) {
      const int64_t tokens = std::min(chunk, shape.tokens - t0);
      const int64_t pairs = tokens * K;
      const scalar_t* x = hidden.data_ptr<scalar_t>() + t0 * hidden.stride(0);
      const int32_t* s = slots.data_ptr<int32_t>() + t0 * K;
      const float* w = weights.data_ptr<float>() + t0 * K;
      scalar_t* o = out.data_ptr<scalar_t>() + t0 * out.stride(0);
      const dim3 grid1((I + kWarpsPerBlock - 1) / kWarpsPerBlock, pairs);
      const dim3 grid2((H + kDownRows - 1) / kDownRows, tokens);
      const size_t smem1 = pairs * sizeof(int32_t);
      const auto launch = [&](auto vector_tag) {
        constexpr bool kVector = decltype(vector_tag)::value;
        bool on_tensor_cores = false;
        if constexpr (kVector && !std::is_same_v<scalar_t, float>) {
          if (wide_gate_up && mxfp4_one_token_gate_up_applies(tokens, H)) {
            gate_up_act_mxfp4_one_token_kernel<scalar_t>
                <<<dim3(I / kMmaRows, pairs), kMxfp4OneTokenThreads, mxfp4_one_token_gate_up_smem(H),
                   current_stream()>>>(
                    x, s, shape.slots, w13_ptr, w13.stride(0), s13_ptr, s13.stride(0), b13_ptr, b13_stride, H, I, act,
                    act_buf.data_ptr<float>(), counters, counter_words_of(tokens));
            on_tensor_cores = true;
          } else if (wide_gate_up) {
            gate_up_act_mxfp4_mma_wide_kernel<scalar_t>
                <<<dim3(I / kMmaRows, pairs), kMmaThreads, smem1, current_stream()>>>(
                    x, hidden.stride(0), s, pairs, K, shape.slots, w13_ptr, w13.stride(0), s13_ptr, s13.stride(0),
                    b13_ptr, b13_stride, H, I, act, act_buf.data_ptr<float>(), counters, counter_words_of(tokens));
            on_tensor_cores = true;
          } else if (tensor_cores) {
            gate_up_act_packed_mma_kernel<scalar_t, Mxfp4Codes>
                <<<dim3(I / kMmaRows, pairs), kMmaThreads, smem1, current_stream()>>>(
                    x, hidden.stride(0), s, pairs, K, shape.slots, w13_ptr, w13.stride(0), s13_ptr, s13.stride(0),
                    per_scale, b13_ptr, b13_stride, H, I, act, act_buf.data_ptr<float>(), counters,
                    counter_words_of(tokens));
            on_tensor_cores = true;
          }
        }
        if (!on_tensor_cores) {
          gate_up_act_packed_kernel<scalar_t, kVector, Mxfp4Codes><<<grid1, kThreads, smem1, current_stream()>>>(
              x, hidden.stride(0), s, pairs, K, shape.slots, w13_ptr, w13.stride(0), s13_ptr, s13.stride(0),
              per_scale, b13_ptr, b13_stride, H, I, act, act_buf.data_ptr<float>(), counters,
              counter_words_of(tokens));
        }
        FT_CHECK_LAUNCH();
        // A dependent launch: it is scheduled while gate_up finishes and loads (the mma kernel) or
        // prefetches (the FMA kernel) its first rows.
        bool down_on_tensor_cores = false;
        if constexpr (!std::is_same_v<scalar_t, float>) {
          if (tensor_core_down) {
            launch_dependent(down_combine_packed_mma_kernel<scalar_t, Mxfp4Codes>, dim3(H / kMmaRows, K, tokens),
                             dim3(kMxfp4DownThreads), size_t(mxfp4_tensor_core_down_smem(I)),
                             static_cast<const float*>(act_buf.data_ptr<float>()), s, w, K, shape.slots, w2_ptr,
                             w2.stride(0), s2_ptr, s2.stride(0), per_scale, b2_ptr, b2_stride, H, I, o,
                             out.stride(0), partial_sums, counters);
            down_on_tensor_cores = true;
          }
        }
        if (!down_on_tensor_cores) {
          launch_dependent(down_combine_packed_kernel<scalar_t, kVector, Mxfp4Codes>, grid2, dim3(kThreads), 0,
                           static_cast<const float*>(act_buf.data_ptr<float>()), s, w, K, shape.slots, w2_ptr,
                           w2.stride(0), s2_ptr, s2.stride(0), per_scale, b2_ptr, b2_stride, H, I, o,
                           out.stride(0));
        }
        FT_CHECK_LAUNCH();
      };
      if (vector) {
        launch(std::true_type{});
      } else {
        launch(std::false_type{});
      }
    }
  });
}

// int4 decode calls: decode_mxfp4.cuh's kernels on int4 rows (Int4Codes): gate_up + act on tensor
// cores (16-bit hidden states, I % 16 == 0, 16-byte aligned rows and hidden rows) or with FMAs, then
// down + combine as a dependent launch, on tensor cores as MXFP4's (16-bit hidden states, I % 64 ==
// 0, 16-byte aligned w2 slots) or with FMAs.
void int4_decode_path(const at::Tensor& hidden, const at::Tensor& slots, const at::Tensor& weights,
                      const at::Tensor& w13, const at::Tensor& w2, const at::Tensor& s13, const at::Tensor& s2,
                      const c10::optional<at::Tensor>& b13, const c10::optional<at::Tensor>& b2,
                      const DeviceActivation& act, const GemmShape& shape, at::Tensor& out) {
  const int64_t K = shape.top_k, H = shape.hidden, I = shape.intermediate;
  // Groups of 32 values per scale (G / 32) of each bank, as the kernels' divider.
  const GroupsPerScale per_scale13(static_cast<unsigned>(H / s13.size(2) / 32)),
      per_scale2(static_cast<unsigned>(I / s2.size(2) / 32));
  const int64_t chunk = std::max<int64_t>(1, std::min<int64_t>(kDecodeChunk, 8192 / K));
  auto act_buf = at::empty({std::min(shape.tokens, chunk) * K, I}, hidden.options().dtype(at::kFloat));
  const auto* w13_ptr = reinterpret_cast<const uint8_t*>(w13.data_ptr());
  const auto* w2_ptr = reinterpret_cast<const uint8_t*>(w2.data_ptr());
  dispatch_dtype(hidden.scalar_type(), [&](auto tag) {
    using scalar_t = decltype(tag);
    // Rows are whole 16-byte chunks (H and I are multiples of 32, checked): only the slot bases and
    // the hidden rows decide whether 16-byte loads are allowed.
    const bool vector = aligned16(hidden.data_ptr()) && (hidden.stride(0) * int64_t(sizeof(scalar_t))) % 16 == 0 &&
                        aligned16(w13_ptr) && w13.stride(0) % 16 == 0 && aligned16(w2_ptr) && w2.stride(0) % 16 == 0;
    // 16-bit hidden states in whole 16-row tiles: gate_up on tensor cores, a 32-column group a step
    // (the MXFP4 kernel's structure; each group inside one int4 scale group); the down projection on
    // tensor cores as MXFP4's, with its partial sums and per-tile counters (zeroed by gate_up).
    const bool tensor_cores = !std::is_same_v<scalar_t, float> && mxfp4_tensor_core_decode_applies(I);
    const bool tensor_core_down = !std::is_same_v<scalar_t, float> && aligned16(w2_ptr) && w2.stride(0) % 16 == 0 &&
                                  mxfp4_tensor_core_down_applies(H, I);
    const int64_t chunk_tokens = std::min(shape.tokens, chunk);
    const int64_t partial_words = tensor_core_down ? chunk_tokens * mxfp4_down_partial_words(H, K) : 0;
    const int64_t counter_words = tensor_core_down ? chunk_tokens * mxfp4_down_counter_words(H) : 0;
    auto down_buf = at::empty({partial_words + counter_words}, hidden.options().dtype(at::kInt));
    auto* partial_sums = reinterpret_cast<float*>(down_buf.data_ptr<int32_t>());
    auto* counters =
        tensor_core_down ? reinterpret_cast<unsigned*>(down_buf.data_ptr<int32_t>() + partial_words) : nullptr;
    const auto counter_words_of = [&](int64_t tokens) {
      return tensor_core_down ? tokens * mxfp4_down_counter_words(H) : int64_t(0);
    };
    const scalar_t* b13_ptr = b13 ? b13->data_ptr<scalar_t>() : nullptr;
    const scalar_t* b2_ptr = b2 ? b2->data_ptr<scalar_t>() : nullptr;
    const int64_t b13_stride = b13 ? b13->stride(0) : 0;
    const int64_t b2_stride = b2 ? b2->stride(0) : 0;
    for (int64_t t0 = 0; t0 < shape.tokens; t0 += chunk) {
      const int64_t tokens = std::min(chunk, shape.tokens - t0);
      const int64_t pairs = tokens * K;
      const scalar_t* x = hidden.data_ptr<scalar_t>() + t0 * hidden.stride(0);
      const int32_t* s = slots.data_ptr<int32_t>() + t0 * K;
      const float* w = weights.data_ptr<float>() + t0 * K;
      scalar_t* o = out.data_ptr<scalar_t>() + t0 * out.stride(0);
      const dim3 grid1((I + kWarpsPerBlock - 1) / kWarpsPerBlock, pairs);
      const dim3 grid2((H + kDownRows - 1) / kDownRows, tokens);
      const size_t smem1 = pairs * sizeof(int32_t);
      const auto launch = [&](auto vector_tag) {
        constexpr bool kVector = decltype(vector_tag)::value;
        bool on_tensor_cores = false;
        if constexpr (kVector && !std::is_same_v<scalar_t, float>) {
          if (tensor_cores) {
            gate_up_act_packed_mma_kernel<scalar_t, Int4Codes>
                <<<dim3(I / kMmaRows, pairs), kMmaThreads, smem1, current_stream()>>>(
                    x, hidden.stride(0), s, pairs, K, shape.slots, w13_ptr, w13.stride(0), s13.data_ptr<float>(),
                    s13.stride(0), per_scale13, b13_ptr, b13_stride, H, I, act, act_buf.data_ptr<float>(), counters,
                    counter_words_of(tokens));
            on_tensor_cores = true;
          }
        }
        if (!on_tensor_cores) {
          gate_up_act_packed_kernel<scalar_t, kVector, Int4Codes><<<grid1, kThreads, smem1, current_stream()>>>(
              x, hidden.stride(0), s, pairs, K, shape.slots, w13_ptr, w13.stride(0), s13.data_ptr<float>(),
              s13.stride(0), per_scale13, b13_ptr, b13_stride, H, I, act, act_buf.data_ptr<float>(), counters,
              counter_words_of(tokens));
        }
        FT_CHECK_LAUNCH();
        const float* s2_ptr = s2.data_ptr<float>();
        bool down_on_tensor_cores = false;
        if constexpr (!std::is_same_v<scalar_t, float>) {
          if (tensor_core_down) {
            launch_dependent(down_combine_packed_mma_kernel<scalar_t, Int4Codes>, dim3(H / kMmaRows, K, tokens),
                             dim3(kMxfp4DownThreads), size_t(mxfp4_tensor_core_down_smem(I)),
                             static_cast<const float*>(act_buf.data_ptr<float>()), s, w, K, shape.slots, w2_ptr,
                             w2.stride(0), s2_ptr, s2.stride(0), per_scale2, b2_ptr, b2_stride, H, I, o, out.stride(0),
                             partial_sums, counters);
            down_on_tensor_cores = true;
          }
        }
        if (!down_on_tensor_cores) {
          launch_dependent(down_combine_packed_kernel<scalar_t, kVector, Int4Codes>, grid2, dim3(kThreads), 0,
                           static_cast<const float*>(act_buf.data_ptr<float>()), s, w, K, shape.slots, w2_ptr,
                           w2.stride(0), s2_ptr, s2.stride(0), per_scale2, b2_ptr, b2_stride, H, I, o, out.stride(0));
        }
        FT_CHECK_LAUNCH();
      };
      if (vector) {
        launch(std::true_type{});
      } else {
        launch(std::false_type{});
      }
    }
  });
}

// Banks of more than limits::kGroupedGemmMaxSlots slots: the same products, one window of slots at
// a time (_grouped_mm takes fewer than 1,024 groups), then the combine over the pairs' rows.
void windowed_grouped_path(const at::Tensor& hidden, const at::Tensor& slots, const at::Tensor& weights,
                           const at::Tensor& w13, const at::Tensor& w2, const c10::optional<at::Tensor>& b13,
                           const c10::optional<at::Tensor>& b2, const DeviceActivation& act, const GemmShape& shape,
                           at::Tensor& out) {
  using scalar_t = at::BFloat16;
  const int64_t K = shape.top_k, H = shape.hidden, pairs = shape.tokens * K;
  auto y_all = at::empty({pairs, H}, hidden.options());
  CudaWindowSteps steps{b13, shape.intermediate, shape.up_row(), act};
  const auto bank = [&](int64_t a, int64_t b) {
    return std::make_pair(w13.narrow(0, a, b - a), w2.narrow(0, a, b - a));
  };
  ft::windowed_grouped_ffn(hidden, slots, shape.slots, K, limits::kGroupedGemmMaxSlots, bank, steps, y_all);
  // Row p of y_all is pair p's product (pairs of slot -1 are skipped by the combine).
  const auto position = at::arange(pairs, slots.options().dtype(at::kLong));
  combine_kernel<scalar_t><<<shape.tokens, 256, 0, current_stream()>>>(
      y_all.data_ptr<scalar_t>(), position.data_ptr<int64_t>(), slots.data_ptr<int32_t>(),
      weights.data_ptr<float>(), K, shape.slots, b2 ? b2->data_ptr<scalar_t>() : nullptr, b2 ? b2->stride(0) : 0,
      H, out.data_ptr<scalar_t>(), out.stride(0));
  FT_CHECK_LAUNCH();
}

// A prompt-sized call on a quantized bank through a slot_map (bf16, the grouped path's shapes): the
// map's E experts are a bank of their own, the expert ids its slots. Each window of them is
// dequantized into one scratch bank of at most limits::kDequantizeWindowBytes (the whole layer in
// one window where it fits: Qwen3-30B-A3B's 1.2 GB; GPT-OSS-120B's 6.4 GB in windows of 43
// experts; at least one expert a window) and computed by the windowed grouped path, then one
// combine over the pairs' rows, so a token's sum is the same whatever the window. `keys`: each
// pair's expert id, -1 where it has no slot in the bank (the caller's mapping), so those pairs are
// not computed, as in the mapped decode path. Needs a bank of at least one slot and a map of at
// least one expert.
void dequantized_grouped_path(const at::Tensor& hidden, const at::Tensor& keys, const at::Tensor& weights,
                              const at::Tensor& w13, const at::Tensor& w2, const at::Tensor& s13, const at::Tensor& s2,
                              const at::Tensor& slot_map, const c10::optional<at::Tensor>& b13,
                              const c10::optional<at::Tensor>& b2, const DeviceActivation& act,
                              const GemmShape& shape, at::Tensor& out) {
  using scalar_t = at::BFloat16;
  const int64_t K = shape.top_k, H = shape.hidden, I = shape.intermediate, pairs = shape.tokens * K;
  const int64_t E = slot_map.numel(), rows13 = shape.gated ? 2 * I : I;
  const auto map = slot_map.to(at::kLong).contiguous();
  const int64_t expert_bytes = std::max<int64_t>(1, (rows13 * H + H * I) * int64_t(sizeof(scalar_t)));
  const int64_t window = std::max<int64_t>(
      1, std::min({limits::kDequantizeWindowBytes / expert_bytes, E, limits::kGroupedGemmMaxSlots}));
  auto w13_scratch = at::empty({window, rows13, H}, hidden.options());
  auto w2_scratch = at::empty({window, H, I}, hidden.options());
  const auto bank = [&](int64_t a, int64_t b) {
    const auto ids = map.narrow(0, a, b - a);
    auto w13_window = w13_scratch.narrow(0, 0, b - a), w2_window = w2_scratch.narrow(0, 0, b - a);
    dequantize_experts_into(w13, s13, ids, shape.gated ? 2 : 1, w13_window);
    dequantize_experts_into(w2, s2, ids, 1, w2_window);
    return std::make_pair(w13_window, w2_window);
  };
  // The biases of the map's experts, indexed by expert id as the steps and the combine read them.
  const auto gather = map.clamp(0, shape.slots - 1);  // rows of unmapped experts: no pair reads them
  const c10::optional<at::Tensor> b13_experts =
      b13 ? c10::optional<at::Tensor>(b13->index_select(0, gather)) : c10::nullopt;
  const c10::optional<at::Tensor> b2_experts =
      b2 ? c10::optional<at::Tensor>(b2->index_select(0, gather)) : c10::nullopt;
  auto y_all = at::empty({pairs, H}, hidden.options());
  CudaWindowSteps steps{b13_experts, I, shape.up_row(), act};
  ft::windowed_grouped_ffn(hidden, keys, E, K, window, bank, steps, y_all);
  const auto position = at::arange(pairs, keys.options().dtype(at::kLong));
  combine_kernel<scalar_t><<<shape.tokens, 256, 0, current_stream()>>>(
      y_all.data_ptr<scalar_t>(), position.data_ptr<int64_t>(), keys.data_ptr<int32_t>(), weights.data_ptr<float>(),
      K, E, b2_experts ? b2_experts->data_ptr<scalar_t>() : nullptr, b2_experts ? b2_experts->stride(0) : 0, H,
      out.data_ptr<scalar_t>(), out.stride(0));
  FT_CHECK_LAUNCH();
}

void grouped_path(const at::Tensor& hidden, const at::Tensor& slots, const at::Tensor& weights,
                  const at::Tensor& w13, const at::Tensor& w2, const c10::optional<at::Tensor>& b13,
                  const c10::optional<at::Tensor>& b2, const DeviceActivation& act, const GemmShape& shape,
                  at::Tensor& out) {
  using scalar_t = at::BFloat16;
  const int64_t K = shape.top_k, H = shape.hidden, I = shape.intermediate, S = shape.slots;
  const int64_t pairs = shape.tokens * K;
  // Pairs of slot -1 (or out of range) sort after every real slot and fall outside the last
  // group offset, so the grouped GEMMs skip them.
  const auto keys = at::where(at::logical_or(slots < 0, slots >= S), at::scalar_tensor(S, slots.options()), slots);
  auto [sorted_keys, order] = at::sort(keys, /*stable=*/true, /*dim=*/0, /*descending=*/false);
  const auto group_ends = at::searchsorted(sorted_keys, at::arange(S, slots.options()),
                                           /*out_int32=*/true, /*right=*/true);
  const auto x = hidden.index_select(0, at::floor_divide(order, K));
  const auto h = at::_grouped_mm(x, w13.transpose(1, 2), group_ends);
  auto a = at::empty({pairs, I}, hidden.options());
  bias_act_kernel<scalar_t><<<pairs, 256, 0, current_stream()>>>(
      h.data_ptr<scalar_t>(), sorted_keys.data_ptr<int32_t>(), pairs, S,
      b13 ? b13->data_ptr<scalar_t>() : nullptr, b13 ? b13->stride(0) : 0, I, shape.up_row(), act,
      a.data_ptr<scalar_t>());
  FT_CHECK_LAUNCH();
  const auto y = at::_grouped_mm(a, w2.transpose(1, 2), group_ends);
  auto position = at::empty_like(order);
  position.scatter_(0, order, at::arange(pairs, order.options()));
  combine_kernel<scalar_t><<<shape.tokens, 256, 0, current_stream()>>>(
      y.data_ptr<scalar_t>(), position.data_ptr<int64_t>(), slots.data_ptr<int32_t>(),
      weights.data_ptr<float>(), K, S, b2 ? b2->data_ptr<scalar_t>() : nullptr, b2 ? b2->stride(0) : 0,
      H, out.data_ptr<scalar_t>(), out.stride(0));
  FT_CHECK_LAUNCH();
}

at::Tensor expert_gemm(const at::Tensor& hidden, const at::Tensor& slot_ids,
                       const at::Tensor& weights, const at::Tensor& w13, const at::Tensor& w2,
                       const c10::optional<at::Tensor>& b13, const c10::optional<at::Tensor>& b2,
                       c10::string_view activation, double alpha, double limit, double up_offset,
                       double gate_softcap, double up_softcap, const c10::optional<at::Tensor>& w13_scale,
                       const c10::optional<at::Tensor>& w2_scale, bool limit_after_act, bool gated,
                       const c10::optional<at::Tensor>& slot_map) {
  const WeightFormat format = check_gemm_weight_format(w13, w2, w13_scale, w2_scale, gated);
  const bool fp8 = is_fp8(format);
  const GemmShape shape = check_gemm_inputs(hidden, slot_ids, weights, w13, w2, b13, b2, format, gated);
  if (slot_map) check_slot_map(*slot_map, hidden);
  const DeviceActivation act =
      to_device(parse_activation(activation, alpha, limit, up_offset, gate_softcap, up_softcap, limit_after_act, gated));
  const c10::cuda::CUDAGuard guard(hidden.device());
  auto out = at::empty({shape.tokens, shape.hidden}, hidden.options());
  if (shape.tokens == 0) return out;
  if (shape.top_k == 0) return out.zero_();  // no pair routed: the kernels' chunking divides by top_k
  // Out-of-range slots cannot raise without a host sync; the kernels treat them like -1. With a
  // map, ids are mapped (and pairs without a slot in the bank set to -1) before the int32 cast.
  at::Tensor mapped = slot_ids;
  const auto none = at::scalar_tensor(-1, slot_ids.options());
  if (slot_map) {
    const auto through_map = slots_through_map(slot_ids, *slot_map);
    mapped = at::where(at::logical_and(through_map >= 0, through_map < shape.slots), through_map, none);
  }
  const auto w = weights.to(at::kFloat).contiguous().view({-1});
  const auto x = hidden.stride(1) == 1 ? hidden : hidden.contiguous();
  if (slot_map && format != WeightFormat::kDense && slot_map->numel() > 0 && shape.slots > 0 &&
      grouped_path_applies(x, shape)) {
    const auto keys = at::where(mapped >= 0, slot_ids, none).to(at::kInt).contiguous().view({-1});
    dequantized_grouped_path(x, keys, w, w13, w2, *w13_scale, *w2_scale, *slot_map, b13, b2, act, shape, out);
    return out;
  }
  const auto slots = mapped.to(at::kInt).contiguous().view({-1});
  if (fp8) {
    fp8_decode_path(x, slots, w, w13, w2, *w13_scale, *w2_scale, b13, b2, act, shape, out);
  } else if (format == WeightFormat::kMxfp4) {
    mxfp4_decode_path(x, slots, w, w13, w2, *w13_scale, *w2_scale, b13, b2, act, shape, out);
  } else if (format == WeightFormat::kInt4) {
    int4_decode_path(x, slots, w, w13, w2, *w13_scale, *w2_scale, b13, b2, act, shape, out);
  } else if (grouped_path_applies(x, shape)) {
    if (shape.slots <= limits::kGroupedGemmMaxSlots) {
      grouped_path(x, slots, w, w13, w2, b13, b2, act, shape, out);
    } else {
      windowed_grouped_path(x, slots, w, w13, w2, b13, b2, act, shape, out);
    }
  } else {
    decode_path(x, slots, w, w13, w2, b13, b2, act, shape, out);
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(freetoken, CUDA, m) { m.impl("expert_gemm", &expert_gemm); }

}  // namespace ft::cuda
