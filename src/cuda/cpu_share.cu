// CUDA kernels of cpu_share_submit / cpu_share_join (src/common/cpu_share.h): the device side of
// the CPU share's mailbox. submit writes the payload into the pinned mailbox through its device
// address (a wide kernel), then a one-block kernel counts the call's CPU pairs and, if any, posts
// the job (the header, the next sequence number, a system-wide fence, then `submitted`); join waits
// in one thread of each block for `done` to reach the job (reading the mapped flag), then adds
// the result, read past the caches (the same addresses are reused by every job). Everything the
// kernels need comes from device tensors and the mailbox, so both are capturable: a replayed
// graph posts a fresh job every time.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <cstdio>
#include <map>
#include <mutex>

#include "../common/cpu_share.h"
#include "cuda_utils.cuh"

namespace ft::cuda {
namespace {

using cpu_share::Layout;
using cpu_share::MailboxHeader;

constexpr int kThreads = 256;
constexpr unsigned long long kJoinTimeoutNs = 60ull * 1000 * 1000 * 1000;  // then trap: never hang

__device__ __forceinline__ unsigned long long global_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %globaltimer;" : "=l"(t));
  return t;
}

// A call's CPU pairs: slot -1 and an expert of the layer.
template <typename Id>
__device__ __forceinline__ int32_t cpu_id(const int32_t* slot_ids, const Id* expert_ids, int64_t i, int64_t experts) {
  const int64_t e = static_cast<int64_t>(expert_ids[i]);
  return slot_ids[i] < 0 && e >= 0 && e < experts ? static_cast<int32_t>(e) : -1;
}

struct SubmitArgs {
  int64_t hidden_stride, tokens, top_k, H, experts, layer;
  uint8_t* mailbox;  // device address
  Layout l;
  int64_t* seq;
  int64_t* ticket;
  int64_t* stats;  // nullptr, or the layer's admit counters
};

// kPayload: write the ids, weights and hidden rows (grid-stride); kPost (one block): count the
// CPU pairs and distinct experts and post the job. A decode call does both in one block; a long
// call writes its payload with many blocks, then posts in a second launch (stream order, and the
// payload writers' system fence, put the payload on the host before the number).
template <typename T, typename W, typename Id, bool kPayload, bool kPost>
__global__ void __launch_bounds__(kThreads)
    submit_kernel(const T* __restrict__ hidden, const int32_t* __restrict__ slot_ids, const Id* __restrict__ expert_ids,
                  const W* __restrict__ weights, SubmitArgs a) {
  extern __shared__ unsigned char seen[];  // [experts]: the distinct CPU experts (kPost)
  const int64_t pairs_total = a.tokens * a.top_k;
  if constexpr (kPayload) {
    // A call without CPU pairs posts nothing, so its payload is not sent (a prompt-sized call's
    // hidden rows would take the link's bandwidth): every block counts for itself (a few
    // thousand ids at most, from L2).
    __shared__ int any;
    if (threadIdx.x == 0) any = 0;
    __syncthreads();
    for (int64_t i = threadIdx.x; i < pairs_total; i += blockDim.x) {
      if (cpu_id(slot_ids, expert_ids, i, a.experts) >= 0) {
        any = 1;
        break;
      }
    }
    __syncthreads();
    if (any) {
      int32_t* ids_m = reinterpret_cast<int32_t*>(a.mailbox + a.l.ids);
      float* weights_m = reinterpret_cast<float*>(a.mailbox + a.l.weights);
      T* hidden_m = reinterpret_cast<T*>(a.mailbox + a.l.hidden);
      const int64_t stride = int64_t(gridDim.x) * blockDim.x;
      const int64_t first = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
      for (int64_t i = first; i < pairs_total; i += stride) {
        ids_m[i] = cpu_id(slot_ids, expert_ids, i, a.experts);
        weights_m[i] = static_cast<float>(weights[i]);
      }
      for (int64_t i = first; i < a.tokens * a.H; i += stride) {
        hidden_m[i] = hidden[(i / a.H) * a.hidden_stride + i % a.H];
      }
      __threadfence_system();  // the payload reaches the host before the job's number
    }
  }
  if constexpr (kPost) {
    __shared__ int pairs, distinct;
    if (threadIdx.x == 0) pairs = distinct = 0;
    for (int64_t e = threadIdx.x; e < a.experts; e += blockDim.x) seen[e] = 0;
    __syncthreads();
    int local = 0;
    for (int64_t i = threadIdx.x; i < pairs_total; i += blockDim.x) {
      const int32_t e = cpu_id(slot_ids, expert_ids, i, a.experts);
      if (e >= 0) {
        ++local;
        seen[e] = 1;
      }
    }
    if (local) atomicAdd(&pairs, local);
    __syncthreads();
    int here = 0;
    for (int64_t e = threadIdx.x; e < a.experts; e += blockDim.x) here += seen[e];
    if (here) atomicAdd(&distinct, here);
    __syncthreads();  // every payload write and its fence (kPayload) before the number
    if (threadIdx.x != 0) return;
    int64_t job = 0;
    if (pairs > 0) {
      auto* header = reinterpret_cast<MailboxHeader*>(a.mailbox);
      header->layer = a.layer;
      header->tokens = a.tokens;
      header->pairs = pairs;
      job = *a.seq + 1;
      *a.seq = job;
      __threadfence_system();
      header->submitted = job;
      if (a.stats != nullptr) {
        a.stats[cpu_share::kStatsCpuPairs] += pairs;
        a.stats[cpu_share::kStatsCpuExperts] += distinct;
      }
    }
    *a.ticket = job;
  }
}

__device__ __forceinline__ float load_uncached(const float* p) {
  float v;
  asm volatile("ld.global.cv.f32 %0, [%1];" : "=f"(v) : "l"(p));
  return v;
}

template <typename T>
__global__ void __launch_bounds__(kThreads)
    join_kernel(const T* __restrict__ out, T* __restrict__ result, int64_t n, const uint8_t* mailbox, Layout l,
                const int64_t* __restrict__ ticket) {
  const int64_t job = *ticket;
  if (job > 0) {
    if (threadIdx.x == 0) {
      const auto* header = reinterpret_cast<const MailboxHeader*>(mailbox);
      const unsigned long long start = global_ns();
      while (header->done < job) {
        if (global_ns() - start > kJoinTimeoutNs) {
          printf("freetoken cpu_share_join: the CPU worker did not finish job %lld in 60 s\n",
                 static_cast<long long>(job));
          __trap();
        }
        __nanosleep(256);
      }
      // Acquire: the result (and `failed`) read below come after the number read above; the
      // barrier extends it to the block's other threads.
      __threadfence_system();
      if (header->failed == job) {
        printf("freetoken cpu_share_join: the CPU worker failed on job %lld (ft_ops.cpu_share.CpuShare.last_error)\n",
               static_cast<long long>(job));
        __trap();
      }
    }
    __syncthreads();
  }
  const float* cpu = reinterpret_cast<const float*>(mailbox + l.result);
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    float v = static_cast<float>(out[i]);
    if (job > 0) v += load_uncached(cpu + i);
    result[i] = static_cast<T>(v);
  }
}

