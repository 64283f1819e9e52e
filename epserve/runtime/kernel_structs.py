"""Structs passed BY VALUE to kernels, packed in Python byte for byte as CUDA lays them out:
PeerSendConfig (cuda/sinks/peer_send_config.cuh) and DispatchConfig
(cuda/comm/dispatch_config.cuh), plus the pointer tables of the row and release kernels.
Each is a size-1 structured NumPy array: CuPy passes its data pointer and the driver copies
the parameter's size. tests/cpu/test_kernel_structs.py compiles static_asserts of these
offsets against the CUDA definitions.

A launch argument made from a NumPy array costs host time on every launch: CuPy wraps the
array in a `CNumpyArray`, which reads `__array_interface__`, and NumPy rebuilds the
description of a structured dtype for that (`_internal._array_descr`) each time. The structs
do not change between calls, so each is wrapped once (`launch_arg`) and the wrapper, which
CuPy passes through as it is, goes to every launch. `i32`/`u64` do the same for fixed
scalars."""

from __future__ import annotations

import functools

import numpy as np

try:  # CuPy's by-value launch argument: a pointer to the bytes, kept alive with them
    from cupy.cuda.function import CNumpyArray as _CNumpyArray
except ImportError:  # pragma: no cover - an older CuPy: it wraps the array itself on every launch
    _CNumpyArray = None

# Ranks per node (EPSERVE_MAX_PEERS, common/nodes.cuh): the kernel structs' address tables hold
# the ranks of this rank's node only (CUDA IPC reaches no further), by local index; the other
# nodes' ranks are reached through the off-node staging, by arithmetic (docs/design.md, "Across nodes").
MAX_PEERS = 8
# Ranks in all (EPSERVE_MAX_WORLD): src_info names the source rank in 7 bits; per-destination
# counts (count rows, arrival counters, destination sets) are sized by the world up to this.
MAX_WORLD = 128
# EPSERVE_MAX_LOCAL_EXPERTS (common/types.cuh): the GEMM keeps a table per local expert, the
# dispatch layout kernel a thread
MAX_LOCAL_EXPERTS = 512
# Experts in all: the dispatch route kernel keeps per-warp counters for every expert in shared memory.
MAX_EXPERTS = 1024

PEER_SEND_CONFIG = np.dtype(
    [
        ("recv", np.uint64, (MAX_PEERS,)),
        ("arrive", np.uint64, (MAX_PEERS,)),
        ("ready", np.uint64),
        ("src_info", np.uint64),
        ("error", np.uint64),
        ("status", np.uint64),
        ("timeout_ns", np.uint64),
        ("off_recv", np.uint64),
        ("rank", np.int32),
        ("world", np.int32),
        ("top_k", np.int32),
        ("hidden", np.int32),
        ("max_tokens", np.int32),
        ("ranks_per_node", np.int32),
        ("node_first", np.int32),
        ("reserved", np.int32),
    ],
    align=True,
)

DISPATCH_CONFIG = np.dtype(
    [
        ("count_table", np.uint64, (MAX_PEERS,)),
        ("tokens", np.uint64, (MAX_PEERS,)),
        ("meta", np.uint64, (MAX_PEERS,)),
        ("count_arrive", np.uint64, (MAX_PEERS,)),
        ("ready", np.uint64, (MAX_PEERS,)),
        ("my_ready", np.uint64),
        ("my_count_arrive", np.uint64),
        ("error", np.uint64),
        ("status", np.uint64),
        ("timeout_ns", np.uint64),
        ("off_count_row", np.uint64),
        ("off_blocks", np.uint64),
        ("off_block_bytes", np.int64),
        ("rank", np.int32),
        ("world", np.int32),
        ("num_experts", np.int32),
        ("top_k", np.int32),
        ("hidden", np.int32),
        ("max_tokens", np.int32),
        ("max_recv_rows", np.int32),
        ("ranks_per_node", np.int32),
        ("node_first", np.int32),
        ("reserved", np.int32),
    ],
    align=True,
)

# The combine's release table (cuda/comm/combine.cu): this node's ranks' ready arrays, by local index.
PEER_COUNTERS = np.dtype(
    [
        ("ready", np.uint64, (MAX_PEERS,)),
        ("ranks_per_node", np.int32),
        ("node_first", np.int32),
    ],
    align=True,
)

