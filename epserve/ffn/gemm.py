"""Launchers of the expert FFN's kernels on the current CuPy stream: the grouped GEMMs (the
wgmma one and the mma.sync reference), GEMM 1 with SwiGLU, and the SwiGLU kernel. Arguments
in the exact types the CUDA signatures take, grid sizes, the shared-memory opt-in. No
validation of user input here (the service does that once, before any data moves)."""

from __future__ import annotations

import functools
import os

import cupy
import numpy as np

from epserve.errors import ConfigError
from epserve.ffn import overlap_gemm, tiles
from epserve.runtime import kernels, tma
from epserve.runtime.kernel_structs import PEER_SEND_CONFIG, i32, launch_arg
from epserve.runtime.launch import NULL, module_int, pointer, sm_count


@functools.lru_cache(maxsize=None)
def _gemm_kernel(variant: str, kernel: str, device: int):
    mod = kernels.module(variant)
    fn = mod.get_function(kernel)
    smem = module_int(mod, "epserve_gemm_smem_bytes")
    threads = module_int(mod, "epserve_gemm_threads")
    fn.max_dynamic_shared_size_bytes = smem
    return fn, smem, threads


@functools.lru_cache(maxsize=None)
def _b_box_rows(variant: str, device: int) -> int:
    return module_int(kernels.module(variant), "epserve_gemm_b_box_rows")


@functools.lru_cache(maxsize=None)
def _wgmma_grid(variant: str, device: int) -> int:
    """One CTA per SM, in whole clusters (the wgmma GEMM's CTA pairs share A tiles)."""
    cluster = module_int(kernels.module(variant), "epserve_gemm_cluster")
    return sm_count(device) // cluster * cluster


# What the null sink is given (it never reads it), wrapped once (kernel_structs.launch_arg).
_NO_PEERS = launch_arg(np.zeros(1, PEER_SEND_CONFIG))


GEMM_IMPLS = ("wgmma", "mma")


def gemm_impl() -> str:
    """Which grouped GEMM runs: $EPSERVE_GEMM, "wgmma" (TMA + wgmma, warp-specialized) by
    default, or "mma" (mma.sync + cp.async: about half as fast, kept as the simpler kernel
    the fast one is checked against)."""
    impl = os.environ.get("EPSERVE_GEMM", "wgmma")
    if impl not in GEMM_IMPLS:
        raise ConfigError(f"EPSERVE_GEMM must be one of {GEMM_IMPLS}, got {impl!r}")
    return impl


PEER_STORES = ("warps", "bulk", "own-bulk")
_PEER_BUILD = {"warps": "peer", "bulk": "peer_bulk", "own-bulk": "peer_ownbulk"}


def peer_stores() -> str:
    """How GEMM 2's peer sink moves its tiles: $EPSERVE_SINK_STORES,
    - "own-bulk" (the default): the rows whose home is this rank by bulk asynchronous copies,
      their arrival published one tile later, the other ranks' rows by the send warps'
      16-byte stores and a system-scope fence a tile (cuda/sinks/row_scatter_bulk.cuh);
    - "warps": every row by the send warps' stores;
    - "bulk": every row by bulk copies (opt-in until measured on two GPUs).
    The same bytes in the same slots either way, so the ranks need not agree. The overlap
    build (EPSERVE_OFFNODE_OVERLAP=1) always uses "warps"."""
    stores = os.environ.get("EPSERVE_SINK_STORES", "own-bulk")
    if stores not in PEER_STORES:
        raise ConfigError(f"EPSERVE_SINK_STORES must be one of {PEER_STORES}, got {stores!r}")
    return stores


PEER_BUILDS_USED: set = set()  # the peer builds this process has launched (the GPU jobs report them)


def peer_variant(sink: str) -> str:
    """The variant name part of `sink` for GEMM 2 (peer_stores says which peer build)."""
    if sink != "peer":
        return sink
    name = _PEER_BUILD[peer_stores()]
    PEER_BUILDS_USED.add(name)
    return name


def grouped_gemm(sink: str, A, B, C, expert_offsets, num_experts: int, N: int, K: int, cfg=None, gate: int = 0,
                 impl: str | None = None, rows: int | None = None, split: str | None = None) -> None:
    """C[m] = A[m] @ B[e]^T per expert; `sink` "null" stores C, "peer" sends to recv (C may be None).
    A [M, K] and B [E, N, K] are CuPy bf16 arrays."""
    run(grouped_gemm_specs(sink, A, B, C, expert_offsets, num_experts, N, K, cfg, gate, impl, rows, split))