// The mailbox's device address (pinned host memory, mapped), looked up once per mailbox: the
// first call of a session is eager (CpuShare's start-up), so a graph capture only reads the cache.
uint8_t* device_address(const cpu_share::SessionInfo& s) {
  static std::mutex mutex;
  static std::map<const uint8_t*, uint8_t*> known;
  const std::lock_guard<std::mutex> lock(mutex);
  const auto it = known.find(s.mailbox);
  if (it != known.end()) return it->second;
  cudaPointerAttributes attr{};
  const cudaError_t err = cudaPointerGetAttributes(&attr, s.mailbox);
  if (err != cudaSuccess || attr.type != cudaMemoryTypeHost) {
    (void)cudaGetLastError();
    TORCH_CHECK(false, "cpu_share: a CUDA producer needs the session's mailbox in pinned host memory "
                       "(ft_ops.cpu_share.CpuShare allocates it pinned for a CUDA pool)");
  }
  uint8_t* device = static_cast<uint8_t*>(attr.devicePointer != nullptr ? attr.devicePointer : s.mailbox);
  known[s.mailbox] = device;
  return device;
}

// fn(T{}) for the floating types the CPU share takes (float32, bfloat16, float16).
template <typename Fn>
void with_float_type(at::ScalarType type, Fn&& fn) {
  switch (type) {
    case at::kFloat: fn(float{}); break;
    case at::kBFloat16: fn(c10::BFloat16{}); break;
    case at::kHalf: fn(c10::Half{}); break;
    default: TORCH_CHECK(false, "cpu_share: float32, bfloat16 or float16 tensors only, got ", type);
  }
}

