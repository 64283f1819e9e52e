// Direct-store dispatch (docs/design.md: "Layouts", "Signalling and epochs"): every token row crosses to a destination
// rank at most once, however many of that rank's experts it routes to; the destination
// expands it into the expert-contiguous rows of the dispatch order (local expert, source
// rank, token, slot). Counts are exchanged on the device, through every rank's count table.
//
//   route   count (many CTAs, a warp per 32-token chunk), publish (1 CTA: a scan over the
//           chunks, a thread per counter; the count row goes to every rank's table, then a
//           release), rank (many CTAs: per-(t, j) rank inside its expert's rows from this
//           source, per-token position inside each destination's token region)
//   layout  (1 block)  waits for every rank's count row; the verdict (a rank's rejected
//                      input, a bad expert id, a receive overflow) into the call status;
//                      expert_offsets and per-source bases, all zero when stopped
//   move               one launch: send blocks put token rows + their routing into the other
//                      ranks' token regions, counting arrivals per chunk of 32 rows there,
//                      while expand blocks copy this rank's own rows from x into expert
//                      order, then each other source's rows as their chunks arrive, with
//                      src_info; each row is read once and stored to all its expert rows
//   release            the promised rows per chunk move on; the dispatch buffers may take
//                      the next call's rows (the move kernel's last block, by default)
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

constexpr int kRouteThreads = 256;  // route parts 1 and 3: a warp per chunk, many CTAs
constexpr int kRouteWarps = kRouteThreads / 32;
constexpr int kPublishThreads = 1024;  // route part 2: a thread per counter
constexpr int kChunk = 32;             // tokens per warp-chunk in route
constexpr int kMoveThreads = 256;      // send and expand: a warp per token row
constexpr int kMaxTopK = 16;           // MoEConfig's limit (src_info packs the slot in 4 bits)

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
  for (; c < n16; c += 32) st_v4(dst + c, ld_cg_v4(src + c));
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
  for (; b < n16; b += 32) {
    const bool in = b + lane < n16;
    uint4 v = make_uint4(0, 0, 0, 0);
    if (in) v = ld_cg_v4(src + b + lane);
    for (unsigned m = lanes; m; m &= m - 1) {
      uint4* dst = reinterpret_cast<uint4*>(
          __shfl_sync(0xffffffffu, reinterpret_cast<unsigned long long>(my_dst), __ffs(m) - 1));
      if (in) st_v4(dst + b + lane, v);
    }
  }
}

}  // namespace

