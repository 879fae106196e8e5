// Programmatic dependent launch (sm90+): a kernel launched with cudaLaunchAttributeProgrammaticStreamSerialization
// may start while the kernel before it in the stream is still running; it calls wait_for_primary_grid() before it
// touches what that kernel writes. The primary may call allow_dependent_launch() to let it start early. Below sm90
// both are no-ops, and the launcher does not set the attribute there, so plain stream order holds.
#pragma once

namespace flash::ptx {

// Blocks until every prerequisite grid has completed and its memory operations are visible to this thread. Returns
// at once for a kernel launched without the attribute (its predecessors have finished before it started).
__device__ __forceinline__ void wait_for_primary_grid() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}

// Lets the dependent grid launch once every CTA of this grid has called this or exited. Says nothing about this
// grid's memory: the dependent still calls wait_for_primary_grid() before reading it.
__device__ __forceinline__ void allow_dependent_launch() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

}  // namespace flash::ptx
