// Direct-store dispatch (docs/design.md: "Layouts", "Signalling and epochs"): every token row crosses to a destination
// rank at most once, however many of that rank's experts it routes to; the destination
// expands it into the expert-contiguous rows of the dispatch order (local expert, source
// rank, token, slot). Counts are exchanged on the device, through every rank's count table.
//
//   route   (1 block)  per-(t, j) rank inside its expert's rows from this source, per-token
//                      position inside each destination's token region, this rank's counts;
//                      the count row goes to every rank's table, then a release
//   layout  (1 block)  waits for every rank's count row; the verdict (a rank's rejected
//                      input, a bad expert id, a receive overflow) into the call status;
//                      expert_offsets and per-source bases, all zero when stopped
//   send               token rows + their routing into the destinations' token regions
//   expand             waits for the tokens; rows into expert order, with src_info
//   release            the dispatch buffers may take the next call's rows
//
// No host looks between the kernels: the verdict is the same on every rank because it is
// computed from the same count rows, and every later kernel reads it from the call status.
// The epoch is this rank's own dispatch_ready count, advanced by release on the device.
#include "comm/dispatch_config.cuh"
#include "common/errors.cuh"
#include "common/ptx.cuh"
#include "common/src_info.cuh"

using namespace epserve;

namespace {

constexpr int kRouteThreads = 1024;
constexpr int kRouteWarps = kRouteThreads / 32;
constexpr int kChunk = 32;  // tokens per warp-chunk in route

constexpr int kLayoutThreads = EPSERVE_MAX_LOCAL_EXPERTS;

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

}  // namespace

// Dynamic shared memory: kRouteWarps * (E + W) ints of per-warp counters, then E + W totals.
extern "C" __global__ void __launch_bounds__(kRouteThreads, 1)
    epserve_dispatch_route(const int* __restrict__ topk_idx, int T, int input_error, const DispatchConfig cfg,
                           int* __restrict__ tok_pos, int* __restrict__ slot_rank, int* __restrict__ chunk_counts) {
  extern __shared__ int smem[];
  __shared__ int bad_id;
  const int E = cfg.num_experts, W = cfg.world, k = cfg.top_k, e_loc = E / W;
  const int width = E + W;  // counters: one per global expert, then one per destination (tokens)
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  int* mine = smem + warp * width;
  int* totals = smem + kRouteWarps * width;
  const int chunks = (T + kChunk - 1) / kChunk;
  if (threadIdx.x == 0) bad_id = 0x7fffffff;

  // 1. counts per chunk of 32 tokens (order does not matter yet)
  for (int c = warp; c < chunks; c += kRouteWarps) {
    for (int i = lane; i < width; i += 32) mine[i] = 0;
    __syncwarp();
    const int t = c * kChunk + lane;
    if (t < T) {
      unsigned dests = 0;
      for (int j = 0; j < k; ++j) {
        const int e = topk_idx[t * k + j];
        if (e < -1 || e >= E) {
          atomicMin(&bad_id, t * k + j);
          continue;
        }
        if (e < 0) continue;
        atomicAdd(&mine[e], 1);
        dests |= 1u << (e / e_loc);
      }
      for (int d = 0; d < W; ++d)
        if (dests >> d & 1) atomicAdd(&mine[E + d], 1);
    }
    __syncwarp();
    for (int i = lane; i < width; i += 32) chunk_counts[c * width + i] = mine[i];
    __syncwarp();
  }
  __syncthreads();

  // 2. exclusive scan over chunks, one counter per thread: chunk_counts becomes chunk bases
  for (int i = threadIdx.x; i < width; i += kRouteThreads) {
    int run = 0;
    for (int c = 0; c < chunks; ++c) {
      const int v = chunk_counts[c * width + i];
      chunk_counts[c * width + i] = run;
      run += v;
    }
    totals[i] = run;
  }
  __syncthreads();

  // 3. in (token, slot) order: each slot's rank among its expert's rows from this source,
  //    each token's position among the tokens going to each destination
  for (int c = warp; c < chunks; c += kRouteWarps) {
    for (int i = lane; i < width; i += 32) mine[i] = chunk_counts[c * width + i];
    __syncwarp();
    for (int tt = 0; tt < kChunk; ++tt) {
      const int t = c * kChunk + tt;
      if (t >= T) break;
      const int e = lane < k ? topk_idx[t * k + lane] : -1;
      const bool valid = e >= 0 && e < E;
      const unsigned same = __match_any_sync(0xffffffffu, valid ? e : -1 - lane);
      int r = -1;
      if (valid) r = mine[e] + __popc(same & ((1u << lane) - 1));
      if (lane < k) slot_rank[t * k + lane] = r;
      const unsigned leader = __ffs(same) - 1;
      __syncwarp();
      if (valid && lane == static_cast<int>(leader)) mine[e] += __popc(same);
      for (int d = 0; d < W; ++d) {
        const unsigned to_d = __ballot_sync(0xffffffffu, valid && e / e_loc == d);
        if (lane == 0) tok_pos[t * W + d] = to_d ? mine[E + d]++ : -1;
      }
      __syncwarp();
    }
  }
  __syncthreads();

  // 4. this rank's count row into every rank's table: [E + W counts, error code]
  __shared__ int ok[EPSERVE_MAX_PEERS];
  const int error_code = input_error ? input_error : (bad_id != 0x7fffffff ? kDispatchBadExpert : 0);
  if (threadIdx.x < W) {
    const int d = threadIdx.x;
    const unsigned long long done = ld_acquire_sys(cfg.my_ready + cfg.rank);
    ok[d] = wait_at_least(cfg.my_ready + d, done, cfg.timeout_ns);
    if (!ok[d]) record_error(cfg.error, kDispatchReadyTimeout, d, static_cast<int>(done + 1));
  }
  if (threadIdx.x == 0 && error_code == kDispatchBadExpert) {
    const int at = bad_id;
    record_error(cfg.error, kDispatchBadExpert, at / k, topk_idx[at]);
  }
  __syncthreads();
  const int row = width + 1;
  for (int d = 0; d < W; ++d) {
    if (!ok[d]) continue;
    int* dst = cfg.count_table[d] + cfg.rank * row;
    for (int i = threadIdx.x; i < row; i += kRouteThreads) dst[i] = i < width ? (error_code ? 0 : totals[i]) : error_code;
  }
  fence_acq_rel_sys();
  __syncthreads();
  if (threadIdx.x < W && ok[threadIdx.x]) red_release_sys_add(cfg.count_arrive[threadIdx.x] + cfg.rank, 1ull);
}

