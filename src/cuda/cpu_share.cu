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

template <typename T>
__global__ void __launch_bounds__(kThreads)
    write_payload_kernel(const T* __restrict__ hidden, int64_t hidden_stride, const int32_t* __restrict__ cpu_ids,
                         const float* __restrict__ weights, int64_t tokens, int64_t top_k, int64_t H,
                         uint8_t* mailbox, Layout l) {
  int32_t* ids_m = reinterpret_cast<int32_t*>(mailbox + l.ids);
  float* weights_m = reinterpret_cast<float*>(mailbox + l.weights);
  T* hidden_m = reinterpret_cast<T*>(mailbox + l.hidden);
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  const int64_t first = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  for (int64_t i = first; i < tokens * top_k; i += stride) {
    ids_m[i] = cpu_ids[i];
    weights_m[i] = weights[i];
  }
  for (int64_t i = first; i < tokens * H; i += stride) hidden_m[i] = hidden[(i / H) * hidden_stride + i % H];
  __threadfence_system();  // the payload reaches the host before the post kernel's number
}

__global__ void __launch_bounds__(kThreads)
    post_job_kernel(const int32_t* __restrict__ cpu_ids, int64_t tokens, int64_t top_k, int64_t layer,
                    uint8_t* mailbox, int64_t* __restrict__ seq, int64_t* __restrict__ ticket) {
  __shared__ int pairs;
  if (threadIdx.x == 0) pairs = 0;
  __syncthreads();
  int local = 0;
  for (int64_t i = threadIdx.x; i < tokens * top_k; i += blockDim.x) local += cpu_ids[i] >= 0;
  if (local) atomicAdd(&pairs, local);
  __syncthreads();
  if (threadIdx.x != 0) return;
  int64_t job = 0;
  if (pairs > 0) {
    auto* header = reinterpret_cast<MailboxHeader*>(mailbox);
    header->layer = layer;
    header->tokens = tokens;
    header->pairs = pairs;
    job = *seq + 1;
    *seq = job;
    __threadfence_system();
    header->submitted = job;
  }
  *ticket = job;
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

// The mailbox's device address (pinned host memory, mapped).
uint8_t* device_address(const cpu_share::SessionInfo& s) {
  cudaPointerAttributes attr{};
  const cudaError_t err = cudaPointerGetAttributes(&attr, s.mailbox);
  if (err != cudaSuccess || attr.type != cudaMemoryTypeHost) {
    (void)cudaGetLastError();
    TORCH_CHECK(false, "cpu_share: a CUDA producer needs the session's mailbox in pinned host memory "
                       "(ft_ops.cpu_share.CpuShare allocates it pinned for a CUDA pool)");
  }
  return static_cast<uint8_t*>(attr.devicePointer != nullptr ? attr.devicePointer : s.mailbox);
}

int blocks_for(int64_t n) { return static_cast<int>(std::min<int64_t>(std::max<int64_t>((n + kThreads - 1) / kThreads, 1), 264)); }

at::Tensor submit_cuda(int64_t session, int64_t layer, const at::Tensor& hidden, const at::Tensor& cpu_ids,
                       const at::Tensor& weights, const at::Tensor& seq) {
  const cpu_share::SessionInfo s = cpu_share::info(session);
  cpu_share::check_submit(s, layer, hidden, cpu_ids, weights, seq);
  TORCH_CHECK(hidden.stride(1) == 1, "cpu_share_submit: hidden's rows must be contiguous");
  const c10::cuda::CUDAGuard guard(hidden.device());
  uint8_t* mailbox = device_address(s);
  const auto ids = cpu_ids.contiguous();
  const auto w = weights.contiguous();
  const int64_t tokens = hidden.size(0);
  auto ticket = at::empty({1}, seq.options());
  const cudaStream_t stream = current_stream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, hidden.scalar_type(), "cpu_share_submit", [&] {
    write_payload_kernel<scalar_t><<<blocks_for(tokens * s.hidden), kThreads, 0, stream>>>(
        hidden.data_ptr<scalar_t>(), hidden.stride(0), ids.data_ptr<int32_t>(), w.data_ptr<float>(), tokens,
        s.top_k, s.hidden, mailbox, s.layout);
  });
  FT_CHECK_LAUNCH();
  post_job_kernel<<<1, kThreads, 0, stream>>>(ids.data_ptr<int32_t>(), tokens, s.top_k, layer, mailbox,
                                              seq.data_ptr<int64_t>(), ticket.data_ptr<int64_t>());
  FT_CHECK_LAUNCH();
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
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, in.scalar_type(), "cpu_share_join", [&] {
    join_kernel<scalar_t><<<blocks_for(n), kThreads, 0, stream>>>(in.data_ptr<scalar_t>(), result.data_ptr<scalar_t>(),
                                                                   n, mailbox, s.layout, ticket.data_ptr<int64_t>());
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
