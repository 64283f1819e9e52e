// Direct-store dispatch (docs/design.md: "Layouts", "Signalling and epochs"): every token row crosses to a destination
// rank at most once, however many of that rank's experts it routes to; the destination
// expands it into the expert-contiguous rows of the dispatch order (local expert, source
// rank, token, slot). Counts are exchanged on the device, through every rank's count table.
// Three launches a call (a kernel boundary costs ~5 us, more than the small kernels' work):
//
//   count + publish   many CTAs, a warp per 32-token chunk counts it and each CTA scans its
//                     own chunks; the last CTA to finish scans the CTAs' totals (a thread per
//                     counter) and publishes the count row to every rank's table, then a release
//   rank + layout     many CTAs: per-(t, j) rank inside its expert's rows from this source,
//                     per-token position inside each destination's token region; the last
//                     CTA to finish waits for every rank's count row, reaches the verdict (a
//                     rank's rejected input, a bad expert id, a receive overflow) into the
//                     call status, and writes expert_offsets and per-source bases (all zero
//                     when stopped)
//   move              send blocks put token rows + their routing into the other ranks' token
//                     regions, counting arrivals per chunk of 32 rows there, while expand
//                     blocks copy this rank's own rows from x into expert order (or the send
//                     warps store them, own_in_send), then each other source's rows as their
//                     chunks arrive, with src_info; each row is read once and stored to all
//                     its expert rows. Its last block releases the dispatch: the promised
//                     rows per chunk move on, and the buffers may take the next call's rows.
//
// Built with EPSERVE_DISPATCH_QUANTIZE=1 (the "dispatch_quantize" variant, FP8 experts), the
// move reads this rank's tokens as bf16 rows of x_cols columns and quantizes each, 1 x 128,
// into a packed FP8 row (values, then scales: token_row_to_many) on its way into the peers'
// token regions and this rank's own expert rows; everything else moves packed rows as it
// moves bf16 ones (cfg.hidden is then the packed row's width in 2-byte units).
//
// "The last CTA to finish" counts on a done counter that it resets itself, so neither a
// launch nor a CUDA graph replay needs a memset. No host looks between the kernels: the
// verdict is the same on every rank because it is computed from the same count rows, and
// every later kernel reads it from the call status. The epoch is this rank's own
// dispatch_ready count, advanced by the release on the device.
#include "comm/dispatch_common.cuh"
#include "comm/dispatch_layout.cuh"
#include "comm/dispatch_route.cuh"

// The route's kernels come twice: for up to EPSERVE_MAX_PEERS ranks (one node; a token's
// destination set is one register) and, named *_wide, for up to EPSERVE_MAX_WORLD (a set of
// kWideWords registers). One source; the host picks by the world (epserve/dispatch/route.py),
// so the one-node kernels keep their registers whatever the wide ones need.
#define EPSERVE_ONE_NODE_AND_WIDE(bounds, name, body, params, args) \
  extern "C" __global__ void bounds name params { body<1> args; }  \
  extern "C" __global__ void bounds name##_wide params { body<kWideWords> args; }

// Count + publish, over a CTA of kCountThreads per kCountWarps chunks: each warp counts its
// chunk and each CTA scans its chunks (their bases within it, and its totals); the last CTA to
// finish scans the CTAs' totals (their bases, this rank's count row) and publishes the count
// row to every rank's table. done: this kernel's zeroed counter of finished CTAs,
// left zero. Dynamic shared memory: kCountThreads / 32 * (E + W) ints.
template <int kWords>
__device__ __forceinline__ void route_count_publish(const int* __restrict__ topk_idx, int T, int input_error,
                                                    const DispatchConfig& cfg, int* __restrict__ chunk_counts,
                                                    int* __restrict__ bad_slot, unsigned* __restrict__ done) {
  __shared__ int totals[EPSERVE_MAX_EXPERTS + EPSERVE_MAX_WORLD];
  __shared__ int bad;
  count_chunks<kWords>(topk_idx, T, cfg, chunk_counts, bad_slot, totals);
  if (!last_block_to_finish(done)) return;
  route_totals(topk_idx, T, input_error, cfg, chunk_counts, bad_slot, totals, &bad);
  publish_count_row(cfg, totals, bad, input_error);
}
EPSERVE_ONE_NODE_AND_WIDE(__launch_bounds__(kCountThreads, 1), epserve_dispatch_route_count_publish,
                          route_count_publish,
                          (const int* __restrict__ topk_idx, int T, int input_error, const DispatchConfig cfg,
                           int* __restrict__ chunk_counts, int* __restrict__ bad_slot, unsigned* __restrict__ done),
                          (topk_idx, T, input_error, cfg, chunk_counts, bad_slot, done))

