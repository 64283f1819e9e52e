"""The off-node transfer alone, against an NCCL all-to-all of the same bytes (issue 15: "the
off-node transfer, timed alone, comes within 1.3 x of an NCCL all-to-all of the same bytes in
the same run"). With a forced node size, on two GPUs (the NCCL carrier, the production one):

    EPSERVE_RANKS_PER_NODE=1 python launch/run.py -n 2 -- python -m mpi4py \
        launch/jobs/time_off_node.py [--preset dsv3-prefill] [--tokens 4096] [--iters 50]

and on one GPU, as a smoke test (the IPC test carrier, which imitates the network over CUDA
IPC; NCCL refuses two ranks on one GPU, so the NCCL column is n/a):

    EPSERVE_OFFNODE_CARRIER=ipc EPSERVE_RANKS_PER_NODE=1 python launch/run.py -n 2 --share-gpu -- \
        python -m mpi4py launch/jobs/time_off_node.py --tokens 256

It sets EPSERVE_OFFNODE_SIZES=host itself, makes one direct dispatch at the preset's shape
with the bench's balanced routing (seed + T), so that the dispatch staging holds its rows and
the host its sizes, then times each carrier group of a call, as the service makes it
(epserve/comm/off_node.py): the count rows; the dispatch's token and routing blocks and the
combine's return blocks, each at capacity (EPSERVE_OFFNODE_SIZES=capacity, the default) and
at the routed sizes (host). Against each, on the service's NCCL communicator in the same run,
a grouped ncclSend/ncclRecv of the same bytes per peer (one message each way per peer). CUDA
events around one group on the stream, each timed group right behind an untimed one (so the
ranks start it together), warm-up first, the median of --iters, the slowest rank. #wrong: the
transfers (both the carrier's and NCCL's, all ranks) whose landed bytes differ from the bytes
the sender had (a checksum of each side). Exits 1 if any is wrong."""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

import cupy
import numpy as np
from job_report import emit
from mpi4py import MPI

from epserve import EPService
from epserve.arrays import BF16
from epserve.bench import presets
from epserve.comm import mpi as ep_comm
from epserve.comm.off_node_sizes import SIZES_ENV

_WEIGHTED = cupy.ElementwiseKernel("uint32 x", "uint64 y", "y = (unsigned long long)x * ((i & 65535) + 1)",
                                   "epserve_weighted_words")