// The verdict, from the W count rows every rank holds alike: the first rank that rejected
// its input, else the first that routed to a bad expert id, else the first that would
// receive more than max_recv_rows. A rank does not record its own input's failure here: its
// host raised it already, or route recorded the bad id with its token.
__device__ void dispatch_verdict(const DispatchConfig& cfg, const int* table, const int* rows_to, int* stopped) {
  const int E = cfg.num_experts, W = cfg.world, row = E + W + 1;
  int code = 0, who = -1, detail = 0;
  for (int s = 0; s < W && !code; ++s)
    if (ld_cg_s32(table + s * row + E + W) == EPSERVE_INPUT_REJECTED) code = kPeerRejectedInput, who = s;
  for (int s = 0; s < W && !code; ++s)
    if (ld_cg_s32(table + s * row + E + W)) code = kPeerBadExpert, who = s;
  for (int d = 0; d < W && !code; ++d)
    if (rows_to[d] > cfg.max_recv_rows) code = kRecvOverflow, who = d, detail = rows_to[d];
  if (code && (who != cfg.rank || code == kRecvOverflow)) record_error(cfg.error, code, who, detail);
  *stopped = code != 0;
  cfg.status[kCallFailed] = code != 0;
  cfg.status[kCallStopped] = code != 0;
}