// Rank + layout, over many CTAs of kRankThreads: each warp ranks its chunks; the last CTA to
// finish waits for every rank's count row and writes the verdict, expert_offsets and the
// per-source bases (direct_layout). done: as count + publish's, a counter of its own.
// arm_expected (or null) and units_per_slot: the combine's arm, done by the layout (forward).
// Dynamic shared memory: kRankWarps * (E + W) ints.
template <int kWords>
__device__ __forceinline__ void route_rank_layout(const int* __restrict__ topk_idx, int T, const DispatchConfig& cfg,
                                                  const int* __restrict__ chunk_bases, int* __restrict__ tok_pos,
                                                  int* __restrict__ slot_rank, unsigned* __restrict__ done,
                                                  int* __restrict__ expert_offsets, int* __restrict__ base,
                                                  unsigned long long* arm_expected, int units_per_slot) {
  rank_chunks<kWords>(topk_idx, T, cfg, chunk_bases, tok_pos, slot_rank);
  if (!last_block_to_finish(done)) return;
  direct_layout(cfg, expert_offsets, base, arm_expected, units_per_slot);
}
// Two CTAs an SM (64 registers): left to itself ptxas aims at three (40 registers), and the
// wide build then spills around the layout's calls.
EPSERVE_ONE_NODE_AND_WIDE(__launch_bounds__(kRankThreads, 2), epserve_dispatch_route_rank_layout, route_rank_layout,
                          (const int* __restrict__ topk_idx, int T, const DispatchConfig cfg,
                           const int* __restrict__ chunk_bases, int* __restrict__ tok_pos,
                           int* __restrict__ slot_rank, unsigned* __restrict__ done, int* __restrict__ expert_offsets,
                           int* __restrict__ base, unsigned long long* arm_expected, int units_per_slot),
                          (topk_idx, T, cfg, chunk_bases, tok_pos, slot_rank, done, expert_offsets, base,
                           arm_expected, units_per_slot))

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

// This rank's token t to the destinations of `lanes` (copy_row_to_many's convention), the
// row read once: row t of x as it is (H 2-byte units), or, built with
// EPSERVE_DISPATCH_QUANTIZE, row t of the bf16 x [T, x_cols] quantized into the packed FP8
// row the dispatch moves (quantize_row_to_many: the bits of epserve_quantize_rows_packed_fp8).
__device__ __forceinline__ void token_row_to_many(uint4* my_dst, unsigned lanes, const bf16_t* x, int t, int H,
                                                  int x_cols, int lane) {
#if EPSERVE_DISPATCH_QUANTIZE
  quantize_row_to_many(my_dst, lanes, x + static_cast<long long>(t) * x_cols, x_cols, H / 8, lane);
#else
  copy_row_to_many(my_dst, lanes, reinterpret_cast<const uint4*>(x + static_cast<long long>(t) * H), H / 8, lane);
#endif
}

