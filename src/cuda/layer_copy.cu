// CUDA kernels that move expert rows from the pinned host pool into the slot banks.
//
// copy_experts executes a decode copy plan whose length lives on the device: a small-grid kernel
// reads pinned host memory through its device address, so no host sync is needed to learn the
// count, and few SMs are taken from the GEMMs it overlaps (a copy that takes many SMs serializes
// with them). async_layer_copy rewrites the maps in one single-block kernel, then fills the
// region: without skip_resident the whole layer through the copy engine (one cudaMemcpyAsync per
// bank; the region is contiguous in both places); with it and the host's row_sources, the copy
// engine moves each row from the host or from the slot where it is resident, and a one-block
// kernel re-reads from the host any row whose source the maps contradict; with skip_resident
// alone, the copy kernel moves the rows the map kernel planned (from the pool or the host).
#include <ATen/ATen.h>
#include <torch/library.h>

#include <map>
#include <mutex>
#include <vector>

#include "../common/checks.h"
#include "../common/limits.h"
#include "cuda_utils.cuh"

namespace ft::cuda {
namespace {

constexpr int kMaxBanks = 8;
constexpr int kCopyThreads = 512;
constexpr int kUnroll = 4;                 // 16-byte loads in flight per thread
constexpr int64_t kChunkBytes = 64 << 10;  // one block's unit of work

struct BankSet {
  char* dst[kMaxBanks];
  const char* src[kMaxBanks];  // device address of host row 0 of the layer
  int64_t row_bytes[kMaxBanks];
  int64_t chunks[kMaxBanks];  // chunks per row
  int count;
  int64_t chunks_per_copy;
  int64_t src_rows;  // rows of host_rows (plan experts index them)
  int64_t dst_rows;  // rows of the banks (plan slots index them)
};

BankSet make_bank_set(at::TensorList banks, at::TensorList host_rows, bool* vectorizable) {
  TORCH_CHECK(static_cast<int>(banks.size()) <= kMaxBanks, "at most ", kMaxBanks,
              " banks are supported, got ", banks.size());
  BankSet set{};
  set.count = static_cast<int>(banks.size());
  set.src_rows = host_rows[0].size(0);
  set.dst_rows = banks[0].size(0);
  *vectorizable = true;
  for (int j = 0; j < set.count; ++j) {
    set.row_bytes[j] = row_bytes(banks[j]);
    set.dst[j] = static_cast<char*>(banks[j].data_ptr());
    void* host_ptr = host_rows[j].data_ptr();
    if (host_rows[j].is_cuda()) {
      set.src[j] = static_cast<const char*>(host_ptr);
    } else {
      void* device_ptr = nullptr;
      if (cudaHostGetDevicePointer(&device_ptr, host_ptr, 0) != cudaSuccess) {
        // A pointer inside (not at the start of) a pinned allocation can be refused; with
        // unified addressing (every 64-bit CUDA platform) the host address is the device one.
        (void)cudaGetLastError();
        device_ptr = host_ptr;
      }
      set.src[j] = static_cast<const char*>(device_ptr);
    }
    set.chunks[j] = (set.row_bytes[j] + kChunkBytes - 1) / kChunkBytes;
    set.chunks_per_copy += set.chunks[j];
    *vectorizable &= set.row_bytes[j] % 16 == 0 && aligned16(set.dst[j]) && aligned16(set.src[j]);
  }
  return set;
}

// For i < n (n = *num if given, at most plan_len; else plan_len): for every bank, row plan_s[i] <-
// host row plan_e[i]. Entries whose expert or slot lies outside the rows are skipped: on the device
// the plan's values are not checked (that would need a host sync), so a bad one copies nothing
// rather than read or write past the tensors.
template <bool kVector>
__global__ void __launch_bounds__(kCopyThreads, 4)
    copy_rows_kernel(BankSet set, const int32_t* __restrict__ plan_e,
                     const int32_t* __restrict__ plan_s, const int32_t* __restrict__ num,
                     int64_t plan_len) {
  const int64_t n = num != nullptr ? min(max(static_cast<int64_t>(num[0]), int64_t(0)), plan_len) : plan_len;
  const int64_t items = n * set.chunks_per_copy;
  for (int64_t item = blockIdx.x; item < items; item += gridDim.x) {
    const int64_t i = item / set.chunks_per_copy;
    int64_t chunk = item - i * set.chunks_per_copy;
    const int32_t e = plan_e[i];
    const int32_t s = plan_s[i];
    if (e < 0 || s < 0 || e >= set.src_rows || s >= set.dst_rows) continue;
    int j = 0;
    while (chunk >= set.chunks[j]) chunk -= set.chunks[j++];
    const int64_t offset = chunk * kChunkBytes;
    const int64_t bytes = min(kChunkBytes, set.row_bytes[j] - offset);
    const char* src = set.src[j] + e * set.row_bytes[j] + offset;
    char* dst = set.dst[j] + s * set.row_bytes[j] + offset;
    if constexpr (kVector) {
      const uint4* src4 = reinterpret_cast<const uint4*>(src);
      uint4* dst4 = reinterpret_cast<uint4*>(dst);
      const int64_t vecs = bytes / 16;
      const int64_t stride = blockDim.x;
      for (int64_t base = threadIdx.x; base < vecs; base += kUnroll * stride) {
        uint4 r[kUnroll];
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
          const int64_t v = base + u * stride;
          if (v < vecs) r[u] = src4[v];
        }
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
          const int64_t v = base + u * stride;
          if (v < vecs) dst4[v] = r[u];
        }
      }
    } else {
      for (int64_t b = threadIdx.x; b < bytes; b += blockDim.x) dst[b] = src[b];
    }
  }
}

