"""The direct dispatch as the bench times it twice, and the check both get (bf16 and FP8).

  dispatch-direct  EPService.dispatch: the public call, which waits once on the host for the
                   row count and the call's verdict and hands back the rows (the caller's
                   time, host included)
  dispatch-layer   EPService.dispatch(wait=False): the same kernels as forward queues them
                   (count + publish, rank + layout, move), no host wait, the row count left on
                   the device; timed with the calls queued back to back
                   (events.queued_samples_ms), so it is the GPU's time, as DeepEP's published
                   dispatch times are (its dispatch given a cached layout)

Each is checked once, before it is timed, into poisoned buffers: every row, expert offset and
src_info entry the call must write is set to all ones first, and the call's must then equal
a reference dispatch's bit for bit (the NCCL dispatch, or where ranks share a GPU the
host-planned one: another route, another move, the same bytes)."""

from __future__ import annotations

import cupy

from epserve.bench.wrong import bitwise_wrong
from epserve.check.testing import poison


class DispatchReference:
    """Copies of a reference dispatch's rows [M, H], expert_offsets and src_info [M]."""

    def __init__(self, dispatched):
        self.rows = dispatched.rows[:dispatched.num_rows].copy()
        self.expert_offsets = dispatched.expert_offsets.copy()
        self.src_info = dispatched.src_info[:dispatched.num_rows].copy()

    @property
    def num_rows(self) -> int:
        return self.rows.shape[0]

    def wrong(self, dispatcher, run) -> int:
        """Elements of dispatcher's buffers that differ from this reference after one call of
        run, with every element the call must write poisoned first. Waits for the GPU."""
        M = self.num_rows
        poison(dispatcher.rows[:M], dispatcher.expert_offsets, dispatcher.src_info[:M])
        run()
        cupy.cuda.get_current_stream().synchronize()
        return (bitwise_wrong(dispatcher.rows[:M], self.rows)
                + bitwise_wrong(dispatcher.expert_offsets, self.expert_offsets)
                + bitwise_wrong(dispatcher.src_info[:M], self.src_info))