def grouped_gemm_specs(sink: str, A, B, C, expert_offsets, num_experts: int, N: int, K: int, cfg=None,
                       gate: int = 0, impl: str | None = None, rows: int | None = None,
                       split: str | None = None, overlap_free_sms: int | None = None) -> list:
    """grouped_gemm's launches as specs, (kernel, grid, block, args, shared_mem), for a caller
    that queues them itself (runtime.launch.LaunchSequence). rows: the rows the call expects
    when A is a capacity-sized buffer (default: all of A's); with `split` ("auto", "never",
    "always"; default $EPSERVE_GEMM2_SPLIT_K) they choose the wgmma build (epserve/ffn/tiles.py).
    overlap_free_sms: across nodes with EPSERVE_OFFNODE_OVERLAP=1, the peer sink's overlap build
    (epserve/ffn/overlap_gemm.py): its tile order kernel, then the GEMM on that many SMs fewer.
    Every choice gives the same bits."""
    if cfg is None:
        assert sink == "null", "the peer sink needs its PeerSendConfig"
        cfg = _NO_PEERS
    assert K % 64 == 0 and K > 0 and N % 64 == 0, (N, K)
    impl = impl or gemm_impl()
    device = cupy.cuda.runtime.getDevice()
    expected_rows = A.shape[0] if rows is None else rows
    if overlap_free_sms is not None:
        assert sink == "peer" and impl == "wgmma", "the overlap build is the wgmma GEMM's, with the peer sink"
        ctas = overlap_gemm.overlap_grid(sm_count(device), overlap_free_sms)
        policy = tiles.gemm2_split_policy(expected_rows, num_experts, N, K, ctas, split)
        variant = "gemm_wgmma_peer_overlap" if policy is None else "gemm_wgmma_peer_split_overlap"
        return _overlap_specs(variant, A, B, C, expert_offsets, num_experts, N, K, cfg, gate, policy or 0,
                              overlap_free_sms)
    if impl == "mma":
        fn, smem, threads = _gemm_kernel(f"gemm_{sink}", "epserve_grouped_gemm", device)
        args = (pointer(A), pointer(B), pointer(C), pointer(expert_offsets), i32(num_experts), i32(N), i32(K), cfg,
                i32(gate))
        return [(fn, (sm_count(device),), (threads,), args, smem)]
    policy = tiles.gemm2_split_policy(expected_rows, num_experts, N, K, sm_count(device), split)
    variant = f"gemm_wgmma_{peer_variant(sink)}" + ("" if policy is None else "_split")
    return _wgmma_specs(variant, A, B, num_experts * N, C, expert_offsets, num_experts, N, K, cfg, gate,
                        split_policy=policy or 0)


def gemm1_swiglu(A, w13, act, expert_offsets, num_experts: int, intermediate: int, hidden: int,
                 impl: str | None = None) -> None:
    """act[m] = silu(g) * u with [g | u] = A[m] @ w13[e]^T rounded to bf16, per expert: GEMM 1
    and SwiGLU. A [M, H], w13 [E, 2I, H] (gate rows, then up rows), act [M, I]. The wgmma
    GEMM applies SwiGLU in its epilogue, rounding exactly as its [M, 2I] output followed by
    the SwiGLU kernel would (the same bits); the mma.sync one stores [M, 2I] for that kernel."""
    run(gemm1_swiglu_specs(A, w13, act, expert_offsets, num_experts, intermediate, hidden, impl))


def gemm1_swiglu_specs(A, w13, act, expert_offsets, num_experts: int, intermediate: int, hidden: int,
                       impl: str | None = None) -> list:
    """gemm1_swiglu's launches as specs (see grouped_gemm_specs)."""
    I, H = intermediate, hidden
    assert H % 64 == 0 and H > 0 and I % 64 == 0, (I, H)
    if (impl or gemm_impl()) == "mma":
        M = A.shape[0]
        h = cupy.empty((M, 2 * I), A.dtype)
        return (grouped_gemm_specs("null", A, w13, h, expert_offsets, num_experts, 2 * I, H, impl="mma")
                + [swiglu_spec(h, act, M, I)])
    return _wgmma_specs("gemm1_wgmma_swiglu", A, w13, num_experts * 2 * I, act, expert_offsets, num_experts, I, H,
                        _NO_PEERS, 0)