// Each copy block asks for all of an SM's shared memory, so no block of another kernel shares its
// SM: the in-place decode GEMM beside copy_experts went from 1.16-1.17 to 1.09-1.13 of the longer
// alone (H200); the grouped GEMM cannot share an SM with it anyway.
// The dynamic shared memory of a copy block: the device's per-block maximum (set on the kernel
// once per device).
template <bool kVector>
int copy_block_smem() {
  constexpr int kMaxDevices = 64;
  static int bytes[kMaxDevices] = {};  // 0: not set yet on that device
  int device = 0;
  C10_CUDA_CHECK(cudaGetDevice(&device));
  if (device >= kMaxDevices) return 0;
  if (bytes[device] == 0) {
    int optin = 0;
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
    C10_CUDA_CHECK(cudaFuncSetAttribute(copy_rows_kernel<kVector>, cudaFuncAttributeMaxDynamicSharedMemorySize, optin));
    bytes[device] = optin;
  }
  return bytes[device];
}

// whole_sm: each block takes all of an SM's shared memory (see copy_block_smem); without it a
// block asks for none, so it can run beside other kernels' blocks.
template <bool kVector>
void launch_copy_kernel(const BankSet& set, const int32_t* plan_e, const int32_t* plan_s, const int32_t* num,
                        int64_t plan_len, int blocks, int threads, bool whole_sm) {
  const int smem = whole_sm ? copy_block_smem<kVector>() : 0;
  copy_rows_kernel<kVector><<<blocks, threads, smem, current_stream()>>>(set, plan_e, plan_s, num, plan_len);
}

void launch_copy(const BankSet& set, bool vectorizable, const int32_t* plan_e,
                 const int32_t* plan_s, const int32_t* num, int64_t plan_len, int blocks,
                 int threads, bool whole_sm) {
  if (plan_len == 0) return;
  if (vectorizable) {
    launch_copy_kernel<true>(set, plan_e, plan_s, num, plan_len, blocks, threads, whole_sm);
  } else {
    launch_copy_kernel<false>(set, plan_e, plan_s, num, plan_len, blocks, threads, whole_sm);
  }
  FT_CHECK_LAUNCH();
}

