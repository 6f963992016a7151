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

// Lets the kernel after this one (launched with launch_dependent) be scheduled now, before this
// one finishes: its blocks then take free SMs and issue their loads of memory that was final
// before this kernel started, while this kernel's last blocks run. Its wait_for_previous_kernel()
// still holds it until this kernel has finished and its writes are visible. It can launch only
// once every block of this kernel has called this or exited, so blocks of this kernel never wait
// behind it for an SM.
__device__ __forceinline__ void let_next_kernel_start() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

}  // namespace ft::cuda
