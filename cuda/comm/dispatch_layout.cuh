// The dispatch's layout and verdict (cuda/comm/dispatch.cu), from the W count rows every rank
// holds alike, for both transports. Run by one CTA of kLayoutThreads (a thread per local
// expert): the last CTA of the rank kernel. Included once, by dispatch.cu.
#pragma once
#include "comm/dispatch_common.cuh"

namespace {

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
  cfg.status[kCallStopped] = code != 0 ? kStoppedByVerdict : 0;
}

// Layout from the W count rows in `table` (both transports): expert_offsets, each source's
// base per local expert, and the verdict into the call status. Every thread of the block
// calls it; it returns true when the verdict stopped the call (expert_offsets are then zero).
__device__ bool layout_from_table(const DispatchConfig& cfg, const int* table, int* __restrict__ expert_offsets,
                                  int* __restrict__ base) {
  const int E = cfg.num_experts, W = cfg.world, e_loc = E / W, row = E + W + 1;
  __shared__ int total_rows, stopped;
  __shared__ int rows_to[EPSERVE_MAX_WORLD];
  __shared__ int warp_sums[kLayoutThreads / 32];
  static_assert(kLayoutThreads >= EPSERVE_MAX_WORLD, "a thread per destination");
  if (threadIdx.x < EPSERVE_MAX_WORLD) rows_to[threadIdx.x] = 0;
  __syncthreads();
  const int e = threadIdx.x, lane = threadIdx.x & 31;  // local expert e of every rank
  const bool expert = e < e_loc;
  // Rows every rank receives: thread e adds expert e of each destination over the sources,
  // EPSERVE_MAX_PEERS destinations a round (one round on one node).
  for (int d0 = 0; d0 < W; d0 += EPSERVE_MAX_PEERS) {
#pragma unroll
    for (int i = 0; i < EPSERVE_MAX_PEERS; ++i) {
      const int d = d0 + i;
      if (d >= W) break;
      int rows = 0;
      for (int s = 0; expert && s < W; ++s) rows += ld_cg_s32(table + s * row + d * e_loc + e);
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) rows += __shfl_down_sync(0xffffffffu, rows, o);
      if (lane == 0 && rows) atomicAdd(&rows_to[d], rows);
    }
  }
  // This rank's layout: expert e's rows from source 0, then from source 1, ... The first
  // EPSERVE_MAX_PEERS sources' counts stay in registers; more (across nodes) are read again.
  int from[EPSERVE_MAX_PEERS];
  int mine = 0;
#pragma unroll
  for (int s = 0; s < EPSERVE_MAX_PEERS; ++s) {
    from[s] = expert && s < W ? ld_cg_s32(table + s * row + cfg.rank * e_loc + e) : 0;
    mine += from[s];
  }
  for (int s = EPSERVE_MAX_PEERS; expert && s < W; ++s) mine += ld_cg_s32(table + s * row + cfg.rank * e_loc + e);
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
    for (int s = EPSERVE_MAX_PEERS; s < W; ++s) {
      base[s * e_loc + e] = run;
      run += ld_cg_s32(table + s * row + cfg.rank * e_loc + e);
    }
  }
  if (e == 0) expert_offsets[e_loc] = total_rows;
  return false;
}

// The combine's arm (epserve_combine_arm in cuda/comm/combine.cu, the same sums): this call's
// combine expects units_per_slot units from rank s for each of this rank's slots whose expert
// s owns, and this rank's own count row holds exactly those slots per expert. Run by the
// layout once the verdict lets the call go on, so forward needs no arm launch of its own.
__device__ void arm_combine(const DispatchConfig& cfg, const int* table, unsigned long long* expected,
                            int units_per_slot) {
  const int E = cfg.num_experts, W = cfg.world, e_loc = E / W;
  const int* mine = table + cfg.rank * (E + W + 1);
  __shared__ unsigned int slots_to[EPSERVE_MAX_WORLD];
  if (threadIdx.x < EPSERVE_MAX_WORLD) slots_to[threadIdx.x] = 0;
  __syncthreads();
  for (int e = threadIdx.x; e < E; e += blockDim.x) {
    const int n = ld_cg_s32(mine + e);
    if (n) atomicAdd(&slots_to[e / e_loc], static_cast<unsigned int>(n));
  }
  __syncthreads();
  if (threadIdx.x < W)
    expected[threadIdx.x] += static_cast<unsigned long long>(slots_to[threadIdx.x]) * units_per_slot;
}

// The direct transport's layout: wait for every rank's count row of this call (this rank's
// epoch: its own dispatch_ready count + 1), then layout_from_table on this rank's table. A
// count row that never arrives fails and stops the call here: nothing moves from or to this
// rank, and the GEMMs see no rows. arm_expected (or null): the combine's expected counters,
// armed here for a call that goes on (arm_combine).
__device__ void direct_layout(const DispatchConfig& cfg, int* __restrict__ expert_offsets, int* __restrict__ base,
                              unsigned long long* arm_expected, int units_per_slot) {
  const int W = cfg.world, e_loc = cfg.num_experts / W;
  __shared__ int arrived;
  if (threadIdx.x == 0) {
    arrived = 1;
    const unsigned long long epoch = ld_acquire_sys(cfg.my_ready + cfg.rank) + 1;
    for (int s = 0; s < W && arrived; ++s) {
      arrived = wait_at_least(cfg.my_count_arrive + s, epoch, cfg.timeout_ns);
      if (!arrived) record_error(cfg.error, kDispatchCountTimeout, s, static_cast<int>(epoch));
    }
    if (!arrived) {
      cfg.status[kCallFailed] = 1;
      cfg.status[kCallStopped] = kStoppedByTimeout;
    }
  }
  __syncthreads();
  if (!arrived) {  // nothing moves from or to here; GEMMs see no rows
    if (threadIdx.x <= e_loc) expert_offsets[threadIdx.x] = 0;
    return;
  }
  const int* table = cfg.count_table[cfg.rank - cfg.node_first];  // this rank's own, at its local index
  if (!layout_from_table(cfg, table, expert_offsets, base) && arm_expected != nullptr)
    arm_combine(cfg, table, arm_expected, units_per_slot);
}

// The NCCL transport's layout: layout_from_table on the gathered table, then
// ret_base[s][e]: where the rows of source s for local expert e start in s's return block
// (exclusive scan over e of what s sent here); home_base[d * e_loc + e]: the same seen from
// the home side, where this rank's rows for expert e of rank d start in d's return block. Both
// are scans of the same count rows, so the sender's and the home rank's positions agree.
__device__ void nccl_layout(const DispatchConfig& cfg, const int* __restrict__ table, int* __restrict__ expert_offsets,
                            int* __restrict__ base, int* __restrict__ ret_base, int* __restrict__ home_base) {
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

}  // namespace
