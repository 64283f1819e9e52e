// What the dispatch kernels (cuda/comm/dispatch.cu) share: block sizes, row copies, a block
// scan and the "last CTA to finish" counter. Included once, by dispatch.cu.
#pragma once
#include "comm/dispatch_config.cuh"
#include "common/errors.cuh"
#include "common/ptx.cuh"
#include "common/src_info.cuh"
#ifndef EPSERVE_DISPATCH_QUANTIZE
#define EPSERVE_DISPATCH_QUANTIZE 0  // 1: the move quantizes bf16 tokens into packed FP8 rows (dispatch.cu)
#endif
#if EPSERVE_DISPATCH_QUANTIZE
#include "common/bulk_copy.cuh"
#include "common/fp8_rows.cuh"
#endif

using namespace epserve;

namespace {

constexpr int kLayoutThreads = EPSERVE_MAX_LOCAL_EXPERTS;  // a thread per local expert
// count + publish: a warp per chunk counts, a CTA scans its warps' chunks (a lane per warp's
// chunk), and the last CTA's scan of the CTA totals takes a thread per counter
constexpr int kCountThreads = 1024;
constexpr int kCountWarps = kCountThreads / 32;  // chunks a count CTA holds: chunk c is CTA c / kCountWarps's
static_assert(kCountWarps == 32, "the CTA's scan of its chunks takes a lane per chunk");
// rank + layout: a warp per chunk ranks; the last CTA's layout takes a thread per local expert
constexpr int kRankThreads = kLayoutThreads;
constexpr int kRankWarps = kRankThreads / 32;
constexpr int kChunk = 32;          // tokens per warp-chunk in route
constexpr int kMoveThreads = 256;   // send and expand: a warp per token row
// The move's expand blocks wait for the peers' send blocks, so the whole grid must be
// resident at once: the host launches up to one send and two expand blocks an SM
// (epserve/dispatch/direct.py), and the bound makes ptxas keep three blocks' registers.
constexpr int kMoveBlocksPerSm = 3;
constexpr int kMaxTopK = 16;        // MoEConfig's limit (src_info packs the slot in 4 bits)

// A set of destination ranks in registers, bit d % 32 of word d / 32. One word is a plain mask;
// with more, every word is indexed by a constant once the loops unroll, so the set stays in
// registers (no local memory). The route's kernels come in both: one word up to
// EPSERVE_MAX_PEERS ranks (one node: its code as before), the wide set beyond, in the _wide
// kernels (so that 16 ranks, the GPU test, run the code 128 ranks run).
template <int kWords>
struct DestSet {
  unsigned w[kWords];
  __device__ __forceinline__ DestSet() {
#pragma unroll
    for (int i = 0; i < kWords; ++i) w[i] = 0;
  }
  __device__ __forceinline__ void add(int d) {
    if constexpr (kWords == 1) {
      w[0] |= 1u << d;
    } else {
#pragma unroll
      for (int i = 0; i < kWords; ++i) w[i] |= (d >> 5) == i ? 1u << (d & 31) : 0u;
    }
  }
  __device__ __forceinline__ bool has(int d) const {
    if constexpr (kWords == 1) {
      return w[0] >> d & 1;
    } else {
      unsigned x = 0;
#pragma unroll
      for (int i = 0; i < kWords; ++i) x = (d >> 5) == i ? w[i] : x;
      return x >> (d & 31) & 1;
    }
  }
};
constexpr int kWideWords = EPSERVE_MAX_WORLD / 32;  // DestSet words for any world

// What other GPUs wrote, read from L2 (never a stale L1 line). Not volatile: the reads
// follow an acquire and a barrier, and the compiler may batch them.
__device__ __forceinline__ int ld_cg_s32(const int* p) { return __ldcg(p); }

// Exclusive scan of one value per thread over a block of kLayoutThreads; *total gets the sum.
__device__ int block_exclusive_scan(int v, int* warp_sums, int* total) {
  constexpr int kWarps = kLayoutThreads / 32;
  static_assert(kWarps <= 32, "one warp scans the warp sums");
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  int x = v;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const int y = __shfl_up_sync(0xffffffffu, x, o);
    if (lane >= o) x += y;
  }
  if (lane == 31) warp_sums[warp] = x;
  __syncthreads();
  if (warp == 0) {
    const int w = lane < kWarps ? warp_sums[lane] : 0;
    int sum = w;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const int y = __shfl_up_sync(0xffffffffu, sum, o);
      if (lane >= o) sum += y;
    }
    if (lane < kWarps) warp_sums[lane] = sum - w;
    if (lane == 31) *total = sum;
  }
  __syncthreads();
  return warp_sums[warp] + x - v;
}

