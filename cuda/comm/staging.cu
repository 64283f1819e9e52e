// Across nodes (docs/design.md, "Across nodes"; epserve/comm/off_node.py): the small kernels
// around the off-node carrier, and the IPC test carrier's exchange.
//
//   epserve_off_node_counts_landed   after the carrier landed the other nodes' count rows in
//                                    this rank's count table: count_arrive[s] += 1 for each
//                                    off-node s, so the dispatch layout's wait sees them
//   epserve_off_node_combine_land    after the carrier landed each off-node owner's combine
//                                    staging (a copy of this rank's recv shape) in a landing
//                                    block: slot (t, j) of an off-node owner into recv, and
//                                    arrive[owner] += its 64-column units
//   epserve_off_node_return_slots    sizes through the host (EPSERVE_OFFNODE_SIZES=host): the
//                                    src_info the owner's sink is given, each row bound
//                                    off-node written as its position in its home's compact
//                                    return block (epserve/comm/off_node_sizes.py)
//   epserve_off_node_combine_land_compact   the land, from compact return blocks
//   epserve_off_node_stamp           before a token-row or combine group: the stamp this rank
//                                    sends each peer at the end of it (this call's number,
//                                    and whether what it sends is valid)
//   epserve_off_node_stamps_check    after the group: every peer's stamp is this call's and
//                                    valid, else the call fails here (kOffNodeStale)
//   epserve_ipc_carrier_exchange     the IPC TEST carrier: one group of "sends" and "recvs"
//                                    between ranks that share one GPU (or one NVLink domain),
//                                    imitating NCCL's grouped send/recv with device-side flags
//
// Node n holds ranks [n * R, (n + 1) * R); the off-node ranks of rank r, in rank order, have
// block index off_node_block(s) = s < first rank of r's node ? s : s - R (common/nodes.cuh).
#include "common/errors.cuh"
#include "common/ptx.cuh"
#include "comm/dispatch_config.cuh"  // EPSERVE_MAX_EXPERTS
#include "sinks/peer_send_config.cuh"

using namespace epserve;

namespace {

__device__ __forceinline__ bool off_node(int s, int rank, int R) { return s / R != rank / R; }

// One warp copies n16 16-byte chunks; loads skip L1 (another process, or the network, wrote
// them), four in flight a lane.
__device__ __forceinline__ void warp_copy(uint4* dst, const uint4* src, long long n16, int lane) {
  long long c = lane;
  for (; c + 96 < n16; c += 128) {
    const uint4 v0 = ld_cg_v4(src + c), v1 = ld_cg_v4(src + c + 32), v2 = ld_cg_v4(src + c + 64),
                v3 = ld_cg_v4(src + c + 96);
    st_v4(dst + c, v0);
    st_v4(dst + c + 32, v1);
    st_v4(dst + c + 64, v2);
    st_v4(dst + c + 96, v3);
  }
  for (; c < n16; c += 32) st_v4(dst + c, ld_cg_v4(src + c));
}

}  // namespace

// Stamps (epserve/comm/off_node_stamps.py): the carrier moves bytes and says nothing of them,
// so a sender whose call failed before it staged (a wait ran out) would otherwise send the
// previous call's rows, and its receivers would use them without an error. Each token-row and
// combine group ends, per peer, with 16 bytes: {the call's number of this kind, 1 if the
// sender's rows are valid}. The numbers count the groups' calls on every rank alike (every
// call makes them, stopped ones included), so a stamp of another call is found too.
// One thread. valid: the sender's call status, or the relay's own verdict on what it forwards.
extern "C" __global__ void epserve_off_node_stamp(unsigned long long* __restrict__ out,
                                                  const unsigned long long* __restrict__ calls,
                                                  const int* __restrict__ valid) {
  out[0] = *calls + 1;
  out[1] = call_failed(valid) ? 0ull : 1ull;
}

