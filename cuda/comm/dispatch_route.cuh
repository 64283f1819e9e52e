// The dispatch's route (cuda/comm/dispatch.cu), shared by both transports: count each chunk
// of 32 tokens, scan the chunks into the count row and the chunk bases, rank each slot and
// position each token. Included once, by dispatch.cu, after dispatch_common.cuh.
#pragma once
#include "comm/dispatch_common.cuh"

namespace {

// Count, a CTA per kCountWarps chunks of 32 tokens (chunk c is warp c % kCountWarps of CTA
// c / kCountWarps; the host launches exactly enough CTAs, epserve/dispatch/route.py): each warp
// counts its chunk (rows per global expert, tokens per destination) into its row of shared
// memory; a bad expert id's slot goes to *bad_slot (the lowest wins). Then the CTA scans its
// rows per counter (a warp per counter, a lane per chunk) and stores each chunk's base within
// the CTA as the chunk's row of chunk_counts, and the CTA's totals as row chunks + blockIdx.x,
// which the last CTA's scan (route_totals) turns into the CTA's base: a chunk's base is its
// row plus its CTA's row (rank_chunks). So each CTA scans its own chunks where it counted
// them, and the one CTA that scans in the end reads a row per CTA, not per chunk: scanning
// every chunk row there took half the kernel (8 us at 4096 tokens; notes/dispatch.md).
// The CTA's totals also go to `totals` (shared): with one count CTA (decode) they are the
// count row already, and its row of chunk_counts is its base, zero.
// Dynamic shared memory: kCountWarps * (E + W) ints. kWords: the words of a token's
// destination set (DestSet: 1 in the one-node kernels, kWideWords in the _wide ones).
template <int kWords>
__device__ void count_chunks(const int* __restrict__ topk_idx, int T, const DispatchConfig& cfg,
                             int* __restrict__ chunk_counts, int* __restrict__ bad_slot, int* totals) {
  extern __shared__ int smem[];
  const int E = cfg.num_experts, W = cfg.world, k = cfg.top_k, e_loc = E / W, width = E + W;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  int* mine = smem + warp * width;
  const int chunks = (T + kChunk - 1) / kChunk;
  const int c = blockIdx.x * kCountWarps + warp;
  for (int i = lane; i < width; i += 32) mine[i] = 0;  // a warp past the last chunk leaves zeros
  __syncwarp();
  const int t = c * kChunk + lane;
  if (t < T) {
    DestSet<kWords> dests;
    for (int j = 0; j < k; ++j) {
      const int e = topk_idx[t * k + j];
      if (e < -1 || e >= E) {
        atomicMin(bad_slot, t * k + j);
        continue;
      }
      if (e < 0) continue;
      atomicAdd(&mine[e], 1);
      dests.add(e / e_loc);
    }
    for (int d = 0; d < W; ++d)
      if (dests.has(d)) atomicAdd(&mine[E + d], 1);
  }
  __syncthreads();
  // kIlp counters a warp at once: their shuffle chains overlap instead of running one after
  // another.
  constexpr int kIlp = 4;
  for (int i0 = warp; i0 < width; i0 += kIlp * kCountWarps) {
    int v[kIlp], x[kIlp];
#pragma unroll
    for (int u = 0; u < kIlp; ++u) {
      const int i = i0 + u * kCountWarps;
      v[u] = i < width ? smem[lane * width + i] : 0;  // chunk `lane` of this CTA
      x[u] = v[u];
    }
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
#pragma unroll
      for (int u = 0; u < kIlp; ++u) {
        const int y = __shfl_up_sync(0xffffffffu, x[u], o);
        if (lane >= o) x[u] += y;
      }
    }
#pragma unroll
    for (int u = 0; u < kIlp; ++u) {
      const int i = i0 + u * kCountWarps;
      if (i < width) {
        smem[lane * width + i] = x[u] - v[u];
        if (lane == 31) {
          totals[i] = x[u];
          chunk_counts[(chunks + blockIdx.x) * width + i] = gridDim.x == 1 ? 0 : x[u];
        }
      }
    }
  }
  __syncthreads();
  if (c < chunks)
    for (int i = lane; i < width; i += 32) chunk_counts[c * width + i] = mine[i];
}

