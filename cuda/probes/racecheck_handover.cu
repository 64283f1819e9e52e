// The tile hand-over of the GEMMs' epilogues (sinks/tile_mailbox.cuh) with nothing else, to
// show which orderings among the output threads compute-sanitizer's racecheck accepts
// (launch/jobs/probe_racecheck_handover.py runs it under racecheck; notes/gemm.md,
// thirty-sixth session). The roles of the FP8 GEMM: two output warpgroups (threads 0-255),
// one idle warp (the producer's, 256-287) and three writer warps (288-383) that copy each
// handed-over tile to global memory. Every protocol is ordered by construction: the drain
// before the tile is written and the hand-over after it are the shipped mailbox's; what
// -DEPSERVE_PROBE_PROTOCOL adds (between them, or after the hand-over) only orders the output
// threads among themselves:
//   0  both warpgroups write their 64 rows (the epilogue of a full tile)
//   1  the first warpgroup writes the 64 rows of a tail alone
//   2  as 1, after a named barrier the first warpgroup takes alone (128 threads)
//   3  as 1, after a named barrier of both warpgroups (256 threads)
//   4  the second warpgroup's words reach the first through the tile's bytes: it writes
//      them, both take a 256-thread named barrier, the first reads them, takes a
//      128-thread named barrier alone and writes its rows (GEMM 1's split tails through
//      the thirty-fifth session)
//   5  as 4, with the second warpgroup arriving at the 256-thread barrier without waiting
//   6  as 4, ordered by two mbarriers of 128 arrivals instead (the shipped split tails)
//   7  as 0, and after each hand-over each warpgroup takes a named barrier of its own (128
//      threads; the split-K build's first halves through the thirty-fifth session)
// Tile t of block b (key = b * tiles + t) holds, at row r and 2-byte column c, the low 16
// bits of key * 7 + r * 64 + c + S, where S is the sum of the words the writing thread read
// from the other warpgroup (0 without an exchange; word i of thread u is key * 4096 + u * 32
// + i); row r's scale is key * 128 + r. out: [blocks * tiles][128 rows * 128 bytes + 128
// scales]; rows past a tail's 64 stay as the host poisoned them.
#include "common/ptx.cuh"
#include "sinks/tile_mailbox.cuh"

#ifndef EPSERVE_PROBE_PROTOCOL
#define EPSERVE_PROBE_PROTOCOL 0
#endif

namespace {

using namespace epserve;
constexpr int kProtocol = EPSERVE_PROBE_PROTOCOL;
static_assert(kProtocol >= 0 && kProtocol <= 7, "EPSERVE_PROBE_PROTOCOL: 0 .. 7");
constexpr bool kExchange = kProtocol >= 4 && kProtocol <= 6;
constexpr int kRows = kProtocol == 0 || kProtocol == 7 ? 128 : 64;
constexpr int kRowBytes = 128, kTileBytes = 128 * kRowBytes, kOutBytes = kTileBytes + 128 * 4;
constexpr int kWriterWarps = 3;
using Mailbox = TileMailbox<256, kWriterWarps * 32>;

}  // namespace

extern "C" __global__ void __launch_bounds__(384, 1)
    epserve_probe_racecheck_handover(unsigned char* __restrict__ out, int tiles) {
  __shared__ __align__(16) unsigned char tile[kTileBytes];
  __shared__ float scales[128];
  __shared__ SendMailbox mailbox;
  __shared__ uint64_t written, read;
  if (threadIdx.x == 0) {
    mbarrier_init(&written, 128);
    mbarrier_init(&read, 128);
  }
  __syncthreads();
  const int warpgroup = threadIdx.x / 128;
  if (warpgroup == 2) {
    const int warp = threadIdx.x % 128 / 32;
    if (warp == 0) return;  // the producer's warp takes no part in the hand-over
    const int writer = threadIdx.x % 128 - 32;
    Mailbox::serve(&mailbox, [&](const SendMailbox& m) {
      unsigned char* o = out + static_cast<long long>(m.m_abs) * kOutBytes;
      for (int i = writer; i < m.rows * kRowBytes / 16; i += kWriterWarps * 32)
        reinterpret_cast<uint4*>(o)[i] = reinterpret_cast<const uint4*>(tile)[i];
      for (int r = writer; r < m.rows; r += kWriterWarps * 32) reinterpret_cast<float*>(o + kTileBytes)[r] = scales[r];
    });
    return;
  }
  const int tid = threadIdx.x, lane = tid % 32, u = tid % 128;
  const int row = warpgroup * 64 + (u / 32) * 16 + lane / 4;  // and row + 8, as the GEMMs' epilogues
  uint32_t phase = 0;
  for (int t = 0; t < tiles; ++t) {
    const int key = blockIdx.x * tiles + t;
    if (t > 0) Mailbox::drain();
    uint32_t words = 0;  // S: the words read from the other warpgroup
    if constexpr (kExchange) {
      uint32_t* xchg = reinterpret_cast<uint32_t*>(tile);
      if (warpgroup == 1) {
        for (int i = 0; i < 32; ++i) xchg[i * 128 + u] = key * 4096u + u * 32u + i;
        if constexpr (kProtocol == 4) named_barrier_sync_across_roles<5, 256>();
        if constexpr (kProtocol == 5) named_barrier_arrive<5, 256>();
        if constexpr (kProtocol == 6) mbarrier_arrive(&written);
      } else {
        if constexpr (kProtocol == 4 || kProtocol == 5) named_barrier_sync_across_roles<5, 256>();
        if constexpr (kProtocol == 6) mbarrier_wait(&written, phase);
        for (int i = 0; i < 32; ++i) words += xchg[i * 128 + u];
        if constexpr (kProtocol == 6) {
          mbarrier_arrive(&read);
          mbarrier_wait(&read, phase);
        } else {
          named_barrier_sync_across_roles<6, 128>();
        }
      }
      phase ^= 1;
    }
    if constexpr (kProtocol == 2) {
      if (warpgroup == 0) named_barrier_sync_across_roles<6, 128>();
    }
    if constexpr (kProtocol == 3) named_barrier_sync_across_roles<5, 256>();
    if (row < kRows) {
      for (int dr = 0; dr < 16; dr += 8) {
        const int r = row + dr;
        for (int c = lane % 4; c < kRowBytes / 2; c += 4)
          reinterpret_cast<uint16_t*>(tile + r * kRowBytes)[c] = static_cast<uint16_t>(key * 7u + r * 64u + c + words);
        if (lane % 4 == 0) scales[r] = static_cast<float>(key * 128 + r);
      }
    }
    Mailbox::hand_over(&mailbox, SmemTile{reinterpret_cast<const bf16_t*>(tile), kRowBytes / 2, kRows, 64}, key, 0,
                       tid);
    if constexpr (kProtocol == 7) {
      if (warpgroup == 0) named_barrier_sync_across_roles<5, 128>();
      else named_barrier_sync_across_roles<6, 128>();
    }
  }
  Mailbox::shutdown(&mailbox, tiles > 0, tid);
}
