"""Direct-store dispatch (cuda/comm/dispatch.cu): each token row crosses to a destination
rank at most once, through that rank's IPC-mapped token regions, and is expanded there into
the expert-contiguous rows of the dispatch order, with counts exchanged on the device.

Three launches a call (epserve/dispatch/route.py's two, then the move kernel), no host wait
and no MPI message: every rank's count row reaches every rank's table, so every rank's layout
(the rank kernel's last CTA) reaches the same verdict (a rejected input, a bad expert id, a receive
overflow) and writes it into the call status, which every later kernel reads. The rows,
expert_offsets and src_info live in buffers sized for max_recv_rows, allocated once; the row
count never leaves the device. A stopped call still runs every kernel (moving nothing) and
releases the buffers, so the next call finds the protocol in step.

With FP8 experts (quantize_cols = H), the move kernel of the "dispatch_quantize" build reads
this rank's bf16 tokens x [T, H] and quantizes each row, 1 x 128, into the packed FP8 row the
dispatch moves (epserve.ffn.fp8.packed_row_bytes(H) bytes: the bits quantize_rows_packed_spec
gives) as it sends it and stores this rank's own rows: no quantize launch, x read once.
quantize_in_send = False takes already packed rows instead (the unfused path, for checks).
"""

from __future__ import annotations

import cupy
import numpy as np

from epserve.comm import signals as sig
from epserve.dispatch import result
from epserve.dispatch.result import Dispatched, RowCount
from epserve.dispatch.route import Route
from epserve.ffn.fp8 import packed_row_bytes
from epserve.runtime import kernels
from epserve.runtime.kernel_structs import i32, launch_arg, pack_dispatch_config, u64
from epserve.runtime.launch import LaunchSequence, Recording
from epserve.runtime.replay import LaunchReplay

INPUT_REJECTED = 100  # EPSERVE_INPUT_REJECTED: the code a rank puts in its count row when its own input failed

_NULL = u64(0)
_NOT_REPLAYABLE = object()  # a key whose recorded launches LaunchReplay refused: built every call
_MAX_REPLAYS = 64  # recorded dispatches kept (token counts x streams x settings)

MOVE_THREADS = 256  # kMoveThreads in dispatch_common.cuh: a warp per token row
MOVE_BLOCKS_PER_SM = 3  # kMoveBlocksPerSm: one send and two expand blocks, all resident at once
RESERVED_SHARED_PER_BLOCK = 1024  # bytes of an SM's shared memory the driver keeps per block (Hopper)
ARRIVAL_CHUNK = 32  # kArrivalChunk in dispatch.cu: token rows per arrival counter
RELEASE_THREADS = 256


def own_row_staging_bytes(hidden: int, static_bytes: int, block_optin: int, per_sm: int) -> int:
    """Dynamic shared memory for the quantizing move's staging rows (a packed row of `hidden`
    2-byte units a warp), or 0 where its MOVE_BLOCKS_PER_SM blocks would then not all fit on
    an SM: the move's expand blocks wait for the peers' send blocks, so the grid must be
    resident at once."""
    staging = MOVE_THREADS // 32 * 2 * hidden
    if staging + static_bytes > block_optin:
        return 0
    if MOVE_BLOCKS_PER_SM * (staging + static_bytes + RESERVED_SHARED_PER_BLOCK) > per_sm:
        return 0
    return staging