def run(specs) -> None:
    """Launch specs through CuPy, on the current stream."""
    for kernel, grid, block, args, shared_mem in specs:
        kernel(grid, block, args, shared_mem=shared_mem)


@functools.lru_cache(maxsize=None)
def _tile_counter(device: int, stream: int):
    """The wgmma GEMM's tile counter for launches on one stream: zero between launches (the
    kernel resets it), so stream order is all the sharing needs; a stream of its own each.
    Four ints: the FP8 GEMM's EPSERVE_GEMM_FP8_L2_SIDES build uses three, the first two as one
    64-bit counter (a CuPy allocation is aligned far beyond 8 bytes)."""
    return cupy.zeros(4, np.int32)


# Split K (GEMM 2's split builds, EPSERVE_GEMM_SPLIT_K=2): a tile's first half stores its fp32
# accumulators in a workspace and raises a flag that its second half waits for. Per (device,
# stream), as the tile counter: (workspace, state, tiles they hold).
_SPLIT_BUFFERS: dict[tuple[int, int], tuple] = {}


def _split_buffers(device: int, stream: int, tile_floats: int, state_head: int) -> tuple:
    """The split-K workspace (fp32, tile_floats a tile) and state (uint32: the epoch, an error
    record, the last launch's parts, then two flags a tile) for launches on one stream, with
    room for tiles.room_tiles tiles (a launch with more runs unsplit). The kernel's last CTA
    advances the epoch and flags compare against it, so nothing is reset between launches or
    graph replays; made once and never moved, so recorded launches (runtime/replay.py) and
    captured graphs keep valid addresses."""
    have = _SPLIT_BUFFERS.get((device, stream))
    if have is None:
        room = tiles.room_tiles(sm_count(device))
        have = (cupy.empty(room * tile_floats, np.float32), cupy.zeros(state_head + 2 * room, np.uint32), room)
        _SPLIT_BUFFERS[(device, stream)] = have
    return have


def split_k_record(device: int | None = None, stream: int | None = None) -> dict:
    """The split-K state of launches on a stream (default: the current device and stream):
    launches (the epoch), the parts the last launch ran its tiles in (1 or 2), and the error
    record (0, or 1 with the tile whose second half's wait ran out). None before any launch."""
    device = cupy.cuda.runtime.getDevice() if device is None else device
    stream = cupy.cuda.get_current_stream().ptr if stream is None else stream
    have = _SPLIT_BUFFERS.get((device, stream))
    if have is None:
        return None
    state = cupy.asnumpy(have[1][:4])
    return {"launches": int(state[0]), "error": int(state[1]), "error_tile": int(state[2]), "parts": int(state[3])}


@functools.lru_cache(maxsize=256)
def _rows_map(ptr: int, rows: int, cols: int, box_rows: int) -> np.ndarray:
    """A tensor map is a pure function of these, so one built once serves every call over the
    same buffer: the service's capacity-sized buffers and the caller's weights each get one.
    (A freed buffer whose address comes back with the same shape gets the same map it would
    get anew.) Never written to after it is made."""
    return launch_arg(tma.bf16_rows_map(ptr, rows, cols, box_rows=box_rows))


def _wgmma_gemm(variant: str, A, B, b_rows: int, C, expert_offsets, num_experts: int, N: int, K: int, cfg,
                gate: int, split_policy: int = tiles.BY_RULE) -> None:
    run(_wgmma_specs(variant, A, B, b_rows, C, expert_offsets, num_experts, N, K, cfg, gate, split_policy))


def _wgmma_specs(variant: str, A, B, b_rows: int, C, expert_offsets, num_experts: int, N: int, K: int, cfg,
                 gate: int, split_policy: int = tiles.BY_RULE, free_sms: int = 0) -> list:
    M = A.shape[0]
    if M == 0:
        return []  # no rows, no tiles (and a tensor map cannot have an empty dimension)
    device = cupy.cuda.runtime.getDevice()
    fn, smem, threads, grid, b_box, split = _wgmma_kernel(variant, device, free_sms)
    # A in 64-row boxes, one per consumer warpgroup; B in boxes of the rows one tile's
    # accumulator columns take: 256, or 128 gate + 128 up rows with SwiGLU.
    map_a = _rows_map(A.data.ptr, M, K, 64)
    map_b = _rows_map(B.data.ptr, b_rows, K, b_box)
    stream = cupy.cuda.get_current_stream().ptr
    counter = _tile_counter(device, stream)
    args = (map_a, map_b, NULL if C is None else C, expert_offsets, i32(num_experts), i32(N), i32(K), cfg, i32(gate),
            counter)
    if split:  # a split-K build takes its workspace, state, their room in tiles and the policy
        acc, state, room = _split_buffers(device, stream, *split)
        args += (acc, state, i32(room), i32(split_policy))
    return [(fn, grid, threads, args, smem)]