// The scan, by the one CTA (the last of the count grid) that sees every CTA's totals: an
// exclusive scan over the CTA rows (chunk_counts' rows chunks .. chunks + gridDim.x - 1), per
// counter, turns them into the CTAs' bases and leaves the totals (this rank's count row) in
// totals (with one CTA, count_chunks left both done); thread 0 takes the lowest bad slot
// into *bad, resets *bad_slot for the next call and records a bad expert id of this rank's
// own routing; it ends with a barrier, so every thread may read *bad and totals after it.
// The other CTAs wrote their rows and *bad_slot in this launch: read from L2.
__device__ void route_totals(const int* __restrict__ topk_idx, int T, int input_error, const DispatchConfig& cfg,
                             int* __restrict__ chunk_counts, int* __restrict__ bad_slot, int* totals, int* bad) {
  const int E = cfg.num_experts, W = cfg.world, k = cfg.top_k, width = E + W;
  const int chunks = (T + kChunk - 1) / kChunk, ctas = gridDim.x;
  int* cta_rows = chunk_counts + chunks * width;
  // The CTA rows split into `parts` runs, a thread per (counter, run), so the block's threads
  // all load at once: each run's sum, then each run rewritten from the sum of the runs
  // before it. partial[p * width + i]: run p's sum of counter i.
  __shared__ int partial[kCountThreads > EPSERVE_MAX_EXPERTS + EPSERVE_MAX_WORLD ? kCountThreads
                                                                                  : EPSERVE_MAX_EXPERTS + EPSERVE_MAX_WORLD];
  // With one CTA, count_chunks left the totals and the CTA's zero base: nothing to scan.
  const int parts = ctas == 1 ? 0 : max(1, static_cast<int>(blockDim.x) / width);
  const int per = parts ? (ctas + parts - 1) / parts : 0;
  for (int x = threadIdx.x; x < parts * width; x += blockDim.x) {
    const int p = x / width, i = x - p * width, end = min(ctas, (p + 1) * per);
    int sum = 0;
    for (int b = p * per; b < end; ++b) sum += __ldcg(cta_rows + b * width + i);
    partial[x] = sum;
  }
  __syncthreads();
  for (int x = threadIdx.x; x < parts * width; x += blockDim.x) {
    const int p = x / width, i = x - p * width, end = min(ctas, (p + 1) * per);
    int run = 0;
    for (int q = 0; q < p; ++q) run += partial[q * width + i];
    for (int b = p * per; b < end; ++b) {
      const int v = __ldcg(cta_rows + b * width + i);
      cta_rows[b * width + i] = run;
      run += v;
    }
    if (p == parts - 1) totals[i] = run;
  }
  if (threadIdx.x == 0) {
    *bad = atomicExch(bad_slot, 0x7fffffff);  // the other CTAs' atomicMin live in L2
    if (!input_error && *bad != 0x7fffffff) record_error(cfg.error, kDispatchBadExpert, *bad / k, topk_idx[*bad]);
  }
  // Callers read *bad and totals from every thread (publish takes bad by value, before its
  // own barrier): without this one, threads read the shared word before thread 0 wrote it,
  // and a call whose routing was fine published a bad-expert code (seen on an H200: the
  // second call of a job stopped with "routed to expert ids outside [-1, num_experts)").
  __syncthreads();
}

// The direct transport's publish, by one CTA after route_totals: once every rank of this node
// has released this rank's previous dispatch, the count row (an error code last: this rank's
// rejected input, or a bad expert id in its routing) goes to every such rank's table, then a
// release on each one's count counter for this rank. Across nodes it also goes into the
// staging's count row, which the off-node carrier takes to the other nodes' ranks after this
// kernel (stream order: no wait, no counter; docs/design.md, "Across nodes").
__device__ void publish_count_row(const DispatchConfig& cfg, const int* totals, int bad, int input_error) {
  __shared__ int ok[EPSERVE_MAX_PEERS];
  const int E = cfg.num_experts, W = cfg.world, width = E + W, R = cfg.ranks_per_node;
  if (threadIdx.x < R) {
    const int p = threadIdx.x, d = cfg.node_first + p;
    const unsigned long long done = ld_acquire_sys(cfg.my_ready + cfg.rank);
    ok[p] = wait_at_least(cfg.my_ready + d, done, cfg.timeout_ns);
    if (!ok[p]) record_error(cfg.error, kDispatchReadyTimeout, d, static_cast<int>(done + 1));
  }
  __syncthreads();  // also orders route_totals' totals and bad before the reads below
  const int error_code = input_error ? input_error : (bad != 0x7fffffff ? kDispatchBadExpert : 0);
  const int row = width + 1;
  for (int p = 0; p < R; ++p) {
    if (!ok[p]) continue;
    int* dst = cfg.count_table[p] + cfg.rank * row;
    for (int i = threadIdx.x; i < row; i += blockDim.x) dst[i] = i < width ? (error_code ? 0 : totals[i]) : error_code;
  }
  if (cfg.off_count_row != nullptr)
    for (int i = threadIdx.x; i < row; i += blockDim.x)
      cfg.off_count_row[i] = i < width ? (error_code ? 0 : totals[i]) : error_code;
  fence_acq_rel_sys();
  __syncthreads();
  if (threadIdx.x < R && ok[threadIdx.x]) red_release_sys_add(cfg.count_arrive[threadIdx.x] + cfg.rank, 1ull);
}