// One block of 32 threads, after the group. stamps: [world][2] as landed, by sender; peers: the
// group's n senders; calls: this kind's calls so far (advance: the call's last group moves it
// on). A call the verdict stopped reads nothing of what came, so it checks nothing.
extern "C" __global__ void epserve_off_node_stamps_check(const unsigned long long* __restrict__ stamps,
                                                         const int* __restrict__ peers, int n,
                                                         unsigned long long* __restrict__ calls, int advance,
                                                         int kind, int* __restrict__ error,
                                                         int* __restrict__ status) {
  const unsigned long long e = *calls + 1;
  if (!stopped_by_verdict(status))
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
      const int s = peers[i];
      if (__ldcg(stamps + 2 * s) != e || __ldcg(stamps + 2 * s + 1) != 1ull) {
        record_error(error, kOffNodeStale, s, kind);
        mark_call_failed(status);
      }
    }
  __syncthreads();
  if (advance && threadIdx.x == 0) *calls = e;
}

// One block of 32 threads. Every call moves every off-node count row (NCCL's sizes are fixed),
// so every call adds exactly 1, as the IPC publish does.
// A carrier that ran out of time (the IPC test carrier records kOffNodeCarrierTimeout) landed
// nothing: then nothing is counted, and the layout's bounded wait for that row fails the call.
extern "C" __global__ void epserve_off_node_counts_landed(unsigned long long* __restrict__ my_count_arrive, int rank,
                                                          int world, int R, const int* __restrict__ error) {
  if (*(volatile const int*)error == kOffNodeCarrierTimeout) return;
  for (int s = threadIdx.x; s < world; s += blockDim.x)
    if (off_node(s, rank, R)) my_count_arrive[s] += 1;
}

// A warp per slot (t, j) of this rank's T tokens whose expert's owner is on another node:
// the row from that owner's landing block into recv, so the reduction reads it where a
// one-node run has it. In capacity blocks [max_tokens][k][H] the row is at the same slot; in
// compact return blocks (kCompact) at row home[e] + slot_rank[(t, j)] (off_node_sizes.py),
// home: this rank's count row scanned per owner (home_base). Each block counts the units it
// landed per owner and adds them to arrive[owner] (the reduction's wait, satisfied by stream
// order anyway). Nothing when the dispatch verdict stopped the call (nothing was staged,
// nothing is expected).
constexpr int kLandThreads = 256;

// Exclusive prefix sums within consecutive segments of `seg` entries of v[0, n) (shared
// memory, n <= EPSERVE_MAX_EXPERTS), in place; incl: n ints of shared scratch. Every thread
// of a block of kLandThreads calls it. Hillis-Steele: log2(seg) rounds.
constexpr int kScanPer = (EPSERVE_MAX_EXPERTS + kLandThreads - 1) / kLandThreads;
__device__ void segment_exclusive_scan(int* v, int* incl, int n, int seg) {
  for (int i = threadIdx.x; i < n; i += kLandThreads) incl[i] = v[i];
  __syncthreads();
  for (int off = 1; off < seg; off <<= 1) {
    int add[kScanPer];
#pragma unroll
    for (int c = 0; c < kScanPer; ++c) {
      const int i = threadIdx.x + c * kLandThreads;
      add[c] = i < n && i % seg >= off ? incl[i - off] : 0;
    }
    __syncthreads();
#pragma unroll
    for (int c = 0; c < kScanPer; ++c) {
      const int i = threadIdx.x + c * kLandThreads;
      if (i < n) incl[i] += add[c];
    }
    __syncthreads();
  }
  for (int i = threadIdx.x; i < n; i += kLandThreads) v[i] = incl[i] - v[i];
  __syncthreads();
}