# The overlap builds' tile order (epserve/ffn/overlap_gemm.py), per (device, stream, room): the
# order kernel writes it, the GEMM after it on the same stream reads it.
_ORDER_BUFFERS: dict[tuple[int, int, int], cupy.ndarray] = {}
_LAST_ORDER: dict[tuple[int, int], cupy.ndarray] = {}  # (device, stream) -> the latest launch's, for tests


def _overlap_specs(variant: str, A, B, C, expert_offsets, num_experts: int, N: int, K: int, cfg, gate: int,
                   split_policy: int, free_sms: int) -> list:
    """The overlap build's launches: the tile order kernel (one block), then the GEMM on
    free_sms SMs fewer, given the order and its room."""
    specs = _wgmma_specs(variant, A, B, num_experts * N, C, expert_offsets, num_experts, N, K, cfg, gate,
                         split_policy, free_sms)
    if not specs:
        return specs
    device, stream = cupy.cuda.runtime.getDevice(), cupy.cuda.get_current_stream().ptr
    room = overlap_gemm.order_room(A.shape[0], num_experts, N, _order_max_mtiles(variant, device))
    order = _ORDER_BUFFERS.get((device, stream, room))
    if order is None:
        order = _ORDER_BUFFERS[(device, stream, room)] = cupy.zeros(max(1, room), np.int32)
    _LAST_ORDER[(device, stream)] = order
    fn = kernels.function(variant, "epserve_gemm_off_node_first_order")
    order_spec = (fn, (1,), (1024,), (expert_offsets, i32(num_experts), i32(N), cfg, order, i32(room)), 0)
    gemm_fn, grid, block, args, smem = specs[0]
    return [order_spec, (gemm_fn, grid, block, args + (order, i32(room)), smem)]


@functools.lru_cache(maxsize=None)
def _order_max_mtiles(variant: str, device: int) -> int:
    """The order kernel's m-tile table (read once: reading a module's constant waits for the device)."""
    return module_int(kernels.module(variant), "epserve_gemm_order_max_mtiles")


def last_tile_order(device: int | None = None, stream: int | None = None):
    """The tile order the overlap build's latest launch on a stream used (default: the current
    device and stream), for tests: the order buffer, or None before any such launch."""
    device = cupy.cuda.runtime.getDevice() if device is None else device
    stream = cupy.cuda.get_current_stream().ptr if stream is None else stream
    return _LAST_ORDER.get((device, stream))


@functools.lru_cache(maxsize=None)
def _wgmma_kernel(variant: str, device: int, free_sms: int = 0):
    """Everything a wgmma GEMM launch needs that depends on the variant, the device and the SMs
    it leaves free (the overlap builds; 0: one CTA per SM) alone; the
    last item is None, or for a split-K build (fp32 floats a tile, uint32 words before the
    flags) of its workspace and state."""
    fn, smem, threads = _gemm_kernel(variant, "epserve_grouped_gemm_wgmma", device)
    split = None
    if int(kernels.VARIANTS[variant][1].get("EPSERVE_GEMM_SPLIT_K", 1)) > 1:
        mod = kernels.module(variant)
        split = (module_int(mod, "epserve_gemm_split_tile_floats"), module_int(mod, "epserve_gemm_split_state_head"))
    grid = _wgmma_grid(variant, device) if not free_sms else overlap_gemm.overlap_grid(sm_count(device), free_sms)
    return fn, smem, (threads,), (grid,), _b_box_rows(variant, device), split


def swiglu(h, act, M: int, intermediate: int) -> None:
    run([swiglu_spec(h, act, M, intermediate)])


def swiglu_spec(h, act, M: int, intermediate: int) -> tuple:
    fn = kernels.function("swiglu", "epserve_swiglu")
    pairs = M * intermediate // 2
    blocks = max(1, min(sm_count(cupy.cuda.runtime.getDevice()) * 8, (pairs + 255) // 256))
    return (fn, (blocks,), (256,), (pointer(h), pointer(act), np.int64(M), np.int32(intermediate)), 0)
