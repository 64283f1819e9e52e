// Thin wrappers over the PTX instructions epserve's kernels use. Kept in one place so the
// memory-ordering choices (scopes, cache operators) are visible side by side.
#pragma once
#include "common/types.cuh"

namespace epserve {

// ---- asynchronous global -> shared copies (Ampere-style cp.async, 16 bytes) ----
// src_bytes = 0 zero-fills the 16 bytes (rows past the end of the operand).
__device__ __forceinline__ void cp_async_16(void* smem_dst, const void* gmem_src, int src_bytes) {
  const uint32_t dst = static_cast<uint32_t>(__cvta_generic_to_shared(smem_dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(gmem_src), "r"(src_bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int kPending>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending)); }

// ---- tensor cores: ldmatrix + mma.sync m16n8k16 bf16 -> fp32 ----
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* smem_row) {
  const uint32_t a = static_cast<uint32_t>(__cvta_generic_to_shared(smem_row));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(a));
}
__device__ __forceinline__ void mma_bf16_16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// ---- 16-byte vector memory access ----
__device__ __forceinline__ uint4 ld_shared_v4(const void* p) {
  uint4 v;
  const uint32_t a = static_cast<uint32_t>(__cvta_generic_to_shared(p));
  asm volatile("ld.shared.v4.u32 {%0,%1,%2,%3}, [%4];\n" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(a));
  return v;
}
// Plain (weak) 16-byte store through a generic pointer: local memory or a peer's IPC mapping.
__device__ __forceinline__ void st_v4(void* p, uint4 v) {
  asm volatile("st.v4.u32 [%0], {%1,%2,%3,%4};\n" ::"l"(p), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w) : "memory");
}
// 16-byte store to this GPU's global memory (a kernel's output array); the generic address
// of global memory is its global address.
__device__ __forceinline__ void st_global_v4(void* p, uint4 v) {
  asm volatile("st.global.v4.u32 [%0], {%1,%2,%3,%4};\n" ::"l"(p), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w) : "memory");
}
// Global load that skips L1: data other GPUs wrote must not come from a stale L1 line.
__device__ __forceinline__ uint4 ld_cg_v4(const void* p) {
  uint4 v;
  asm volatile("ld.global.cg.v4.u32 {%0,%1,%2,%3}, [%4];\n" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}
// 8-byte fp32 pairs (the wgmma GEMM's split-K workspace, written and read by different SMs).
__device__ __forceinline__ void st_global_f32x2(void* p, float x, float y) {
  asm volatile("st.global.v2.f32 [%0], {%1,%2};\n" ::"l"(p), "f"(x), "f"(y) : "memory");
}
__device__ __forceinline__ float2 ld_cg_f32x2(const void* p) {
  float2 v;
  asm volatile("ld.global.cg.v2.f32 {%0,%1}, [%2];\n" : "=f"(v.x), "=f"(v.y) : "l"(p));
  return v;
}
__device__ __forceinline__ uint4 ld_v4(const void* p) {
  uint4 v;
  asm volatile("ld.v4.u32 {%0,%1,%2,%3}, [%4];\n" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}

// ---- cross-GPU ordering and signalling (docs/design.md, "Signalling and epochs") ----
__device__ __forceinline__ void fence_acq_rel_sys() { asm volatile("fence.acq_rel.sys;\n" ::: "memory"); }
__device__ __forceinline__ void red_release_sys_add(unsigned long long* counter, unsigned long long v) {
  asm volatile("red.release.sys.global.add.u64 [%0], %1;\n" ::"l"(counter), "l"(v) : "memory");
}
__device__ __forceinline__ unsigned long long ld_acquire_sys(const unsigned long long* p) {
  unsigned long long v;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];\n" : "=l"(v) : "l"(p) : "memory");
  return v;
}
// ---- GPU-scope flags between CTAs of one kernel (the wgmma GEMM's split K) ----
__device__ __forceinline__ unsigned ld_acquire_gpu(const unsigned* p) {
  unsigned v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];\n" : "=r"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ void st_release_gpu(unsigned* p, unsigned v) {
  asm volatile("st.release.gpu.global.u32 [%0], %1;\n" ::"l"(p), "r"(v) : "memory");
}
__device__ __forceinline__ int atom_add_acq_rel_gpu(int* p, int v) {
  int old;
  asm volatile("atom.acq_rel.gpu.global.add.s32 %0, [%1], %2;\n" : "=r"(old) : "l"(p), "r"(v) : "memory");
  return old;
}
__device__ __forceinline__ unsigned long long globaltimer_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;\n" : "=l"(t));
  return t;
}