extern "C" __global__ void __launch_bounds__(kLayoutThreads, 1)
    epserve_dispatch_layout(const DispatchConfig cfg, int* __restrict__ expert_offsets, int* __restrict__ base) {
  const int E = cfg.num_experts, W = cfg.world, e_loc = E / W, row = E + W + 1;
  __shared__ int arrived, total_rows, stopped;
  __shared__ int rows_to[EPSERVE_MAX_PEERS];
  __shared__ int warp_sums[kLayoutThreads / 32];
  if (threadIdx.x < EPSERVE_MAX_PEERS) rows_to[threadIdx.x] = 0;
  if (threadIdx.x == 0) {
    arrived = 1;
    const unsigned long long epoch = ld_acquire_sys(cfg.my_ready + cfg.rank) + 1;
    for (int s = 0; s < W && arrived; ++s) {
      arrived = wait_at_least(cfg.my_count_arrive + s, epoch, cfg.timeout_ns);
      if (!arrived) record_error(cfg.error, kDispatchCountTimeout, s, static_cast<int>(epoch));
    }
    if (!arrived) cfg.status[kCallFailed] = cfg.status[kCallStopped] = 1;
  }
  __syncthreads();
  if (!arrived) {  // nothing moves from or to here; GEMMs see no rows
    if (threadIdx.x <= e_loc) expert_offsets[threadIdx.x] = 0;
    return;
  }
  const int* table = cfg.count_table[cfg.rank];
  const int e = threadIdx.x, lane = threadIdx.x & 31;  // local expert e of every rank
  const bool expert = e < e_loc;
  // Rows every rank receives: thread e adds expert e of each destination over the sources.
#pragma unroll
  for (int d = 0; d < EPSERVE_MAX_PEERS; ++d) {
    if (d >= W) break;
    int rows = 0;
    for (int s = 0; expert && s < W; ++s) rows += ld_cg_s32(table + s * row + d * e_loc + e);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) rows += __shfl_down_sync(0xffffffffu, rows, o);
    if (lane == 0 && rows) atomicAdd(&rows_to[d], rows);
  }
  // This rank's layout: expert e's rows from source 0, then from source 1, ...
  int from[EPSERVE_MAX_PEERS];
  int mine = 0;
#pragma unroll
  for (int s = 0; s < EPSERVE_MAX_PEERS; ++s) {
    from[s] = expert && s < W ? ld_cg_s32(table + s * row + cfg.rank * e_loc + e) : 0;
    mine += from[s];
  }
  int run = block_exclusive_scan(mine, warp_sums, &total_rows);  // its barriers also order rows_to
  if (threadIdx.x == 0) dispatch_verdict(cfg, table, rows_to, &stopped);
  __syncthreads();
  if (stopped) {
    if (threadIdx.x <= e_loc) expert_offsets[threadIdx.x] = 0;
    return;
  }
  if (expert) {
    expert_offsets[e] = run;
#pragma unroll
    for (int s = 0; s < EPSERVE_MAX_PEERS; ++s) {
      if (s >= W) break;
      base[s * e_loc + e] = run;
      run += from[s];
    }
  }
  if (e == 0) expert_offsets[e_loc] = total_rows;
}

// One warp per token: its row to every destination that owns one of its experts, once.
extern "C" __global__ void epserve_dispatch_send(const bf16_t* __restrict__ x, int T, const int* __restrict__ topk_idx,
                                                 const int* __restrict__ tok_pos, const int* __restrict__ slot_rank,
                                                 const DispatchConfig cfg) {
  __shared__ unsigned sent[EPSERVE_MAX_PEERS];
  const int W = cfg.world, k = cfg.top_k, H = cfg.hidden, e_loc = cfg.num_experts / W, meta_len = 1 + 2 * k;
  const int lane = threadIdx.x & 31, warps = blockDim.x >> 5;
  if (call_stopped(cfg.status)) return;
  if (threadIdx.x < EPSERVE_MAX_PEERS) sent[threadIdx.x] = 0;
  __syncthreads();
  for (int t = blockIdx.x * warps + (threadIdx.x >> 5); t < T; t += gridDim.x * warps) {
    const uint4* src = reinterpret_cast<const uint4*>(x + static_cast<long long>(t) * H);
    for (int d = 0; d < W; ++d) {
      const int pos = tok_pos[t * W + d];
      if (pos < 0) continue;
      const long long slot = static_cast<long long>(cfg.rank) * cfg.max_tokens + pos;
      uint4* dst = reinterpret_cast<uint4*>(cfg.tokens[d] + slot * H);
      for (int c = lane; c < H / 8; c += 32) st_v4(dst + c, src[c]);
      int* meta = cfg.meta[d] + slot * meta_len;
      if (lane == 0) meta[0] = t;
      if (lane < k) {
        const int e = topk_idx[t * k + lane];
        const bool here = e >= 0 && e / e_loc == d;
        meta[1 + lane] = here ? e - d * e_loc : -1;
        meta[1 + k + lane] = here ? slot_rank[t * k + lane] : -1;
      }
      if (lane == 0) atomicAdd(&sent[d], 1u);
    }
  }
  fence_acq_rel_sys();
  __syncthreads();
  if (threadIdx.x < W && sent[threadIdx.x])
    red_release_sys_add(cfg.token_arrive[threadIdx.x] + cfg.rank, sent[threadIdx.x]);
}