def checksum(ptr: int, nbytes: int) -> tuple:
    """Two sums over the 4-byte words at ptr (every transfer here is whole words): plain, and
    weighted by position, so a shifted or swapped piece shows."""
    if nbytes == 0:
        return (0, 0)
    mem = cupy.cuda.MemoryPointer(cupy.cuda.UnownedMemory(ptr, nbytes, None), 0)
    words = cupy.ndarray((nbytes // 4,), np.uint32, memptr=mem)
    return int(words.sum(dtype=np.uint64)), int(_WEIGHTED(words).sum(dtype=np.uint64))


def wrong_transfers(comm, sends, recvs) -> int:
    """Collective: the receives (over all ranks) whose landed bytes differ from the matching
    send's, matched per peer in order as the carriers match them."""
    rank = comm.Get_rank()
    mine = {}
    for s in sends:
        mine.setdefault(s.peer, []).append(checksum(s.ptr, s.nbytes))
    sent = comm.allgather(mine)
    wrong, seen = 0, {}
    for r in recvs:
        i = seen.get(r.peer, 0)
        seen[r.peer] = i + 1
        theirs = sent[r.peer].get(rank, [])
        wrong += i >= len(theirs) or theirs[i] != checksum(r.dst, r.nbytes)
    return comm.allreduce(wrong)


@dataclasses.dataclass(frozen=True)
class Piece:
    """One transfer as the checksums see it: a peer, a device address, a size."""

    peer: int
    ptr: int
    nbytes: int
    dst: int = 0


def carrier_pieces(sends, recvs):
    return ([Piece(s.peer, s.staging.ptr + s.offset, s.nbytes) for s in sends],
            [Piece(r.peer, 0, r.nbytes, r.dst) for r in recvs])


class NcclAllToAll:
    """A grouped ncclSend/ncclRecv of `send_bytes[peer]` to each peer and `recv_bytes[peer]`
    from each: one message each way per peer, from and into plain buffers."""

    def __init__(self, nccl_comm, send_bytes: dict, recv_bytes: dict, seed: int):
        self.comm = nccl_comm
        self.send_bytes, self.recv_bytes = send_bytes, recv_bytes
        total_send, total_recv = sum(send_bytes.values()), sum(recv_bytes.values())
        rs = cupy.random.RandomState(seed)
        self.sendbuf = rs.randint(0, 2**31, size=max(1, total_send // 4), dtype=np.int64).astype(np.uint32)
        self.recvbuf = cupy.zeros(max(1, total_recv // 4), np.uint32)
        self.send_at = _offsets(send_bytes, self.sendbuf.data.ptr)
        self.recv_at = _offsets(recv_bytes, self.recvbuf.data.ptr)

    def __call__(self):
        from cupy.cuda import nccl

        stream = cupy.cuda.get_current_stream().ptr
        nccl.groupStart()
        try:
            for d, n in self.send_bytes.items():
                self.comm.send(self.send_at[d], n, nccl.NCCL_UINT8, d, stream)
            for s, n in self.recv_bytes.items():
                self.comm.recv(self.recv_at[s], n, nccl.NCCL_UINT8, s, stream)
        finally:
            nccl.groupEnd()

    def pieces(self):
        return ([Piece(d, self.send_at[d], n) for d, n in self.send_bytes.items()],
                [Piece(s, 0, n, self.recv_at[s]) for s, n in self.recv_bytes.items()])


def _offsets(sizes: dict, base: int) -> dict:
    at, out = base, {}
    for peer, n in sizes.items():
        out[peer] = at
        at += n
    return out


def per_peer(items) -> dict:
    out = {}
    for x in items:
        out[x.peer] = out.get(x.peer, 0) + x.nbytes
    return {p: n for p, n in out.items() if n}


def median_us(comm, fn, warmup: int, iters: int) -> float:
    """Median microseconds of fn on the stream, each timed call right behind an untimed one
    after a barrier; the slowest rank's."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(iters):
        cupy.cuda.runtime.deviceSynchronize()
        comm.Barrier()
        fn()
        start, stop = cupy.cuda.Event(), cupy.cuda.Event()
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        samples.append(cupy.cuda.get_elapsed_time(start, stop) * 1e3)
    return comm.allreduce(float(np.median(samples)), op=MPI.MAX)


def main():
    p = argparse.ArgumentParser(prog="launch/jobs/time_off_node.py")
    p.add_argument("--preset", default="dsv3-prefill", choices=sorted(presets.PRESETS))
    p.add_argument("--tokens", type=int, help="tokens per rank (default: the preset's)")
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--seed", type=int, default=17, help="the bench's seed (routing seed + T, x seed + 1000 rank)")
    args = p.parse_args()
    os.environ[SIZES_ENV] = "host"  # the routed sizes come from the host; the capacity groups need none
    comm = ep_comm.world()
    rank, world = comm.Get_rank(), comm.Get_size()
    pre, cfg, topk_all = presets.balanced_point(args.preset, args.tokens, world, args.seed)
    T, H, E, k = pre.tokens_per_rank, pre.hidden, pre.num_experts, pre.top_k
    with EPService(cfg, comm) as svc:
        off = svc.off_node
        if off is None:
            if rank == 0:
                emit(f"# time_off_node: {world} ranks form one node: set EPSERVE_RANKS_PER_NODE (1 on 2 ranks)")
            return 2
        idx = cupy.asarray(topk_all[rank])
        rs = cupy.random.RandomState(args.seed + 1000 * rank)
        x = rs.standard_normal((T, H), dtype=np.float32).astype(BF16)
        w = rs.uniform(0.05, 1.0, (T, k), dtype=np.float32)
        svc.dispatch(x, idx, w, "direct")  # staging filled, and the host holds this routing's sizes
        svc.check()
        sizes = off.last_sizes
        transfers = [("counts", "fixed", off.count_group()),
                     ("dispatch", "capacity", off.rows_group()), ("dispatch", "host", off.rows_group(sizes)),
                     ("combine", "capacity", off.combine_group()), ("combine", "host", off.combine_group(sizes))]
        nodes = svc.nodes
        if rank == 0:
            emit(f"# time_off_node: carrier {off.carrier.name}, route {off.route}, {world} ranks as {nodes.nodes} "
                 f"nodes of {nodes.ranks_per_node}, {pre.name} T={T} H={H} E={E} k={k}, balanced routing "
                 f"(seed {args.seed} + T)")
            emit(f"# warm-up {args.warmup}, median of {args.iters}, the slowest rank. bytes: what one rank sends per "
                 "call (the most of any rank); sizes capacity: whole blocks (the default), host: the routed rows "
                 f"({SIZES_ENV}=host)")
            emit("# nccl a2a: grouped ncclSend/ncclRecv of the same bytes per peer, one message each way, "
                 "the service's NCCL communicator" + (" (n/a: the ranks share a GPU)" if svc.nccl is None else ""))
            emit("#")
            emit(f"# {'transfer':<10}{'sizes':>9}{'bytes':>13}{'carrier us':>12}{'GB/s':>8}{'nccl us':>10}"
                 f"{'GB/s':>8}{'ratio':>8}{'#wrong':>8}")
        bad = 0
        for name, mode, (sends, recvs) in transfers:
            sent = comm.allreduce(sum(s.nbytes for s in sends), op=MPI.MAX)
            carrier_us = median_us(comm, lambda: off.carrier.exchange(sends, recvs), args.warmup, args.iters)
            wrong = wrong_transfers(comm, *carrier_pieces(sends, recvs))
            nccl_us = None
            if svc.nccl is not None:
                a2a = NcclAllToAll(svc.nccl, per_peer(sends), per_peer(recvs), args.seed + rank)
                nccl_us = median_us(comm, a2a, args.warmup, args.iters)
                wrong += wrong_transfers(comm, *a2a.pieces())
            bad += wrong

            def gbs(us):
                return f"{sent / us / 1e3:8.1f}" if us else f"{'n/a':>8}"

            if rank == 0:
                nccl_cols = (f"{nccl_us:10.1f}{gbs(nccl_us)}{carrier_us / nccl_us:8.2f}" if nccl_us
                             else f"{'n/a':>10}{'n/a':>8}{'n/a':>8}")
                emit(f"{name:<12}{mode:>9}{sent:13d}{carrier_us:12.1f}{gbs(carrier_us)}{nccl_cols}{wrong:8d}")
        if rank == 0:
            emit(f"# time_off_node: {'every transfer landed as sent' if not bad else f'{bad} transfers wrong'}")
        return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