// Rewrites the maps for streaming `layer` into [first_slot, first_slot + E) (the CPU kernel has
// the same two phases) and writes two compacted copy plans, their lengths in counts[0] and
// counts[1]: rows the copy kernel reads from other slots of the pool (pool_src -> pool_dst), and
// rows it reads from the host (host_e -> host_dst). With hints (row_sources, on the device), the
// copy engine has moved every row already (from the host where the hint is -1, from the hinted
// slot otherwise): only rows whose hint the maps contradict are planned, from the host.
// from_host accumulates the rows read from the host.
__global__ void __launch_bounds__(1024)
    layer_map_kernel(int32_t* __restrict__ slot_of, int32_t* __restrict__ owner_of,
                     int64_t* __restrict__ last_use, int64_t* __restrict__ clock, int64_t layer,
                     int64_t experts, int64_t first_slot, bool skip_resident,
                     int64_t reclaim_lo, int64_t reclaim_hi, bool opportunity,
                     const int32_t* __restrict__ hints, int32_t* __restrict__ pool_src,
                     int32_t* __restrict__ pool_dst, int32_t* __restrict__ host_e,
                     int32_t* __restrict__ host_dst, int32_t* __restrict__ counts,
                     int64_t* __restrict__ from_host) {
  const int64_t now = clock[0] + 1;
  const int64_t base = layer * experts;
  for (int64_t e = threadIdx.x; e < experts; e += blockDim.x) {
    const int64_t s = first_slot + e;
    const int32_t o = owner_of[s];
    if (o < 0 || (skip_resident && o == base + e)) continue;
    slot_of[o] = -1;
    owner_of[s] = -1;
    last_use[s] = 0;
  }
  __syncthreads();
  for (int64_t e = threadIdx.x; e < experts; e += blockDim.x) {
    const int32_t cur = slot_of[base + e];
    const int32_t target = static_cast<int32_t>(first_slot + e);
    // Where the row comes from: -1 the host, a slot of the pool, or target itself (in place).
    int32_t source = skip_resident && cur >= 0 ? cur : -1;
    if (hints != nullptr) {
      const int32_t hint = hints[e];
      const bool engine_right = hint != -1 && hint == cur;
      if (!engine_right) source = -1;
      if (hint == -1) {
        atomicAdd(reinterpret_cast<unsigned long long*>(from_host), 1ull);  // the engine read it
      } else if (!engine_right) {  // the engine copied a wrong row (or none): read the host
        const int32_t i = atomicAdd(&counts[1], 1);
        host_e[i] = static_cast<int32_t>(e);
        host_dst[i] = target;
        atomicAdd(reinterpret_cast<unsigned long long*>(from_host), 1ull);
      }
    } else if (skip_resident) {
      if (source == -1) {
        const int32_t i = atomicAdd(&counts[1], 1);
        host_e[i] = static_cast<int32_t>(e);
        host_dst[i] = target;
        atomicAdd(reinterpret_cast<unsigned long long*>(from_host), 1ull);
      } else if (source != target) {
        const int32_t i = atomicAdd(&counts[0], 1);
        pool_src[i] = source;
        pool_dst[i] = target;
      }
    } else {
      atomicAdd(reinterpret_cast<unsigned long long*>(from_host), 1ull);  // the whole layer crosses
    }
    const bool reclaimed = cur >= reclaim_lo && cur < reclaim_hi && cur != target;
    if (skip_resident && cur >= 0 && !reclaimed) {
      if (!opportunity) last_use[cur] = now;  // the opportunity policy leaves decode stamps alone
      continue;
    }
    if (cur >= 0) {  // a resident copy elsewhere is dropped (no skip_resident, or reclaimed)
      owner_of[cur] = -1;
      last_use[cur] = 0;
    }
    slot_of[base + e] = target;
    owner_of[target] = static_cast<int32_t>(base + e);
    last_use[target] = opportunity ? kStreamedStamp : now;
  }
  if (threadIdx.x == 0) clock[0] = now;
}

void copy_experts(at::TensorList banks, at::TensorList host_rows, const at::Tensor& copy_experts,
                  const at::Tensor& copy_slots, const at::Tensor& num_copies) {
  check_banks(banks, host_rows, host_experts(host_rows), banks[0]);
  check_copy_plan(copy_experts, copy_slots, num_copies, banks[0]);
  const c10::cuda::CUDAGuard guard(banks[0].device());
  bool vectorizable = false;
  const BankSet set = make_bank_set(banks, host_rows, &vectorizable);
  launch_copy(set, vectorizable, copy_experts.data_ptr<int32_t>(), copy_slots.data_ptr<int32_t>(),
              num_copies.data_ptr<int32_t>(), copy_experts.numel(), limits::kCopyBlocks, kCopyThreads, true);
}