template <bool kCompact>
__device__ __forceinline__ void land_rows(const bf16_t* __restrict__ landing, const int* __restrict__ topk_idx,
                                          const int* __restrict__ slot_rank, const int* __restrict__ home, int T,
                                          int k, int H, int experts_per_rank, int max_tokens, int rank, int world,
                                          int R, bf16_t* __restrict__ recv, unsigned long long* __restrict__ arrive,
                                          int units_per_slot) {
  __shared__ unsigned int landed[EPSERVE_MAX_WORLD];
  for (int s = threadIdx.x; s < world; s += blockDim.x) landed[s] = 0;
  __syncthreads();
  const int lane = threadIdx.x & 31, warps = blockDim.x >> 5;
  const long long slots = static_cast<long long>(T) * k, block_rows = static_cast<long long>(max_tokens) * k;
  for (long long i = static_cast<long long>(blockIdx.x) * warps + (threadIdx.x >> 5); i < slots;
       i += static_cast<long long>(gridDim.x) * warps) {
    const int e = topk_idx[i];
    if (e < 0) continue;
    const int s = e / experts_per_rank;
    if (s >= world || !off_node(s, rank, R)) continue;
    const long long row = kCompact ? static_cast<long long>(home[e]) + slot_rank[i] : i;
    if (row < 0 || row >= block_rows) continue;  // only a corrupt plan: never outside the block
    const long long block = off_node_block(s, rank / R * R, R);
    warp_copy(reinterpret_cast<uint4*>(recv + i * H),
              reinterpret_cast<const uint4*>(landing + (block * block_rows + row) * H), H / 8, lane);
    if (lane == 0) atomicAdd(&landed[s], 1u);
  }
  __syncthreads();
  for (int s = threadIdx.x; s < world; s += blockDim.x)
    if (landed[s]) atomicAdd(arrive + s, static_cast<unsigned long long>(landed[s]) * units_per_slot);
}

extern "C" __global__ void __launch_bounds__(kLandThreads)
    epserve_off_node_combine_land(const bf16_t* __restrict__ landing, const int* __restrict__ topk_idx, int T, int k,
                                  int H, int experts_per_rank, int max_tokens, int rank, int world, int R,
                                  bf16_t* __restrict__ recv, unsigned long long* __restrict__ arrive,
                                  int units_per_slot, const int* __restrict__ status) {
  if (call_stopped(status)) return;
  land_rows<false>(landing, topk_idx, nullptr, nullptr, T, k, H, experts_per_rank, max_tokens, rank, world, R, recv,
                   arrive, units_per_slot);
}

// my_count_row: this rank's count row of the call (E + W + 1 ints); slot_rank: route's, of
// this call's dispatch [T * k].
extern "C" __global__ void __launch_bounds__(kLandThreads)
    epserve_off_node_combine_land_compact(const bf16_t* __restrict__ landing, const int* __restrict__ topk_idx,
                                          const int* __restrict__ slot_rank, const int* __restrict__ my_count_row,
                                          int T, int k, int H, int num_experts, int max_tokens, int rank, int world,
                                          int R, bf16_t* __restrict__ recv, unsigned long long* __restrict__ arrive,
                                          int units_per_slot, const int* __restrict__ status) {
  if (call_stopped(status)) return;
  __shared__ int home[EPSERVE_MAX_EXPERTS], scratch[EPSERVE_MAX_EXPERTS];
  for (int e = threadIdx.x; e < num_experts; e += kLandThreads) home[e] = __ldcg(my_count_row + e);
  __syncthreads();
  segment_exclusive_scan(home, scratch, num_experts, num_experts / world);
  land_rows<true>(landing, topk_idx, slot_rank, home, T, k, H, num_experts / world, max_tokens, rank, world, R, recv,
                  arrive, units_per_slot);
}