// One warp copies a row of n16 16-byte chunks. Loads and stores are volatile asm, which
// keeps them in program order: four loads go out before their stores, so a warp has four in
// flight instead of one (the copy is bound by bytes in flight, not by instructions). ld_cg:
// a row another GPU wrote must not come from a stale L1 line; st_v4: the destination may be
// a peer's memory.
__device__ __forceinline__ void copy_row(uint4* dst, const uint4* src, int n16, int lane) {
  constexpr int kUnroll = 4;
  int c = lane;
  for (; c + 32 * (kUnroll - 1) < n16; c += 32 * kUnroll) {
    uint4 v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) v[u] = ld_cg_v4(src + c + 32 * u);
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) st_v4(dst + c + 32 * u, v[u]);
  }
  if (c < n16) {  // the last, partial round: its loads in flight together too
    uint4 v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      v[u] = make_uint4(0, 0, 0, 0);
      if (c + 32 * u < n16) v[u] = ld_cg_v4(src + c + 32 * u);
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u)
      if (c + 32 * u < n16) st_v4(dst + c + 32 * u, v[u]);
  }
}

// One warp copies a row of n16 16-byte chunks to several destination rows at once: lane j
// holds destination j's address in my_dst, for each bit j of `lanes`. The row is read once
// (four chunks a lane in flight, as copy_row) and each piece stored to every destination
// from registers, so a row feeding four experts costs one read, not four.
__device__ __forceinline__ void copy_row_to_many(uint4* my_dst, unsigned lanes, const uint4* src, int n16, int lane) {
  constexpr int kUnroll = 4;
  int b = 0;  // warp-uniform, so every lane takes part in every shuffle
  for (; b + 32 * kUnroll <= n16; b += 32 * kUnroll) {
    uint4 v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) v[u] = ld_cg_v4(src + b + lane + 32 * u);
    for (unsigned m = lanes; m; m &= m - 1) {
      uint4* dst = reinterpret_cast<uint4*>(
          __shfl_sync(0xffffffffu, reinterpret_cast<unsigned long long>(my_dst), __ffs(m) - 1));
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) st_v4(dst + b + lane + 32 * u, v[u]);
    }
  }
  // The last, partial round (a packed FP8 row's 464 chunks leave 80), its loads in flight
  // together. Apart from the full rounds: one predicated loop for both took the quantizing
  // move kernel from 62 to 80 registers, the most its three blocks an SM allow.
  if (b < n16) {
    uint4 v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      v[u] = make_uint4(0, 0, 0, 0);
      if (b + lane + 32 * u < n16) v[u] = ld_cg_v4(src + b + lane + 32 * u);
    }
    for (unsigned m = lanes; m; m &= m - 1) {
      uint4* dst = reinterpret_cast<uint4*>(
          __shfl_sync(0xffffffffu, reinterpret_cast<unsigned long long>(my_dst), __ffs(m) - 1));
#pragma unroll
      for (int u = 0; u < kUnroll; ++u)
        if (b + lane + 32 * u < n16) st_v4(dst + b + lane + 32 * u, v[u]);
    }
  }
}

#if EPSERVE_DISPATCH_QUANTIZE
// One warp quantizes a bf16 row of `cols` columns (a multiple of 128) into a packed FP8 row
// of row16 16-byte chunks: bytes [0, cols) the e4m3 values, then the cols / 128 fp32 scales,
// then zeros to the row's end (epserve.ffn.fp8.packed_row_bytes: rows on whole 128-byte
// lines). The bits of epserve_quantize_rows_packed_fp8, by the same functions
// (common/fp8_rows.cuh). Each pass takes 4 k-blocks of 128 columns: lane l loads 16 bf16 (two
// 16-byte chunks) of k-block l / 8, the 8 lanes of a k-block reduce its amax, each lane holds
// its 16 e4m3 as one 16-byte chunk, and lane 0 the pass's 4 scales as one 16-byte chunk (zeros
// past the last k-block). Two passes a round, so four 16-byte loads a lane are in flight, as
// in copy_row_to_many (four passes a round measured no faster and took 80 registers, not 61).
// For each pass, the row's chunks go out by each_row(store): each_row calls store(dst) for
// every row base the chunks go to (every lane with the same dst, so it may shuffle between).
// The row is read once, however many destinations it has.
// Passes [pass_begin, pass_end) only (row_passes(cols) in all), so several warps may share a
// row, each its own passes (the expansion at decode, where rows are fewer than warps): a
// pass's k-blocks, value chunks and scale chunk are its own, and the warp whose passes reach
// the row's end writes the padding. The bits do not depend on the split.
__device__ __forceinline__ int row_passes(int cols) { return (cols / 128 + 3) / 4; }