int blocks_for(int64_t n) { return static_cast<int>(std::min<int64_t>(std::max<int64_t>((n + kThreads - 1) / kThreads, 1), 264)); }

at::Tensor submit_cuda(int64_t session, int64_t layer, const at::Tensor& hidden, const at::Tensor& slot_ids,
                       const at::Tensor& expert_ids, const at::Tensor& weights, const at::Tensor& seq,
                       const c10::optional<at::Tensor>& stats) {
  const cpu_share::SessionInfo s = cpu_share::info(session);
  cpu_share::check_submit(s, layer, hidden, slot_ids, expert_ids, weights, seq, stats);
  TORCH_CHECK(hidden.stride(1) == 1, "cpu_share_submit: hidden's rows must be contiguous");
  const c10::cuda::CUDAGuard guard(hidden.device());
  const auto slots = slot_ids.contiguous();
  const auto experts = expert_ids.contiguous();
  const auto w = weights.contiguous();
  const int64_t tokens = hidden.size(0);
  auto ticket = at::empty({1}, seq.options());
  SubmitArgs a{hidden.stride(0), tokens, s.top_k, s.hidden, s.experts, layer, device_address(s), s.layout,
               seq.data_ptr<int64_t>(), ticket.data_ptr<int64_t>(),
               stats.has_value() ? stats->data_ptr<int64_t>() : nullptr};
  const cudaStream_t stream = current_stream();
  const size_t smem = static_cast<size_t>(s.experts);
  // One block writes a decode call's payload (a few rows) and posts it in one launch.
  const bool one_launch = tokens * s.hidden <= 16 * kThreads * 8;
  with_float_type(hidden.scalar_type(), [&](auto hidden_zero) {
    using T = decltype(hidden_zero);
    with_float_type(w.scalar_type(), [&](auto weight_zero) {
      using W = decltype(weight_zero);
      const auto launch = [&](auto* ids) {
        using Id = std::remove_const_t<std::remove_pointer_t<decltype(ids)>>;
        if (one_launch) {
          submit_kernel<T, W, Id, true, true><<<1, kThreads, smem, stream>>>(
              hidden.data_ptr<T>(), slots.data_ptr<int32_t>(), ids, w.data_ptr<W>(), a);
          FT_CHECK_LAUNCH();
        } else {
          submit_kernel<T, W, Id, true, false><<<blocks_for(tokens * s.hidden), kThreads, 0, stream>>>(
              hidden.data_ptr<T>(), slots.data_ptr<int32_t>(), ids, w.data_ptr<W>(), a);
          FT_CHECK_LAUNCH();
          submit_kernel<T, W, Id, false, true><<<1, kThreads, smem, stream>>>(
              hidden.data_ptr<T>(), slots.data_ptr<int32_t>(), ids, w.data_ptr<W>(), a);
          FT_CHECK_LAUNCH();
        }
      };
      if (experts.scalar_type() == at::kLong) {
        launch(experts.data_ptr<int64_t>());
      } else {
        launch(experts.data_ptr<int32_t>());
      }
    });
  });
  return ticket;
}

at::Tensor join_cuda(int64_t session, const at::Tensor& out, const at::Tensor& ticket) {
  const cpu_share::SessionInfo s = cpu_share::info(session);
  cpu_share::check_join(out, ticket, s);
  const c10::cuda::CUDAGuard guard(out.device());
  const uint8_t* mailbox = device_address(s);
  const auto in = out.contiguous();
  auto result = at::empty_like(in);
  const int64_t n = in.numel();
  const cudaStream_t stream = current_stream();
  with_float_type(in.scalar_type(), [&](auto zero) {
    using T = decltype(zero);
    join_kernel<T><<<blocks_for(n), kThreads, 0, stream>>>(in.data_ptr<T>(), result.data_ptr<T>(), n, mailbox,
                                                           s.layout, ticket.data_ptr<int64_t>());
  });
  FT_CHECK_LAUNCH();
  return result;
}

}  // namespace

TORCH_LIBRARY_IMPL(freetoken, CUDA, m) {
  m.impl("cpu_share_submit", &submit_cuda);
  m.impl("cpu_share_join", &join_cuda);
}

}  // namespace ft::cuda
