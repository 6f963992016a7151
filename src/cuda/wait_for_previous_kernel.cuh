// The device side of a programmatic dependent launch (dependent_launch.cuh launches such
// kernels). No torch headers, so kernels that use it can be compiled alone.
#pragma once

namespace ft::cuda {

// Waits for the kernels before this one on the stream (a no-op when launched the ordinary way),
// then lets the kernel after it be scheduled early: its own wait still holds it until this one
// has finished. Call it before the kernel's first global memory access.
__device__ __forceinline__ void wait_for_previous_kernel() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

}  // namespace ft::cuda
