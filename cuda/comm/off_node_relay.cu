// Across nodes through the rail peer (EPSERVE_OFFNODE_ROUTE=relay; docs/design.md, "Across
// nodes", "Relay through the rail peer"; epserve/comm/off_node_relay.py): one transfer per pair
// of ranks with the same local index on two nodes (a "rail"), then the forwarding over NVLink
// inside the node, as DeepEP's internode kernels do. Rank r = a * R + l sends everything for
// node b to b's rank of local index l; that rank stores it where r's direct stores would have
// put it in its node's ranks, so every slot, src_info and reduction order is the one-node run's.
//
//   epserve_relay_count_rows     after the carrier landed each rail source's count row in this
//                                rank's table: the row into every node rank's table (IPC), once
//                                that rank has published its own count row of this call (so
//                                it is done reading the previous call's rows), and
//                                count_arrive[source] += 1 in each (the layouts' wait)
//   epserve_relay_token_blocks   after the carrier landed each rail source's R token blocks
//                                (one per rank of this node) in the relay area: each block's
//                                routed rows and routing into its rank's token regions at the
//                                source's block (IPC); then relay_arrive[source] += 1 in each
//   epserve_relay_rows_wait      before the off-node expand: every other node's source relayed
//                                to this rank (bounded)
//   epserve_relay_combine_ready  once a call, before its first combine_rows: which node ranks'
//                                combine relay areas are free (bounded), one verdict for every
//                                copy and count of the call
//   epserve_relay_combine_rows   after GEMM 2 (or the IPC push) staged the rows of off-node
//                                homes: each row into the combine relay area of the home's rail
//                                peer on this node (IPC), at (home's node, this owner), slot
//                                (t, j); then combine_relay[home's node][owner] += 1 in every
//                                node rank. All other nodes' homes, or (the send under GEMM 2,
//                                EPSERVE_OFFNODE_OVERLAP=1) one node's, once GEMM 2 staged them
//   epserve_relay_combine_wait   before the combine's carrier group (of all nodes, or of one):
//                                every owner of this node has relayed (bounded)
//
// Counters only grow, one step per call on every rank whether the call goes on or was stopped
// by the dispatch verdict (nothing is copied then), so they stay in step with the epochs. A
// rank whose call failed otherwise (a wait ran out, its layout's included) does not count: the
// ranks that wait for it fail in turn, within their bound, rather than read the rows of an
// earlier call. Each wait's target is a local count of this rank's relayed dispatches or
// combines (epochs[0], epochs[1]), which only these kernels advance. A wait lane stops at its
// first timeout, so a call fails within one bound, not one per source.
#include "comm/dispatch_config.cuh"
#include "comm/relay_copy.cuh"
#include "common/errors.cuh"
#include "common/nodes.cuh"
#include "common/ptx.cuh"
#include "common/src_info.cuh"
#include "sinks/peer_send_config.cuh"

using namespace epserve;

namespace {

constexpr int kRelayThreads = 256;

// Thread q < R: wait (bounded) until node rank q's counter `counters[first + q]` has reached
// `target`; the rank itself needs no wait.
__device__ __forceinline__ bool node_rank_reached(const unsigned long long* counters, int q, int me, int first,
                                                  unsigned long long target, unsigned long long timeout_ns,
                                                  int* error, int code) {
  if (q == me) return true;
  const bool ok = wait_at_least(counters + first + q, target, timeout_ns);
  if (!ok) record_error(error, code, first + q, static_cast<int>(target));
  return ok;
}

// The relay area of the per-rank relay: block (ci R + q) is what other node ci's rail source
// staged for node rank q (token rows, then their routing), block_bytes apart.
struct RankBlocks {
  const unsigned char* relay;
  long long block_bytes;
  int R;
  __device__ __forceinline__ const unsigned char* block(int ci, int q) const {
    return relay + (static_cast<long long>(ci) * R + q) * block_bytes;
  }
  __device__ __forceinline__ void copy_row(uint4* dst, const unsigned char* src, int, long long i,
                                           long long row_bytes, int lane) const {
    warp_copy16(dst, reinterpret_cast<const uint4*>(src + i * row_bytes), row_bytes / 16, lane);
  }
  __device__ __forceinline__ const int* meta(const unsigned char* src, int, long long tokens_bytes) const {
    return reinterpret_cast<const int*>(src + tokens_bytes);
  }
};

}  // namespace

