"""EPService: one object per rank that owns the communicators, the symmetric buffers and the
compiled modules, and serves MoE layer calls (the layer is described in docs/design.md).

    with EPService(MoEConfig(...)) as svc:
        out = svc.forward(x, topk_idx, topk_weights, w13, w2)          # fused (peer sink)

Work is enqueued on the caller's current CuPy stream. The host waits on the GPU once per
dispatch: after the device-side count exchange, to learn how many rows this rank receives
(the size of GEMM 1's output) and to stop every rank, before any row moves, when some rank's
routing would overflow a capacity or some rank's input is bad. Nothing else synchronizes,
except the baselines: NCCL dispatch and the unfused NCCL combine gather the routing on the
host, and the IPC copy transports (ranks sharing a GPU) wait for every rank between steps.

Each call is collective: every rank calls the same methods in the same order. A bad input
raises the same kind of error on every rank (the rank that holds it gets the detailed
message) and leaves the service usable.
"""

from __future__ import annotations

from dataclasses import dataclass

import cupy

from . import comm as ep_comm
from . import ops
from .arrays import BF16, checked_array
from .combine import Combiner
from .config import MoEConfig, check_agreement
from .device_plan import DevicePlan
from .direct_dispatch import DirectDispatcher, Dispatched
from .dispatch import Dispatcher
from .errors import ConfigError
from .layout import check_recv_capacity, count_recv_rows, plan_dispatch
from .nccl_transport import gpus_shared, make_nccl
from .peers import PeerGroup
from .signals import SignalBlock

SINKS = ("peer", "null")
DISPATCHES = ("direct", "nccl")


@dataclass
class DispatchResult(Dispatched):
    """Dispatched rows plus what the combine needs to bring them home."""

    topk_idx: cupy.ndarray = None
    topk_weights: cupy.ndarray = None
    plan: DevicePlan | None = None  # the host-side plan, when the baseline dispatch made one

    @property
    def num_tokens(self) -> int:
        return self.topk_idx.shape[0]


