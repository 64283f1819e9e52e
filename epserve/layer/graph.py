"""forward as a CUDA graph (EPService.capture): decode serving replays one layer call per step
with no host work but a graph launch.

Nothing in the default forward depends on the host between its kernels: buffers are sized
for capacity and made once, tensor maps and kernel arguments are built once per buffer, row
counts stay on the device, and each epoch is a counter the device advances. So the kernels
one forward queues are the kernels every call needs, and a graph of them replays correctly
with fresh inputs copied into the captured buffers. A failure under a graph is recorded on
the device (out is poisoned) and raised by replay(check=True) or EPService.check().
"""

from __future__ import annotations

import cupy
import numpy as np

from epserve.arrays import BF16


class CapturedForward:
    """One captured forward. x [T, H] bf16, topk_idx [T, k] int32, topk_weights [T, k]
    float32: write the call's inputs here; out [T, H] bf16 holds its output after replay()."""

    def __init__(self, svc, tokens: int, w13, w2):
        c = svc.config
        self.svc, self.tokens = svc, int(tokens)
        self.x = cupy.zeros((tokens, c.hidden), BF16)
        self.topk_idx = cupy.full((tokens, c.top_k), -1, np.int32)
        self.topk_weights = cupy.zeros((tokens, c.top_k), np.float32)
        self.out = cupy.empty((tokens, c.hidden), BF16)
        self.w13, self.w2 = w13, w2  # the graph reads them by address: keep them alive
        self.stream = cupy.cuda.Stream(non_blocking=True)
        # The buffers were filled on the caller's stream, which a non-blocking stream does
        # not follow by itself: without this, route could read topk_idx before its fill.
        self.stream.wait_event(cupy.cuda.get_current_stream().record())
        with self.stream:
            # One eager call on this stream first, collective like every call: kernels load,
            # and the per-stream and per-buffer caches fill, so capture sees only launches.
            self._forward(check=True)
            self.stream.begin_capture()
            try:
                self._forward(check=False)
            finally:
                self.graph = self.stream.end_capture()

    def _forward(self, check: bool):
        return self.svc.forward(self.x, self.topk_idx, self.topk_weights, self.w13, self.w2, out=self.out,
                                check=check)

    def replay(self, check: bool | None = None) -> cupy.ndarray:
        """One forward on every rank, on the current stream; returns out. check (default: the
        service's check_errors) waits for the call and raises its failure, as eager forward."""
        self.graph.launch(stream=cupy.cuda.get_current_stream())
        if self.svc.check_errors if check is None else check:
            self.svc._raise_pending()
        return self.out