// One block. cfg: the direct dispatch's (its tables hold this node's ranks).
extern "C" __global__ void __launch_bounds__(kRelayThreads) epserve_relay_count_rows(const DispatchConfig cfg) {
  // The IPC test carrier ran out of time: nothing landed, so nothing is counted, and the
  // layouts' bounded waits fail the call.
  if (*(volatile const int*)cfg.error == kOffNodeCarrierTimeout) return;
  const int R = cfg.ranks_per_node, W = cfg.world, N = W / R, me = cfg.rank - cfg.node_first, a = cfg.rank / R;
  const int row = cfg.num_experts + W + 1;
  __shared__ int ok[EPSERVE_MAX_PEERS];
  // Node rank q reads the other nodes' rows of its table until its off-node expand (and, with
  // routed sizes, its return slots), after it released the dispatch: its count row of this
  // call, published after all that on its stream, says the rows may be overwritten. A rank
  // that never publishes fails its node peers' layouts anyway (code 6, as here).
  if (threadIdx.x < R)
    ok[threadIdx.x] = node_rank_reached(cfg.my_count_arrive, threadIdx.x, me, cfg.node_first,
                                        ld_acquire_sys(cfg.my_ready + cfg.rank) + 1, cfg.timeout_ns, cfg.error,
                                        kDispatchCountTimeout);
  __syncthreads();
  const int* mine = cfg.count_table[me];
  for (int c = 0; c < N; ++c) {
    if (c == a) continue;
    const int s = c * R + me;  // node c's rail source: its rank of this rank's local index
    for (int q = 0; q < R; ++q) {
      if (q == me || !ok[q]) continue;
      int* dst = cfg.count_table[q] + s * row;
      for (int i = threadIdx.x; i < row; i += blockDim.x) dst[i] = __ldcg(mine + s * row + i);
    }
  }
  fence_acq_rel_sys();
  __syncthreads();
  for (int i = threadIdx.x; i < N * R; i += blockDim.x) {
    const int c = i / R, q = i % R;
    if (c != a && ok[q]) red_release_sys_add(cfg.count_arrive[q] + c * R + me, 1ull);
  }
}

// Any grid of kRelayThreads. relay: the relay area, block (other_node_index(c) * R + q) holding
// node c's rail source's block for node rank q, laid out as that source's staging block
// (token rows [max_tokens][hidden], then their routing [max_tokens][1 + 2k] ints), block_bytes
// apart; relay_arrive[q]: node rank q's relay counters [W], by source; done: a zeroed counter.
extern "C" __global__ void __launch_bounds__(kRelayThreads)
    epserve_relay_token_blocks(const DispatchConfig cfg, const unsigned char* __restrict__ relay, long long block_bytes,
                               unsigned long long* const* __restrict__ relay_arrive, unsigned* __restrict__ done) {
  relay_into_token_regions(cfg, RankBlocks{relay, block_bytes, cfg.ranks_per_node},
                           relay_arrive, done);
}

// One warp. my_relay_arrive: this rank's relay counters [W], by source; epochs[0]: the relayed
// dispatches so far. A source that never comes fails the call here, as a token row that never
// comes fails it in the move kernel: nothing more moves to or from this rank (expert_offsets
// zero), and the ranks waiting for its combine rows fail in turn.
extern "C" __global__ void __launch_bounds__(32)
    epserve_relay_rows_wait(const DispatchConfig cfg, const unsigned long long* __restrict__ my_relay_arrive,
                            unsigned long long* __restrict__ epochs, int* __restrict__ expert_offsets,
                            int experts_per_rank) {
  const int lane = threadIdx.x, R = cfg.ranks_per_node;
  const unsigned long long e = epochs[0] + 1;
  if (!call_failed(cfg.status)) {
    bool ok = true;
    for (int s = lane; s < cfg.world && ok; s += 32) {
      if (node_index(s, cfg.node_first, R) >= 0) continue;
      if (!wait_at_least(my_relay_arrive + s, e, cfg.timeout_ns)) {
        record_error(cfg.error, kOffNodeRelayTimeout, s, 0);
        ok = false;
      }
    }
    if (!__all_sync(0xffffffffu, ok)) {
      mark_call_failed(cfg.status);
      for (int q = lane; q <= experts_per_rank; q += 32) expert_offsets[q] = 0;
    }
  }
  __syncwarp();
  if (lane == 0) epochs[0] = e;
}

// One block of at least R threads, once a call before its first epserve_relay_combine_rows.
// Combine e goes into node rank q's relay area once q has sent combine e - 1 from it: its
// reduction, which follows that send, has counted e - 1 in ready (the sink's rule for recv).
// area_ok[q]: 1 when it has (within the bound); every CTA of every copy of the call reads this
// one verdict, so a block is copied and counted in q wholly or not at all. relayed: the call's
// verdict on what this rank relays (an int[2] call status: epserve_relay_combine_wait marks it
// failed), made valid here for the call.
extern "C" __global__ void epserve_relay_combine_ready(const PeerSendConfig cfg, int* __restrict__ area_ok,
                                                       int* __restrict__ relayed) {
  const int q = threadIdx.x, R = cfg.ranks_per_node;
  if (q == 0) relayed[kCallFailed] = 0;
  if (q >= R) return;
  const bool ok = node_rank_reached(cfg.ready, q, cfg.rank - cfg.node_first, cfg.node_first,
                                    ld_acquire_sys(cfg.ready + cfg.rank), cfg.timeout_ns, cfg.error,
                                    kPeerReadyTimeout);
  if (!ok) mark_call_failed(cfg.status);
  area_ok[q] = ok;
}

