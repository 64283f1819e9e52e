// bf16 -> e4m3 with fp32 block scales (the convention of common/fp8.cuh), two block shapes:
//  * rows, 1 x 128 (activations): a warp per (row, 128-column block), 4 values a lane;
//    scales[kb, m] k-block-major, one row of `scale_ld` floats per k-block, because the FP8
//    GEMM's producer loads a tile's 128 row scales of one k-block as one TMA box;
//  * packed rows, 1 x 128 (the FP8 dispatch): each row's e4m3 values, then its scales, in
//    one row of row_bytes, so the dispatch moves a token's values and scales as one row;
//    unpack_row_scales turns the received rows' scales into the k-block-major layout above;
//  * blocks, 128 x 128 (weights, prepared once): a CTA per block, 16 rows a warp;
//    scales[row block, column block] row-major, which for w [E, N, K] is [E, N/128, K/128].
// The GEMM 1 epilogue quantizes its SwiGLU output with the same functions, so this kernel
// applied to the unfused bf16 act gives the fused kernel's bits; the direct dispatch built
// with EPSERVE_DISPATCH_QUANTIZE quantizes tokens into packed rows with the same functions
// (common/fp8_rows.cuh), so its rows are this kernel's bits.
#include "common/bf16.cuh"
#include "common/fp8_rows.cuh"  // warp_max, lanes_max, quantize_bf16x4/x8: shared with the dispatch's quantizing send

using namespace epserve;

// x [rows, cols] bf16 -> q [rows, cols] e4m3, scales [cols / 128, scale_ld] (scale_ld >= rows).
extern "C" __global__ void epserve_quantize_rows_fp8(const bf16_t* __restrict__ x, long long rows, int cols,
                                                     fp8_t* __restrict__ q, float* __restrict__ scales,
                                                     long long scale_ld) {
  const int lane = threadIdx.x % 32;
  const long long warps = static_cast<long long>(gridDim.x) * blockDim.x / 32;
  const long long blocks = rows * (cols / 128);
  // Block b is row b % rows of k-block b / rows: neighbouring warps write neighbouring scales.
  for (long long b = (static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x) / 32; b < blocks; b += warps) {
    const long long kb = b / rows, m = b - kb * rows;
    const long long at = m * cols + kb * 128 + lane * 4;
    const uint2 v = *reinterpret_cast<const uint2*>(x + at);
    const float amax = warp_max(fmaxf(bf16x2_amax(v.x), bf16x2_amax(v.y)));
    *reinterpret_cast<uint32_t*>(q + at) = quantize_bf16x4(v, fp8_inv_scale(amax));
    if (lane == 0) scales[kb * scale_ld + m] = fp8_scale(amax);
  }
}

// x [rows, cols] bf16 -> packed [rows, row_bytes] bytes: row m's e4m3 values in bytes
// [0, cols), its cols / 128 fp32 scales from byte cols on, then zeros to row_bytes
// (row_bytes >= cols + cols / 32, a multiple of 4). The values and scales are those of
// epserve_quantize_rows_fp8, bit for bit; every byte of the row is written.
// A warp takes kPackedGroupKB k-blocks of a row, two a load (a half-warp's 16 lanes x 8
// values each), and has all of their loads in flight before the first amax: a warp per
// k-block with one 8-byte load a lane kept too few bytes in flight for HBM (50-57 us for dsv3's
// 4096 tokens, 89 MB, on an H100: half the copy rate). Work item w is row w / groups, so
// neighbouring warps read and write neighbouring bytes.
constexpr int kPackedGroupKB = 8;  // epserve/ffn/fp8.py PACKED_GROUP_KB sizes the grid by it
extern "C" __global__ void __launch_bounds__(256)
    epserve_quantize_rows_packed_fp8(const bf16_t* __restrict__ x, long long rows, int cols,
                                     unsigned char* __restrict__ packed, long long row_bytes) {
  constexpr int kLoads = kPackedGroupKB / 2;
  const int lane = threadIdx.x % 32, half = lane / 16, col = (lane % 16) * 8;
  const long long warps = static_cast<long long>(gridDim.x) * blockDim.x / 32;
  const int k_blocks = cols / 128, groups = (k_blocks + kPackedGroupKB - 1) / kPackedGroupKB;
  const long long items = rows * groups;
  for (long long w = (static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x) / 32; w < items; w += warps) {
    const long long m = w / groups;
    const int kb0 = static_cast<int>(w - m * groups) * kPackedGroupKB + half;  // this half-warp's first k-block
    const bf16_t* xr = x + m * cols;
    uint4 v[kLoads];
#pragma unroll
    for (int j = 0; j < kLoads; ++j)
      v[j] = kb0 + 2 * j < k_blocks ? __ldg(reinterpret_cast<const uint4*>(xr + (kb0 + 2 * j) * 128 + col))
                                    : make_uint4(0u, 0u, 0u, 0u);
    unsigned char* row = packed + m * row_bytes;
#pragma unroll
    for (int j = 0; j < kLoads; ++j) {
      const int kb = kb0 + 2 * j;
      const float amax = lanes_max<16>(bf16x8_amax(v[j]));  // every lane: the shuffles take the whole warp
      if (kb < k_blocks) {
        *reinterpret_cast<uint2*>(row + kb * 128 + col) = quantize_bf16x8(v[j], fp8_inv_scale(amax));
        if (col == 0) reinterpret_cast<float*>(row + cols)[kb] = fp8_scale(amax);
      }
    }
    if (kb0 < 2)  // the padding after the scales, by the warp of the row's first group
      for (long long at = cols + k_blocks * 4 + lane * 4; at < row_bytes; at += 128)
        *reinterpret_cast<uint32_t*>(row + at) = 0u;
  }
}

