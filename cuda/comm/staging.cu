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
//   epserve_ipc_carrier_exchange     the IPC TEST carrier: one group of "sends" and "recvs"
//                                    between ranks that share one GPU (or one NVLink domain),
//                                    imitating NCCL's grouped send/recv with device-side flags
//
// Node n holds ranks [n * R, (n + 1) * R); the off-node ranks of rank r, in rank order, have
// block index off_node_block(s) = s < first rank of r's node ? s : s - R (common/nodes.cuh).
#include "common/errors.cuh"
#include "common/ptx.cuh"
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
// the row from that owner's landing block [max_tokens][k][H] (the same slot) into recv, so the
// reduction reads it where a one-node run has it. Each block counts the units it landed per
// owner and adds them to arrive[owner] (the reduction's wait, satisfied by stream order
// anyway). Nothing when the dispatch verdict stopped the call (nothing was staged, nothing is
// expected).
constexpr int kLandThreads = 256;
extern "C" __global__ void __launch_bounds__(kLandThreads)
    epserve_off_node_combine_land(const bf16_t* __restrict__ landing, const int* __restrict__ topk_idx, int T, int k,
                                  int H, int experts_per_rank, int max_tokens, int rank, int world, int R,
                                  bf16_t* __restrict__ recv, unsigned long long* __restrict__ arrive,
                                  int units_per_slot, const int* __restrict__ status) {
  if (call_stopped(status)) return;
  __shared__ unsigned int landed[EPSERVE_MAX_WORLD];
  for (int s = threadIdx.x; s < world; s += blockDim.x) landed[s] = 0;
  __syncthreads();
  const int lane = threadIdx.x & 31, warps = blockDim.x >> 5;
  for (long long i = static_cast<long long>(blockIdx.x) * warps + (threadIdx.x >> 5); i < static_cast<long long>(T) * k;
       i += static_cast<long long>(gridDim.x) * warps) {
    const int e = topk_idx[i];
    if (e < 0) continue;
    const int s = e / experts_per_rank;
    if (s >= world || !off_node(s, rank, R)) continue;
    const long long block = off_node_block(s, rank / R * R, R);
    warp_copy(reinterpret_cast<uint4*>(recv + i * H),
              reinterpret_cast<const uint4*>(landing + (block * max_tokens * k + i) * H), H / 8, lane);
    if (lane == 0) atomicAdd(&landed[s], 1u);
  }
  __syncthreads();
  for (int s = threadIdx.x; s < world; s += blockDim.x)
    if (landed[s]) atomicAdd(arrive + s, static_cast<unsigned long long>(landed[s]) * units_per_slot);
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