class DirectDispatcher:
    """One rank's direct dispatch. After enqueue, `rows`, `expert_offsets` and `src_info` hold
    this call's rows (capacity-sized; expert_offsets[-1] rows are valid) until the next call,
    and `status` the call status (cuda/common/errors.cuh)."""

    off_node = None  # epserve/comm/off_node.py OffNode when the ranks span several nodes

    def __init__(self, group, signals, *, num_experts: int, top_k: int, hidden: int, max_tokens: int,
                 max_recv_rows: int, wait_timeout_s: float, dtype, off_node=None, quantize_cols: int = 0):
        self.group, self.signals = group, signals
        self.off_node = off_node  # epserve/comm/off_node.py: the ranks of other nodes, or None (one node)
        self.rank, self.world = group.rank, group.world
        self.E, self.k, self.H, self.max_tokens = num_experts, top_k, hidden, max_tokens
        self.max_recv_rows = max_recv_rows
        self.timeout_ns = int(wait_timeout_s * 1e9)
        self.dtype = dtype
        W = self.world
        self.row = self.E + W + 1
        self.meta_len = 1 + 2 * top_k
        self._table = group.allocate(W * self.row * 4)
        self._tokens = group.allocate(W * max_tokens * hidden * 2)
        self._meta = group.allocate(W * max_tokens * self.meta_len * 4)
        self.route = Route("direct", num_experts=num_experts, world=W, top_k=top_k, max_tokens=max_tokens)
        self._base = cupy.empty((W, self.E // W), np.int32)
        self.status = cupy.zeros(2, np.int32)
        self.expert_offsets = cupy.zeros(self.E // W + 1, np.int32)
        self.rows = cupy.zeros((max_recv_rows, hidden), dtype)
        self.src_info = cupy.zeros(max_recv_rows, np.int32)
        # Arrival counters [W][max_chunks] u64 on every rank, by sender and chunk of 32 token
        # rows; they only grow, and expected_chunk (local, the same shape) holds what the
        # earlier calls promised. Zeroed before any peer can count into them (the barrier).
        self._max_chunks = (max_tokens + ARRIVAL_CHUNK - 1) // ARRIVAL_CHUNK
        self._chunk_arrive = group.allocate(W * self._max_chunks * 8)
        self._chunk_arrive.view(np.uint64, (W * self._max_chunks,)).fill(0)
        # by rank: null for the ranks of other nodes (their rows come by the carrier, uncounted)
        chunk_ptrs = [p if group.reaches(d) else 0 for d, p in enumerate(self._chunk_arrive.peer_ptrs)]
        self._chunk_ptrs = cupy.asarray(np.array(chunk_ptrs, np.uint64))
        self._expected_chunk = cupy.zeros(W * self._max_chunks, np.uint64)
        # The move kernel's count of finished blocks: its last block releases the dispatch
        # and zeroes it. fuse_release=False launches the release kernel instead (timing).
        self._done = cupy.zeros(1, np.uint32)
        self.fuse_release = True
        # own_in_send: the send warps also store this rank's own expert rows, from the registers
        # they loaded each row into (x read once, not twice); off, the expand blocks read x again
        # for them. Bitwise the same rows either way; launch/jobs/time_dispatch.py times both.
        self.own_in_send = False
        # FP8 experts: x is bf16 [T, quantize_cols] and the move quantizes it into the packed
        # rows (hidden 2-byte units each) it moves; quantize_in_send False: x is packed already.
        if quantize_cols and 2 * hidden != packed_row_bytes(quantize_cols):
            raise ValueError(f"rows of {hidden} 2-byte units are not packed FP8 rows of {quantize_cols} columns")
        self.quantize_cols = quantize_cols
        self.quantize_in_send = bool(quantize_cols)
        cupy.cuda.runtime.deviceSynchronize()
        group.comm.Barrier()
        mod = kernels.module("dispatch")
        self._move = mod.get_function("epserve_dispatch_move")
        self._move_quantize = kernels.module("dispatch_quantize").get_function("epserve_dispatch_move") \
            if quantize_cols else None
        self._x_cols = i32(quantize_cols)
        # stage_own_rows: the quantizing move stages each of this rank's own rows in shared
        # memory and the bulk copy engine writes its expert rows (quantize_row_to_many_staged);
        # off, the warps store them. The same bits either way; launch/jobs/time_dispatch.py
        # times both. Off by default: on an H100 the move took 138 us staged against 129 by
        # the warps (dsv3-prefill-fp8, 4096 tokens, one rank; notes/dispatch.md, thirty-first
        # session); an H200 microbench had it 9% faster. It has no effect where the staging
        # rows would not leave the move's three blocks an SM (_staging_bytes 0: wide rows).
        self._staging_bytes = self._own_row_staging_bytes() if quantize_cols else 0
        self.stage_own_rows = False
        self._release = mod.get_function("epserve_dispatch_release")
        self._sms = cupy.cuda.Device().attributes["MultiProcessorCount"]
        # Nothing in it changes between calls (the epoch is on the device): packed and wrapped once.
        self._cfg = launch_arg(self._config())
        # The move kernel's expand blocks wait for the peers' send blocks, which wait for
        # nothing, so all of them must be resident at once: it asks for at most 1 (send) +
        # 2 (expand) blocks an SM, and the kernel's launch bound keeps its registers within
        # three blocks (kMoveBlocksPerSm; tests/cpu/test_dispatch_residency.py). Two
        # expand blocks an SM whatever the token count: with fewer rows than warps (decode)
        # the kernel gives each row several warps (dispatch.cu, expand_tokens).
        # send_blocks_max and expand_blocks may be changed before the first call of a T
        # (launch/jobs/time_dispatch.py tries others).
        self.send_blocks_max = self._sms
        self.expand_blocks = self._sms * 2
        self._max_chunks_arg = i32(self._max_chunks)
        self.row_count = RowCount(self.expert_offsets)
        self._shapes = {}  # (T, rejected) -> the launches' grids and int arguments
        # The launches, prepared once per (T, rejected): a call rewrites only x and topk_idx.
        # launch/jobs/time_dispatch.py sets launches.prepared = False to wrap each kernel.
        self.launches = LaunchSequence()
        # The public dispatch's launches, recorded at the first call of a key and replayed as
        # one CUDA graph (runtime/replay.py), as forward does: it waits for the GPU, so the
        # host's time is the call's. replay_dispatch = False builds them every call (checks).
        self._replays = {}
        self.replay_dispatch = True
        self.replayed_calls = 0
        if off_node is not None:  # its sized transfers and compact land read these
            off_node.bind_dispatch(self._table.ptr, self._tokens.ptr, self._meta.ptr, self.route.slot_rank)

    def _own_row_staging_bytes(self) -> int:
        """The quantizing move's dynamic shared memory for its staging rows, set on the kernel
        (0: none, the warps store the own rows)."""
        fn, attrs = self._move_quantize, cupy.cuda.Device().attributes
        staging = own_row_staging_bytes(self.H, fn.shared_size_bytes, attrs["MaxSharedMemoryPerBlockOptin"],
                                        attrs["MaxSharedMemoryPerMultiprocessor"])
        if staging:
            fn.max_dynamic_shared_size_bytes = staging
        return staging

    @property
    def quantizes(self) -> bool:
        """Whether enqueue takes bf16 tokens [T, quantize_cols] and the move quantizes them."""
        return self.quantize_in_send and bool(self.quantize_cols)

    def quantizes_call(self, x) -> bool:
        """Whether the move quantizes this call's x: with `quantizes`, unless x is uint8, rows
        packed already ([T, 2H] bytes: the tokens came quantized, and the plain move carries
        them). Told by the dtype, not the width: at H = 128 a packed row (256 bytes on whole
        lines) is as wide as a bf16 token."""
        return self.quantizes and getattr(x, "dtype", None) != np.uint8

    def _launch_shape(self, T: int, rejected: bool) -> tuple:
        """What the launches of a call with T tokens take besides the pointers, made once per T."""
        key = (T, rejected)
        shape = self._shapes.get(key)
        if shape is None:
            send_blocks = max(1, min(self.send_blocks_max, (T + 7) // 8))
            shape = self._shapes[key] = (i32(T), i32(INPUT_REJECTED if rejected else 0),
                                         (send_blocks + self.expand_blocks,), i32(send_blocks))
        return shape

    def _config(self) -> np.ndarray:
        s, W, g = self.signals, self.world, self.group
        node = g.node_ranks  # the address tables hold this node's ranks (common/nodes.cuh)
        tables = dict(count_table=g.node_table(self._table.peer_ptrs), tokens=g.node_table(self._tokens.peer_ptrs),
                      meta=g.node_table(self._meta.peer_ptrs),
                      count_arrive=[s.peer(d, sig.COUNT_ARRIVE) for d in node],
                      ready=[s.peer(d, sig.DISPATCH_READY) for d in node])
        # the other nodes' ranks: by arithmetic into the dispatch staging (off_node.py)
        staging = self.off_node.dispatch_staging() if self.off_node is not None else \
            dict(off_count_row=0, off_blocks=0, off_block_bytes=0)
        return pack_dispatch_config(
            **tables, **staging, ranks_per_node=len(node), node_first=node.start,
            my_ready=s.local(sig.DISPATCH_READY), my_count_arrive=s.local(sig.COUNT_ARRIVE),
            error=s.local(sig.ERROR), status=self.status.data.ptr, timeout_ns=self.timeout_ns, rank=self.rank,
            world=W, num_experts=self.E, top_k=self.k, hidden=self.H, max_tokens=self.max_tokens,
            max_recv_rows=self.max_recv_rows)

    def enqueue(self, x: cupy.ndarray | None, topk_idx: cupy.ndarray | None, rejected: bool = False,
                arm_combine: tuple | None = None) -> None:
        """Queue one dispatch on the current stream; no host wait. x [T, H] bf16 and topk_idx
        [T, k] int32 are already checked on the host; rejected=True (x and topk_idx None) when
        this rank's own input failed those checks: it then takes part with no tokens, and its
        count row tells every rank to stop the call. arm_combine: (u64 of the combine's
        expected counters, i32 of its units per slot) for the layout to arm this call's
        combine (then the combine must not arm it again: Combiner.fused(armed=True)). When
        `quantizes`, x is the bf16 tokens [T, quantize_cols] or the rows packed already (uint8
        [T, 2H]: the plain move, see quantizes_call), else the rows as they move [T, H]."""
        cfg = self._cfg
        T = 0 if rejected else x.shape[0]
        t, code, move_grid, send_blocks = self._launch_shape(T, rejected)
        quantize = self.quantizes_call(None if rejected else x)
        width = self.quantize_cols if quantize else 2 * self.H if getattr(x, "dtype", None) == np.uint8 else self.H
        if T and x.shape[1] != width:
            raise ValueError(f"x has rows of {x.shape[1]} elements, this dispatch takes {width}"
                             f"{' (bf16 tokens)' if quantize else ''}")
        if T == 0:
            x = topk_idx = _NULL  # a null pointer (an empty array's may be anything)
        route = self.route
        move_args = (x, t, topk_idx, route.tok_pos, route.slot_rank, cfg, self._base, self.rows, self.src_info,
                     self.expert_offsets, send_blocks, self._chunk_ptrs, self._expected_chunk, self._max_chunks_arg,
                     self._done if self.fuse_release else _NULL, i32(1 if self.own_in_send else 0))
        if quantize:  # the quantizing build takes x's width last
            move, move_args = self._move_quantize, move_args + (self._x_cols,)
        else:
            move = self._move
        specs = [
            route.count_publish_spec(topk_idx, T, t, code, cfg),
            route.rank_layout_spec(topk_idx, T, t, cfg, self.expert_offsets, self._base,
                                   *(arm_combine or (_NULL, i32(0)))),
            (move, move_grid, (MOVE_THREADS,), move_args,
             self._staging_bytes if quantize and self.stage_own_rows else 0),
        ]
        if not self.fuse_release:
            specs.append((self._release, (1,), (RELEASE_THREADS,), (cfg, self._expected_chunk, self._max_chunks_arg),
                          0))
        if self.off_node is None:
            self.launches.run((T, rejected, arm_combine is not None), specs)
            return
        # Across nodes (docs/design.md, "Across nodes"): the count rows cross between count +
        # publish and the layout, the staged token blocks after the move, then their expansion.
        # With sizes through the host (EPSERVE_OFFNODE_SIZES=host) the count table goes to the
        # host right after the count rows' group, the host waits for it while the GPU runs the
        # layout and the move, and the blocks cross at their routed sizes; then sink_src_info
        # for the compact return (epserve/comm/off_node_sizes.py).
        off = self.off_node
        self.launches.run((T, rejected, "count"), specs[:1])
        off.exchange_counts(self._table.ptr, cfg)
        if off.host_sizes:
            off.counts_to_host(self._table.ptr)
        self.launches.run((T, rejected, arm_combine is not None, "move"), specs[1:])
        sizes = off.await_sizes() if off.host_sizes else None
        off.exchange_rows(self._tokens.ptr, self._meta.ptr, self.status, sizes, cfg, self.expert_offsets,
                          self.E // self.world)
        expand = [off.expand_spec(cfg, self._base, self.rows, self.src_info, self.expert_offsets, self.expand_blocks)]
        if off.host_sizes:
            expand.append(off.return_slots_spec(self.src_info, self.expert_offsets, self._base, self._table.ptr,
                                                self.status))
        self.launches.run(("off-node expand", off.host_sizes), expand)

    def rows_received(self) -> int:
        """This call's row count, read on the host (waits for the stream): for the baselines
        and the public dispatch, never for forward."""
        return self.row_count.wait()

    def dispatch(self, x: cupy.ndarray | None, topk_idx: cupy.ndarray | None, input_error: BaseException | None = None
                 ) -> Dispatched:
        """Dispatch and wait for it: every rank raises when any rank's input was bad or some
        rank would overflow its receive capacity (this rank's own input_error, when it has
        one). The rows returned are views of this dispatcher's buffers, valid until the next
        dispatch; expert_offsets and src_info are the call's own copies (epserve/dispatch/result.py)."""
        stream = cupy.cuda.get_current_stream().ptr
        if self.replay_dispatch and input_error is None and self.off_node is None and x.shape[0]:
            self._enqueue_replayed(x, topk_idx, stream)
        else:
            self.enqueue(x, topk_idx, rejected=input_error is not None)
        return result.take(self, self.rank, input_error, stream)

    def _enqueue_replayed(self, x: cupy.ndarray, topk_idx: cupy.ndarray, stream: int) -> None:
        """enqueue for a one-node call with good input, its launches recorded once per key
        (everything that shapes them: the token count, the stream, the grids and builds
        launch/jobs/time_dispatch.py may change) and replayed with x and topk_idx rewritten."""
        key = (x.shape[0], stream, self.quantizes_call(x), self.own_in_send, self.stage_own_rows, self.fuse_release,
               self.send_blocks_max, self.expand_blocks, self._move, self._move_quantize)
        replay = self._replays.get(key)
        inputs = {"x": x, "topk_idx": topk_idx}
        if replay is None and self.launches.prepared:
            with Recording() as recording:
                self.enqueue(x, topk_idx)
            if recording.complete:
                if len(self._replays) >= _MAX_REPLAYS:
                    self._replays.clear()
                self._replays[key] = LaunchReplay.of(recording, inputs) or _NOT_REPLAYABLE
        elif replay is None or replay is _NOT_REPLAYABLE:
            self.enqueue(x, topk_idx)
        else:
            replay(inputs, stream)
            self.replayed_calls += 1

    @property
    def graph_replays(self) -> int:
        """Replayed dispatches that went out as one CUDA graph launch."""
        return sum(r.graph_launches for r in self._replays.values() if isinstance(r, LaunchReplay))