// One cudaMemcpyAsync for rows [e0, e1) of one bank of the layer from the host into their region
// slots (contiguous in both places).
void copy_host_rows(const at::Tensor& bank, const at::Tensor& host, int64_t first_slot, int64_t e0, int64_t e1,
                    cudaStream_t stream) {
  const int64_t bytes = row_bytes(bank);
  if (bytes == 0) return;  // empty rows: nothing to copy
  char* dst = static_cast<char*>(bank.data_ptr()) + (first_slot + e0) * bytes;
  const char* src = static_cast<const char*>(host.data_ptr()) + e0 * bytes;
  C10_CUDA_CHECK(cudaMemcpyAsync(dst, src, (e1 - e0) * bytes,
                                 host.is_cuda() ? cudaMemcpyDeviceToDevice : cudaMemcpyHostToDevice, stream));
}

// Work queued on `later` from now on runs after everything queued on `earlier` so far. (The
// event may be destroyed at once: CUDA releases it when the recorded work completes.)
void order_after(cudaStream_t later, cudaStream_t earlier) {
  cudaEvent_t event;
  C10_CUDA_CHECK(cudaEventCreateWithFlags(&event, cudaEventDisableTiming));
  C10_CUDA_CHECK(cudaEventRecord(event, earlier));
  C10_CUDA_CHECK(cudaStreamWaitEvent(later, event, 0));
  C10_CUDA_CHECK(cudaEventDestroy(event));
}

// Two streams per device that only hinted layer copies use, made once and kept for the process:
// streams from torch's pool are shared round robin with every other user of the pool (the
// streamer's own copy stream among them), and a wait on one of those could order these copies
// behind unrelated work.
struct SideStreams {
  cudaStream_t host;    // the host runs the current stream does not take
  cudaStream_t device;  // the device-to-device runs
};

const SideStreams& side_streams(int device) {
  static std::mutex mutex;
  static std::map<int, SideStreams> streams;
  const std::lock_guard<std::mutex> lock(mutex);
  auto it = streams.find(device);
  if (it == streams.end()) {
    SideStreams made{};
    C10_CUDA_CHECK(cudaStreamCreateWithFlags(&made.host, cudaStreamNonBlocking));
    C10_CUDA_CHECK(cudaStreamCreateWithFlags(&made.device, cudaStreamNonBlocking));
    it = streams.emplace(device, made).first;
  }
  return it->second;
}

#if CUDART_VERSION >= 13000  // the cudaMemcpyBatchAsync signature this file uses
// Whether a list of copies on `stream` can go as one cudaMemcpyBatchAsync: a driver that has it, a
// stream other than the legacy default one (which the call refuses), and no capture under way (it
// has no graph node).
bool can_batch(cudaStream_t stream) {
  static const bool driver_has_it = [] {
    int version = 0;
    return cudaDriverGetVersion(&version) == cudaSuccess && version >= 13000;
  }();
  if (!driver_has_it || stream == nullptr || stream == cudaStreamLegacy) return false;
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  C10_CUDA_CHECK(cudaStreamIsCapturing(stream, &capture));
  return capture == cudaStreamCaptureStatusNone;
}
#endif

// Copies gathered for one stream, submitted together: a partly resident layer is hundreds of runs
// of a row or two, and one cudaMemcpyAsync a run leaves the link idle while each is set up; one
// cudaMemcpyBatchAsync hands the driver the whole list (docs/performance.md, "End to end": the
// warm prompt's distance to its link bound halved). Where the batch call cannot be used, one
// cudaMemcpyAsync a copy.
class CopyBatch {
 public:
  void add(void* dst, const void* src, size_t size) {
    dsts_.push_back(dst);
    srcs_.push_back(src);
    sizes_.push_back(size);
    bytes_ += static_cast<int64_t>(size);
  }
  int64_t bytes() const { return bytes_; }
  void submit(cudaStream_t stream) const {
    if (dsts_.empty()) return;
#if CUDART_VERSION >= 13000
    if (dsts_.size() > 1 && can_batch(stream)) {
      cudaMemcpyAttributes attrs = {};
      attrs.srcAccessOrder = cudaMemcpySrcAccessOrderStream;  // sources read in stream order
      size_t attrs_index = 0;
      C10_CUDA_CHECK(cudaMemcpyBatchAsync(dsts_.data(), srcs_.data(), sizes_.data(), dsts_.size(), &attrs,
                                          &attrs_index, 1, stream));
      return;
    }
#endif
    for (size_t i = 0; i < dsts_.size(); ++i)
      C10_CUDA_CHECK(cudaMemcpyAsync(dsts_[i], srcs_[i], sizes_[i], cudaMemcpyDefault, stream));
  }