// The scales of packed rows (as epserve_quantize_rows_packed_fp8 writes them, here after the
// dispatch moved them) -> scales [cols / 128, scale_ld], the layout the FP8 GEMM reads A's
// scales in. row_count, when not null, holds the rows there are (expert_offsets[E] of the
// dispatch): only min(rows, *row_count) are read. A transpose through shared memory, a tile of
// kUnpackTile rows x kUnpackTile k-blocks at a time: each warp reads a row's run of scales (128
// contiguous bytes) and writes a k-block's run of rows, where a thread per scale read a sector
// of its own row for 4 bytes (18 us at dsv3's 32768 rows, ~3x the bytes' time).
constexpr int kUnpackTile = 32;
constexpr int kUnpackThreads = 256;  // kUnpackTile x 8: each thread moves 4 scales of a tile
extern "C" __global__ void __launch_bounds__(kUnpackThreads)
    epserve_unpack_row_scales_fp8(const unsigned char* __restrict__ packed, long long rows, int cols,
                                  long long row_bytes, float* __restrict__ scales, long long scale_ld,
                                  const int* __restrict__ row_count) {
  __shared__ float tile[kUnpackTile][kUnpackTile + 1];  // [row][k-block], padded off bank conflicts
  if (row_count != nullptr) rows = min(rows, static_cast<long long>(max(*row_count, 0)));
  const int k_blocks = cols / 128, kb_tiles = (k_blocks + kUnpackTile - 1) / kUnpackTile;
  const long long tiles = (rows + kUnpackTile - 1) / kUnpackTile * kb_tiles;
  const int tx = threadIdx.x % kUnpackTile, ty = threadIdx.x / kUnpackTile;
  constexpr int kRowsAPass = kUnpackThreads / kUnpackTile;
  for (long long t = blockIdx.x; t < tiles; t += gridDim.x) {
    const long long m0 = t / kb_tiles * kUnpackTile;
    const int kb0 = static_cast<int>(t % kb_tiles) * kUnpackTile;
#pragma unroll
    for (int r = ty; r < kUnpackTile; r += kRowsAPass)
      if (m0 + r < rows && kb0 + tx < k_blocks)
        tile[r][tx] = reinterpret_cast<const float*>(packed + (m0 + r) * row_bytes + cols)[kb0 + tx];
    __syncthreads();
#pragma unroll
    for (int k = ty; k < kUnpackTile; k += kRowsAPass)
      if (m0 + tx < rows && kb0 + k < k_blocks) scales[(kb0 + k) * scale_ld + m0 + tx] = tile[tx][k];
    __syncthreads();  // the tile is rewritten by the next one
  }
}

// w [row_blocks * 128, cols] bf16 -> q alike, scales [row_blocks, cols / 128]. Blocks never
// straddle two experts' matrices when each has a multiple of 128 rows.
extern "C" __global__ void __launch_bounds__(256) epserve_quantize_blocks_fp8(const bf16_t* __restrict__ w,
                                                                              long long row_blocks, int cols,
                                                                              fp8_t* __restrict__ q,
                                                                              float* __restrict__ scales) {
  __shared__ float warp_amax[8];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int col_blocks = cols / 128;
  for (long long blk = blockIdx.x; blk < row_blocks * col_blocks; blk += gridDim.x) {
    const long long rb = blk / col_blocks;
    const int cb = static_cast<int>(blk - rb * col_blocks);
    const long long at = (rb * 128 + warp * 16) * cols + cb * 128 + lane * 4;  // this warp's 16 rows
    uint2 v[16];
    float amax = 0.f;
#pragma unroll
    for (int r = 0; r < 16; ++r) {
      v[r] = *reinterpret_cast<const uint2*>(w + at + r * static_cast<long long>(cols));
      amax = fmaxf(amax, fmaxf(bf16x2_amax(v[r].x), bf16x2_amax(v[r].y)));
    }
    amax = warp_max(amax);
    if (lane == 0) warp_amax[warp] = amax;
    __syncthreads();
#pragma unroll
    for (int i = 0; i < 8; ++i) amax = fmaxf(amax, warp_amax[i]);
    const float inv = fp8_inv_scale(amax);
#pragma unroll
    for (int r = 0; r < 16; ++r)
      *reinterpret_cast<uint32_t*>(q + at + r * static_cast<long long>(cols)) = quantize_bf16x4(v[r], inv);
    if (threadIdx.x == 0) scales[blk] = fp8_scale(amax);
    __syncthreads();  // warp_amax is rewritten by the next block
  }
}
