"""What the public dispatch returns, taken with one host wait, for both dispatchers: copies
of expert_offsets and src_info (at capacity, sliced once the count is known) and the row
count into pinned memory are queued behind the dispatch, then the error record's copy and
the wait (SignalBlock.raise_pending_or) cover them all, so the GPU has nothing left to do
after the wait. Plain stream copies: CuPy's elementwise copy costs several times their host
time, and the call's time is the host's when the dispatch is small."""

from __future__ import annotations

from dataclasses import dataclass

import cupy
import numpy as np


@dataclass
class Dispatched:
    """What dispatch returns: this rank's expert rows and where each came from. A dispatch that
    did not wait (EPService.dispatch(wait=False)) leaves the row count on the device: rows and
    src_info are then capacity-sized, num_rows is None, and expert_offsets[-1] holds M."""

    rows: cupy.ndarray            # [M, H] bf16, expert-contiguous (dispatch order)
    expert_offsets: cupy.ndarray  # [E_loc + 1] int32
    src_info: cupy.ndarray        # [M] int32, packed (rank << 24) | (token << 4) | slot
    num_rows: int | None          # M, or None when the count stayed on the device


class RowCount:
    """The row count of the dispatcher's last call (expert_offsets[-1]) read on the host."""

    def __init__(self, expert_offsets: cupy.ndarray):
        self._offsets = expert_offsets
        self._pinned = cupy.cuda.alloc_pinned_memory(4)
        self._host = np.frombuffer(self._pinned, np.int32, 1)

    def queue(self, stream: int) -> None:
        """Copy the count into pinned memory behind the work queued on `stream`."""
        cupy.cuda.runtime.memcpyAsync(self._pinned.ptr, self._offsets.data.ptr + self._offsets.nbytes - 4, 4,
                                      cupy.cuda.runtime.memcpyDeviceToHost, stream)

    def read(self) -> int:
        """The count queued last (after a wait that covers its copy)."""
        return int(self._host[0])

    def wait(self) -> int:
        """The count after the work queued so far on the current stream: one host wait."""
        stream = cupy.cuda.get_current_stream()
        self.queue(stream.ptr)
        stream.synchronize()
        return self.read()


def take(dispatcher, rank: int, input_error: BaseException | None, stream: int) -> Dispatched:
    """The result of the dispatch just queued on `stream` by `dispatcher` (its rows,
    expert_offsets, src_info, row_count and signals), after one host wait; raises as
    raise_pending_or does. rows are views of the dispatcher's buffers (valid until its next
    call); expert_offsets and src_info are the call's own copies."""
    offsets = cupy.empty_like(dispatcher.expert_offsets)
    src_info = cupy.empty_like(dispatcher.src_info)
    d2d = cupy.cuda.runtime.memcpyDeviceToDevice
    cupy.cuda.runtime.memcpyAsync(offsets.data.ptr, dispatcher.expert_offsets.data.ptr, offsets.nbytes, d2d, stream)
    cupy.cuda.runtime.memcpyAsync(src_info.data.ptr, dispatcher.src_info.data.ptr, src_info.nbytes, d2d, stream)
    dispatcher.row_count.queue(stream)
    dispatcher.signals.raise_pending_or(rank, input_error)
    M = dispatcher.row_count.read()
    return Dispatched(dispatcher.rows[:M], offsets, src_info[:M], M)