// Any grid of kRelayThreads. cfg: GEMM 2's (or the IPC push's) PeerSendConfig, whose src_info
// names this call's rows and whose off_recv is the combine staging they were stored into;
// expert_offsets: the call's (null: no rows, a rank standing in). relay[q]: node rank q's
// combine relay area, block (other_node_index(home's node) * R + owner's local index) of
// max_tokens * k rows of hidden bf16; relay_arrive[q]: its counters [nodes][W], by home node
// and owner; area_ok: epserve_relay_combine_ready's verdict of this call. only_node: the homes
// of that node only, or -1: of every other node. A call that failed here before (not one the
// verdict stopped) is not counted: its staged rows may be an earlier call's, and the rail
// peers' bounded waits fail in turn.
extern "C" __global__ void __launch_bounds__(kRelayThreads)
    epserve_relay_combine_rows(const PeerSendConfig cfg, const int* __restrict__ expert_offsets, int experts_per_rank,
                               bf16_t* const* __restrict__ relay, unsigned long long* const* __restrict__ relay_arrive,
                               const int* __restrict__ area_ok, unsigned* __restrict__ done, int only_node) {
  const int R = cfg.ranks_per_node, me = cfg.rank - cfg.node_first, a = cfg.rank / R, k = cfg.top_k;
  const int W = cfg.world, N = W / R;
  const long long H = cfg.hidden, block_rows = static_cast<long long>(cfg.max_tokens) * k;
  __shared__ int ok[EPSERVE_MAX_PEERS];
  const bool count = !call_failed(cfg.status) || stopped_by_verdict(cfg.status);
  if (threadIdx.x < R) ok[threadIdx.x] = count && __ldcg(area_ok + threadIdx.x);
  __syncthreads();
  const int M = expert_offsets != nullptr && !call_stopped(cfg.status) ? expert_offsets[experts_per_rank] : 0;
  const int lane = threadIdx.x & 31, warps = blockDim.x >> 5;
  for (long long m = static_cast<long long>(blockIdx.x) * warps + (threadIdx.x >> 5); m < M;
       m += static_cast<long long>(gridDim.x) * warps) {
    const RowSource src = decode_src_info(cfg.src_info[m]);
    if (src.rank >= cfg.world || src.token >= cfg.max_tokens || src.slot >= k) continue;  // the sink refused it
    if (node_index(src.rank, cfg.node_first, R) >= 0) continue;                           // home on this node
    if (only_node >= 0 && src.rank / R != only_node) continue;
    const int p = src.rank % R;  // the home's rail peer here: this node's rank of its local index
    if (!ok[p]) continue;
    const long long slot = static_cast<long long>(src.token) * k + src.slot;
    const long long block = static_cast<long long>(other_node_index(src.rank / R, a)) * R + me;
    warp_copy16(reinterpret_cast<uint4*>(relay[p] + (block * block_rows + slot) * H),
                reinterpret_cast<const uint4*>(
                    cfg.off_recv + (off_node_block(src.rank, cfg.node_first, R) * block_rows + slot) * H),
                H / 8, lane);
  }
  fence_acq_rel_sys();
  if (last_block_done(done))
    for (int i = threadIdx.x; i < N * R; i += blockDim.x) {
      const int c = i / R, q = i % R;
      if (c != a && (only_node < 0 || c == only_node) && ok[q])
        red_release_sys_add(relay_arrive[q] + static_cast<long long>(c) * W + cfg.rank, 1ull);
    }
}

// One warp. my_combine_relay: this rank's counters [nodes][W], by home node and owner;
// epochs[1]: the relayed combines so far, which the call's last wait (advance) moves on. Waits
// for the owners of this node to have relayed their rows for node only_node's homes, or (-1)
// for every other node's. Runs whatever the call's status (the owners count stopped calls too),
// and the carrier group follows whatever it finds (its peers make theirs); an owner that never
// came fails the call here and marks `relayed` failed, which the group's stamp tells the homes
// (epserve/comm/off_node_stamps.py).
extern "C" __global__ void __launch_bounds__(32)
    epserve_relay_combine_wait(const unsigned long long* __restrict__ my_combine_relay,
                               unsigned long long* __restrict__ epochs, int rank, int world, int R, int only_node,
                               int advance, unsigned long long timeout_ns, int* __restrict__ error,
                               int* __restrict__ status, int* __restrict__ relayed) {
  const int lane = threadIdx.x, first = rank / R * R, N = world / R;
  const unsigned long long e = epochs[1] + 1;
  for (int i = lane; i < N * R; i += 32) {
    const int c = i / R, o = first + i % R;
    if (c == rank / R || (only_node >= 0 && c != only_node)) continue;
    // this rank's own rows were relayed earlier on this stream, or never will be: no wait
    if (!wait_at_least(my_combine_relay + static_cast<long long>(c) * world + o, e, o == rank ? 0 : timeout_ns)) {
      record_error(error, kOffNodeRelayTimeout, o, 1);
      mark_call_failed(status);
      mark_call_failed(relayed);
      break;
    }
  }
  __syncwarp();
  if (lane == 0 && advance) epochs[1] = e;
}
