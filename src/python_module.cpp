// The Python extension module ft_ops._C. Importing it loads the shared library, whose static
// initializers register the freetoken ops with the dispatcher. It also holds two helpers that are
// not ops: mapped_view, a CUDA tensor over pinned host memory (see below), and copy_kernel_blocks.
#include <torch/extension.h>

#ifdef FT_WITH_CUDA
#include <cuda_runtime_api.h>

#include "cuda/copy_grid.h"
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

// Blocks of the copy kernels (copy_experts, async_layer_copy with skip_resident); 0 in the CPU build.
pybind11::tuple copy_kernel_blocks() {
#ifdef FT_WITH_CUDA
  return pybind11::make_tuple(ft::cuda::copy_kernel_blocks(false), ft::cuda::copy_kernel_blocks(true));
#else
  return pybind11::make_tuple(0, 0);
#endif
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "freetoken operator kernels (use torch.ops.freetoken)";
  m.def("mapped_view", &mapped_view, pybind11::arg("host"), pybind11::arg("device_index"),
        "CUDA tensor aliasing a pinned host tensor (read through its device address)");
  m.def("copy_kernel_blocks", &copy_kernel_blocks,
        "(copy_experts blocks, async_layer_copy skip_resident blocks): the SMs the copy kernels take");
}