 private:
  std::vector<void*> dsts_;
  std::vector<const void*> srcs_;
  std::vector<size_t> sizes_;
  int64_t bytes_ = 0;
};

// The copy engine's share of a hinted layer copy: runs of consecutive experts whose hint is -1
// from the host, and rows with a hinted slot outside the region from those slots, runs of
// consecutive sources as one copy. A hint inside the region is the row's own target (nothing to
// copy) or contradicted by the maps (the fix-up kernel reads it from the host).
//
// The host runs are split between the current stream and a second one by bytes queued (two engines
// share the link, one starting while the other moves bytes; gate_up's rows are two thirds of an
// expert's bytes, so taking turns by run would load one stream with them), each stream's runs go as
// one batch, and the device-to-device runs as one batch on a third stream, off the link's path. The
// current stream waits for both at the end: what it runs next (the fix-up kernel, the layer's ready
// event) sees every row.
void copy_hinted_rows(at::TensorList banks, at::TensorList host_rows, int64_t first_slot,
                      const int32_t* hints, int64_t experts) {
  const cudaStream_t main = current_stream();
  const SideStreams& side = side_streams(banks[0].get_device());
  // The side streams start after everything queued before this call (the map kernel, the wait for
  // the region's previous readers).
  order_after(side.host, main);
  order_after(side.device, main);
  CopyBatch host_batches[2], device_batch;
  const auto in_region = [&](int64_t slot) { return slot >= first_slot && slot < first_slot + experts; };
  for (int64_t e = 0; e < experts;) {
    if (hints[e] == -1) {
      int64_t end = e + 1;
      while (end < experts && hints[end] == -1) ++end;
      for (size_t j = 0; j < banks.size(); ++j) {
        const int64_t bytes = row_bytes(banks[j]);
        if (bytes == 0) continue;  // empty rows: nothing to copy
        CopyBatch& batch = host_batches[host_batches[1].bytes() < host_batches[0].bytes() ? 1 : 0];
        batch.add(static_cast<char*>(banks[j].data_ptr()) + (first_slot + e) * bytes,
                  static_cast<const char*>(host_rows[j].data_ptr()) + e * bytes, (end - e) * bytes);
      }
      e = end;
      continue;
    }
    if (in_region(hints[e])) {  // in place, or a hint the maps contradict (the fix-up reads it)
      ++e;
      continue;
    }
    // Rows whose source slots are consecutive too go as one copy (sources outside the region,
    // targets inside: never overlapping).
    int64_t end = e + 1;
    while (end < experts && hints[end] == hints[e] + (end - e) && !in_region(hints[end])) ++end;
    for (size_t j = 0; j < banks.size(); ++j) {
      const int64_t bytes = row_bytes(banks[j]);
      if (bytes == 0) continue;  // empty rows: nothing to copy
      char* base = static_cast<char*>(banks[j].data_ptr());
      device_batch.add(base + (first_slot + e) * bytes, base + hints[e] * bytes, (end - e) * bytes);
    }
    e = end;
  }
  host_batches[0].submit(main);
  host_batches[1].submit(side.host);
  device_batch.submit(side.device);
  order_after(main, side.host);
  order_after(main, side.device);
}

