// Programmatic dependent launch (sm_90 and later): a kernel launched this way may be scheduled
// while the kernel before it on the stream is still running, so the launch latency between two
// dependent kernels overlaps the first one's work instead of adding to it. The decode path is a
// chain of small dependent kernels (admission, copy, expert GEMM, per layer), where that latency
// is a large part of each step. Works under CUDA-graph capture (the edge becomes programmatic).
//
// Contract for a kernel launched with launch_dependent(): it calls wait_for_previous_kernel()
// before it writes any global memory and before it reads any the previous kernel may write; the
// wait returns once every kernel before it on the stream has finished and its writes are
// visible, exactly as with an ordinary launch. Before the wait it may read memory that was final
// when the previous kernel started, when that kernel was itself launched the ordinary way (it
// started after every earlier kernel had finished).
#pragma once

#include "cuda_utils.cuh"
#include "wait_for_previous_kernel.cuh"

#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAStream.h>

#include <atomic>

namespace ft::cuda {

// On for devices of compute capability 9.0 and later.
inline bool dependent_launch_enabled() {
  // Compute capability per device, asked once (a host-side query, no sync).
  static std::atomic<int> major_of[64] = {};
  const int device = c10::cuda::current_device();
  if (device >= 64) return false;
  int major = major_of[device].load(std::memory_order_relaxed);
  if (major == 0) {
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
    major_of[device].store(major, std::memory_order_relaxed);
  }
  return major >= 9;
}

// Whether `kernel`'s code on `device` was compiled for sm_90 or later (its PTX version), so that
// its wait_for_previous_kernel() holds a griddepcontrol.wait: a build that ships only older PTX
// (FT_CUDA_GENCODE=compute_80, JIT-compiled on an H100) compiles the wait out, and launched
// dependent such a kernel could read its predecessor's output before it is written. Asked once per
// kernel and device (kernel_attributes).
inline bool kernel_waits_for_previous(const void* kernel, int device) {
  return kernel_attributes(kernel, device).ptxVersion >= 90;
}

// kernel<<<grid, block, smem, current stream>>>(args...), as a programmatic dependent launch
// where the device and the kernel's code support it. The kernel must follow the contract above.
template <typename... KernelArgs, typename... Args>
void launch_dependent(void (*kernel)(KernelArgs...), dim3 grid, dim3 block, size_t smem, Args&&... args) {
  cudaLaunchConfig_t config = {};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = smem;
  config.stream = c10::cuda::getCurrentCUDAStream().stream();
  cudaLaunchAttribute attribute[1];
  config.attrs = attribute;
  config.numAttrs = 0;
  if (dependent_launch_enabled() &&
      kernel_waits_for_previous(reinterpret_cast<const void*>(kernel), c10::cuda::current_device())) {
    attribute[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attribute[0].val.programmaticStreamSerializationAllowed = 1;
    config.numAttrs = 1;
  }
  C10_CUDA_CHECK(cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...));
}

}  // namespace ft::cuda
