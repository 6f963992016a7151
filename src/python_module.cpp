// The Python extension module ft_ops._C. Importing it loads the shared library, whose static
// initializers register the freetoken ops with the dispatcher. It also holds two helpers that are
// not ops: mapped_view, a CUDA tensor over pinned host memory (see below), and limits, the kernel
// limits the runtime plans around (src/common/limits.h).
#include <torch/extension.h>

#include "common/cpu_share.h"
#include "common/limits.h"

#ifdef FT_WITH_CUDA
#include <cuda_runtime_api.h>

#include <cstdlib>
#endif

namespace {

// A CUDA tensor that aliases a pinned host tensor: kernels read it through the pinned memory's
// device address (over the link), and torch.compile / CUDA graphs see a CUDA tensor instead of a
// CPU one (a CPU tensor in a graph makes cudagraph trees skip it). The view keeps the host tensor
// alive. Only kernels that read it (copy_experts, async_layer_copy) should be given it.
at::Tensor mapped_view(const at::Tensor& host, int64_t device_index) {
#ifdef FT_WITH_CUDA
  TORCH_CHECK(host.is_cpu() && host.is_pinned(),
              "mapped_view needs a pinned CPU tensor (allocate it with pin_memory=True), got a ",
              host.is_cpu() ? "pageable CPU" : host.device().str(), " tensor");
  int count = 0;
  TORCH_CHECK(cudaGetDeviceCount(&count) == cudaSuccess && device_index >= 0 && device_index < count,
              "mapped_view: no CUDA device ", device_index, " (", count, " visible)");
  void* device_ptr = nullptr;
  if (cudaHostGetDevicePointer(&device_ptr, host.data_ptr(), 0) != cudaSuccess) {
    // A pointer inside (not at the start of) a pinned allocation can be refused; with unified
    // addressing (every 64-bit CUDA platform) the host address is the device address.
    (void)cudaGetLastError();
    device_ptr = host.data_ptr();
  }
  at::Tensor keep_alive = host;
  return at::from_blob(
      device_ptr, host.sizes(), host.strides(), [keep_alive](void*) mutable { keep_alive.reset(); },
      host.options().device(at::Device(at::kCUDA, static_cast<c10::DeviceIndex>(device_index))));
#else
  (void)host;
  (void)device_index;
  TORCH_CHECK(false, "mapped_view needs the CUDA build of ft_ops (this one was built for the CPU only)");
#endif
}

// An uninitialized pinned CPU tensor of exactly its size: page-aligned host memory registered with
// CUDA (cudaHostRegister). torch's pinned allocator rounds every block up to a power of two, which
// for a host pool of tens of GiB can nearly double the host memory it takes (a 36 GiB bank takes
// 64 GiB). The memory is unregistered and freed with the tensor.
at::Tensor pinned_empty(std::vector<int64_t> sizes, at::ScalarType dtype) {
  const auto options = at::TensorOptions().dtype(dtype).device(at::kCPU);
#ifdef FT_WITH_CUDA
  int64_t numel = 1;
  for (const int64_t n : sizes) {
    TORCH_CHECK(n >= 0, "pinned_empty: negative size ", n);
    numel *= n;
  }
  const size_t bytes = static_cast<size_t>(numel) * c10::elementSize(dtype);
  if (bytes == 0) return at::empty(sizes, options);
  constexpr size_t kPage = 4096;
  void* ptr = nullptr;
  TORCH_CHECK(posix_memalign(&ptr, kPage, (bytes + kPage - 1) / kPage * kPage) == 0 && ptr != nullptr,
              "could not allocate ", bytes, " bytes of host memory for the host pool");
  const cudaError_t err = cudaHostRegister(ptr, bytes, cudaHostRegisterPortable | cudaHostRegisterMapped);
  if (err != cudaSuccess) {
    std::free(ptr);
    (void)cudaGetLastError();
    TORCH_CHECK(false, "could not pin ", bytes, " bytes of host memory (", cudaGetErrorString(err),
                "); a smaller model, or a machine with more host memory, is needed");
  }
  return at::from_blob(ptr, sizes, [](void* p) { (void)cudaHostUnregister(p); std::free(p); }, options);
#else
  return at::empty(sizes, options);
#endif
}

// The limits of this build's kernels (src/common/limits.h); copy grids are 0 without CUDA kernels.
pybind11::dict limits() {
#ifdef FT_WITH_CUDA
  constexpr bool kCuda = true;
#else
  constexpr bool kCuda = false;
#endif
  pybind11::dict d;
  d["grouped_gemm_max_slots"] = ft::limits::kGroupedGemmMaxSlots;
  d["grouped_gemm_min_tokens"] = ft::limits::kGroupedGemmMinTokens;
  d["dequantize_window_bytes"] = ft::limits::kDequantizeWindowBytes;
  d["copy_blocks"] = kCuda ? ft::limits::kCopyBlocks : 0;
  d["layer_copy_blocks"] = kCuda ? ft::limits::kLayerCopyBlocks : 0;
  d["decode_call_max_ids"] = ft::limits::kDecodeCallMaxIds;
  d["max_register_pool_slots"] = ft::limits::kMaxRegisterPoolSlots;
  d["max_slots"] = ft::limits::kMaxSlots;
  return d;
}

int64_t cpu_share_open(const at::Tensor& mailbox, const at::Tensor& w13, const at::Tensor& w2,
                       const c10::optional<at::Tensor>& b13, const c10::optional<at::Tensor>& b2,
                       const c10::optional<at::Tensor>& w13_scale, const c10::optional<at::Tensor>& w2_scale,
                       const std::vector<ft::cpu_share::ActivationArgs>& activations, int64_t capacity,
                       int64_t top_k, at::ScalarType dtype) {
  return ft::cpu_share::open(mailbox, w13, w2, b13, b2, w13_scale, w2_scale, activations, capacity, top_k, dtype);
}

int64_t cpu_share_mailbox_bytes(int64_t capacity, int64_t top_k, int64_t hidden, at::ScalarType dtype) {
  return ft::cpu_share::mailbox_layout(capacity, top_k, hidden, c10::elementSize(dtype)).total;
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "freetoken operator kernels (use torch.ops.freetoken)";
  m.def("mapped_view", &mapped_view, pybind11::arg("host"), pybind11::arg("device_index"),
        "CUDA tensor aliasing a pinned host tensor (read through its device address)");
  // The CPU share's sessions (ft_ops/cpu_share.py): not ops, set up once outside any graph.
  m.def("cpu_share_mailbox_bytes", &cpu_share_mailbox_bytes, pybind11::arg("capacity"), pybind11::arg("top_k"),
        pybind11::arg("hidden"), pybind11::arg("dtype"));
  m.def("cpu_share_open", &cpu_share_open, pybind11::arg("mailbox"), pybind11::arg("w13"), pybind11::arg("w2"),
        pybind11::arg("b13"), pybind11::arg("b2"), pybind11::arg("w13_scale"), pybind11::arg("w2_scale"),
        pybind11::arg("activations"), pybind11::arg("capacity"),
        pybind11::arg("top_k"), pybind11::arg("dtype"));
  m.def("cpu_share_close", &ft::cpu_share::close, pybind11::arg("session"));
  m.def("cpu_share_worker_counters", &ft::cpu_share::worker_counters, pybind11::arg("session"));
  m.def("cpu_share_row_thread_counters", &ft::cpu_share::row_thread_counters, pybind11::arg("session"));
  m.def("cpu_share_last_error", &ft::cpu_share::last_error, pybind11::arg("session"));
  m.def("limits", &limits, "the kernel limits the runtime plans around (src/common/limits.h)");
  m.def("pinned_empty", &pinned_empty, pybind11::arg("sizes"), pybind11::arg("dtype"),
        "uninitialized pinned CPU tensor of exactly its size (page-aligned, cudaHostRegister)");
}