// ---- Hopper: mbarriers, TMA, wgmma bracketing, named barriers, register budgets ----
__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void mbarrier_init(uint64_t* bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_u32(bar)), "r"(count));
}
// Makes initialized mbarriers visible to the async proxy (TMA) before first use.
__device__ __forceinline__ void fence_mbarrier_init() {
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}
// Spins until the barrier completes the phase of this parity; SEM is the try_wait's
// semantics ("" for the default acquire at CTA scope).
#define EPSERVE_MBARRIER_WAIT(SEM)                                                       \
  asm volatile(                                                                          \
      "{\n.reg .pred done;\nWAIT_%=:\n"                                                  \
      "mbarrier.try_wait.parity" SEM ".shared::cta.b64 done, [%0], %1;\n"                \
      "@!done bra WAIT_%=;\n}\n" ::"r"(smem_u32(bar)),                                    \
      "r"(phase)                                                                         \
      : "memory")
__device__ __forceinline__ void mbarrier_wait(uint64_t* bar, uint32_t phase) { EPSERVE_MBARRIER_WAIT(""); }
__device__ __forceinline__ void mbarrier_arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(smem_u32(bar)) : "memory");
}
__device__ __forceinline__ void mbarrier_expect_tx(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_u32(bar)), "r"(bytes) : "memory");
}
// Counts `bytes` as arrived on `bar` without a copy (a diagnostic build's stand-in for a TMA
// load whose bytes an expect_tx already announced).
__device__ __forceinline__ void mbarrier_complete_tx(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.complete_tx.relaxed.cta.shared::cta.b64 [%0], %1;\n" ::"r"(smem_u32(bar)), "r"(bytes)
               : "memory");
}
// 2-D tile copy global -> shared through a tensor map; completes on `bar` with its byte count.
// What the tensor map's encoder cannot check, since it sees no coordinates or destinations:
// x * element size (x: the innermost coordinate) must be a multiple of 16 bytes, and smem_dst
// 128-byte aligned (1024 for a 128-byte swizzle). Triton's TMA model asserts the first rule
// and its users met its breach as CUDA_ERROR_ILLEGAL_INSTRUCTION on H100s; it is the likely
// cause of the same error in the FP8 GEMM's first GPU run (gemm/grouped_gemm_fp8.cu).
__device__ __forceinline__ void tma_load_2d(void* smem_dst, const void* tensor_map, uint64_t* bar, int x, int y) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];\n" ::
          "r"(smem_u32(smem_dst)),
      "l"(tensor_map), "r"(x), "r"(y), "r"(smem_u32(bar))
      : "memory");
}
// A tensor map in global memory gets dimension `dim`'s extent replaced, and is then made
// visible to this thread's later TMA operations through it (the map is written through the
// generic proxy and read through the tensormap proxy: a release then an acquire fence).
template <int kDim>
__device__ __forceinline__ void tensor_map_set_extent(void* global_map, int extent) {
  asm volatile("tensormap.replace.tile.global_dim.global.b1024.b32 [%0], %1, %2;\n" ::"l"(global_map), "n"(kDim),
               "r"(extent)
               : "memory");
  asm volatile("fence.proxy.tensormap::generic.release.gpu;\n" ::: "memory");
  asm volatile("fence.proxy.tensormap::generic.acquire.gpu [%0], 128;\n" ::"l"(global_map) : "memory");
}
// ---- thread-block clusters (the wgmma GEMM's CTA pairs) ----
__device__ __forceinline__ uint32_t cluster_ctarank() {
  uint32_t r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(r));
  return r;
}
// Every thread of every CTA of the cluster; not .aligned, since the warp roles arrive from
// different code.
__device__ __forceinline__ void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release;\nbarrier.cluster.wait.acquire;\n" ::: "memory");
}
// The address of the same shared-memory object in CTA `cta` of the cluster.
__device__ __forceinline__ uint32_t cluster_peer_u32(const void* p, uint32_t cta) {
  uint32_t r;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(r) : "r"(smem_u32(p)), "r"(cta));
  return r;
}
// Arrive on CTA `cta`'s barrier. Default semantics (release at CTA scope), as a consumer freeing
// a stage needs: its wgmmas have read the stage, and the overwrite is the async proxy's.
__device__ __forceinline__ void mbarrier_arrive_remote(uint64_t* bar, uint32_t cta) {
  asm volatile("mbarrier.arrive.shared::cluster.b64 _, [%0];\n" ::"r"(cluster_peer_u32(bar, cta)) : "memory");
}
__device__ __forceinline__ void mbarrier_expect_tx_remote(uint64_t* bar, uint32_t cta, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cluster.b64 _, [%0], %1;\n" ::"r"(cluster_peer_u32(bar, cta)),
               "r"(bytes)
               : "memory");
}
// The same with release at cluster scope: what this thread stored into the peer before it
// (st_shared_cluster) is seen by a peer thread that waits with mbarrier_wait_cluster.
__device__ __forceinline__ void mbarrier_expect_tx_cluster(uint64_t* bar, uint32_t cta, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.release.cluster.shared::cluster.b64 _, [%0], %1;\n" ::"r"(
                   cluster_peer_u32(bar, cta)),
               "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void st_shared_cluster(int* p, uint32_t cta, int v) {
  asm volatile("st.shared::cluster.s32 [%0], %1;\n" ::"r"(cluster_peer_u32(p, cta)), "r"(v) : "memory");
}
// mbarrier_wait that also sees what another CTA of the cluster wrote before its release-arrive.
__device__ __forceinline__ void mbarrier_wait_cluster(uint64_t* bar, uint32_t phase) {
  EPSERVE_MBARRIER_WAIT(".acquire.cluster");
}
// tma_load_2d into the same offset of every CTA whose bit is set in cta_mask; each
// destination's barrier at `bar`'s offset gets the box's bytes.
__device__ __forceinline__ void tma_load_2d_multicast(void* smem_dst, const void* tensor_map, uint64_t* bar, int x,
                                                      int y, uint16_t cta_mask) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes.multicast::cluster"
      " [%0], [%1, {%2, %3}], [%4], %5;\n" ::"r"(smem_u32(smem_dst)),
      "l"(tensor_map), "r"(x), "r"(y), "r"(smem_u32(bar)), "h"(cta_mask)
      : "memory");
}
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
// Pins accumulator registers in place: the compiler must not move their reads or writes
// across the asynchronous wgmma bracket (fence ... wait), which it cannot see into.
template <int kN>
__device__ __forceinline__ void fence_operands(float (&r)[kN]) {
#pragma unroll
  for (int i = 0; i < kN; ++i) asm volatile("" : "+f"(r[i])::"memory");
}
// The same for the first kCount registers only (an instruction with fewer accumulators).
template <int kCount, int kN>
__device__ __forceinline__ void fence_operands_prefix(float (&r)[kN]) {
  static_assert(kCount <= kN, "prefix");
#pragma unroll
  for (int i = 0; i < kCount; ++i) asm volatile("" : "+f"(r[i])::"memory");
}
template <int kPending>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(kPending) : "memory");
}
// K-major bf16 tile in 128-byte rows, 128-byte swizzle: 8-row groups 1024 bytes apart. The
// descriptor by its two words: the low word holds the address / 16 and the leading byte
// offset, the high word (constant) the stride and the swizzle. Only the low word moves with
// the address, d bytes further by d / 16 (shared memory ends below 256 KB, so the 14-bit
// address never carries): a loop that steps through a stage adds to a low word computed
// once instead of rebuilding each descriptor from a pointer (a mask, a shift, an or and a
// move each time: the FP8 GEMM's consumers issued about 45 such instructions around every
// 4 wgmmas).
constexpr uint32_t kSmemDescSw128Hi = (1u << 30) | 64u;
__device__ __forceinline__ uint32_t smem_desc_sw128_lo(const void* p) {
  return ((smem_u32(p) & 0x3FFFF) >> 4) | (1u << 16);
}
__device__ __forceinline__ uint64_t smem_desc_sw128_from_lo(uint32_t lo) {
  return (static_cast<uint64_t>(kSmemDescSw128Hi) << 32) | lo;
}
__device__ __forceinline__ uint64_t smem_desc_sw128(const void* p) {
  return smem_desc_sw128_from_lo(smem_desc_sw128_lo(p));
}
// Barrier over a subset of the block (id 1..15), so producer warps need not join.
template <int kId, int kThreads>
__device__ __forceinline__ void named_barrier_sync() {
  if constexpr (kId == 0) {
    __syncthreads();
  } else {
    asm volatile("bar.sync %0, %1;\n" ::"n"(kId), "n"(kThreads) : "memory");
  }
}
// The same, for a barrier whose participants reach it from different code (warp roles):
// bar.sync is barrier.sync.aligned, which promises that every participant of a generation
// executes the same barrier instruction; compute-sanitizer's synccheck holds code to that.
template <int kId, int kThreads>
__device__ __forceinline__ void named_barrier_sync_across_roles() {
  static_assert(kId > 0 && kThreads % 32 == 0, "a named barrier of whole warps");
  asm volatile("barrier.sync %0, %1;\n" ::"n"(kId), "n"(kThreads) : "memory");
}
// Arrives at a named barrier without waiting: a producer's side of a barrier that the
// consumers of its signal wait at with named_barrier_sync_across_roles (same id and count).
template <int kId, int kThreads>
__device__ __forceinline__ void named_barrier_arrive() {
  static_assert(kId > 0 && kThreads % 32 == 0, "a named barrier of whole warps");
  asm volatile("barrier.arrive %0, %1;\n" ::"n"(kId), "n"(kThreads) : "memory");
}
template <int kRegs>
__device__ __forceinline__ void setmaxnreg_dec() { asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kRegs)); }
template <int kRegs>
__device__ __forceinline__ void setmaxnreg_inc() { asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kRegs)); }

}  // namespace epserve