class EPService:
    """One rank's share of an expert-parallel MoE layer: its experts' GEMMs, and the buffers
    through which the ranks exchange token rows (dispatch) and expert outputs (combine).

    Start one per rank, under MPI (``mpirun -n W python -m mpi4py your_program.py``), with the
    same MoEConfig on every rank; rank r owns experts [r * E/W, (r + 1) * E/W) and passes
    their weights to every call. Every method is collective: all ranks call the same methods
    in the same order, each with its own tokens (any number up to max_tokens_per_rank, zero
    included).

    Inputs are GPU arrays on this rank's device: CuPy arrays, or any object with
    ``__cuda_array_interface__`` or ``__dlpack__``, C-contiguous and of the exact dtype; they
    are viewed, never copied or converted. Outputs are CuPy arrays. bf16 means
    ``ml_dtypes.bfloat16`` (uint16 storage, or the ``<V2`` typestr, is accepted as bf16).

    Use it as a context manager, or call close(), which is collective too: it frees the
    symmetric buffers after every peer has unmapped them.

    Attributes: config; comm (the mpi4py communicator); rank and world (its rank and size);
    device (the CUDA device index this rank uses); shared_gpu (True where the ranks share one
    GPU); transport (the unfused combine's transport: "nccl", or "ipc" where ranks share a
    GPU, since NCCL refuses that).
    """

    def __init__(self, config: MoEConfig, comm=None, device=None):
        """Set up this rank's part of the layer. Collective over `comm`.

        config  the MoEConfig, the same on every rank; its world_size must be comm's size.
        comm    the mpi4py communicator of the ranks that serve the layer together (default
                MPI.COMM_WORLD); a sub-communicator serves a layer of its ranks only.
        device  the CUDA device index for this rank. Default: $EPSERVE_DEVICE if set, else
                the rank's index among the ranks on its node, modulo the node's GPU count
                (one GPU per rank when there are as many GPUs as ranks). It is made current
                before any other CUDA call.

        It compiles (or loads from the cache) the kernels, allocates the symmetric buffers
        (recv: max_tokens_per_rank * top_k * hidden bf16, plus the dispatch's token regions)
        and maps every peer's through CUDA IPC, and creates the NCCL communicator.

        Raises, on every rank alike: RankMismatchError when the ranks' configs differ or
        world_size is not comm's size (before any CUDA call); RankFailedError naming each
        rank that has no usable GPU or failed to allocate or map a buffer. MPI must be
        running: started without mpirun/mpiexec, the communicator has one rank.
        """
        self.config = config
        self.comm = ep_comm.world(comm)
        self.rank, self.world = self.comm.Get_rank(), self.comm.Get_size()
        check_agreement(config, self.comm)  # needs no GPU: a mismatch is reported before any CUDA call
        self.device = ep_comm.select_device(self.comm, device)
        self._closed = False
        self.group = PeerGroup(self.comm)
        with ep_comm.checked(self.comm, "EPService setup"):
            self.shared_gpu = gpus_shared(self.comm)
            self.transport = "ipc" if self.shared_gpu else "nccl"
        self.nccl = None if self.shared_gpu else make_nccl(self.comm)
        c = config
        self.signals = SignalBlock.create(self.group)
        self.direct = DirectDispatcher(self.group, self.signals, num_experts=c.num_experts, top_k=c.top_k,
                                       hidden=c.hidden, max_tokens=c.max_tokens_per_rank,
                                       max_recv_rows=c.recv_rows_capacity, wait_timeout_s=c.wait_timeout_s, dtype=BF16)
        self.baseline = Dispatcher(self.group, c.hidden, c.max_tokens_per_rank * c.top_k, self.transport, self.nccl,
                                   BF16)
        self.combiner = Combiner(self.group, self.signals, num_experts=c.num_experts, top_k=c.top_k, hidden=c.hidden,
                                 max_tokens=c.max_tokens_per_rank, wait_timeout_s=c.wait_timeout_s,
                                 transport=self.transport, nccl_comm=self.nccl, dtype=BF16)
        cupy.cuda.runtime.deviceSynchronize()
        self.comm.Barrier()

    # ---- validation ---------------------------------------------------------------------
    def _tokens(self, x, topk_idx, topk_weights):
        c = self.config
        x = checked_array(x, "x", "bf16", (None, c.hidden))
        T = x.shape[0]
        if T > c.max_tokens_per_rank:
            raise ConfigError(f"x has {T} tokens, more than max_tokens_per_rank = {c.max_tokens_per_rank}")
        topk_idx = checked_array(topk_idx, "topk_idx", "int32", (T, c.top_k))
        topk_weights = checked_array(topk_weights, "topk_weights", "float32", (T, c.top_k))
        return x, topk_idx, topk_weights

    def _weights(self, w13, w2):
        c = self.config
        w13 = checked_array(w13, "w13", "bf16", (c.experts_per_rank, 2 * c.intermediate, c.hidden))
        w2 = checked_array(w2, "w2", "bf16", (c.experts_per_rank, c.hidden, c.intermediate))
        return w13, w2

    @staticmethod
    def _check_choice(what: str, value, allowed: tuple) -> None:
        if value not in allowed:
            raise ConfigError(f"{what} must be one of {allowed}, got {value!r}")

    # ---- the layer ----------------------------------------------------------------------
    def dispatch(self, x, topk_idx, topk_weights, transport: str = "direct") -> DispatchResult:
        """Token rows to the ranks owning their experts, expert-contiguous there.

        transport "direct": each row crosses to a rank at most once, by IPC stores, expanded on
        arrival (one host wait, see the module docstring). "nccl": the baseline, planned on the
        host from the gathered routing; the IPC pull stands in where ranks share a GPU.
        Both give bitwise identical rows, offsets and src_info.

        A transport other than these raises ConfigError on the calling rank at once (the ranks
        cannot agree on a path they do not share); forward checks it on every rank together."""
        self._check_choice("dispatch transport", transport, DISPATCHES)
        error = None
        try:
            x, topk_idx, topk_weights = self._tokens(x, topk_idx, topk_weights)
        except ConfigError as exc:
            error = exc
        if transport == "direct":
            d = self.direct.dispatch(x, topk_idx, error)
            return DispatchResult(d.rows, d.expert_offsets, d.src_info, d.num_rows, topk_idx, topk_weights)
        ep_comm.collective_verdict(self.comm, "dispatch input", error)
        plan = self._host_plan(topk_idx)
        rows = self.baseline.dispatch(x, plan)
        return DispatchResult(rows, plan.expert_offsets, plan.src_info, plan.num_recv_rows, topk_idx, topk_weights,
                              plan)

    def _host_plan(self, topk_idx) -> DevicePlan:
        c = self.config
        routing = self.comm.allgather(cupy.asnumpy(topk_idx))
        # Every rank has every routing, so every rank reaches the same verdict.
        check_recv_capacity([count_recv_rows(d, routing, c.num_experts, self.world) for d in range(self.world)],
                            c.recv_rows_capacity)
        return DevicePlan.upload(plan_dispatch(self.rank, routing, c.num_experts, self.world), c.top_k)

    def expert_ffn(self, dispatched: DispatchResult, w13, w2, sink: str = "peer", out=None, gate: int = 0):
        """GEMM 1, SwiGLU and GEMM 2 over the dispatched rows; GEMM 2's epilogue hands its tiles
        to `sink`: "peer" writes them into their home ranks' recv (no C exists), "null" stores
        C and the baseline transport moves it. Returns the combined [T, H] output of this
        rank's tokens. w13, w2, out and the failures are as for forward. gate < 0 runs GEMM 2
        with the peer sink silenced and returns None (the math alone, for measurement)."""
        w13, w2, out = self._checked_ffn_inputs(sink, w13, w2, out, dispatched.num_tokens, "expert_ffn input")
        return self._expert_ffn(dispatched, w13, w2, sink, out, gate)

    def _checked_ffn_inputs(self, sink, w13, w2, out, tokens, stage, dispatch="direct"):
        """Collective: every rank raises if any rank's weights, sink, dispatch or out are bad."""
        error = None
        try:
            self._check_choice("sink", sink, SINKS)
            self._check_choice("dispatch", dispatch, DISPATCHES)
            w13, w2 = self._weights(w13, w2)
            if out is not None:
                out = checked_array(out, "out", "bf16", (tokens, self.config.hidden))
        except ConfigError as exc:
            error = exc
        ep_comm.collective_verdict(self.comm, stage, error)
        return w13, w2, out

    def _expert_ffn(self, d: DispatchResult, w13, w2, sink, out, gate):
        c = self.config
        M, I, H, e_loc = d.num_rows, c.intermediate, c.hidden, c.experts_per_rank
        act = cupy.empty((M, I), BF16)
        ops.gemm1_swiglu(d.rows, w13, act, d.expert_offsets, e_loc, I, H)
        comb = self.combiner
        if gate < 0:
            comb.gemm_only(act, w2, self._send_plan(d), I)
            return None
        if sink == "peer":
            out = comb.fused(act, w2, self._send_plan(d), d.topk_idx, d.topk_weights, I, out=out)
        else:
            C = cupy.empty((M, H), BF16)
            ops.grouped_gemm("null", act, w2, C, d.expert_offsets, e_loc, H, I)
            plan = self._send_plan(d) if self.transport == "ipc" else (d.plan or self._host_plan(d.topk_idx))
            out = comb.unfused(C, plan, d.topk_idx, d.topk_weights, out=out)
        return out

    @staticmethod
    def _send_plan(d: DispatchResult):
        """What the peer sink and the IPC push read: expert_offsets and src_info."""
        return d.plan if d.plan is not None else _RowSources(d.expert_offsets, d.src_info, d.num_rows)

    def forward(self, x, topk_idx, topk_weights, w13, w2, sink: str = "peer", dispatch: str = "direct", out=None):
        """The whole MoE layer for this rank's tokens: dispatch, GEMM 1, SwiGLU, GEMM 2, combine.

        With H = hidden, I = intermediate, k = top_k, E_loc = experts per rank, T <= max_tokens_per_rank:
            x             [T, H]           bf16     this rank's tokens
            topk_idx      [T, k]           int32    global expert ids in [0, num_experts); -1 marks an unused slot
            topk_weights  [T, k]           float32  router weights (any values; they are not normalized here)
            w13           [E_loc, 2I, H]   bf16     this rank's experts' gate (rows 0..I-1) and up (I..2I-1) projections
            w2            [E_loc, H, I]    bf16     this rank's experts' down projections
        Weights are in Linear layout (out features, in features), the inner dimension contiguous.

        Returns out [T, H] bf16, out[t] = sum over j with topk_idx[t, j] >= 0 of
        topk_weights[t, j] * expert(topk_idx[t, j])(x[t]), where expert(e)(v) =
        w2[e] @ (silu(w13[e][:I] @ v) * (w13[e][I:] @ v)). Each expert output is rounded to bf16,
        and the sum is taken in fp32 in ascending j and rounded to bf16 once, so the result is
        reproducible bit for bit. A token whose slots are all -1 gets zeros.

        sink      "peer" (default): GEMM 2's epilogue writes each output row straight into
                  its token's home rank (the fused layer). "null": GEMM 2 stores its output
                  locally and the transport brings it home (the unfused baseline). Both give
                  bitwise identical outputs.
        dispatch  "direct" (default): every token row crosses to each rank that owns one of
                  its experts once, by stores into that rank's memory. "nccl": the baseline,
                  planned on the host from the gathered routing. Both give identical rows.
        out       optional [T, H] bf16 array (C-contiguous, this device) to write into and
                  return; by default a new CuPy array is returned.

        Synchronization: the work goes on the current CuPy stream, and out is ready when that
        stream has done it. The host waits for the GPU once, in the direct dispatch (to learn
        how many rows arrive); the "nccl" dispatch and the unfused combine also gather routing
        on the host, and where the ranks share a GPU the unfused transport waits for every rank.

        Failures, on every rank alike and before any row moves: RankFailedError (an
        EPServeError) naming the rank and what was wrong when any rank's input is bad (shape,
        dtype, device, layout, an expert id out of range, an unknown sink or dispatch; the
        rank at fault may raise the ConfigError itself), ConfigError when some rank would
        receive more rows than MoEConfig.max_recv_rows. The service stays usable after these.
        A peer that stops answering makes the device-side waits run out after wait_timeout_s:
        the dispatch raises PeerTimeoutError naming the peer and the stage; in the combine
        the timeout is recorded on the device, out is not valid, and check() raises it.
        """
        tokens = getattr(x, "shape", (0,))[0]
        w13, w2, out = self._checked_ffn_inputs(sink, w13, w2, out, tokens, "forward input", dispatch)
        return self._expert_ffn(self.dispatch(x, topk_idx, topk_weights, dispatch), w13, w2, sink, out, 0)

    def check(self) -> None:
        """Synchronize the device, then raise what a device-side check recorded since the last
        check: PeerTimeoutError when a wait for a peer ran out (naming the peer and the stage),
        ConfigError when a row was refused. Local: no other rank takes part."""
        self.signals.raise_if_error(self.rank)

    # ---- lifetime -----------------------------------------------------------------------
    def close(self) -> None:
        """Collective teardown (synchronize, unmap the peers' buffers, barrier, free,
        barrier: docs/design.md, "IPC lifetime"); safe to call twice."""
        if self._closed:
            return
        self._closed = True
        self.group.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


@dataclass(frozen=True)
class _RowSources:
    expert_offsets: cupy.ndarray
    src_info: cupy.ndarray
    num_recv_rows: int

