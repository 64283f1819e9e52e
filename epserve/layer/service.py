"""EPService: one object per rank that owns the communicators, the symmetric buffers and the
compiled modules, and serves MoE layer calls (the layer is described in docs/design.md).

    with EPService(MoEConfig(...)) as svc:
        out = svc.forward(x, topk_idx, topk_weights, w13, w2)          # fused (peer sink)

Work is enqueued on the caller's current CuPy stream. The default forward (direct dispatch,
peer sink) makes no MPI call and waits for the GPU at most once, at its end, to raise a
failure on every rank (check_errors=False leaves even that to check()); it can be captured in
a CUDA graph (capture()). Its buffers are sized for capacity when the service starts, the
row counts and the epochs stay on the device, and the ranks agree on a call's fate from the
count rows they exchange on the device (docs/design.md, "Synchronisation"). The NCCL
transport (dispatch="nccl", with either sink, where every rank has its own GPU) is planned on
the device the same way, its count rows exchanged by an ncclAllGather on the stream: no MPI
call, no host wait but the final check. The baselines that remain plan on the host: the
NCCL dispatch where ranks share a GPU (an IPC pull then) gathers the routing with MPI, the
unfused IPC combine reads the row count, and the step-by-step expert_ffn with the null sink
plans its NCCL combine from the gathered routing.

Each call is collective: every rank calls the same methods in the same order. A bad input
raises the same kind of error on every rank (the rank that holds it gets the detailed
message) and leaves the service usable.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import cupy
import numpy as np

from epserve.arrays import BF16, checked_array
from epserve.combine.combiner import Combiner
from epserve.comm import mpi as ep_comm
from epserve.comm import signals as sig
from epserve.comm.nccl import gpus_shared, make_nccl
from epserve.comm.off_node import agree_carrier, make_off_node
from epserve.comm.off_node_dedup import agree_dedup
from epserve.comm.off_node_overlap import OVERLAP_ENV, agree_overlap
from epserve.comm.off_node_relay import agree_route
from epserve.comm.off_node_sizes import SIZES_ENV, agree_sizes
from epserve.comm.peers import PeerGroup
from epserve.comm.signals import SignalBlock
from epserve.comm.topology import gather_node_layout
from epserve.config import MoEConfig, check_agreement
from epserve.dispatch.device_plan import DevicePlan
from epserve.dispatch.direct import DirectDispatcher
from epserve.dispatch.host import Dispatcher
from epserve.dispatch.host_plan import check_recv_capacity, count_recv_rows, plan_dispatch
from epserve.dispatch.nccl import NcclDispatcher
from epserve.dispatch.result import Dispatched
from epserve.errors import ConfigError, EPServeError, PeerTimeoutError
from epserve.ffn import fp8, fp8_stage, gemm, tiles
from epserve.ffn.fp8 import packed_row_bytes
from epserve.ffn.fp8_stage import FP8Buffers
from epserve.runtime.kernel_structs import i32, u64
from epserve.runtime.launch import LaunchSequence, Recording
from epserve.runtime.replay import LaunchReplay

SINKS = ("peer", "null")
DISPATCHES = ("direct", "nccl")


@dataclass
class DispatchResult(Dispatched):
    """Dispatched rows plus what the combine needs to bring them home."""

    topk_idx: cupy.ndarray = None
    topk_weights: cupy.ndarray = None
    plan: DevicePlan | None = None  # the host-side plan, when the baseline dispatch made one
    after_direct: bool = False  # the rows came by the direct dispatch (its state serves their combine)
    # a dispatch that did not wait: its call status (the verdict, on the device), which the
    # expert FFN's kernels read, so that a stopped call computes nothing and poisons its output
    status: cupy.ndarray | None = None

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

    def __init__(self, config: MoEConfig, comm=None, device=None, check_errors: bool = True):
        """Set up this rank's part of the layer. Collective over `comm`.

        config  the MoEConfig, the same on every rank; its world_size must be comm's size.
        comm    the mpi4py communicator of the ranks that serve the layer together (default
                MPI.COMM_WORLD); a sub-communicator serves a layer of its ranks only.
        device  the CUDA device index for this rank. Default: $EPSERVE_DEVICE if set, else
                the rank's index among the ranks on its node, modulo the node's GPU count
                (one GPU per rank when there are as many GPUs as ranks). It is made current
                before any other CUDA call.
        check_errors  the default of forward's `check`: True makes every eager forward wait
                for its own end and raise a failure on every rank; False leaves that to check().

        It compiles (or loads from the cache) the kernels, allocates the symmetric buffers
        (recv: max_tokens_per_rank * top_k * hidden bf16, plus the dispatch's token regions)
        and maps every peer's through CUDA IPC, and creates the NCCL communicator.

        Raises, on every rank alike: RankMismatchError when the ranks' configs differ or
        world_size is not comm's size (before any CUDA call); ConfigError when the ranks'
        placement is unusable (epserve/comm/topology.py), the grouped GEMM's settings
        (EPSERVE_GEMM, EPSERVE_GEMM2_SPLIT_K) are unknown or differ, or, across nodes, the off-node carrier
        (EPSERVE_OFFNODE_CARRIER), sizes (EPSERVE_OFFNODE_SIZES), overlap
        (EPSERVE_OFFNODE_OVERLAP, EPSERVE_OFFNODE_OVERLAP_SMS), route (EPSERVE_OFFNODE_ROUTE) or
        deduplication (EPSERVE_OFFNODE_DEDUP) are unknown or differ between ranks, or deduplication is
        asked for where it does not apply (without the relay, with routed sizes or the overlap), also
        before any CUDA call, or the carrier cannot run here (nccl where ranks share a
        GPU); RankFailedError naming each
        rank that has no usable GPU or failed to allocate or map a buffer. MPI must be
        running: started without mpirun/mpiexec, the communicator has one rank.
        """
        self.config = config
        self.check_errors = bool(check_errors)
        # the PeerTimeoutError after which this service cannot go on, kept without its traceback:
        # its frames hold this service, and a cycle would leave the NCCL communicator to the
        # garbage collector, whose destroy is collective inside a node (docs/design.md)
        self._lost = None
        self.comm = ep_comm.world(comm)
        self.rank, self.world = self.comm.Get_rank(), self.comm.Get_size()
        check_agreement(config, self.comm)  # needs no GPU: a mismatch is reported before any CUDA call
        self.nodes = gather_node_layout(self.comm)  # every rank computes it alike, and raises alike
        self._carrier = agree_carrier(self.comm, self.nodes)  # across nodes: the off-node carrier's name
        self._offnode_sizes = agree_sizes(self.comm, self.nodes.nodes)  # across nodes: "capacity" or "host"
        self._offnode_overlap = agree_overlap(self.comm, self.nodes.nodes)  # across nodes: free SMs, or None
        # across nodes: "direct" or "relay" (along the rails, then over NVLink)
        self._offnode_route = agree_route(self.comm, self.nodes.nodes)
        # across nodes, the relay only: each token row once per destination node (or ConfigError)
        self._offnode_dedup = agree_dedup(self.comm, self.nodes.nodes, self._offnode_route, self._offnode_sizes,
                                          self._offnode_overlap)
        # The grouped GEMM's settings (EPSERVE_GEMM, EPSERVE_GEMM2_SPLIT_K): a name that does not
        # exist would otherwise raise mid-forward, after the dispatch has moved rows.
        ep_comm.agree_choice(self.comm, gemm.gemm_impl, "EPSERVE_GEMM", "grouped GEMMs")
        ep_comm.agree_choice(self.comm, tiles.split_mode, tiles.SPLIT_ENV, "GEMM 2 split modes")
        self.device = ep_comm.select_device(self.comm, device)
        self._closed = False
        self.group = PeerGroup(self.comm, self.nodes)  # IPC mappings inside this rank's node only
        with ep_comm.checked(self.comm, "EPService setup"):
            self.shared_gpu = gpus_shared(self.comm)
            self.transport = "ipc" if self.shared_gpu else "nccl"
        self.nccl = None if self.shared_gpu else make_nccl(self.comm)
        c = config
        self.fp8 = c.expert_dtype == "fp8"
        # The rows the dispatch moves: bf16 tokens, or with FP8 experts packed e4m3 rows (values
        # and scales, epserve/ffn/fp8_stage.py), which the dispatchers carry as rows of this width.
        width = fp8_stage.dispatch_width(c.hidden) if self.fp8 else c.hidden
        self.signals = SignalBlock.create(self.group)
        # Across nodes: staging and the carrier for the other nodes' ranks (None on one node).
        self.off_node = make_off_node(self.comm, self.group, self.signals, self.nodes, self._carrier,
                                      num_experts=c.num_experts,
                                      top_k=c.top_k, hidden=width, combine_hidden=c.hidden,
                                      max_tokens=c.max_tokens_per_rank, wait_timeout_s=c.wait_timeout_s,
                                      nccl_comm=self.nccl, shared_gpu=self.shared_gpu,
                                      sizes=self._offnode_sizes, max_recv_rows=c.recv_rows_capacity,
                                      overlap_free_sms=self._offnode_overlap, route=self._offnode_route,
                                      dedup=self._offnode_dedup)
        self.direct = DirectDispatcher(self.group, self.signals, num_experts=c.num_experts, top_k=c.top_k,
                                       hidden=width, max_tokens=c.max_tokens_per_rank,
                                       max_recv_rows=c.recv_rows_capacity, wait_timeout_s=c.wait_timeout_s, dtype=BF16,
                                       off_node=self.off_node, quantize_cols=c.hidden if self.fp8 else 0)
        # The NCCL transport planned on the device; its buffers are made on first use.
        self.nccl_path = None if self.shared_gpu else NcclDispatcher(
            self.nccl, self.signals, rank=self.rank, world=self.world, num_experts=c.num_experts, top_k=c.top_k,
            hidden=width, max_tokens=c.max_tokens_per_rank, max_recv_rows=c.recv_rows_capacity, dtype=BF16,
            combine_hidden=c.hidden)
        self.baseline = Dispatcher(self.group, width, c.max_tokens_per_rank * c.top_k, self.transport, self.nccl,
                                   BF16)
        self.combiner = Combiner(self.group, self.signals, num_experts=c.num_experts, top_k=c.top_k, hidden=c.hidden,
                                 max_tokens=c.max_tokens_per_rank, wait_timeout_s=c.wait_timeout_s,
                                 transport=self.transport, nccl_comm=self.nccl, dtype=BF16, off_node=self.off_node)
        # GEMM 1's output at capacity, once: forward allocates nothing but a default out. FP8
        # experts (epserve/ffn/fp8_stage.py): the quantized received rows and act instead.
        self._fp8 = FP8Buffers(c.recv_rows_capacity, c.hidden, c.intermediate, c.max_tokens_per_rank) \
            if self.fp8 else None
        # FP8 experts: the tokens' quantization before the NCCL and host-planned dispatches (the
        # direct dispatch quantizes in its move kernel unless direct.quantize_in_send is False)
        self._quantize = LaunchSequence()
        self._act = self._fp8.act if self.fp8 else cupy.zeros((c.recv_rows_capacity, c.intermediate), BF16)
        self._C = None  # GEMM 2's output for the unfused IPC combine, made on first use
        self._gemm1 = LaunchSequence()  # forward's GEMM 1, prepared once per dispatch path
        self._no_tokens = (cupy.zeros((0, c.top_k), np.int32), cupy.zeros((0, c.top_k), np.float32))
        # forward's default path replayed per (tokens, stream, weights): runtime/replay.py.
        # replay_forward = False builds every call's launches anew (the same bits).
        self.replay_forward = True
        self._checked_weights = {}  # (id(w13), id(w2)) -> weak references to them and to them checked
        self._arm_combine = (u64(self.signals.local(sig.EXPECTED)), i32(c.hidden // 64))  # the combine's units a row
        self._replays = {}
        self.replayed_calls = 0
        cupy.cuda.runtime.deviceSynchronize()
        self.comm.Barrier()

    # ---- validation ---------------------------------------------------------------------
    def _tokens(self, x, topk_idx, topk_weights):
        c = self.config
        if self.fp8 and getattr(x, "dtype", None) == np.uint8:  # tokens packed already (quantize_tokens)
            x = checked_array(x, "x (packed FP8 rows)", "uint8", (None, packed_row_bytes(c.hidden)))
        elif not self.fp8:
            x = checked_array(x, "x", "bf16", (None, c.hidden))
        else:
            try:
                x = checked_array(x, "x", "bf16", (None, c.hidden))
            except ConfigError as exc:  # name the other input FP8 experts take
                raise ConfigError(f"{exc} (with FP8 experts x may instead be packed FP8 rows, uint8 "
                                  f"[T, {packed_row_bytes(c.hidden)}], as quantize_tokens makes them)") from None
        T = x.shape[0]
        if T > c.max_tokens_per_rank:
            raise ConfigError(f"x has {T} tokens, more than max_tokens_per_rank = {c.max_tokens_per_rank}")
        topk_idx = checked_array(topk_idx, "topk_idx", "int32", (T, c.top_k))
        topk_weights = checked_array(topk_weights, "topk_weights", "float32", (T, c.top_k))
        return x, topk_idx, topk_weights

    def _weights(self, w13, w2):
        # CuPy arrays cannot change shape, dtype, layout or device in place: ones checked
        # before pass again without the checks. Held by weak references, so the service keeps
        # no weights alive (an id can come back for another array: the references tell).
        key = (id(w13), id(w2))
        seen = self._checked_weights.get(key)
        if seen is not None:
            given13, given2, checked13, checked2 = (ref() for ref in seen)
            if given13 is w13 and given2 is w2 and checked13 is not None and checked2 is not None:
                return checked13, checked2
        checked = self._check_weights(w13, w2)
        if type(w13) is cupy.ndarray and type(w2) is cupy.ndarray:
            if len(self._checked_weights) >= _MAX_KEYS:
                self._checked_weights.clear()
            self._checked_weights[key] = tuple(weakref.ref(a) for a in (w13, w2) + checked)
        return checked

    def _check_weights(self, w13, w2):
        c = self.config
        if self.fp8:
            w = fp8_stage.checked_weights(w13, w2, c.experts_per_rank, c.hidden, c.intermediate)
            return w, w  # the FP8Weights holds both projections; GEMM 2 takes it as w2
        w13 = checked_array(w13, "w13", "bf16", (c.experts_per_rank, 2 * c.intermediate, c.hidden))
        w2 = checked_array(w2, "w2", "bf16", (c.experts_per_rank, c.hidden, c.intermediate))
        return w13, w2

    def quantize_tokens(self, x) -> cupy.ndarray:
        """FP8 experts: tokens x [T, H] bf16 as packed FP8 rows, uint8 [T, packed_row_bytes(H)]
        (epserve.ffn.fp8: bytes [0, H) the e4m3 values, then H / 128 fp32 scales, then zeros),
        quantized 1 x 128 with the layer's own bits, in one launch on the current stream.
        forward and dispatch take such rows in place of x and move them as they are (no
        quantization in the send): for a stack whose tokens come quantized, as DeepEP's FP8
        dispatch takes them. Local, no other rank takes part; ConfigError without FP8 experts."""
        if not self.fp8:
            raise ConfigError("quantize_tokens needs FP8 experts (MoEConfig expert_dtype 'fp8')")
        x = checked_array(x, "x", "bf16", (None, self.config.hidden))
        packed = cupy.empty((x.shape[0], packed_row_bytes(self.config.hidden)), np.uint8)
        if x.shape[0]:
            kernel, grid, block, args, shared_mem = fp8.quantize_rows_packed_spec(x, packed, x.shape[0])
            kernel(grid, block, args, shared_mem=shared_mem)
        return packed

    def _rows_to_dispatch(self, x, transport: str = "direct"):
        """What the dispatcher of `transport` takes for tokens x (checked): x itself, or with
        FP8 experts x quantized into packed rows (one launch, into a buffer made once), except
        for the direct dispatch, whose move kernel quantizes x itself (direct.quantizes); rows
        packed already (uint8, from quantize_tokens) move as they are on every path."""
        if self.fp8 and x.dtype == np.uint8:  # the direct dispatcher tells packed rows by their dtype
            return x if transport == "direct" else x.view(BF16)
        if not self.fp8 or transport == "direct" and self.direct.quantizes:
            return x
        self._quantize.run(x.shape[0], [fp8_stage.quantize_tokens_spec(self._fp8, x)])
        return fp8_stage.tokens_to_dispatch(self._fp8, x)

    @staticmethod
    def _check_choice(what: str, value, allowed: tuple) -> None:
        if value not in allowed:
            raise ConfigError(f"{what} must be one of {allowed}, got {value!r}")

    # ---- the layer ----------------------------------------------------------------------
    def dispatch(self, x, topk_idx, topk_weights, transport: str = "direct", wait: bool = True) -> DispatchResult:
        """Token rows to the ranks owning their experts, expert-contiguous there.

        transport "direct": each row crosses to a rank at most once, by IPC stores, expanded on
        arrival (one host wait, see the module docstring). "nccl": the same deduplicated rows
        in fixed-size blocks through one grouped NCCL send/recv, planned on the device (no
        MPI; epserve/dispatch/nccl.py); where ranks share a GPU, NCCL cannot run and the host-
        planned IPC pull stands in. All give bitwise identical rows, offsets and src_info.

        With FP8 experts (MoEConfig.expert_dtype "fp8") the rows are packed FP8 rows: bytes
        [0, H) the e4m3 values, then H / 128 fp32 scales (epserve.ffn.fp8.packed_row_bytes(H)
        bytes a row, carried as bf16-typed rows of half that width; `.view(numpy.uint8)` gives
        the bytes). The direct dispatch quantizes the tokens inside its move kernel, the others
        in a launch before it: the same bytes.

        A transport other than these raises ConfigError on the calling rank at once (the ranks
        cannot agree on a path they do not share); forward checks it on every rank together.

        wait  True (default): wait for the call's end. Every rank raises a failure here, the
              result's num_rows is this call's row count, and expert_offsets and src_info are
              the call's own copies. False: no host wait, as forward's own dispatch. The
              result's rows, expert_offsets and src_info are then the dispatcher's
              capacity-sized buffers (valid until the next dispatch or forward), num_rows is
              None (expert_offsets[-1] holds the count on the device), and the call can be
              captured in a CUDA graph. A failure (another rank's bad input, a bad expert id, a
              receive overflow, a peer that stopped) is recorded on the device: check() raises
              it, the rows' expert_offsets are all zero, and expert_ffn on the result poisons
              its output. A rank whose own input is bad still raises its ConfigError at once,
              after taking its part. Needs a dispatch planned on the device: "direct" (not
              across nodes with EPSERVE_OFFNODE_SIZES=host) or "nccl" where every rank has its
              own GPU; elsewhere ConfigError (on every rank alike: they share the placement).
              After a PeerTimeoutError it refuses calls, as forward does. In FP8 mode the
              direct dispatch quantizes in its move as with wait=True."""
        self._check_choice("dispatch transport", transport, DISPATCHES)
        if not wait:
            return self._dispatch_queued(x, topk_idx, topk_weights, transport)
        error = None
        try:
            x, topk_idx, topk_weights = self._tokens(x, topk_idx, topk_weights)
        except ConfigError as exc:
            error = exc
        if error is None:
            x = self._rows_to_dispatch(x, transport)
        if transport == "direct":
            d = self._lose_on_timeout(self.direct.dispatch, x, topk_idx, error)
            return DispatchResult(d.rows, d.expert_offsets, d.src_info, d.num_rows, topk_idx, topk_weights,
                                  after_direct=True)
        if self.nccl_path is not None:
            d = self.nccl_path.dispatch(x, topk_idx, error)
            return DispatchResult(d.rows, d.expert_offsets, d.src_info, d.num_rows, topk_idx, topk_weights)
        self._refuse_across_nodes("dispatch transport 'nccl' where ranks share a GPU")
        ep_comm.collective_verdict(self.comm, "dispatch input", error)
        plan = self._host_plan(topk_idx)
        rows = self.baseline.dispatch(x, plan)
        return DispatchResult(rows, plan.expert_offsets, plan.src_info, plan.num_recv_rows, topk_idx, topk_weights,
                              plan)

    def _dispatch_queued(self, x, topk_idx, topk_weights, transport: str) -> DispatchResult:
        """dispatch(wait=False): the dispatcher's launches, queued; see dispatch."""
        self._refuse_if_lost()  # as forward: nothing queued would find the peers in step
        if transport == "direct" and self.host_waits:
            raise ConfigError(f"{SIZES_ENV}=host: the direct dispatch reads each call's sizes on the host, so it "
                              f"cannot return without waiting; unset {SIZES_ENV} (capacity blocks) or wait")
        d = self.direct if transport == "direct" else self.nccl_path
        if d is None:
            raise ConfigError("dispatch(wait=False) with transport 'nccl' needs a GPU per rank: where ranks share a "
                              "GPU the NCCL dispatch is planned on the host, which waits")
        try:
            x, topk_idx, topk_weights = self._tokens(x, topk_idx, topk_weights)
        except ConfigError as exc:
            d.enqueue(None, None, rejected=True)  # this rank's count row stops the call on every rank
            # Raises exc after reading the call's record (one host wait, on the failing rank
            # only), which only says that this rank rejected its input: check() will not raise it.
            self.signals.raise_pending_or(self.rank, exc)
            raise
        d.enqueue(self._rows_to_dispatch(x, transport), topk_idx)
        return DispatchResult(d.rows, d.expert_offsets, d.src_info, None, topk_idx, topk_weights,
                              after_direct=transport == "direct", status=d.status)

    def _host_plan(self, topk_idx) -> DevicePlan:
        c = self.config
        routing = self.comm.allgather(cupy.asnumpy(topk_idx))
        # Every rank has every routing, so every rank reaches the same verdict.
        check_recv_capacity([count_recv_rows(d, routing, c.num_experts, self.world) for d in range(self.world)],
                            c.recv_rows_capacity)
        return DevicePlan.upload(plan_dispatch(self.rank, routing, c.num_experts, self.world), c.top_k)

    def expert_ffn(self, dispatched: DispatchResult, w13, w2=None, sink: str = "peer", out=None, gate: int = 0):
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
        # A dispatch that did not wait left its count on the device: its rows are capacity-sized.
        M = d.num_rows if d.num_rows is not None else c.recv_rows_capacity
        I, H, e_loc = c.intermediate, c.hidden, c.experts_per_rank
        if self.fp8:  # into the capacity buffers: the scale unpacking stops at the row count
            gemm.run(fp8_stage.gemm1_specs(self._fp8, d.rows, d.expert_offsets, w13, e_loc, I, H))
            act = self._fp8.act
        else:  # capacity-sized rows: forward's act, made once
            act = cupy.empty((M, I), BF16) if d.num_rows is not None else self._act
            gemm.gemm1_swiglu(d.rows, w13, act, d.expert_offsets, e_loc, I, H)
        comb = self.combiner
        if gate < 0:
            comb.gemm_only(act, w2, self._send_plan(d), I)
            return None
        if sink == "peer":
            out = comb.fused(act, w2, self._send_plan(d), d.topk_idx, d.topk_weights, I, out=out, status=d.status,
                             after_direct=d.after_direct)
        else:
            C = cupy.empty((M, H), BF16) if d.num_rows is not None else self._capacity_C()
            gemm.run(fp8_stage.gemm2_specs("null", act, w2, C, d.expert_offsets, e_loc, H, I))
            if self.transport == "ipc":  # the IPC push takes the row count on the host (it waits for it)
                plan = self._send_plan(d, count_on_host=True)
            else:
                plan = d.plan or self._host_plan(d.topk_idx)
            out = comb.unfused(C, plan, d.topk_idx, d.topk_weights, out=out, status=d.status,
                               after_direct=d.after_direct)
        return out

    def _capacity_C(self) -> cupy.ndarray:
        """GEMM 2's output at capacity for the null sink (the unfused baselines), made on first use."""
        if self._C is None:
            self._C = cupy.empty((self.config.recv_rows_capacity, self.config.hidden), BF16)
        return self._C

    @staticmethod
    def _send_plan(d: DispatchResult, count_on_host: bool = False):
        """What the peer sink and the IPC push read: expert_offsets and src_info, and for the
        push (count_on_host) the row count, read from the device when the dispatch left it there."""
        if d.plan is not None:
            return d.plan
        M = d.num_rows
        if M is None and count_on_host:
            M = int(cupy.asnumpy(d.expert_offsets[-1:])[0])
        return _RowSources(d.expert_offsets, d.src_info, M)

    def forward(self, x, topk_idx, topk_weights, w13, w2=None, sink: str = "peer", dispatch: str = "direct",
                out=None, check: bool | None = None):
        """The whole MoE layer for this rank's tokens: dispatch, GEMM 1, SwiGLU, GEMM 2, combine.

        With H = hidden, I = intermediate, k = top_k, E_loc = experts per rank, T <= max_tokens_per_rank:
            x             [T, H]           bf16     this rank's tokens
            topk_idx      [T, k]           int32    global expert ids in [0, num_experts); -1 marks an unused slot
            topk_weights  [T, k]           float32  router weights (any values; they are not normalized here)
            w13           [E_loc, 2I, H]   bf16     this rank's experts' gate (rows 0..I-1) and up (I..2I-1) projections
            w2            [E_loc, H, I]    bf16     this rank's experts' down projections
        Weights are in Linear layout (out features, in features), the inner dimension contiguous.

        FP8 experts (MoEConfig.expert_dtype "fp8"): quantize the weights once with
        ``fp8w = epserve.quantize_weights(w13, w2)`` and pass ``forward(x, topk_idx,
        topk_weights, fp8w)`` (w2 None, or fp8w again). Its arrays are checked like bf16
        weights: w13 uint8 (e4m3) [E_loc, 2I, H], w13_scales float32 [E_loc, 2I/128, H/128],
        w2 uint8 [E_loc, H, I], w2_scales float32 [E_loc, H/128, I/128]. The tokens are
        quantized to e4m3 with one scale per row and 128 columns (by the direct dispatch's
        move kernel as it sends them; before the NCCL dispatch, in a launch of its own), and
        move as packed rows (about half the bytes of bf16); GEMM 1 and GEMM 2 run on FP8
        with block scales (SwiGLU and act's quantization fused into GEMM 1), GEMM 2 hands bf16
        rows to the combine, which is unchanged: fused == unfused bit for bit as in bf16
        (docs/design.md, "FP8 experts"). Tokens that come quantized can be passed as packed
        FP8 rows instead of x, uint8 [T, packed_row_bytes(H)] (``svc.quantize_tokens(x)`` makes
        them with the layer's bits, and gives the same output bit for bit): they move as they
        are, and the send quantizes nothing (dispatch takes them too; capture takes bf16 x).

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
                  its experts once, by stores into that rank's memory. "nccl": the same rows
                  through NCCL (grouped send/recv of fixed-size blocks), planned on the device;
                  with sink "null" GEMM 2's rows go home through NCCL too. Identical rows and
                  outputs either way.
        out       optional [T, H] bf16 array (C-contiguous, this device) to write into and
                  return; by default a new CuPy array is returned.

        check     whether to wait for this call's end and raise its failure here (default:
                  the service's check_errors, True). False: no host wait at all; a failure
                  is then recorded on the device, out is poisoned, and check() raises it.

        Host time: the default path (direct dispatch, peer sink) records its launches at the
        first call of a token count, stream and set of weights (by address), and later such
        calls (on one node) replay them with only the per-call arrays' addresses rewritten
        (epserve/runtime/replay.py): the same kernels and bits for less host time.

        Synchronization: the work goes on the current CuPy stream, and out is ready when that
        stream has done it. The default path (direct dispatch, peer sink) makes no MPI call
        and waits for the GPU at most once, at the end, only when `check` is on; it can be
        captured in a CUDA graph (see capture()). Dispatch "nccl" (either sink) makes no MPI
        call and no host wait either, where every rank has its own GPU. The baselines that
        remain: dispatch "nccl" where ranks share a GPU is planned on the host (MPI), and the
        null sink after the direct dispatch pushes C over IPC after reading the row count.
        Across nodes with EPSERVE_OFFNODE_SIZES=host (docs/design.md, "Across nodes") the
        direct dispatch also waits for its count rows on the host, once, so that the off-node
        carrier moves only the routed rows: such a forward cannot be captured (ConfigError).

        Failures, on every rank alike, before any row moves, the service usable afterwards:
        - a rank whose own input is bad (shape, dtype, device, layout, token count, an
          unknown sink or dispatch) raises its ConfigError at once, without waiting, and its
          count row stops the call on every rank;
        - the others raise RankFailedError naming that rank; an expert id out of range is
          found on the device and raised the same way (ConfigError on the rank that holds it,
          RankFailedError naming it elsewhere); a routing that would give some rank more rows
          than MoEConfig.max_recv_rows raises ConfigError on every rank.
        With check=False, or under a graph, these come from check() instead.
        A failed call's out is poisoned (NaN in every element): it never holds output that
        looks right. (A rank whose own input was bad poisons `out` when `out` itself is a
        usable [*, H] bf16 array.)

        A peer that stops answering (dead, or stuck in host code and never calling forward)
        makes a device-side wait run out after wait_timeout_s: every other rank raises
        PeerTimeoutError naming the peer and the stage, out is poisoned, and from then on
        this service refuses calls: the ranks' epochs are out of step, so close it (close()
        gives up on the peer after wait_timeout_s too) and start a new one on every rank,
        even if the peer comes back.

        The NCCL path reaches the same verdicts on the device and raises the same classes; a
        rank whose input is bad still makes its share of every NCCL call (the sizes are
        fixed), so the ranks must agree on dispatch and sink. The host-planned baseline (NCCL
        dispatch on a shared GPU) checks its inputs with an MPI verdict first.
        """
        check = self.check_errors if check is None else check
        self._refuse_if_lost()
        if dispatch == "nccl" and self.nccl_path is None:  # ranks share a GPU: NCCL cannot run
            return self._forward_baseline(x, topk_idx, topk_weights, w13, w2, sink, dispatch, out)
        self._refuse_host_wait_in_capture(dispatch)  # every rank captures alike: no stand-in, nothing queued
        try:
            self._check_choice("sink", sink, SINKS)
            self._check_choice("dispatch", dispatch, DISPATCHES)
            x, topk_idx, topk_weights = self._tokens(x, topk_idx, topk_weights)
            w13, w2 = self._weights(w13, w2)
            if out is not None:
                out = checked_array(out, "out", "bf16", (x.shape[0], self.config.hidden))
        except ConfigError as exc:
            self._stand_in(out, check, dispatch, sink)
            raise exc
        # Across nodes the carrier's NCCL calls are not launches a recording could replay.
        if dispatch == "direct" and sink == "peer" and self.replay_forward and self.off_node is None:
            out = self._forward_replayed(x, topk_idx, topk_weights, w13, w2, out)
        else:
            out = self._lose_on_timeout(self._forward_launches, x, topk_idx, topk_weights, w13, w2, sink, dispatch,
                                        out)
        if check:
            self._raise_pending()
        return out

    def _refuse_if_lost(self) -> None:
        """A service that lost a peer has its ranks' epochs out of step: it refuses calls."""
        if self._lost is not None:
            raise PeerTimeoutError(f"rank {self.rank}: this service lost a peer earlier ({self._lost}); close it "
                                   "and start a new one on every rank")

    def _lose(self, exc: PeerTimeoutError) -> None:
        """This service cannot go on after exc: later calls are refused, naming it."""
        self._lost = PeerTimeoutError(str(exc))  # a copy without the traceback (see __init__)

    def _lose_on_timeout(self, fn, *args):
        """fn(*args); a PeerTimeoutError from a host wait (the off-node sizes') loses the service."""
        try:
            return fn(*args)
        except PeerTimeoutError as exc:
            self._lose(exc)
            raise

    @property
    def host_waits(self) -> bool:
        """Whether the direct dispatch waits for the host (across nodes with
        EPSERVE_OFFNODE_SIZES=host): then its forward cannot be captured in a CUDA graph."""
        return self.off_node is not None and self.off_node.host_sizes

    def _refuse_host_wait_in_capture(self, dispatch: str) -> None:
        """A direct dispatch that reads sizes on the host cannot run inside a stream capture:
        ConfigError (on every rank, which all capture alike) before anything is queued."""
        if dispatch == "direct" and self.host_waits and cupy.cuda.get_current_stream().is_capturing():
            raise ConfigError(f"{SIZES_ENV}=host: the direct dispatch reads this call's sizes on the host, so "
                              f"forward cannot be captured in a CUDA graph; unset {SIZES_ENV} (capacity blocks) "
                              "to capture")
        if self._overlaps_off_node and cupy.cuda.get_current_stream().is_capturing():
            raise ConfigError(_OVERLAP_NOT_CAPTURED)

    @property
    def _overlaps_off_node(self) -> bool:
        """Across nodes with EPSERVE_OFFNODE_OVERLAP=1: the combine's off-node send runs on a
        side stream under GEMM 2 (epserve/comm/off_node_overlap.py)."""
        return self.off_node is not None and self.off_node.overlap is not None

    def _forward_replayed(self, x, topk_idx, topk_weights, w13, w2, out):
        """The default path's launches (checked inputs): recorded at the first call of a token
        count, stream and set of weights, replayed after that with only the per-call arrays'
        pointers rewritten (epserve/runtime/replay.py): the same kernels, arguments and bits,
        without the host time of building them again."""
        if out is None:
            out = cupy.empty((x.shape[0], self.config.hidden), BF16)
        inputs = {"x": x, "topk_idx": topk_idx, "topk_weights": topk_weights, "out": out}
        stream = cupy.cuda.get_current_stream().ptr
        key = (x.shape[0], stream, _addresses(w13), _addresses(w2), self.direct.quantizes, x.dtype)
        replay = self._replays.get(key)
        if replay is None:
            with Recording() as recording:
                self._forward_launches(x, topk_idx, topk_weights, w13, w2, "peer", "direct", out)
            if recording.complete:
                if len(self._replays) >= _MAX_KEYS:
                    self._replays.clear()
                self._replays[key] = LaunchReplay.of(recording, inputs) or _NOT_REPLAYABLE
        elif replay is _NOT_REPLAYABLE:
            self._forward_launches(x, topk_idx, topk_weights, w13, w2, "peer", "direct", out)
        else:
            replay(inputs, stream)
            self.combiner.epoch += 1
            self.replayed_calls += 1
        return out

    @property
    def graph_replays(self) -> int:
        """Replayed forwards that went out as one CUDA graph launch (runtime/replay.py)."""
        return sum(r.graph_launches for r in self._replays.values() if isinstance(r, LaunchReplay))

    def _forward_launches(self, x, topk_idx, topk_weights, w13, w2, sink, dispatch, out):
        """forward's launches for checked inputs, built call by call."""
        c = self.config
        d = self.nccl_path if dispatch == "nccl" else self.direct
        # The direct dispatch's layout arms the fused combine: one launch fewer.
        armed = dispatch == "direct" and sink == "peer"
        if armed:
            d.enqueue(self._rows_to_dispatch(x, dispatch), topk_idx, arm_combine=self._arm_combine)
        else:
            d.enqueue(self._rows_to_dispatch(x, dispatch), topk_idx)
        if self.fp8:
            specs = fp8_stage.gemm1_specs(self._fp8, d.rows, d.expert_offsets, w13, c.experts_per_rank,
                                          c.intermediate, c.hidden)
        else:
            specs = gemm.gemm1_swiglu_specs(d.rows, w13, self._act, d.expert_offsets, c.experts_per_rank,
                                            c.intermediate, c.hidden)
        self._gemm1.run(dispatch, specs)
        if sink == "peer":
            out = self.combiner.fused(self._act, w2, d, topk_idx, topk_weights, c.intermediate, out=out,
                                      status=d.status, armed=armed, after_direct=dispatch == "direct")
        elif dispatch == "nccl":  # the unfused layer over NCCL: GEMM 2 stores C, NCCL brings it home
            C = self._capacity_C()
            gemm.run(fp8_stage.gemm2_specs("null", self._act, w2, C, d.expert_offsets, c.experts_per_rank,
                                           c.hidden, c.intermediate, rows=topk_idx.size))
            out = self.combiner.unfused_nccl(C, d, topk_idx, topk_weights, out=out)
        else:  # the null sink after the direct dispatch: C pushed over IPC; it reads the row count
            C = self._capacity_C()
            gemm.run(fp8_stage.gemm2_specs("null", self._act, w2, C, d.expert_offsets, c.experts_per_rank,
                                           c.hidden, c.intermediate, rows=topk_idx.size))
            rows = _RowSources(d.expert_offsets, d.src_info, d.rows_received())
            out = self.combiner.unfused(C, rows, topk_idx, topk_weights, out=out, status=d.status,
                                        after_direct=True)
        return out

    def _stand_in(self, out, check, dispatch="direct", sink="peer") -> None:
        """This rank's input failed its host checks: it still takes its part of the call with no
        tokens, so its count row stops every rank before any row moves and the epochs stay in
        step; a usable `out` is poisoned. Then the caller raises the local error. On the NCCL
        path it makes the same NCCL calls as its peers (the combine's too with the null sink)."""
        if dispatch == "nccl" and self.nccl_path is not None:
            self.nccl_path.enqueue(None, None, rejected=True)
            if sink == "null":
                self.nccl_path.combine(None, 0, self.combiner.recv)
        else:
            self.direct.enqueue(None, None, rejected=True)
        # The NCCL combine (null sink after the NCCL dispatch) stages nothing across nodes.
        nccl_dispatch = dispatch == "nccl" and self.nccl_path is not None
        self.combiner.stand_in(off_node=not (nccl_dispatch and sink == "null"), after_direct=not nccl_dispatch)
        try:
            poisoned = checked_array(out, "out", "bf16", (None, self.config.hidden)) if out is not None else None
        except ConfigError:
            poisoned = None
        if poisoned is not None:
            poisoned.fill(np.nan)
        if check:  # this call's own record would be stale for the next call: read and drop it
            try:
                self.signals.raise_pending(self.rank)
            except EPServeError:
                pass

    def _raise_pending(self) -> None:
        try:
            self.signals.raise_pending(self.rank)
        except PeerTimeoutError as exc:
            self._lose(exc)
            raise

    def _forward_baseline(self, x, topk_idx, topk_weights, w13, w2, sink, dispatch, out):
        """Dispatch "nccl" where ranks share a GPU (NCCL refuses that): planned on the host, rows
        pulled over IPC, with an MPI verdict on the inputs first."""
        self._refuse_across_nodes("dispatch 'nccl' where ranks share a GPU")
        tokens = getattr(x, "shape", (0,))[0]
        w13, w2, out = self._checked_ffn_inputs(sink, w13, w2, out, tokens, "forward input", dispatch)
        result = self._expert_ffn(self.dispatch(x, topk_idx, topk_weights, dispatch), w13, w2, sink, out, 0)
        self._raise_pending()
        return result

    def _refuse_across_nodes(self, what: str) -> None:
        """The host-planned baseline pulls rows over IPC, which does not cross nodes: refused
        on every rank alike (they share the layout and the GPU placement) before anything moves."""
        if self.off_node is not None:
            raise ConfigError(f"{what} (the host-planned IPC baseline) cannot reach ranks of other nodes "
                              f"({self.nodes.nodes} nodes of {self.nodes.ranks_per_node}); use dispatch 'direct'")

    def check(self) -> None:
        """Synchronize the device, then raise what a device-side check recorded since the last
        check: PeerTimeoutError when a wait for a peer ran out (naming the peer and the stage),
        RankFailedError when a call was stopped for another rank's input, ConfigError for
        this rank's bad expert ids, a receive overflow or a refused row. Local: no other rank
        takes part. This is how a failure under a graph, or with check=False, is seen."""
        try:
            self.signals.raise_if_error(self.rank)
        except PeerTimeoutError as exc:
            self._lose(exc)
            raise

    # ---- lifetime -----------------------------------------------------------------------
    def capture(self, tokens: int, w13, w2=None):
        """A CUDA graph of forward (direct dispatch, peer sink) at `tokens` tokens on this rank,
        over input and output buffers it owns: write fresh inputs into its x, topk_idx and
        topk_weights, then replay() it; the output is bitwise the eager forward's. Collective:
        it runs one eager forward first (every rank at once), and every replay is a forward
        call of every rank. See epserve/layer/graph.py.

        Refused (ConfigError, on every rank alike) across nodes with EPSERVE_OFFNODE_SIZES=host:
        that dispatch waits for the host once per call, which no graph can hold; and with
        EPSERVE_OFFNODE_OVERLAP=1 (a side stream, not captured so far)."""
        from epserve.layer.graph import CapturedForward

        if self.host_waits:
            raise ConfigError(f"{SIZES_ENV}=host: the direct dispatch reads each call's sizes on the host, so "
                              f"forward cannot be captured in a CUDA graph; unset {SIZES_ENV} (capacity blocks) "
                              "to capture")
        if self._overlaps_off_node:
            raise ConfigError(_OVERLAP_NOT_CAPTURED)

        return CapturedForward(self, tokens, w13, w2)

    def close(self) -> None:
        """Collective teardown (synchronize, unmap the peers' buffers, barrier, free,
        barrier: docs/design.md, "IPC lifetime"); safe to call twice. Each barrier gives up
        after wait_timeout_s and raises PeerTimeoutError naming the ranks that never came, so
        a stuck peer cannot hang it; this rank's buffers then stay allocated."""
        if self._closed:
            return
        self._closed = True
        if self.off_node is not None:  # NCCL's waits are not bounded: abort the carrier if the work never ends
            self.off_node.quiesce(self.config.wait_timeout_s)
        self.group.close(self.config.wait_timeout_s)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


_MAX_KEYS = 512  # recorded forwards kept: token counts x weight sets (layers) in use
_OVERLAP_NOT_CAPTURED = (f"{OVERLAP_ENV}=1: the combine's off-node send runs on a side stream under GEMM 2, which "
                         f"capture does not take yet; unset {OVERLAP_ENV} to capture")
_NOT_REPLAYABLE = object()  # a recording LaunchReplay refused: build that call's launches each time


def _addresses(weights) -> tuple:
    """What identifies a set of weights for a replay: the addresses of its arrays (the
    tensor maps recorded with it are built from them; their shapes are fixed by the config)."""
    if isinstance(weights, cupy.ndarray):
        return (weights.data.ptr,)
    return tuple(a.data.ptr for a in vars(weights).values() if isinstance(a, cupy.ndarray))


@dataclass(frozen=True)
class _RowSources:
    expert_offsets: cupy.ndarray
    src_info: cupy.ndarray
    num_recv_rows: int