// The owner's side of the compact return (EPSERVE_OFFNODE_SIZES=host), after the dispatch:
// sink_src_info[m] = src_info[m] for the M dispatched rows, except that a row from a rank s of
// another node names its position q in s's compact return block as a slot (q / k, q % k):
// q = ret[s][e] + (m - base[s][e]), e the row's local expert, ret[s][*] s's count row's
// entries for this rank's experts scanned (ret_base). Then the peer sink and the IPC push,
// unchanged, store the row at row q of s's block in the combine staging. A thread per row.
// table: this rank's count table [W][E + W + 1] (only the other nodes' rows are read); base:
// the layout's [W][E_loc]. Nothing when the verdict stopped the call (no rows).
extern "C" __global__ void __launch_bounds__(kLandThreads)
    epserve_off_node_return_slots(const int* __restrict__ src_info, const int* __restrict__ expert_offsets,
                                  const int* __restrict__ base, const int* __restrict__ table, int num_experts,
                                  int top_k, int max_tokens, int rank, int world, int R,
                                  int* __restrict__ sink_src_info, const int* __restrict__ status) {
  if (call_stopped(status)) return;
  __shared__ int ret[EPSERVE_MAX_EXPERTS], scratch[EPSERVE_MAX_EXPERTS];
  __shared__ int offsets[EPSERVE_MAX_EXPERTS / 2 + 1];  // at least two ranks: E_loc <= E / 2
  const int E = num_experts, W = world, e_loc = E / W, row = E + W + 1;
  for (int i = threadIdx.x; i < E; i += kLandThreads) {
    const int s = i / e_loc;
    ret[i] = off_node(s, rank, R) ? __ldcg(table + static_cast<long long>(s) * row + rank * e_loc + i % e_loc) : 0;
  }
  for (int e = threadIdx.x; e <= e_loc; e += kLandThreads) offsets[e] = expert_offsets[e];
  __syncthreads();
  segment_exclusive_scan(ret, scratch, E, e_loc);
  const int M = offsets[e_loc], block_rows = max_tokens * top_k;
  for (int m = blockIdx.x * kLandThreads + threadIdx.x; m < M; m += gridDim.x * kLandThreads) {
    const int info = src_info[m];
    const int s = (info >> 24) & 0x7f;
    int out = info;
    if (s < W && off_node(s, rank, R)) {
      int lo = 0, hi = e_loc - 1;  // the row's local expert: the last e with offsets[e] <= m
      while (lo < hi) {
        const int mid = (lo + hi + 1) >> 1;
        if (offsets[mid] <= m) lo = mid;
        else hi = mid - 1;
      }
      const int q = ret[s * e_loc + lo] + (m - base[s * e_loc + lo]);
      if (q >= 0 && q < block_rows) out = (s << 24) | ((q / top_k) << 4) | (q % top_k);  // else: a failed call
    }
    sink_src_info[m] = out;
  }
}

// ---- The IPC test carrier (epserve/comm/carriers.py, IpcTestCarrier) -------------------------
// Imitates one NCCL group of sends and receives over CUDA IPC, for ranks that share a GPU
// (NCCL refuses two ranks on one device). Each rank has a symmetric flag block, mapped into
// every rank (this carrier alone maps across "nodes"): posted[s] counts the groups rank s has
// posted to it, taken[d] the groups rank d has taken from it; local counters (sent[d],
// consumed[s]) count this rank's own. One launch per group, stream-ordered like NCCL:
//   1. block 0 posts: for each peer it sends to, posted[me] += 1 in that peer's block (a
//      system-scope release after a fence: the staging was written by earlier launches);
//   2. every block, for each receive, waits until its peer has posted this group
//      (posted[s] > consumed[s]), then copies its share of the bytes from the peer's staging
//      (through the IPC mapping) into the destination;
//   3. the last block to finish: consumed[s] += 1 and taken[me] += 1 in each sender's block;
//      then, for each peer it sent to, waits until that peer has taken this group (taken[d] >=
//      sent[d]): like a completed ncclSend, the staging may then be rewritten.
// Every wait is bounded (timeout_ns): on timeout the error record names the peer
// (kOffNodeCarrierTimeout) and the call is marked failed (its output is poisoned). Posting
// never waits, so no order of ranks can deadlock.
struct CarrierRecv {
  unsigned long long peer, src, dst, bytes;  // src: the peer's staging as mapped here; bytes a multiple of 16
};

constexpr unsigned long long kCarrierPosted = 0, kCarrierTaken = EPSERVE_MAX_WORLD;  // u64 offsets in a flag block