# CUDA struct name -> dtype, for the layout test
STRUCTS = {"PeerSendConfig": PEER_SEND_CONFIG, "DispatchConfig": DISPATCH_CONFIG, "PeerCounters": PEER_COUNTERS}

# The pointer table (PeerBases) passed by value to the host-planned dispatch's pull kernel
# (one node only: it is refused across nodes).
PEER_POINTERS = np.dtype([("ptr", np.uint64, (MAX_PEERS,))], align=True)

_TABLES = "the address tables hold the ranks of one node"


def pack(dtype: np.dtype, **fields) -> np.ndarray:
    """One struct as a size-1 array; every field must be given. Per-rank table fields take a
    list of `ranks_per_node` addresses: the ranks of this rank's node, by local index (rank -
    node_first), never more than MAX_PEERS; `world` may be up to MAX_WORLD."""
    world, R, first = fields.get("world", 0), fields.get("ranks_per_node", 0), fields.get("node_first", 0)
    if world > MAX_WORLD:
        raise ValueError(f"epserve serves at most {MAX_WORLD} ranks (src_info's 7 rank bits), got {world}")
    if R > MAX_PEERS:
        raise ValueError(f"{_TABLES}: at most {MAX_PEERS} ranks per node, got {R}")
    if "ranks_per_node" in fields and not (R >= 1 and 0 <= first and first + R <= max(world, 1)
                                           and first <= fields.get("rank", first) < first + R):
        raise ValueError(f"the node [{first}, {first + R}) must hold rank {fields.get('rank')} of {world}")
    missing = set(dtype.names) - set(fields) - {"reserved"}
    unknown = set(fields) - set(dtype.names)
    if missing or unknown:
        raise ValueError(f"packing {dtype.names}: missing {sorted(missing)}, unknown {sorted(unknown)}")
    out = np.zeros(1, dtype)
    for name, value in fields.items():
        if dtype.fields[name][0].shape:
            if len(value) != R:
                raise ValueError(f"{name}: need one address per rank of the node ({R}), got {len(value)}")
            out[name][0, :R] = value
        else:
            out[name] = value
    return out


def pack_peer_send_config(**fields) -> np.ndarray:
    return pack(PEER_SEND_CONFIG, **fields)


def pack_dispatch_config(**fields) -> np.ndarray:
    return pack(DISPATCH_CONFIG, **fields)


def pack_peer_counters(*, ready, ranks_per_node: int, node_first: int) -> np.ndarray:
    """The combine's PeerCounters: `ready` holds this node's ranks' ready arrays, by local index."""
    if not 1 <= ranks_per_node <= MAX_PEERS or len(ready) != ranks_per_node:
        raise ValueError(f"{_TABLES}: {len(ready)} ready arrays for {ranks_per_node} ranks per node "
                         f"(at most {MAX_PEERS})")
    table = np.zeros(1, PEER_COUNTERS)
    table["ready"][0, :ranks_per_node] = ready
    table["ranks_per_node"], table["node_first"] = ranks_per_node, node_first
    return table


def pack_peer_pointers(addresses) -> np.ndarray:
    """A PeerBases table as a size-1 array."""
    if len(addresses) > MAX_PEERS:
        raise ValueError(f"at most {MAX_PEERS} peers, got {len(addresses)}")
    table = np.zeros(1, PEER_POINTERS)
    table["ptr"][0, : len(addresses)] = addresses
    return table


def launch_arg(value: np.ndarray):
    """A size-1 NumPy array (a struct, a tensor map, a scalar) as a ready-made CuPy launch
    argument, passed by value exactly as CuPy passes the array itself, without the per-launch
    wrapping. The array must not be written to afterwards (CuPy reads it at each launch)."""
    if value.size != 1:
        raise ValueError(f"a by-value launch argument is one element, got shape {value.shape}")
    return value if _CNumpyArray is None else _CNumpyArray(value)


@functools.lru_cache(maxsize=4096)
def i32(value: int):
    """An int kernel argument, made once per value."""
    return launch_arg(np.full(1, value, np.int32))


@functools.lru_cache(maxsize=4096)
def u64(value: int):
    """An unsigned 64-bit kernel argument (an address, a count), made once per value."""
    return launch_arg(np.full(1, value, np.uint64))
