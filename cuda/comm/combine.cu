// The combine's receive side (docs/design.md: "Layouts", "Signalling and epochs").
//   epserve_combine_arm      : adds this call's expected 64-column units to `expected`
//   epserve_combine_reduce   : waits (bounded) until every expected unit has arrived, then
//                              out[t] = bf16(sum_j w[t,j] * recv[t,j,:]), fp32, j ascending;
//                              its last block to finish releases recv to the peers
//   epserve_release_recv     : the release alone (a rank that takes part in a call with no tokens)
#include "common/bf16.cuh"
#include "common/errors.cuh"
#include "comm/peer_counters.cuh"
#include "sinks/peer_send_config.cuh"

using namespace epserve;

// expected[s] += units of this call's slots whose expert rank s owns. One CTA of
// kCombineArmThreads (so `expected` needs no atomics), each thread loading four ids at once
// where topk_idx is 16-byte aligned: the slots are read in a few round trips, not one per 256
// slots (a 256-thread loop took 64 us at 32768 slots on an H200). Each thread counts the first
// EPSERVE_MAX_PEERS ranks in registers and adds once per rank (one shared counter hit by
// every slot would serialize); the slots of ranks past them (more than one node) go to the
// shared counters directly. A call the dispatch verdict stopped (status) sends nothing, so
// nothing is expected.
constexpr int kCombineArmThreads = 1024;

__device__ __forceinline__ void count_slot_source(int e, int experts_per_rank, unsigned int (&mine)[EPSERVE_MAX_PEERS],
                                                  unsigned int* per_source) {
  if (e < 0) return;
  const int s = e / experts_per_rank;
#pragma unroll
  for (int d = 0; d < EPSERVE_MAX_PEERS; ++d) mine[d] += s == d;
  if (s >= EPSERVE_MAX_PEERS) atomicAdd(&per_source[s], 1u);
}

extern "C" __global__ void __launch_bounds__(kCombineArmThreads)
    epserve_combine_arm(const int* __restrict__ topk_idx, int T, int k, int experts_per_rank, int world,
                        int units_per_slot, unsigned long long* expected, const int* status) {
  if (call_stopped(status)) return;
  __shared__ unsigned int per_source[EPSERVE_MAX_WORLD];
  for (int d = threadIdx.x; d < world; d += blockDim.x) per_source[d] = 0;
  __syncthreads();
  unsigned int mine[EPSERVE_MAX_PEERS] = {};
  const int slots = T * k;
  int first_scalar = 0;  // slots from here on are read one at a time
  if ((reinterpret_cast<unsigned long long>(topk_idx) & 15) == 0) {
    const int4* quads = reinterpret_cast<const int4*>(topk_idx);
    const int n = slots / 4;
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
      const int4 q = __ldg(quads + i);
      count_slot_source(q.x, experts_per_rank, mine, per_source);
      count_slot_source(q.y, experts_per_rank, mine, per_source);
      count_slot_source(q.z, experts_per_rank, mine, per_source);
      count_slot_source(q.w, experts_per_rank, mine, per_source);
    }
    first_scalar = n * 4;
  }
  for (int i = first_scalar + threadIdx.x; i < slots; i += blockDim.x)
    count_slot_source(topk_idx[i], experts_per_rank, mine, per_source);
#pragma unroll
  for (int d = 0; d < EPSERVE_MAX_PEERS; ++d)
    if (d < world && mine[d]) atomicAdd(&per_source[d], mine[d]);
  __syncthreads();
  for (int d = threadIdx.x; d < world; d += blockDim.x)
    expected[d] += static_cast<unsigned long long>(per_source[d]) * units_per_slot;
}

// The last block of the reduction to finish tells every peer that recv has been read, so no
// separate release launch follows it. blocks_done counts the blocks and is reset by that last
// block, so launches and graph replays need no memset. Every block's reads of recv happen
// before its fenced increment, and the release comes after the last increment.
__device__ __forceinline__ void release_when_last(unsigned int* blocks_done, const PeerCounters& peers, int rank) {
  __syncthreads();
  if (threadIdx.x != 0) return;
  __threadfence();
  if (atomicAdd(blocks_done, 1u) != gridDim.x - 1) return;
  *blocks_done = 0;
  __threadfence();
  for (int p = 0; p < peers.ranks_per_node; ++p) red_release_sys_add(peers.ready[p] + rank, 1ull);
}

// A failed call's output is NaN: never a plausible-looking result (docs/design.md, "Error semantics").
__device__ __forceinline__ void poison_tokens(bf16_t* out, int T, int H) {
  const uint4 nan = make_uint4(0x7fc07fc0u, 0x7fc07fc0u, 0x7fc07fc0u, 0x7fc07fc0u);
  for (int t = blockIdx.x; t < T; t += gridDim.x)
    for (int c = threadIdx.x * 8; c < H; c += blockDim.x * 8)
      *reinterpret_cast<uint4*>(out + static_cast<long long>(t) * H + c) = nan;
}

constexpr int kMaxTopK = 16;  // MoEConfig's bound on top_k (src_info keeps j in 4 bits)