// route, part 1, over many CTAs: each warp counts one chunk of 32 tokens (rows per global
// expert, tokens per destination) into chunk_counts; a bad expert id's slot goes to *bad_slot
// (the lowest wins). Dynamic shared memory: kRouteWarps * (E + W) ints.
extern "C" __global__ void __launch_bounds__(kRouteThreads)
    epserve_dispatch_route_count(const int* __restrict__ topk_idx, int T, const DispatchConfig cfg,
                                 int* __restrict__ chunk_counts, int* __restrict__ bad_slot) {
  extern __shared__ int smem[];
  const int E = cfg.num_experts, W = cfg.world, k = cfg.top_k, e_loc = E / W, width = E + W;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  int* mine = smem + warp * width;
  const int chunks = (T + kChunk - 1) / kChunk;
  for (int c = blockIdx.x * kRouteWarps + warp; c < chunks; c += gridDim.x * kRouteWarps) {
    for (int i = lane; i < width; i += 32) mine[i] = 0;
    __syncwarp();
    const int t = c * kChunk + lane;
    if (t < T) {
      unsigned dests = 0;
      for (int j = 0; j < k; ++j) {
        const int e = topk_idx[t * k + j];
        if (e < -1 || e >= E) {
          atomicMin(bad_slot, t * k + j);
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
}

// route, part 2's scan, shared by both transports (one CTA): an exclusive scan over the
// chunks, one counter per thread, turns chunk_counts into chunk bases and leaves the totals
// (this rank's count row) in totals; thread 0 takes route's lowest bad slot into *bad, resets
// *bad_slot for the next call and records a bad expert id of this rank's own routing.
__device__ void route_totals(const int* __restrict__ topk_idx, int T, int input_error, const DispatchConfig& cfg,
                             int* __restrict__ chunk_counts, int* __restrict__ bad_slot, int* totals, int* bad) {
  const int E = cfg.num_experts, W = cfg.world, k = cfg.top_k, width = E + W;
  const int chunks = (T + kChunk - 1) / kChunk;
  // The chunks split into `parts` runs, a thread per (counter, run), so the block's threads
  // all load at once: each run's sum, then each run rewritten from the sum of the runs
  // before it. partial[p * width + i]: run p's sum of counter i.
  __shared__ int partial[kPublishThreads > EPSERVE_MAX_EXPERTS + EPSERVE_MAX_PEERS ? kPublishThreads
                                                                                  : EPSERVE_MAX_EXPERTS + EPSERVE_MAX_PEERS];
  const int parts = max(1, static_cast<int>(blockDim.x) / width), per = (chunks + parts - 1) / parts;
  for (int x = threadIdx.x; x < parts * width; x += blockDim.x) {
    const int p = x / width, i = x - p * width, end = min(chunks, (p + 1) * per);
    int sum = 0;
#pragma unroll 8
    for (int c = p * per; c < end; ++c) sum += chunk_counts[c * width + i];
    partial[x] = sum;
  }
  __syncthreads();
  for (int x = threadIdx.x; x < parts * width; x += blockDim.x) {
    const int p = x / width, i = x - p * width, end = min(chunks, (p + 1) * per);
    int run = 0;
    for (int q = 0; q < p; ++q) run += partial[q * width + i];
#pragma unroll 8
    for (int c = p * per; c < end; ++c) {
      const int v = chunk_counts[c * width + i];
      chunk_counts[c * width + i] = run;
      run += v;
    }
    if (p == parts - 1) totals[i] = run;
  }
  if (threadIdx.x == 0) {
    *bad = *bad_slot;
    *bad_slot = 0x7fffffff;
    if (!input_error && *bad != 0x7fffffff) record_error(cfg.error, kDispatchBadExpert, *bad / k, topk_idx[*bad]);
  }
}

// route, part 2, one CTA: an exclusive scan over the chunks, one counter per thread, turns
// chunk_counts into chunk bases; the totals are this rank's count row, which goes to every
// rank's table at once (part 3 is needed only by the send, so the peers' layouts need not
// wait for it). Resets *bad_slot for the next call.
extern "C" __global__ void __launch_bounds__(kPublishThreads, 1)
    epserve_dispatch_route_publish(const int* __restrict__ topk_idx, int T, int input_error, const DispatchConfig cfg,
                                   int* __restrict__ chunk_counts, int* __restrict__ bad_slot) {
  __shared__ int totals[EPSERVE_MAX_EXPERTS + EPSERVE_MAX_PEERS];
  __shared__ int ok[EPSERVE_MAX_PEERS];
  __shared__ int bad;
  const int E = cfg.num_experts, W = cfg.world, width = E + W;
  route_totals(topk_idx, T, input_error, cfg, chunk_counts, bad_slot, totals, &bad);
  if (threadIdx.x < W) {
    const int d = threadIdx.x;
    const unsigned long long done = ld_acquire_sys(cfg.my_ready + cfg.rank);
    ok[d] = wait_at_least(cfg.my_ready + d, done, cfg.timeout_ns);
    if (!ok[d]) record_error(cfg.error, kDispatchReadyTimeout, d, static_cast<int>(done + 1));
  }
  __syncthreads();
  const int error_code = input_error ? input_error : (bad != 0x7fffffff ? kDispatchBadExpert : 0);
  const int row = width + 1;
  for (int d = 0; d < W; ++d) {
    if (!ok[d]) continue;
    int* dst = cfg.count_table[d] + cfg.rank * row;
    for (int i = threadIdx.x; i < row; i += kPublishThreads)
      dst[i] = i < width ? (error_code ? 0 : totals[i]) : error_code;
  }
  fence_acq_rel_sys();
  __syncthreads();
  if (threadIdx.x < W && ok[threadIdx.x]) red_release_sys_add(cfg.count_arrive[threadIdx.x] + cfg.rank, 1ull);
}

// route, part 3, over many CTAs: in (token, slot) order within each chunk, from its base,
// each slot's rank among its expert's rows from this source, and each token's position among
// the tokens going to each destination. A warp per chunk, a lane per token: a slot's rank is
// its expert's base plus the chunk's earlier tokens that chose that expert, a popcount of a
// per-expert mask of lanes (the warp's shared memory, every lane setting its experts' bits),
// and a token's position the same over a ballot per destination; a chunk where some token
// names an expert twice takes the token-by-token path instead, with the bases in the same
// shared memory. Dynamic shared memory as part 1; the masks are zero between chunks.
extern "C" __global__ void __launch_bounds__(kRouteThreads)
    epserve_dispatch_route_rank(const int* __restrict__ topk_idx, int T, const DispatchConfig cfg,
                                const int* __restrict__ chunk_bases, int* __restrict__ tok_pos,
                                int* __restrict__ slot_rank) {
  extern __shared__ int smem[];
  // The chunk's expert ids, loaded at once (one round trip, not one per token); an id
  // outside [-1, E) becomes -2 (route stopped the call; it must only stay in bounds here).
  __shared__ short ids[kRouteWarps][kChunk * kMaxTopK];
  const int E = cfg.num_experts, W = cfg.world, k = cfg.top_k, e_loc = E / W, width = E + W;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const unsigned before = (1u << lane) - 1;  // the lanes of the chunk's earlier tokens
  int* mine = smem + warp * width;           // the token-by-token path's running bases
  unsigned* masks = reinterpret_cast<unsigned*>(mine);  // per expert: the lanes whose token chose it
  short* chunk_ids = ids[warp];
  for (int i = lane; i < E; i += 32) masks[i] = 0;  // each use clears what it set
  const int chunks = (T + kChunk - 1) / kChunk;
  for (int c = blockIdx.x * kRouteWarps + warp; c < chunks; c += gridDim.x * kRouteWarps) {
    const int* bases = chunk_bases + c * width;
    const int n = min(kChunk, T - c * kChunk) * k;
    for (int i = lane; i < n; i += 32) {
      const int e = topk_idx[c * kChunk * k + i];
      chunk_ids[i] = static_cast<short>(e < -1 || e >= E ? -2 : e);
    }
    __syncwarp();
    const int t = c * kChunk + lane;
    const bool live = t < T;
    const short* row = chunk_ids + lane * k;
    bool twice = false;  // this token names an expert twice
    for (int j = 1; live && j < k; ++j)
      for (int q = 0; q < j; ++q) twice |= row[j] >= 0 && row[q] == row[j];
    if (!__any_sync(0xffffffffu, twice)) {
      unsigned dests = 0;
      for (int j = 0; live && j < k; ++j) {
        const int e = row[j];
        if (e < 0) continue;
        atomicOr(&masks[e], 1u << lane);
        dests |= 1u << (e / e_loc);
      }
      __syncwarp();
      for (int j = 0; live && j < k; ++j) {
        const int e = row[j];
        slot_rank[t * k + j] = e >= 0 ? bases[e] + __popc(masks[e] & before) : -1;
      }
      for (int d = 0; d < W; ++d) {
        const unsigned to_d = __ballot_sync(0xffffffffu, dests >> d & 1);
        if (live) tok_pos[t * W + d] = dests >> d & 1 ? bases[E + d] + __popc(to_d & before) : -1;
      }
      __syncwarp();
      for (int j = 0; live && j < k; ++j)
        if (row[j] >= 0) masks[row[j]] = 0;
      __syncwarp();
      continue;
    }
    for (int i = lane; i < width; i += 32) mine[i] = bases[i];
    __syncwarp();
    for (int tt = 0; tt < kChunk; ++tt) {  // token by token: the slots of one expert in slot order
      const int t = c * kChunk + tt;
      if (t >= T) break;
      const int e = lane < k ? chunk_ids[tt * k + lane] : -1;
      const bool valid = e >= 0;
      const unsigned same = __match_any_sync(0xffffffffu, valid ? e : -1 - lane);
      int r = -1;
      if (valid) r = mine[e] + __popc(same & before);
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
    for (int i = lane; i < E; i += 32) masks[i] = 0;
    __syncwarp();
  }
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

// Layout from the W count rows in `table` (both transports): expert_offsets, each source's
// base per local expert, and the verdict into the call status. Every thread of the block
// calls it; it returns true when the verdict stopped the call (expert_offsets are then zero).
__device__ bool layout_from_table(const DispatchConfig& cfg, const int* table, int* __restrict__ expert_offsets,
                                  int* __restrict__ base) {
  const int E = cfg.num_experts, W = cfg.world, e_loc = E / W, row = E + W + 1;
  __shared__ int total_rows, stopped;
  __shared__ int rows_to[EPSERVE_MAX_PEERS];
  __shared__ int warp_sums[kLayoutThreads / 32];
  if (threadIdx.x < EPSERVE_MAX_PEERS) rows_to[threadIdx.x] = 0;
  __syncthreads();
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
    return true;
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
  return false;
}

extern "C" __global__ void __launch_bounds__(kLayoutThreads, 1)
    epserve_dispatch_layout(const DispatchConfig cfg, int* __restrict__ expert_offsets, int* __restrict__ base) {
  const int W = cfg.world, e_loc = cfg.num_experts / W;
  __shared__ int arrived;
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
  layout_from_table(cfg, cfg.count_table[cfg.rank], expert_offsets, base);
}

#ifdef EPSERVE_DISPATCH_STAMPS
// Instrumentation for launch/jobs/time_dispatch.py only (a module built with this define):
// per move block, the global timer at its start [0], when its warps were done with this
// rank's own rows [1] (expand blocks), and when its last warp ended [2].
constexpr int kStampBlocks = 2048;
__device__ unsigned long long epserve_move_stamps[kStampBlocks * 3];
__device__ __forceinline__ void move_stamp(int slot) {
  if ((threadIdx.x & 31) == 0 && blockIdx.x < kStampBlocks)
    atomicMax(&epserve_move_stamps[blockIdx.x * 3 + slot], globaltimer_ns());
}
#else
__device__ __forceinline__ void move_stamp(int) {}
#endif

// Token rows per arrival counter: a sender counts the rows it has put into a destination's
// token region per chunk of kArrivalChunk positions there (epserve/dispatch/direct.py
// ARRIVAL_CHUNK), so the destination expands each chunk as soon as it is whole.
constexpr int kArrivalChunk = 32;

// The rows chunk c of a region of n rows holds: kArrivalChunk, fewer in the last, else 0.
__device__ __forceinline__ int chunk_rows(int n, int c) {
  return max(0, min(kArrivalChunk, n - c * kArrivalChunk));
}

// One warp per token: its row to every other destination that owns one of its experts, once,
// its routing beside it. A destination's rows of this rank land in position order (tok_pos
// grows with the token), and the warps walk the tokens in waves of one token each, so the
// chunks of positions fill up roughly in order: each row adds 1 to its chunk's counter
// there, after a system-scope fence, and the destination expands a chunk when it is whole.
// This rank's own rows never go through a token region: expand reads them from x.
__device__ void send_tokens(const bf16_t* __restrict__ x, int T, const int* __restrict__ topk_idx,
                            const int* __restrict__ tok_pos, const int* __restrict__ slot_rank, const DispatchConfig& cfg,
                            unsigned long long* const* __restrict__ chunk_arrive, int max_chunks, int block, int grid) {
  const int W = cfg.world, k = cfg.top_k, H = cfg.hidden, e_loc = cfg.num_experts / W, meta_len = 1 + 2 * k;
  const int rank = cfg.rank, lane = threadIdx.x & 31, warps = blockDim.x >> 5;
  if (call_stopped(cfg.status)) return;
  for (int t = block * warps + (threadIdx.x >> 5); t < T; t += grid * warps) {
    const int pos = lane < W && lane != rank ? tok_pos[t * W + lane] : -1;  // lane d: the position at d
    const unsigned to = __ballot_sync(0xffffffffu, pos >= 0);
    if (!to) continue;
    const long long slot = static_cast<long long>(rank) * cfg.max_tokens + pos;
    uint4* dst = pos >= 0 ? reinterpret_cast<uint4*>(cfg.tokens[lane] + slot * H) : nullptr;
    copy_row_to_many(dst, to, reinterpret_cast<const uint4*>(x + static_cast<long long>(t) * H), H / 8, lane);
    const int e = lane < k ? topk_idx[t * k + lane] : -1;
    const int r = lane < k ? slot_rank[t * k + lane] : -1;
    for (unsigned m = to; m; m &= m - 1) {
      const int d = __ffs(m) - 1;
      const int p = __shfl_sync(0xffffffffu, pos, d);
      int* meta = cfg.meta[d] + (static_cast<long long>(rank) * cfg.max_tokens + p) * meta_len;
      if (lane == 0) meta[0] = t;
      if (lane < k) {
        const bool here = e >= 0 && e / e_loc == d;
        meta[1 + lane] = here ? e - d * e_loc : -1;
        meta[1 + k + lane] = here ? r : -1;
      }
    }
    fence_acq_rel_sys();
    __syncwarp();
    if (pos >= 0) red_release_sys_add(chunk_arrive[lane] + rank * max_chunks + pos / kArrivalChunk, 1ull);
  }
  move_stamp(2);
}

// Spin until *counter >= target; false when the call failed meanwhile (another warp's wait
// ran out) or this wait ran out (timeout_ns).
__device__ __forceinline__ bool wait_chunk(const unsigned long long* counter, unsigned long long target,
                                           unsigned long long timeout_ns, const int* status) {
  if (ld_acquire_sys(counter) >= target) return true;
  const unsigned long long start = globaltimer_ns();
  while (ld_acquire_sys(counter) < target) {
    if (call_failed(status) || globaltimer_ns() - start > timeout_ns) return false;
    __nanosleep(64);
  }
  return true;
}

// One warp per token row, copied into every expert row of this rank it feeds (the row read
// once), src_info beside it. Work items: first this rank's own T tokens, straight from x
// (they need no wait), then the rows of the other sources, rank + 1, rank + 2, ..., in
// position order, each waiting only for its chunk's arrival counter, so expansion follows
// arrival. A wait that runs out fails this rank's call: expert_offsets go to zero, so the
// GEMMs see no rows, the output is poisoned, and the other warps stop waiting.
__device__ void expand_tokens(const bf16_t* __restrict__ x, int T, const int* __restrict__ topk_idx,
                              const int* __restrict__ slot_rank, const DispatchConfig& cfg,
                              const int* __restrict__ base, bf16_t* __restrict__ a, int* __restrict__ src_info,
                              int* __restrict__ expert_offsets, const unsigned long long* __restrict__ my_chunk_arrive,
                              const unsigned long long* __restrict__ expected_chunk, int max_chunks, int block,
                              int grid) {
  const int E = cfg.num_experts, W = cfg.world, k = cfg.top_k, H = cfg.hidden, e_loc = E / W, row = E + W + 1;
  const int meta_len = 1 + 2 * k, rank = cfg.rank;
  __shared__ int first[EPSERVE_MAX_PEERS];  // first work item of each other source, in order; first[W - 1]: the end
  __shared__ int order[EPSERVE_MAX_PEERS];  // the other sources, in the order their rows are taken
  if (call_stopped(cfg.status)) return;
  if (threadIdx.x == 0) {
    const int* table = cfg.count_table[rank];
    first[0] = T;
    for (int n = 1; n < W; ++n) {
      const int s = (rank + n) % W;
      order[n - 1] = s;
      first[n] = first[n - 1] + ld_cg_s32(table + s * row + E + rank);
    }
  }
  __syncthreads();
  const int lane = threadIdx.x & 31, warps = blockDim.x >> 5;
  int have = -1;  // the (source, chunk) whose arrival this warp has seen, as s * max_chunks + c
  bool own = true;
  for (int i = block * warps + (threadIdx.x >> 5); i < first[W - 1]; i += grid * warps) {
    int s, t, m = -1;
    const uint4* src;
    if (own && i >= T) own = false, move_stamp(1);
    if (i < T) {  // this rank's own token i
      s = rank, t = i;
      const int e = lane < k ? topk_idx[t * k + lane] : -1;
      if (e >= 0 && e / e_loc == rank) m = base[e] + slot_rank[t * k + lane];  // base[rank][e - rank * e_loc]
      src = reinterpret_cast<const uint4*>(x + static_cast<long long>(t) * H);
    } else {
      int n = 0;
      while (i >= first[n + 1]) ++n;
      s = order[n];
      const int pos = i - first[n], c = pos / kArrivalChunk, key = s * max_chunks + c;
      if (key != have) {
        int ok = 1;
        if (lane == 0) {
          const unsigned long long target = expected_chunk[key] + chunk_rows(first[n + 1] - first[n], c);
          ok = !call_failed(cfg.status) && wait_chunk(my_chunk_arrive + key, target, cfg.timeout_ns, cfg.status);
          if (!ok && atomicExch(cfg.status + kCallFailed, 1) == 0) {
            record_error(cfg.error, kDispatchTokenTimeout, s,
                         static_cast<int>(ld_acquire_sys(cfg.my_ready + rank) + 1));
            for (int q = 0; q <= e_loc; ++q) expert_offsets[q] = 0;
          }
        }
        if (!__shfl_sync(0xffffffffu, ok, 0)) return;
        have = key;
      }
      const long long slot = static_cast<long long>(s) * cfg.max_tokens + pos;
      const int* meta = cfg.meta[rank] + slot * meta_len;
      t = ld_cg_s32(meta);
      const int e = lane < k ? ld_cg_s32(meta + 1 + lane) : -1;
      if (e >= 0) m = base[s * e_loc + e] + ld_cg_s32(meta + 1 + k + lane);
      src = reinterpret_cast<const uint4*>(cfg.tokens[rank] + slot * H);
    }
    const unsigned rows = __ballot_sync(0xffffffffu, m >= 0);
    if (!rows) continue;  // an own token that feeds no expert here
    uint4* dst = m >= 0 ? reinterpret_cast<uint4*>(a + static_cast<long long>(m) * H) : nullptr;
    copy_row_to_many(dst, rows, src, H / 8, lane);
    if (m >= 0) src_info[m] = (s << 24) | (t << 4) | lane;
  }
  if (own) move_stamp(1);
  move_stamp(2);
}

// The end of every dispatch, stopped or not, by one block: the token regions and the count
// table may take the next call, and this rank's epoch (ready[rank]) moves on. The rows each
// chunk of each other source was promised move on only when rows were sent, that is, unless
// the verdict stopped the call.
__device__ void release_dispatch(const DispatchConfig& cfg, unsigned long long* __restrict__ expected_chunk,
                                 int max_chunks) {
  const int E = cfg.num_experts, W = cfg.world, row = E + W + 1, rank = cfg.rank;
  if (!call_stopped(cfg.status)) {
    const int* table = cfg.count_table[rank];
    for (int i = threadIdx.x; i < W * max_chunks; i += blockDim.x) {
      const int s = i / max_chunks;
      if (s != rank) expected_chunk[i] += chunk_rows(ld_cg_s32(table + s * row + E + rank), i - s * max_chunks);
    }
  }
  __syncthreads();  // every read of the count table is done before the peers may overwrite it
  if (threadIdx.x < W) red_release_sys_add(cfg.ready[threadIdx.x] + rank, 1ull);
}

// send and expand in one launch, so expansion overlaps arrival: blocks [0, send_blocks)
// send this rank's tokens to the other ranks, the rest expand this rank's own tokens and
// then what arrives, each warp waiting only for the chunk of the row in hand. The host sizes
// the grid to fit on the GPU at once, and the send blocks come first, so expand blocks that
// wait for a peer never hold SMs this rank's send needs (the peer's expand waits for it).
// chunk_arrive[d]: rank d's arrival counters [W][max_chunks], by sender and chunk;
// expected_chunk: this rank's own [W][max_chunks], what the earlier calls promised. With
// `done` (a zeroed counter, left zero), the last block to finish releases the dispatch
// (release_dispatch) and no release kernel follows; without it the release kernel must.
extern "C" __global__ void __launch_bounds__(kMoveThreads)
    epserve_dispatch_move(const bf16_t* __restrict__ x, int T, const int* __restrict__ topk_idx,
                          const int* __restrict__ tok_pos, const int* __restrict__ slot_rank, const DispatchConfig cfg,
                          const int* __restrict__ base, bf16_t* __restrict__ a, int* __restrict__ src_info,
                          int* __restrict__ expert_offsets, int send_blocks,
                          unsigned long long* const* __restrict__ chunk_arrive,
                          unsigned long long* __restrict__ expected_chunk, int max_chunks, unsigned* __restrict__ done) {
#ifdef EPSERVE_DISPATCH_STAMPS
  if (threadIdx.x == 0 && blockIdx.x < kStampBlocks) epserve_move_stamps[blockIdx.x * 3] = globaltimer_ns();
#endif
  if (static_cast<int>(blockIdx.x) < send_blocks)
    send_tokens(x, T, topk_idx, tok_pos, slot_rank, cfg, chunk_arrive, max_chunks, blockIdx.x, send_blocks);
  else
    expand_tokens(x, T, topk_idx, slot_rank, cfg, base, a, src_info, expert_offsets, chunk_arrive[cfg.rank],
                  expected_chunk, max_chunks, blockIdx.x - send_blocks, gridDim.x - send_blocks);
  if (done == nullptr) return;
  __shared__ int last;
  __syncthreads();  // this block's reads of the token regions and the count table are done
  if (threadIdx.x == 0) {
    __threadfence();
    last = atomicAdd(done, 1u) == gridDim.x - 1;
    if (last) {
      __threadfence();
      *done = 0;  // every block has counted: ready for the next call
    }
  }
  __syncthreads();
  if (last) release_dispatch(cfg, expected_chunk, max_chunks);
}

// The release on its own, when the move kernel ran without `done`. One block.
extern "C" __global__ void epserve_dispatch_release(const DispatchConfig cfg,
                                                    unsigned long long* __restrict__ expected_chunk, int max_chunks) {
  release_dispatch(cfg, expected_chunk, max_chunks);
}

// ---- The NCCL transport, planned on the device (epserve/dispatch/nccl.py) -------------------
// Same route kernels (count, rank) and the same layout and verdict as the direct dispatch;
// only the movement differs. Every NCCL call has a size fixed when the service starts, so the
// host needs no count and the path can be captured in a CUDA graph:
//   publish     the count row into this rank's row of a local [W][E + W + 1] table, which one
//               in-place ncclAllGather (on the stream) fills with every rank's row
//   layout      layout_from_table, plus the combine's return positions (two scans per rank)
//   pack        each token row once per destination into that destination's fixed block of
//               max_tokens rows (this rank's own rows straight into its receive region), its
//               routing beside it; the home index of each (t, j) for the combine's unpack
//   (NCCL)      one grouped ncclSend/ncclRecv of the blocks
//   expand      as the direct expand, without waits: NCCL's kernels precede it on the stream
// The combine: combine_pack puts C's rows into fixed blocks of combine_cap rows per home rank
// (this rank's own straight into its recv slots), one grouped send/recv, combine_unpack puts
// the arrived rows into their recv slots, and the usual reduction follows.
// Blocks for peers are indexed by peer_block(d): the ranks other than this one, in order.

__device__ __forceinline__ int peer_block(int d, int rank) { return d - (d > rank); }

extern "C" __global__ void __launch_bounds__(kPublishThreads, 1)
    epserve_nccl_dispatch_publish(const int* __restrict__ topk_idx, int T, int input_error, const DispatchConfig cfg,
                                  int* __restrict__ chunk_counts, int* __restrict__ bad_slot, int* __restrict__ table) {
  __shared__ int totals[EPSERVE_MAX_EXPERTS + EPSERVE_MAX_PEERS];
  __shared__ int bad;
  const int width = cfg.num_experts + cfg.world;
  route_totals(topk_idx, T, input_error, cfg, chunk_counts, bad_slot, totals, &bad);
  __syncthreads();
  const int error_code = input_error ? input_error : (bad != 0x7fffffff ? kDispatchBadExpert : 0);
  int* dst = table + cfg.rank * (width + 1);
  for (int i = threadIdx.x; i <= width; i += blockDim.x) dst[i] = i < width ? (error_code ? 0 : totals[i]) : error_code;
}

// ret_base[s][e]: where the rows of source s for local expert e start in s's return block
// (exclusive scan over e of what s sent here); home_base[d * e_loc + e]: the same seen from
// the home side, where this rank's rows for expert e of rank d start in d's return block. Both
// are scans of the same count rows, so the sender's and the home rank's positions agree.
extern "C" __global__ void __launch_bounds__(kLayoutThreads, 1)
    epserve_nccl_dispatch_layout(const DispatchConfig cfg, const int* __restrict__ table,
                                 int* __restrict__ expert_offsets, int* __restrict__ base, int* __restrict__ ret_base,
                                 int* __restrict__ home_base) {
  if (layout_from_table(cfg, table, expert_offsets, base)) return;
  __shared__ int warp_sums[kLayoutThreads / 32];
  __shared__ int total;
  const int E = cfg.num_experts, W = cfg.world, e_loc = E / W, row = E + W + 1, e = threadIdx.x;
  const bool expert = e < e_loc;
  for (int s = 0; s < W; ++s) {
    const int v = expert ? ld_cg_s32(table + s * row + cfg.rank * e_loc + e) : 0;
    const int p = block_exclusive_scan(v, warp_sums, &total);
    if (expert) ret_base[s * e_loc + e] = p;
    __syncthreads();  // warp_sums is reused by the next scan
  }
  for (int d = 0; d < W; ++d) {
    const int v = expert ? ld_cg_s32(table + cfg.rank * row + d * e_loc + e) : 0;
    const int p = block_exclusive_scan(v, warp_sums, &total);
    if (expert) home_base[d * e_loc + e] = p;
    __syncthreads();
  }
}

// One warp per token: its row and routing into each destination's block at its position
// there (tok_pos), once per destination; blocks: send_tok [W - 1][max_tokens][H] for peers,
// recv_tok [W][max_tokens][H] by source for this rank's own. home_idx[t * k + j]: the row of
// the combine's receive buffer that brings (t, j) home, -1 for an unused slot or one this
// rank serves itself.
extern "C" __global__ void __launch_bounds__(kMoveThreads)
    epserve_nccl_dispatch_pack(const bf16_t* __restrict__ x, int T, const int* __restrict__ topk_idx,
                               const int* __restrict__ tok_pos, const int* __restrict__ slot_rank,
                               const DispatchConfig cfg, bf16_t* __restrict__ send_tok, int* __restrict__ send_meta,
                               bf16_t* __restrict__ recv_tok, int* __restrict__ recv_meta,
                               const int* __restrict__ home_base, int* __restrict__ home_idx, int combine_cap) {
  if (call_stopped(cfg.status)) return;
  const int W = cfg.world, k = cfg.top_k, H = cfg.hidden, e_loc = cfg.num_experts / W, meta_len = 1 + 2 * k;
  const int rank = cfg.rank, lane = threadIdx.x & 31, warps = blockDim.x >> 5;
  for (int t = blockIdx.x * warps + (threadIdx.x >> 5); t < T; t += gridDim.x * warps) {
    const uint4* src = reinterpret_cast<const uint4*>(x + static_cast<long long>(t) * H);
    const int e = lane < k ? topk_idx[t * k + lane] : -1;
    const int r = lane < k ? slot_rank[t * k + lane] : -1;
    for (int d = 0; d < W; ++d) {
      const int pos = tok_pos[t * W + d];
      if (pos < 0) continue;
      const bool own = d == rank;
      const long long slot = static_cast<long long>(own ? rank : peer_block(d, rank)) * cfg.max_tokens + pos;
      copy_row(reinterpret_cast<uint4*>((own ? recv_tok : send_tok) + slot * H), src, H / 8, lane);
      int* meta = (own ? recv_meta : send_meta) + slot * meta_len;
      if (lane == 0) meta[0] = t;
      if (lane < k) {
        const bool here = e >= 0 && e / e_loc == d;
        meta[1 + lane] = here ? e - d * e_loc : -1;
        meta[1 + k + lane] = here ? r : -1;
      }
    }
    if (lane < k) {
      const int d = e >= 0 ? e / e_loc : rank;
      home_idx[t * k + lane] = d == rank ? -1 : peer_block(d, rank) * combine_cap + home_base[e] + r;
    }
  }
}

// One warp per arrived token row, as expand_tokens, plus ret_idx[m]: the row of the combine's
// send buffer that takes dispatched row m home (-1 for this rank's own rows).
extern "C" __global__ void __launch_bounds__(kMoveThreads)
    epserve_nccl_dispatch_expand(const DispatchConfig cfg, const int* __restrict__ table,
                                 const bf16_t* __restrict__ recv_tok, const int* __restrict__ recv_meta,
                                 const int* __restrict__ base, const int* __restrict__ ret_base, bf16_t* __restrict__ a,
                                 int* __restrict__ src_info, int* __restrict__ ret_idx, int combine_cap) {
  if (call_stopped(cfg.status)) return;
  const int E = cfg.num_experts, W = cfg.world, k = cfg.top_k, H = cfg.hidden, e_loc = E / W, row = E + W + 1;
  const int meta_len = 1 + 2 * k, rank = cfg.rank;
  __shared__ int first[EPSERVE_MAX_PEERS + 1];  // prefix of token rows per source
  if (threadIdx.x == 0) {
    first[0] = 0;
    for (int s = 0; s < W; ++s) first[s + 1] = first[s] + ld_cg_s32(table + s * row + E + rank);
  }
  __syncthreads();
  const int lane = threadIdx.x & 31, warps = blockDim.x >> 5;
  for (int i = blockIdx.x * warps + (threadIdx.x >> 5); i < first[W]; i += gridDim.x * warps) {
    int s = 0;
    while (i >= first[s + 1]) ++s;
    const long long slot = static_cast<long long>(s) * cfg.max_tokens + (i - first[s]);
    const int* meta = recv_meta + slot * meta_len;
    const int t = ld_cg_s32(meta);
    const int e = lane < k ? ld_cg_s32(meta + 1 + lane) : -1;
    const int r = e >= 0 ? ld_cg_s32(meta + 1 + k + lane) : -1;
    const int m = e >= 0 ? base[s * e_loc + e] + r : -1;
    const unsigned rows = __ballot_sync(0xffffffffu, m >= 0);
    uint4* dst = m >= 0 ? reinterpret_cast<uint4*>(a + static_cast<long long>(m) * H) : nullptr;
    copy_row_to_many(dst, rows, reinterpret_cast<const uint4*>(recv_tok + slot * H), H / 8, lane);
    if (m >= 0) {
      src_info[m] = (s << 24) | (t << 4) | lane;
      ret_idx[m] = s == rank ? -1 : peer_block(s, rank) * combine_cap + ret_base[s * e_loc + e] + r;
    }
  }
}

// The combine's send side: C's row m (dispatch order; M = expert_offsets[e_loc], read here)
// into its home rank's return block at ret_idx[m], or, when its home is this rank, straight
// into its recv slot (t, j). Nothing when the dispatch verdict stopped the call.
extern "C" __global__ void __launch_bounds__(kMoveThreads)
    epserve_nccl_combine_pack(const bf16_t* __restrict__ C, const int* __restrict__ expert_offsets, int e_loc,
                              const int* __restrict__ src_info, const int* __restrict__ ret_idx,
                              bf16_t* __restrict__ send, bf16_t* __restrict__ recv, int H, int k, int rank,
                              const int* __restrict__ status) {
  if (call_stopped(status)) return;
  const int M = expert_offsets[e_loc];
  const int lane = threadIdx.x & 31, warps = blockDim.x >> 5;
  for (int m = blockIdx.x * warps + (threadIdx.x >> 5); m < M; m += gridDim.x * warps) {
    const RowSource from = decode_src_info(src_info[m]);
    const long long dst = from.rank == rank ? static_cast<long long>(from.token) * k + from.slot : ret_idx[m];
    copy_row(reinterpret_cast<uint4*>((from.rank == rank ? recv : send) + dst * H),
             reinterpret_cast<const uint4*>(C + static_cast<long long>(m) * H), H / 8, lane);
  }
}

// The combine's home side: recv slot i = t * k + j gets row home_idx[i] of the return blocks
// (slots this rank served itself, and unused ones, have -1 and are left alone).
extern "C" __global__ void __launch_bounds__(kMoveThreads)
    epserve_nccl_combine_unpack(const bf16_t* __restrict__ returned, const int* __restrict__ home_idx, int slots,
                                int H, bf16_t* __restrict__ recv, const int* __restrict__ status) {
  if (call_stopped(status)) return;
  const int lane = threadIdx.x & 31, warps = blockDim.x >> 5;
  for (int i = blockIdx.x * warps + (threadIdx.x >> 5); i < slots; i += gridDim.x * warps) {
    const int h = home_idx[i];
    if (h < 0) continue;
    copy_row(reinterpret_cast<uint4*>(recv + static_cast<long long>(i) * H),
             reinterpret_cast<const uint4*>(returned + static_cast<long long>(h) * H), H / 8, lane);
  }
}