// One warp per arrived token row: copied into every expert row it feeds, src_info beside it.
// Each warp waits only for the sender of the row in hand (per-sender arrival counters), so
// rows from a sender that is done, this rank's own first, expand while others still arrive.
// A wait that runs out stops this rank's call: expert_offsets go to zero, so the GEMMs see
// no rows, and the output is poisoned.
extern "C" __global__ void epserve_dispatch_expand(const DispatchConfig cfg, const int* __restrict__ base,
                                                   bf16_t* __restrict__ a, int* __restrict__ src_info,
                                                   int* __restrict__ expert_offsets) {
  const int E = cfg.num_experts, W = cfg.world, k = cfg.top_k, H = cfg.hidden, e_loc = E / W, row = E + W + 1;
  const int meta_len = 1 + 2 * k;
  __shared__ int first[EPSERVE_MAX_PEERS + 1];  // prefix of token rows per source, own rank first
  __shared__ int order[EPSERVE_MAX_PEERS];      // sources in the order rows are taken
  __shared__ int failed;
  if (call_stopped(cfg.status)) return;
  if (threadIdx.x == 0) {
    const int* table = cfg.count_table[cfg.rank];
    failed = 0;
    first[0] = 0;
    for (int n = 0; n < W; ++n) {
      const int s = (cfg.rank + n) % W;
      order[n] = s;
      first[n + 1] = first[n] + ld_cg_s32(table + s * row + E + cfg.rank);
    }
  }
  __syncthreads();
  const int lane = threadIdx.x & 31, warps = blockDim.x >> 5;
  int have = -1;  // the source whose rows this warp has seen arrive
  for (int i = blockIdx.x * warps + (threadIdx.x >> 5); i < first[W]; i += gridDim.x * warps) {
    int n = 0;
    while (i >= first[n + 1]) ++n;
    const int s = order[n];
    if (s != have) {
      int ok = 1;
      if (lane == 0) {
        const unsigned long long target = cfg.expected_tokens[s] + (first[n + 1] - first[n]);
        ok = !*(volatile int*)&failed && wait_at_least(cfg.my_token_arrive + s, target, cfg.timeout_ns);
        if (!ok && atomicExch(&failed, 1) == 0) {
          record_error(cfg.error, kDispatchTokenTimeout, s,
                       static_cast<int>(ld_acquire_sys(cfg.my_ready + cfg.rank) + 1));
          mark_call_failed(cfg.status);
          for (int x = 0; x <= e_loc; ++x) expert_offsets[x] = 0;
        }
      }
      ok = __shfl_sync(0xffffffffu, ok, 0);
      if (!ok) return;
      have = s;
    }
    const long long slot = static_cast<long long>(s) * cfg.max_tokens + (i - first[n]);
    const int* meta = cfg.meta[cfg.rank] + slot * meta_len;
    const int t = ld_cg_s32(meta);
    const uint4* src = reinterpret_cast<const uint4*>(cfg.tokens[cfg.rank] + slot * H);
    for (int j = 0; j < k; ++j) {
      const int e = ld_cg_s32(meta + 1 + j);
      if (e < 0) continue;
      const int m = base[s * e_loc + e] + ld_cg_s32(meta + 1 + k + j);
      uint4* dst = reinterpret_cast<uint4*>(a + static_cast<long long>(m) * H);
      for (int c = lane; c < H / 8; c += 32) dst[c] = ld_cg_v4(src + c);
      if (lane == 0) src_info[m] = (s << 24) | (t << 4) | j;
    }
  }
}

// Last kernel of every dispatch, stopped or not: the token regions and the count table may
// take the next call, and this rank's epoch (ready[rank]) moves on. The expected token
// count moves only when rows were sent, that is, unless the verdict stopped the call.
extern "C" __global__ void epserve_dispatch_release(const DispatchConfig cfg) {
  const int W = cfg.world, row = cfg.num_experts + W + 1;
  if (threadIdx.x < W) {
    const int s = threadIdx.x;
    if (!call_stopped(cfg.status))
      cfg.expected_tokens[s] += ld_cg_s32(cfg.count_table[cfg.rank] + s * row + cfg.num_experts + cfg.rank);
    red_release_sys_add(cfg.ready[s] + cfg.rank, 1ull);
  }
}