// One block per token at a time, as many blocks as fit the GPU at once (the launcher's grid;
// a larger one runs a second, partial round of blocks); each thread owns 8 consecutive
// columns (16 bytes). A thread loads all of its chunk's k slot rows before it adds any (up
// to kSlots 16-byte loads in flight, not one): the reduction reads k rows per output row,
// and with one load in flight a thread waited out each one's latency in turn. The sum is
// unchanged: used slots only, j ascending, fp32, rounded once. kSlots (>= k) sizes the
// loads' registers: the k <= 8 entry point has half of kMaxTopK's, so more blocks fit an SM
// and more bytes are in flight (the reduction streams recv from HBM). A call with k above
// kSlots (the launcher never makes one) poisons its output rather than drop slots.
// wait = 0 when the rows came by stream-ordered copies (NCCL) and no counter is involved.
// arrive and expected are this rank's per-sender arrays [world]. status (or null) is the
// call status: a call that failed earlier, or whose wait here runs out, poisons out.
template <int kSlots>
__device__ __forceinline__ void combine_reduce(const bf16_t* __restrict__ recv, const int* __restrict__ topk_idx,
                                               const float* __restrict__ topk_weights, bf16_t* __restrict__ out, int T,
                                               int k, int H, int world, const unsigned long long* arrive,
                                               const unsigned long long* expected, int* error,
                                               unsigned long long timeout_ns, int wait, int* status,
                                               const PeerCounters& peers, int rank, unsigned int* blocks_done) {
  __shared__ int ok;
  if (threadIdx.x == 0) {
    ok = !call_failed(status) && k <= kSlots;
    for (int s = 0; ok && wait && s < world; ++s) {
      const unsigned long long target = expected[s];
      if (!wait_at_least(arrive + s, target, timeout_ns)) {
        // detail: how many units from s are missing (clamped), so the message says how far it got
        const unsigned long long missing = target - ld_acquire_sys(arrive + s);
        record_error(error, kCombineWaitTimeout, s, missing > 0x7fffffffull ? 0x7fffffff : static_cast<int>(missing));
        mark_call_failed(status);
        ok = 0;
        break;
      }
    }
  }
  __syncthreads();
  if (!ok) {
    poison_tokens(out, T, H);
    release_when_last(blocks_done, peers, rank);
    return;
  }
  for (int t = blockIdx.x; t < T; t += gridDim.x) {
    // The token's used slots (a bit each) and their weights, read once for all its chunks.
    unsigned used = 0;
    float w[kSlots];
#pragma unroll
    for (int j = 0; j < kSlots; ++j) {
      w[j] = 0.f;
      if (j < k && topk_idx[t * k + j] >= 0) {
        used |= 1u << j;
        w[j] = topk_weights[t * k + j];
      }
    }
    const bf16_t* rows = recv + static_cast<long long>(t) * k * H;
    for (int c = threadIdx.x * 8; c < H; c += blockDim.x * 8) {
      uint4 v[kSlots];
#pragma unroll
      for (int j = 0; j < kSlots; ++j)
        if (used & (1u << j)) v[j] = ld_cg_v4(rows + static_cast<long long>(j) * H + c);
      float acc[8];
#pragma unroll
      for (int i = 0; i < 8; ++i) acc[i] = 0.f;
#pragma unroll
      for (int j = 0; j < kSlots; ++j) {
        if (!(used & (1u << j))) continue;
        const uint32_t p[4] = {v[j].x, v[j].y, v[j].z, v[j].w};
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          acc[2 * i] = __fadd_rn(acc[2 * i], __fmul_rn(w[j], bf16_lo(p[i])));
          acc[2 * i + 1] = __fadd_rn(acc[2 * i + 1], __fmul_rn(w[j], bf16_hi(p[i])));
        }
      }
      uint4 o;
      o.x = pack_bf16x2(acc[0], acc[1]);
      o.y = pack_bf16x2(acc[2], acc[3]);
      o.z = pack_bf16x2(acc[4], acc[5]);
      o.w = pack_bf16x2(acc[6], acc[7]);
      *reinterpret_cast<uint4*>(out + static_cast<long long>(t) * H + c) = o;
    }
  }
  release_when_last(blocks_done, peers, rank);
}

#define EPSERVE_COMBINE_REDUCE_PARAMS                                                                          \
  const bf16_t *__restrict__ recv, const int *__restrict__ topk_idx, const float *__restrict__ topk_weights,   \
      bf16_t *__restrict__ out, int T, int k, int H, int world, const unsigned long long *arrive,              \
      const unsigned long long *expected, int *error, unsigned long long timeout_ns, int wait, int *status,    \
      const PeerCounters peers, int rank, unsigned int *blocks_done
#define EPSERVE_COMBINE_REDUCE_ARGS                                                                 \
  recv, topk_idx, topk_weights, out, T, k, H, world, arrive, expected, error, timeout_ns, wait, status, \
      peers, rank, blocks_done

// Any top_k; and top_k <= 8 (a call with more poisons its output: the launcher picks by k).
extern "C" __global__ void epserve_combine_reduce(EPSERVE_COMBINE_REDUCE_PARAMS) {
  combine_reduce<kMaxTopK>(EPSERVE_COMBINE_REDUCE_ARGS);
}
extern "C" __global__ void epserve_combine_reduce_k8(EPSERVE_COMBINE_REDUCE_PARAMS) {
  combine_reduce<8>(EPSERVE_COMBINE_REDUCE_ARGS);
}

// recv may now be overwritten by the next combine: the peers' stores for it wait on this.
extern "C" __global__ void epserve_release_recv(const PeerCounters peers, int rank) {
  const int p = threadIdx.x;
  if (p < peers.ranks_per_node) red_release_sys_add(peers.ready[p] + rank, 1ull);
}