// Where this rank's token rows for destination rank d go: on this node, d's token region for
// this rank (row pos at (rank * max_tokens + pos) * H), over IPC; on another node, d's block of
// the dispatch staging (row pos at pos * H), which the off-node carrier takes to d's token
// region after the kernel (docs/design.md, "Across nodes"). The routing likewise.
__device__ __forceinline__ bf16_t* token_dst(const DispatchConfig& cfg, int d, int pos) {
  const int p = node_index(d, cfg.node_first, cfg.ranks_per_node);
  if (p >= 0) return cfg.tokens[p] + (static_cast<long long>(cfg.rank) * cfg.max_tokens + pos) * cfg.hidden;
  const long long block = off_node_block(d, cfg.node_first, cfg.ranks_per_node);
  return reinterpret_cast<bf16_t*>(cfg.off_blocks + block * cfg.off_block_bytes) + static_cast<long long>(pos) * cfg.hidden;
}
__device__ __forceinline__ int* meta_dst(const DispatchConfig& cfg, int d, int pos, int meta_len) {
  const int p = node_index(d, cfg.node_first, cfg.ranks_per_node);
  if (p >= 0) return cfg.meta[p] + (static_cast<long long>(cfg.rank) * cfg.max_tokens + pos) * meta_len;
  const long long block = off_node_block(d, cfg.node_first, cfg.ranks_per_node);
  return reinterpret_cast<int*>(cfg.off_blocks + block * cfg.off_block_bytes +
                                static_cast<long long>(cfg.max_tokens) * cfg.hidden * 2) +
         static_cast<long long>(pos) * meta_len;
}