at::Tensor async_layer_copy(const at::Tensor& slot_of, const at::Tensor& owner_of,
                            const at::Tensor& last_use, const at::Tensor& clock,
                            at::TensorList banks, at::TensorList host_rows, int64_t layer,
                            int64_t first_slot, bool skip_resident, int64_t reclaim_lo,
                            int64_t reclaim_hi, int64_t policy,
                            const c10::optional<at::Tensor>& row_sources) {
  const PoolShape pool = check_layer_copy_inputs(slot_of, owner_of, last_use, clock, banks, host_rows,
                                                 layer, first_slot, reclaim_lo, reclaim_hi, skip_resident,
                                                 row_sources);
  // Opportunity and hit density stamp streamed rows 1 and leave kept rows' stamps alone.
  const bool opportunity = check_policy(policy) != EvictionPolicy::kLru;
  const c10::cuda::CUDAGuard guard(slot_of.device());
  const int64_t E = pool.experts;
  // One int32 buffer: the two plans (pool_src, pool_dst, host_e, host_dst: E each) and their two
  // counts; the rows read from the host in an int64.
  auto plans = at::empty({4 * E + 2}, slot_of.options());
  int32_t* p = plans.data_ptr<int32_t>();
  int32_t* counts = p + 4 * E;
  auto from_host = at::zeros({}, slot_of.options().dtype(at::kLong));
  C10_CUDA_CHECK(cudaMemsetAsync(counts, 0, 2 * sizeof(int32_t), current_stream()));
  // The hints on the device, through pinned memory (a pageable copy may wait for the stream's
  // earlier copies); torch's host allocator keeps the pinned block until the copy has run.
  // A fresh pinned copy (clone first: pin_memory() returns a pinned tensor itself, which the caller
  // could change before the copy runs), so the device checks the hints the host decided on.
  at::Tensor hints_on_device;
  if (row_sources.has_value()) {
    hints_on_device = row_sources->clone().pin_memory().to(slot_of.options(), /*non_blocking=*/true);
  }
  const int32_t* hints = row_sources.has_value() ? hints_on_device.data_ptr<int32_t>() : nullptr;
  const int threads = static_cast<int>(std::min<int64_t>(1024, ((E + 31) / 32) * 32));
  layer_map_kernel<<<1, threads, 0, current_stream()>>>(
      slot_of.data_ptr<int32_t>(), owner_of.data_ptr<int32_t>(), last_use.data_ptr<int64_t>(),
      clock.data_ptr<int64_t>(), layer, E, first_slot, skip_resident, reclaim_lo, reclaim_hi, opportunity,
      hints, p, p + E, p + 2 * E, p + 3 * E, counts, from_host.data_ptr<int64_t>());
  FT_CHECK_LAUNCH();
  if (!skip_resident) {
    // Every row crosses: the region is contiguous in the bank and the layer in the host pool.
    for (size_t j = 0; j < banks.size(); ++j) copy_host_rows(banks[j], host_rows[j], first_slot, 0, E, current_stream());
    return from_host;
  }
  bool vectorizable = false;
  const BankSet from_host_set = make_bank_set(banks, host_rows, &vectorizable);
  if (hints != nullptr) {
    // The copy engines move every row; a one-block kernel (it fits beside the prefill GEMM's
    // blocks) then re-reads from the host the rows whose hint the maps contradicted, normally none.
    copy_hinted_rows(banks, host_rows, first_slot, row_sources->data_ptr<int32_t>(), E);
    launch_copy(from_host_set, vectorizable, p + 2 * E, p + 3 * E, counts + 1, E, 1, kCopyThreads, false);
    return from_host;
  }
  bool pool_vectorizable = false;
  const BankSet from_pool_set = make_bank_set(banks, banks, &pool_vectorizable);
  launch_copy(from_pool_set, pool_vectorizable, p, p + E, counts, E, limits::kLayerCopyBlocks, kCopyThreads, true);
  launch_copy(from_host_set, vectorizable, p + 2 * E, p + 3 * E, counts + 1, E, limits::kLayerCopyBlocks,
              kCopyThreads, true);
  return from_host;
}

}  // namespace

TORCH_LIBRARY_IMPL(freetoken, CUDA, m) {
  m.impl("copy_experts", &copy_experts);
  m.impl("async_layer_copy", &async_layer_copy);
}

}  // namespace ft::cuda