// Rank, over many CTAs of kRankThreads: in (token, slot) order within each chunk, from its
// base, each slot's rank among its expert's rows from this source, and each token's position
// among the tokens going to each destination. A warp per chunk, a lane per token: a slot's
// rank is its expert's base plus the chunk's earlier tokens that chose that expert, a popcount
// of a per-expert mask of lanes (the warp's shared memory, every lane setting its experts'
// bits), and a token's position the same over a ballot per destination; a chunk where some
// token names an expert twice takes the token-by-token path instead, with the bases in the
// same shared memory. Dynamic shared memory: kRankWarps * (E + W) ints; the masks are zero
// between chunks. kWords: the words of a token's destination set (as count_chunks').
template <int kWords>
__device__ void rank_chunks(const int* __restrict__ topk_idx, int T, const DispatchConfig& cfg,
                            const int* __restrict__ chunk_bases, int* __restrict__ tok_pos, int* __restrict__ slot_rank) {
  extern __shared__ int smem[];
  // The chunk's expert ids, loaded at once (one round trip, not one per token); an id
  // outside [-1, E) becomes -2 (route stopped the call; it must only stay in bounds here).
  __shared__ short ids[kRankWarps][kChunk * kMaxTopK];
  const int E = cfg.num_experts, W = cfg.world, k = cfg.top_k, e_loc = E / W, width = E + W;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, warps = blockDim.x >> 5;
  const unsigned before = (1u << lane) - 1;  // the lanes of the chunk's earlier tokens
  int* mine = smem + warp * width;           // the token-by-token path's running bases
  unsigned* masks = reinterpret_cast<unsigned*>(mine);  // per expert: the lanes whose token chose it
  short* chunk_ids = ids[warp];
  for (int i = lane; i < E; i += 32) masks[i] = 0;  // each use clears what it set
  const int chunks = (T + kChunk - 1) / kChunk;
  for (int c = blockIdx.x * warps + warp; c < chunks; c += gridDim.x * warps) {
    // A counter's base for this chunk: the chunk's base within its count CTA plus that CTA's
    // base (count_chunks); written by the previous kernel: plain loads are fine.
    const int* bases = chunk_bases + c * width;
    const int* cta_bases = bases + (chunks + c / kCountWarps - c) * width;
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
      DestSet<kWords> dests;
      for (int j = 0; live && j < k; ++j) {
        const int e = row[j];
        if (e < 0) continue;
        atomicOr(&masks[e], 1u << lane);
        dests.add(e / e_loc);
      }
      __syncwarp();
      for (int j = 0; live && j < k; ++j) {
        const int e = row[j];
        slot_rank[t * k + j] = e >= 0 ? bases[e] + cta_bases[e] + __popc(masks[e] & before) : -1;
      }
      for (int d = 0; d < W; ++d) {
        const bool to = dests.has(d);
        const unsigned to_d = __ballot_sync(0xffffffffu, to);
        if (live) tok_pos[t * W + d] = to ? bases[E + d] + cta_bases[E + d] + __popc(to_d & before) : -1;
      }
      __syncwarp();
      for (int j = 0; live && j < k; ++j)
        if (row[j] >= 0) masks[row[j]] = 0;
      __syncwarp();
      continue;
    }
    for (int i = lane; i < width; i += 32) mine[i] = bases[i] + cta_bases[i];
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


}  // namespace