extern "C" __global__ void __launch_bounds__(256)
    epserve_ipc_carrier_exchange(const unsigned long long* __restrict__ flag_blocks,  // [world]: each rank's, as mapped
                                 const int* __restrict__ send_peers, int n_send, const int* __restrict__ recv_peers,
                                 int n_recv_peers, const CarrierRecv* __restrict__ recvs, int n_recv,
                                 unsigned long long* __restrict__ local,  // [2 * EPSERVE_MAX_WORLD]: sent, consumed
                                 int rank, unsigned long long timeout_ns, int* __restrict__ error,
                                 int* __restrict__ status, unsigned int* __restrict__ done) {
  unsigned long long* sent = local;
  unsigned long long* consumed = local + EPSERVE_MAX_WORLD;
  unsigned long long* mine = reinterpret_cast<unsigned long long*>(flag_blocks[rank]);
  __shared__ int ok;
  if (blockIdx.x == 0 && threadIdx.x < n_send) {  // 1. post (never waits)
    const int d = send_peers[threadIdx.x];
    fence_acq_rel_sys();
    red_release_sys_add(reinterpret_cast<unsigned long long*>(flag_blocks[d]) + kCarrierPosted + rank, 1ull);
  }
  const int lane = threadIdx.x & 31, warps = blockDim.x >> 5;
  for (int i = 0; i < n_recv; ++i) {  // 2. receive each item once posted
    const CarrierRecv r = recvs[i];
    const int s = static_cast<int>(r.peer);
    if (threadIdx.x == 0) {
      ok = !call_failed(status);
      if (ok && !wait_at_least(mine + kCarrierPosted + s, consumed[s] + 1, timeout_ns)) {
        record_error(error, kOffNodeCarrierTimeout, s, 0);
        mark_call_failed(status);
        ok = 0;
      }
    }
    __syncthreads();
    const bool go = ok;
    __syncthreads();  // ok is rewritten by the next item
    if (!go) continue;
    // 16-byte pieces where both ends and the size allow (token rows), else 4-byte words (count
    // rows and routing); a warp takes one contiguous share.
    const bool wide = ((r.src | r.dst | r.bytes) & 15) == 0;
    const long long n = static_cast<long long>(wide ? r.bytes / 16 : r.bytes / 4);
    const long long per = (n + gridDim.x * warps - 1) / (gridDim.x * warps);  // pieces a warp
    const long long w = static_cast<long long>(blockIdx.x) * warps + (threadIdx.x >> 5);
    const long long from = w * per, to = min(n, from + per);
    if (from < to && wide)
      warp_copy(reinterpret_cast<uint4*>(r.dst) + from, reinterpret_cast<const uint4*>(r.src) + from, to - from, lane);
    else
      for (long long c = from + lane; c < to; c += 32)
        reinterpret_cast<unsigned*>(r.dst)[c] = __ldcg(reinterpret_cast<const unsigned*>(r.src) + c);
  }
  // 3. the last block: every block's copies are done (and visible) before the peers hear it.
  __threadfence_system();
  __syncthreads();
  __shared__ int last;
  if (threadIdx.x == 0) {
    last = atomicAdd(done, 1u) == gridDim.x - 1;
    if (last) {
      __threadfence();
      *done = 0;
    }
  }
  __syncthreads();
  if (!last) return;
  if (threadIdx.x < n_recv_peers) {
    const int s = recv_peers[threadIdx.x];
    consumed[s] += 1;
    fence_acq_rel_sys();
    red_release_sys_add(reinterpret_cast<unsigned long long*>(flag_blocks[s]) + kCarrierTaken + rank, 1ull);
  }
  if (threadIdx.x < n_send) {
    const int d = send_peers[threadIdx.x];
    const unsigned long long target = sent[d] + 1;
    sent[d] = target;
    if (!wait_at_least(mine + kCarrierTaken + d, target, timeout_ns)) {
      record_error(error, kOffNodeCarrierTimeout, d, 1);
      mark_call_failed(status);
    }
  }
}
