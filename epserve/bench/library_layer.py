"""The whole MoE layer as a torch-free user composes it from libraries, planned on the device
the way an all-to-all token dispatcher does it (Megatron's, for one): the bench's strongest
`layer-library` row.

    1. sort the k slots of every token by expert (CuPy argsort); count rows per expert;
    2. NCCL all-to-all of the counts; one host wait to read them (cuBLAS per expert and the
       NCCL sizes need them on the host);
    3. NCCL grouped send/recv of one row per slot (no deduplication: a library has none);
    4. a CuPy scatter from (source rank, expert) blocks into expert-contiguous rows;
    5. cuBLAS per expert for GEMM 1, a CuPy elementwise SwiGLU, cuBLAS per expert for GEMM 2
       (CuPy 14 has no binding of cublasGemmGroupedBatchedEx);
    6. the inverse gather, NCCL send/recv back, a CuPy scatter into the slots, and the
       weighted sum over the k slots as one batched fp32 matmul (CuPy's reduction).

No MPI call per layer. It sums in another order than epserve, so it is checked within bf16
tolerance. Unused slots (expert id -1) move nothing and weigh nothing."""

from __future__ import annotations

import cupy
import numpy as np

from epserve.arrays import BF16
from epserve.bench.cublas import grouped_gemm_per_expert
from epserve.comm.nccl import exchange_rows


class LibraryLayer:
    def __init__(self, nccl_comm, rank: int, world: int, num_experts: int, hidden: int, intermediate: int,
                 swiglu):
        self.nccl, self.rank, self.world = nccl_comm, rank, world
        self.E, self.H, self.I = num_experts, hidden, intermediate
        self.e_loc = num_experts // world
        self.swiglu = swiglu  # (h [M, 2I], act [M, I], I) -> None: the CuPy elementwise SwiGLU
        self._ones = np.ones(world, np.int64)
        self._steps = np.arange(world, dtype=np.int64)

    def forward(self, x, topk_idx, topk_weights, w13, w2, out) -> None:
        W, E, e_loc, H = self.world, self.E, self.e_loc, self.H
        T, k = topk_idx.shape
        key = cupy.where(topk_idx < 0, E, topk_idx).ravel()
        order = cupy.argsort(key)  # slots grouped by expert, so by destination rank
        counts = cupy.bincount(key, minlength=E + 1)[:E].astype(np.int32)

        # 2. counts of my experts from every rank (a [W, e_loc] matrix), then one host wait.
        recv_counts = cupy.empty((W, e_loc), np.int32)
        exchange_rows(self.nccl, counts, self._ones, self._steps, recv_counts, self._ones, self._steps, e_loc * 4)
        both = cupy.asnumpy(cupy.concatenate([counts, recv_counts.ravel()]))
        sent = both[:E].reshape(W, e_loc).sum(axis=1)
        got_by_block = both[E:].reshape(W, e_loc)
        got = got_by_block.sum(axis=1)
        n_send, M = int(sent.sum()), int(got.sum())
        send_displs = np.concatenate([[0], np.cumsum(sent)[:-1]])
        recv_displs = np.concatenate([[0], np.cumsum(got)[:-1]])
        expert_offsets = np.concatenate([[0], np.cumsum(got_by_block.sum(axis=0))])

        # 3. one row per used slot, sorted by expert.
        send_rows = cupy.take(x, order[:n_send] // k, axis=0)
        recv_rows = cupy.empty((M, H), BF16)
        exchange_rows(self.nccl, send_rows, sent, send_displs, recv_rows, got, recv_displs, H * 2)

        # 4. received row r of block (s, e) goes to expert e's rows, after sources s' < s.
        target = self._expert_major_positions(recv_counts, M)
        rows = cupy.empty_like(recv_rows)
        rows[target] = recv_rows

        # 5. the experts.
        h = cupy.empty((M, 2 * self.I), BF16)
        act = cupy.empty((M, self.I), BF16)
        y = cupy.empty((M, H), BF16)
        grouped_gemm_per_expert(rows, w13, h, expert_offsets)
        self.swiglu(h, act, self.I)
        grouped_gemm_per_expert(act, w2, y, expert_offsets)

        # 6. back to the sources, into their slots, weighted and summed.
        back = cupy.empty((n_send, H), BF16)
        exchange_rows(self.nccl, cupy.take(y, target, axis=0), got, recv_displs, back, sent, send_displs, H * 2)
        slots = cupy.zeros((T * k, H), np.float32)
        slots[order[:n_send]] = back.astype(np.float32)
        weights = cupy.where(topk_idx < 0, 0.0, topk_weights).astype(np.float32)
        out[...] = cupy.matmul(weights[:, None, :], slots.reshape(T, k, H))[:, 0, :].astype(BF16)

    def _expert_major_positions(self, recv_counts, M: int):
        """For each received row (blocks by source rank, then expert), its row in the
        expert-contiguous order (blocks by expert, then source rank); on the device."""
        c = recv_counts.astype(np.int64)                     # [W, e_loc]
        recv_base = (cupy.cumsum(c.ravel()) - c.ravel())     # block starts, source-major
        by_expert = c.T.ravel()                              # [e_loc * W], expert-major
        target_base = (cupy.cumsum(by_expert) - by_expert).reshape(self.e_loc, self.world).T.ravel()
        r = cupy.arange(M, dtype=np.int64)
        block = cupy.searchsorted(recv_base, r, side="right") - 1
        # Empty blocks share their start with the next one; searchsorted's "right" lands on
        # the last block starting at or before r, which is the non-empty one holding r.
        return target_base[block] + r - recv_base[block]