template <class EachRow>
__device__ __forceinline__ void quantize_row(const bf16_t* src, int cols, int row16, int lane, EachRow each_row,
                                             int pass_begin = 0, int pass_end = 1 << 30) {
  constexpr int kPasses = 2;
  const int k_blocks = cols / 128, values16 = cols / 16, g = lane >> 3, i = lane & 7;
  pass_end = min(pass_end, row_passes(cols));
  const uint4* row = reinterpret_cast<const uint4*>(src);  // 8 bf16 a chunk: k-block kb's are [16 kb, 16 kb + 16)
  for (int p = pass_begin; p < pass_end; p += kPasses) {  // warp-uniform: every lane takes part in every shuffle
    uint4 lo[kPasses], hi[kPasses];
#pragma unroll
    for (int u = 0; u < kPasses; ++u) {
      const int kb = 4 * (p + u) + g;
      lo[u] = hi[u] = make_uint4(0, 0, 0, 0);
      if (p + u < pass_end && kb < k_blocks) {
        lo[u] = ld_cg_v4(row + 16 * kb + 2 * i);
        hi[u] = ld_cg_v4(row + 16 * kb + 2 * i + 1);
      }
    }
    uint4 q[kPasses], scales[kPasses];
#pragma unroll
    for (int u = 0; u < kPasses; ++u) {
      const float amax = lanes_max<8>(fmaxf(bf16x8_amax(lo[u]), bf16x8_amax(hi[u])));
      const float inv = fp8_inv_scale(amax);
      const uint2 a = quantize_bf16x8(lo[u], inv), b = quantize_bf16x8(hi[u], inv);
      q[u] = make_uint4(a.x, a.y, b.x, b.y);
      // lane 8 g holds k-block 4 (p + u) + g's scale; lane 0 gathers the pass's four
      unsigned s = 4 * (p + u) + g < k_blocks ? __float_as_uint(fp8_scale(amax)) : 0u;
      scales[u].x = __shfl_sync(0xffffffffu, s, 0);
      scales[u].y = __shfl_sync(0xffffffffu, s, 8);
      scales[u].z = __shfl_sync(0xffffffffu, s, 16);
      scales[u].w = __shfl_sync(0xffffffffu, s, 24);
    }
    each_row([&](uint4* dst) {
#pragma unroll
      for (int u = 0; u < kPasses; ++u) {
        const int kb = 4 * (p + u) + g;
        if (p + u < pass_end && kb < k_blocks) st_v4(dst + 8 * kb + i, q[u]);
        if (lane == 0 && p + u < pass_end) st_v4(dst + values16 + p + u, scales[u]);
      }
    });
  }
  // The padding after the scale chunks (the last of which holds zeros past the last k-block).
  const int pad16 = values16 + row_passes(cols);
  if (pass_end == row_passes(cols) && pad16 < row16)  // warp-uniform: every lane takes part in the shuffles
    each_row([&](uint4* dst) {
      for (int c = pad16 + lane; c < row16; c += 32) st_v4(dst + c, make_uint4(0, 0, 0, 0));
    });
}

// quantize_row's packed row stored to several destinations at once (lanes as
// copy_row_to_many's), each chunk from registers to every destination.
__device__ __forceinline__ void quantize_row_to_many(uint4* my_dst, unsigned lanes, const bf16_t* src, int cols,
                                                     int row16, int lane, int pass_begin = 0,
                                                     int pass_end = 1 << 30) {
  quantize_row(
      src, cols, row16, lane,
      [&](auto store) {
        for (unsigned m = lanes; m; m &= m - 1)
          store(reinterpret_cast<uint4*>(
              __shfl_sync(0xffffffffu, reinterpret_cast<unsigned long long>(my_dst), __ffs(m) - 1)));
      },
      pass_begin, pass_end);
}

// The same row staged whole in this warp's row of shared memory, then handed to the bulk copy
// engine: each lane of `lanes` copies it to its my_dst by one cp.async.bulk. On an H200 a
// microbench of the fan-out ran 9% faster so (notes/dispatch.md, twentieth session); in the
// move on an H100 it is 7% slower (thirty-first session), so the host leaves it off unless
// asked (DirectDispatcher.stage_own_rows). The staging row is rewritten only once the engine
// has read it; bulk_wait<0> before the kernel's end makes the writes complete.
__device__ __forceinline__ void quantize_row_to_many_staged(uint4* my_dst, unsigned lanes, const bf16_t* src,
                                                            int cols, int row16, int lane, uint4* staging) {
  bool read = false;  // whether the engine has read the previous row: waited for at the first store, so the
                     // first pass's loads are in flight meanwhile
  quantize_row(src, cols, row16, lane, [&](auto store) {
    if (!read) {
      bulk_wait_read<0>();  // this lane's copies of the previous row
      __syncwarp();
      read = true;
    }
    store(staging);
  });
  fence_proxy_async_shared();  // this lane's stores, before the engine reads them
  __syncwarp();
  if (lanes >> lane & 1) {
    bulk_copy_shared_to_global(my_dst, staging, static_cast<uint32_t>(row16) * 16);
    bulk_commit();
  }
}
#endif

// True in the last CTA of the grid to get here, once every other CTA's writes before its
// call are visible to it. That CTA resets *done, so the next launch or CUDA graph replay
// finds it zero with no memset (*done starts zeroed when the buffer is made). Every thread
// of every CTA must call it, once per launch.
__device__ bool last_block_to_finish(unsigned* done) {
  __shared__ int last;
  __threadfence();  // this thread's writes, before its CTA counts itself done
  __syncthreads();
  if (threadIdx.x == 0) {
    last = atomicAdd(done, 1u) == gridDim.x - 1;
    if (last) {
      __threadfence();  // the other CTAs' writes, before this one reads them
      *done = 0;        // every CTA has counted: ready for the next launch
    }
  }
  __syncthreads();
  return last;
}

}  // namespace
