// Bulk asynchronous copies from shared to global memory (Hopper's cp.async.bulk, the TMA
// engine without a tensor map): one thread hands the engine a contiguous run of bytes and
// goes on; the copies of a thread form groups that it commits and later waits for, either
// until the engine has read the source (the shared memory may be rewritten) or until the
// writes are done (they may be published to other GPUs). Used by the peer sink's bulk build
// (sinks/ep_peer_sink_bulk.cuh).
#pragma once
#include "common/types.cuh"

namespace epserve {

// `bytes` (a multiple of 16; both addresses 16-byte aligned) from shared `src` to global `dst`,
// which may be a peer GPU's memory mapped over CUDA IPC.
__device__ __forceinline__ void bulk_copy_shared_to_global(void* dst, const void* src, uint32_t bytes) {
  const uint32_t s = static_cast<uint32_t>(__cvta_generic_to_shared(src));
  asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;\n" ::"l"(dst), "r"(s), "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void bulk_commit() { asm volatile("cp.async.bulk.commit_group;\n" ::: "memory"); }
// Until at most kPending of this thread's groups may still read their shared sources.
template <int kPending>
__device__ __forceinline__ void bulk_wait_read() {
  asm volatile("cp.async.bulk.wait_group.read %0;\n" ::"n"(kPending) : "memory");
}
// Until at most kPending of this thread's groups are not complete (their writes done).
template <int kPending>
__device__ __forceinline__ void bulk_wait() {
  asm volatile("cp.async.bulk.wait_group %0;\n" ::"n"(kPending) : "memory");
}
// Generic-proxy writes to shared memory before it, ordered before async-proxy reads after it
// (every thread that wrote the tile, before the barrier that hands it over).
__device__ __forceinline__ void fence_proxy_async_shared() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}
// Async-proxy writes to global memory this thread waited for, ordered before its generic
// operations after it (the system-scope release that publishes them).
__device__ __forceinline__ void fence_proxy_async_global() {
  asm volatile("fence.proxy.async.global;\n" ::: "memory");
}

}  // namespace epserve
