// The proxy fence between ordinary shared-memory writes and the async proxy (sm90+): the one definition shared by the
// wgmma / TMA wrappers (warpgroup_sm90.h) and the bulk reductions (bulk_reduce_sm90.h), which both read shared memory
// that threads wrote with ordinary stores.
#pragma once

namespace flash::ptx {

// Makes this thread's generic-proxy shared-memory writes visible to later async-proxy reads (wgmma, TMA store, bulk
// reduction): every writer runs it after its last store and before the barrier that precedes the async read. Reached
// below sm90 it traps (callers branch at compile time).
__device__ __forceinline__ void fence_proxy_async_shared() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
#elif defined(__CUDA_ARCH__)
  __trap();
#endif
}

}  // namespace flash::ptx