// One warp per token: its row to every other destination that owns one of its experts, once,
// its routing beside it. A destination's rows of this rank land in position order (tok_pos
// grows with the token), and the warps walk the tokens in waves of one token each, so the
// chunks of positions fill up roughly in order: each row adds 1 to its chunk's counter
// there (a destination on this node), after a system-scope fence, and the destination
// expands a chunk when it is whole. A destination on another node gets the row in its
// staging block, carried after the kernel, and no counter.
// This rank's own rows never go through a token region: with own_in_send the same warp
// stores them into this rank's expert rows from the registers it loaded the row into (x is
// read once for both), with src_info; without it, expand reads them from x again.
// Lanes: [0, kOwnLane) the destinations, kOwnLane + j this rank's expert row of slot j, so one
// copy_row_to_many stores to both (the peers' first: their stores are the slower ones). Up to
// EPSERVE_MAX_PEERS ranks, lane d is rank d; with more, lane j is the destination of slot j,
// when j is the first slot of the token that picks that rank (at most top_k destinations).
constexpr int kOwnLane = kMaxTopK;
static_assert(kOwnLane + kMaxTopK <= 32 && EPSERVE_MAX_PEERS <= kOwnLane, "a lane per destination and per slot");
__device__ void send_tokens(const bf16_t* __restrict__ x, int x_cols, int T, const int* __restrict__ topk_idx,
                            const int* __restrict__ tok_pos, const int* __restrict__ slot_rank, const DispatchConfig& cfg,
                            const int* __restrict__ base, bf16_t* __restrict__ a, int* __restrict__ src_info,
                            bool own_in_send, unsigned long long* const* __restrict__ chunk_arrive, int max_chunks,
                            int block, int grid) {
  const int W = cfg.world, k = cfg.top_k, H = cfg.hidden, e_loc = cfg.num_experts / W, meta_len = 1 + 2 * k;
  const int rank = cfg.rank, lane = threadIdx.x & 31, warps = blockDim.x >> 5, j = lane - kOwnLane;
  const bool lane_per_rank = W <= EPSERVE_MAX_PEERS;  // warp-uniform
  if (call_stopped(cfg.status)) return;
  for (int t = block * warps + (threadIdx.x >> 5); t < T; t += grid * warps) {
    int dest = lane < W && lane != rank ? lane : -1;  // this lane's destination rank
    if (!lane_per_rank) {
      const int e = lane < k ? topk_idx[t * k + lane] : -1;  // ids are valid: the verdict let the call go on
      const int d = e >= 0 ? e / e_loc : -1 - lane;          // unused slots and lanes match nobody
      const unsigned same = __match_any_sync(0xffffffffu, d);
      dest = d >= 0 && d != rank && __ffs(same) - 1 == lane ? d : -1;
    }
    const int pos = dest >= 0 ? tok_pos[t * W + dest] : -1;  // the position at dest
    const unsigned to = __ballot_sync(0xffffffffu, pos >= 0);
    int m = -1;  // lane kOwnLane + j: this rank's expert row of slot j, when the slot picks one of its experts
    if (own_in_send && j >= 0 && j < k) {
      const int e = topk_idx[t * k + j];
      if (e >= 0 && e / e_loc == rank) m = base[e] + slot_rank[t * k + j];  // base[rank][e - rank * e_loc]
    }
    const unsigned own = __ballot_sync(0xffffffffu, m >= 0);
    if (!(to | own)) continue;
    uint4* dst = pos >= 0 ? reinterpret_cast<uint4*>(token_dst(cfg, dest, pos))
                 : m >= 0 ? reinterpret_cast<uint4*>(a + static_cast<long long>(m) * H)
                          : nullptr;
    token_row_to_many(dst, to | own, x, t, H, x_cols, lane);
    if (m >= 0) src_info[m] = (rank << 24) | (t << 4) | j;
    if (!to) continue;
    const int e = lane < k ? topk_idx[t * k + lane] : -1;
    const int r = lane < k ? slot_rank[t * k + lane] : -1;
    for (unsigned mask = to; mask; mask &= mask - 1) {
      const int l = __ffs(mask) - 1;
      const int d = lane_per_rank ? l : __shfl_sync(0xffffffffu, dest, l);
      const int p = __shfl_sync(0xffffffffu, pos, l);
      int* meta = meta_dst(cfg, d, p, meta_len);
      if (lane == 0) meta[0] = t;
      if (lane < k) {
        const bool here = e >= 0 && e / e_loc == d;
        meta[1 + lane] = here ? e - d * e_loc : -1;
        meta[1 + k + lane] = here ? r : -1;
      }
    }
    fence_acq_rel_sys();
    __syncwarp();
    if (pos >= 0 && chunk_arrive[dest] != nullptr)  // null: another node's (no counter; the carrier follows)
      red_release_sys_add(chunk_arrive[dest] + rank * max_chunks + pos / kArrivalChunk, 1ull);
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

// One warp per token row, or per part of one where rows are fewer than the warps (decode: a
// row each would leave most warps idle), copied into every expert row of this rank it feeds
// (the part read once), src_info beside it. A row's `parts` parts are adjacent work items
// of up to 128 16-byte chunks each (copy_row_to_many's unrolled step); every block computes
// the same `parts` from the same counts. Work items: first this rank's own T tokens,
// straight from x (they need no wait; none when own_in_send: the send warps store them),
// then the rows of the other sources, rank + 1, rank + 2, ..., in position order, each
// waiting only for its chunk's arrival counter, so expansion follows arrival. A wait that runs out fails this
// rank's call: expert_offsets go to zero, so the GEMMs see no rows, the output is poisoned,
// and the other warps stop waiting.
__device__ void expand_tokens(const bf16_t* __restrict__ x, int x_cols, int T, const int* __restrict__ topk_idx,
                              const int* __restrict__ slot_rank, const DispatchConfig& cfg,
                              const int* __restrict__ base, bf16_t* __restrict__ a, int* __restrict__ src_info,
                              int* __restrict__ expert_offsets, const unsigned long long* __restrict__ my_chunk_arrive,
                              const unsigned long long* __restrict__ expected_chunk, int max_chunks,
                              bool own_in_send, int block, int grid, bool off_node = false,
                              uint4* staging = nullptr) {
  const int E = cfg.num_experts, W = cfg.world, k = cfg.top_k, H = cfg.hidden, e_loc = E / W, row = E + W + 1;
  const int meta_len = 1 + 2 * k, rank = cfg.rank;
  // first[n]: the first work item of the n-th source taken (first[0]: after this rank's own
  // T), first[sources]: the end. The sources are the other ranks of this rank's node
  // (off_node false: the move kernel, rows stored over IPC as they arrive) or the ranks of
  // the other nodes (off_node true: after the carrier landed their blocks, no waits;
  // docs/design.md, "Across nodes"). With one node, every other rank is of this node.
  __shared__ int first[EPSERVE_MAX_WORLD + 1];
  __shared__ int order[EPSERVE_MAX_WORLD];  // the sources, in the order their rows are taken
  __shared__ int sources;
  const int me = rank - cfg.node_first;     // this rank's local index: its own tables
  if (call_stopped(cfg.status)) return;
  if (off_node && call_failed(cfg.status)) return;
  if (threadIdx.x == 0) {
    const int* table = cfg.count_table[me];
    first[0] = T;
    int n = 0;
    for (int i = 1; i < W; ++i) {
      const int s = (rank + i) % W;
      if ((node_index(s, cfg.node_first, cfg.ranks_per_node) < 0) != off_node) continue;
      order[n] = s;
      first[n + 1] = first[n] + ld_cg_s32(table + s * row + E + rank);
      ++n;
    }
    sources = n;
  }
  __syncthreads();
  const int lane = threadIdx.x & 31, warps = blockDim.x >> 5;
  int have = -1;  // the (source, chunk) whose arrival this warp has seen, as s * max_chunks + c
  bool own = true;
  const int start = own_in_send ? T : 0;
  const int items = first[sources] - start, n16 = H / 8;
  constexpr int kPartChunks = 128;
  const int want = max(1, min((n16 + kPartChunks - 1) / kPartChunks, grid * warps / max(items, 1)));
  const int part_chunks = kPartChunks * ((n16 + want * kPartChunks - 1) / (want * kPartChunks));
  const int parts = (n16 + part_chunks - 1) / part_chunks;
  for (int w = block * warps + (threadIdx.x >> 5); w < items * parts; w += grid * warps) {
    const int i = start + w / parts, part = w % parts;
    const int c0 = part * part_chunks, chunks = min(n16, c0 + part_chunks) - c0;
    int s, t, m = -1;
    const uint4* src = nullptr;  // the row; with EPSERVE_DISPATCH_QUANTIZE null for this rank's own token t (from x)
    if (own && i >= T) own = false, move_stamp(1);
    if (i < T) {  // this rank's own token i
      s = rank, t = i;
      const int e = lane < k ? topk_idx[t * k + lane] : -1;
      if (e >= 0 && e / e_loc == rank) m = base[e] + slot_rank[t * k + lane];  // base[rank][e - rank * e_loc]
#if !EPSERVE_DISPATCH_QUANTIZE
      src = reinterpret_cast<const uint4*>(x + static_cast<long long>(t) * H);
#endif
    } else {
      int n = 0;
      while (i >= first[n + 1]) ++n;
      s = order[n];
      const int pos = i - first[n], c = pos / kArrivalChunk, key = s * max_chunks + c;
      if (key != have && !off_node) {  // off-node rows landed before this launch (stream order)
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
      const int* meta = cfg.meta[me] + slot * meta_len;
      t = ld_cg_s32(meta);
      const int e = lane < k ? ld_cg_s32(meta + 1 + lane) : -1;
      if (e >= 0) m = base[s * e_loc + e] + ld_cg_s32(meta + 1 + k + lane);
      src = reinterpret_cast<const uint4*>(cfg.tokens[me] + slot * H);
    }
    const unsigned rows = __ballot_sync(0xffffffffu, m >= 0);
    if (!rows) continue;  // an own token that feeds no expert here
    uint4* dst = m >= 0 ? reinterpret_cast<uint4*>(a + static_cast<long long>(m) * H) : nullptr;
#if EPSERVE_DISPATCH_QUANTIZE
    if (src == nullptr) {  // this rank's own token t: quantized from x on the way, as the send does
      const bf16_t* row = x + static_cast<long long>(t) * x_cols;
      if (staging != nullptr) {  // staged whole, by part 0
        if (part == 0)
          quantize_row_to_many_staged(dst, rows, row, x_cols, n16, lane, staging + (threadIdx.x >> 5) * n16);
      } else {  // each part its share of the row's passes (all of them when a row is one part)
        const int passes = row_passes(x_cols);
        quantize_row_to_many(dst, rows, row, x_cols, n16, lane, passes * part / parts, passes * (part + 1) / parts);
      }
    } else
#endif
      copy_row_to_many(dst == nullptr ? nullptr : dst + c0, rows, src + c0, chunks, lane);
    if (m >= 0 && part == 0) src_info[m] = (s << 24) | (t << 4) | lane;
  }
  if (own) move_stamp(1);
  move_stamp(2);
}

// The end of every dispatch, stopped or not, by one block: the token regions and the count
// table may take the next call (for this node's ranks; the other nodes' wrote through the
// carrier, ordered on the stream), and this rank's epoch (ready[rank]) moves on. The rows each
// chunk of each other source was promised move on only when rows were sent, that is, unless
// the verdict stopped the call.
__device__ void release_dispatch(const DispatchConfig& cfg, unsigned long long* __restrict__ expected_chunk,
                                 int max_chunks) {
  const int E = cfg.num_experts, W = cfg.world, row = E + W + 1, rank = cfg.rank;
  if (!call_stopped(cfg.status)) {
    const int* table = cfg.count_table[rank - cfg.node_first];
    for (int i = threadIdx.x; i < W * max_chunks; i += blockDim.x) {
      const int s = i / max_chunks;
      if (s != rank) expected_chunk[i] += chunk_rows(ld_cg_s32(table + s * row + E + rank), i - s * max_chunks);
    }
  }
  __syncthreads();  // every read of the count table is done before the peers may overwrite it
  if (threadIdx.x < cfg.ranks_per_node) red_release_sys_add(cfg.ready[threadIdx.x] + rank, 1ull);
}

// The quantizing build's staging rows for this rank's own rows (quantize_row_to_many_staged):
// one packed row of H 2-byte units a warp, in the dynamic shared memory the host gives the
// move kernel (epserve/dispatch/direct.py, DirectDispatcher.stage_own_rows); null where it
// gave none (the rows are then stored by the warps, the same bits).
__device__ __forceinline__ uint4* own_row_staging(int H) {
#if EPSERVE_DISPATCH_QUANTIZE
  extern __shared__ uint4 move_staging[];
  unsigned bytes;
  asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(bytes));
  return bytes >= (blockDim.x >> 5) * 2u * H ? move_staging : nullptr;
#else
  return nullptr;
#endif
}

// send and expand in one launch, so expansion overlaps arrival: blocks [0, send_blocks)
// send this rank's tokens to the other ranks (and, own_in_send, store its own expert rows),
// the rest expand this rank's own tokens (unless own_in_send) and then what arrives, each
// warp waiting only for the chunk of the row in hand. The host sizes the grid to fit on the
// GPU at once, and the send blocks come first, so expand blocks that wait for a peer never
// hold SMs this rank's send needs (the peer's expand waits for it).
// chunk_arrive[d]: rank d's arrival counters [W][max_chunks], by sender and chunk;
// expected_chunk: this rank's own [W][max_chunks], what the earlier calls promised. With
// `done` (a zeroed counter, left zero), the last block to finish releases the dispatch
// (release_dispatch) and no release kernel follows; without it the release kernel must.
// x: this rank's T rows as they move (cfg.hidden 2-byte units each), or, built with
// EPSERVE_DISPATCH_QUANTIZE, its bf16 tokens [T, x_cols] (x_cols a multiple of 128,
// cfg.hidden * 2 = packed_row_bytes(x_cols)), which the send and the own-row expansion
// quantize into packed FP8 rows; an extra last argument, only in that build.
extern "C" __global__ void __launch_bounds__(kMoveThreads, kMoveBlocksPerSm)
    epserve_dispatch_move(const bf16_t* __restrict__ x, int T, const int* __restrict__ topk_idx,
                          const int* __restrict__ tok_pos, const int* __restrict__ slot_rank, const DispatchConfig cfg,
                          const int* __restrict__ base, bf16_t* __restrict__ a, int* __restrict__ src_info,
                          int* __restrict__ expert_offsets, int send_blocks,
                          unsigned long long* const* __restrict__ chunk_arrive,
                          unsigned long long* __restrict__ expected_chunk, int max_chunks, unsigned* __restrict__ done,
                          int own_in_send
#if EPSERVE_DISPATCH_QUANTIZE
                          , int x_cols  // x is bf16 [T, x_cols], quantized into packed rows on the way
#endif
                          ) {
#if !EPSERVE_DISPATCH_QUANTIZE
  constexpr int x_cols = 0;  // x holds the rows as they move
#endif
#ifdef EPSERVE_DISPATCH_STAMPS
  if (threadIdx.x == 0 && blockIdx.x < kStampBlocks) epserve_move_stamps[blockIdx.x * 3] = globaltimer_ns();
#endif
  if (static_cast<int>(blockIdx.x) < send_blocks)
    send_tokens(x, x_cols, T, topk_idx, tok_pos, slot_rank, cfg, base, a, src_info, own_in_send, chunk_arrive,
                max_chunks, blockIdx.x, send_blocks);
  else
    expand_tokens(x, x_cols, T, topk_idx, slot_rank, cfg, base, a, src_info, expert_offsets, chunk_arrive[cfg.rank],
                  expected_chunk, max_chunks, own_in_send, blockIdx.x - send_blocks, gridDim.x - send_blocks, false,
                  own_row_staging(cfg.hidden));
#if EPSERVE_DISPATCH_QUANTIZE
  bulk_wait<0>();              // this thread's staged rows written (none: no wait)
  fence_proxy_async_global();  // and ordered before what the block does next (the release)
#endif
  if (done == nullptr) return;
  // Every block's reads of the token regions and the count table are done before the release.
  if (last_block_to_finish(done)) release_dispatch(cfg, expected_chunk, max_chunks);
}

// The release on its own, when the move kernel ran without `done`. One block.
extern "C" __global__ void epserve_dispatch_release(const DispatchConfig cfg,
                                                    unsigned long long* __restrict__ expected_chunk, int max_chunks) {
  release_dispatch(cfg, expected_chunk, max_chunks);
}

// Across nodes (docs/design.md, "Across nodes"): the rows of the other nodes' ranks, after the
// off-node carrier has landed their token blocks, routing and count rows in this rank's own
// token regions and count table (so the same slots as a one-node run). A warp per token row,
// as the move kernel's expand, without waits: the carrier's transfer precedes this launch on
// the stream. Nothing when the call was stopped or failed; this rank's own rows, and its
// node's, were expanded by the move kernel.
extern "C" __global__ void __launch_bounds__(kMoveThreads)
    epserve_dispatch_expand_off_node(const DispatchConfig cfg, const int* __restrict__ base, bf16_t* __restrict__ a,
                                     int* __restrict__ src_info, int* __restrict__ expert_offsets) {
  expand_tokens(nullptr, 0, 0, nullptr, nullptr, cfg, base, a, src_info, expert_offsets, nullptr, nullptr, 1, true,
                blockIdx.x, gridDim.x, true);
}

// ---- The NCCL transport, planned on the device (epserve/dispatch/nccl.py) -------------------
// The same route (count, scan, rank) and the same layout and verdict as the direct dispatch;
// only the movement differs. Every NCCL call has a size fixed when the service starts, so the
// host needs no count and the path can be captured in a CUDA graph:
//   count + publish   the count row into this rank's row of a local [W][E + W + 1] table,
//                     which one in-place ncclAllGather (on the stream) fills with every rank's
//   rank + layout     layout_from_table, plus the combine's return positions (two scans per rank)
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

// Count + publish as the direct transport's, except that the count row goes into this rank's
// row of the local table, which the ncclAllGather that follows fills with every rank's.
template <int kWords>
__device__ __forceinline__ void nccl_count_publish(const int* __restrict__ topk_idx, int T, int input_error,
                                                   const DispatchConfig& cfg, int* __restrict__ chunk_counts,
                                                   int* __restrict__ bad_slot, unsigned* __restrict__ done,
                                                   int* __restrict__ table) {
  __shared__ int totals[EPSERVE_MAX_EXPERTS + EPSERVE_MAX_WORLD];
  __shared__ int bad;
  count_chunks<kWords>(topk_idx, T, cfg, chunk_counts, bad_slot, totals);
  if (!last_block_to_finish(done)) return;
  const int width = cfg.num_experts + cfg.world;
  route_totals(topk_idx, T, input_error, cfg, chunk_counts, bad_slot, totals, &bad);
  __syncthreads();
  const int error_code = input_error ? input_error : (bad != 0x7fffffff ? kDispatchBadExpert : 0);
  int* dst = table + cfg.rank * (width + 1);
  for (int i = threadIdx.x; i <= width; i += blockDim.x) dst[i] = i < width ? (error_code ? 0 : totals[i]) : error_code;
}
EPSERVE_ONE_NODE_AND_WIDE(__launch_bounds__(kCountThreads, 1), epserve_nccl_dispatch_count_publish, nccl_count_publish,
                          (const int* __restrict__ topk_idx, int T, int input_error, const DispatchConfig cfg,
                           int* __restrict__ chunk_counts, int* __restrict__ bad_slot, unsigned* __restrict__ done,
                           int* __restrict__ table),
                          (topk_idx, T, input_error, cfg, chunk_counts, bad_slot, done, table))

// Rank + layout as the direct transport's, the layout from the gathered table plus the
// combine's return positions (nccl_layout).
template <int kWords>
__device__ __forceinline__ void nccl_rank_layout(const int* __restrict__ topk_idx, int T, const DispatchConfig& cfg,
                                                 const int* __restrict__ chunk_bases, int* __restrict__ tok_pos,
                                                 int* __restrict__ slot_rank, unsigned* __restrict__ done,
                                                 const int* __restrict__ table, int* __restrict__ expert_offsets,
                                                 int* __restrict__ base, int* __restrict__ ret_base,
                                                 int* __restrict__ home_base) {
  rank_chunks<kWords>(topk_idx, T, cfg, chunk_bases, tok_pos, slot_rank);
  if (!last_block_to_finish(done)) return;
  nccl_layout(cfg, table, expert_offsets, base, ret_base, home_base);
}
EPSERVE_ONE_NODE_AND_WIDE(__launch_bounds__(kRankThreads), epserve_nccl_dispatch_rank_layout, nccl_rank_layout,
                          (const int* __restrict__ topk_idx, int T, const DispatchConfig cfg,
                           const int* __restrict__ chunk_bases, int* __restrict__ tok_pos,
                           int* __restrict__ slot_rank, unsigned* __restrict__ done, const int* __restrict__ table,
                           int* __restrict__ expert_offsets, int* __restrict__ base, int* __restrict__ ret_base,
                           int* __restrict__ home_base),
                          (topk_idx, T, cfg, chunk_bases, tok_pos, slot_rank, done, table, expert_offsets, base,
                           ret_base, home_base))

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
  __shared__ int first[EPSERVE_MAX_WORLD + 1];  // prefix of token rows per source
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
