"""PeerSendConfig, packed in Python byte for byte as cuda/sinks/peer_send_config.cuh lays it
out, so it can be passed by value to the GEMM (a size-1 structured NumPy array: CuPy passes
its data pointer and the driver copies the parameter's size). tests/cpu/test_sendconfig.py
compiles static_asserts of these offsets against the CUDA definition."""

from __future__ import annotations

import numpy as np

MAX_PEERS = 8  # EPSERVE_MAX_PEERS

PEER_SEND_CONFIG = np.dtype(
    [
        ("recv", np.uint64, (MAX_PEERS,)),
        ("arrive", np.uint64, (MAX_PEERS,)),
        ("ready", np.uint64),
        ("src_info", np.uint64),
        ("error", np.uint64),
        ("epoch", np.uint64),
        ("timeout_ns", np.uint64),
        ("rank", np.int32),
        ("world", np.int32),
        ("top_k", np.int32),
        ("hidden", np.int32),
        ("max_tokens", np.int32),
        ("reserved", np.int32),
    ],
    align=True,
)

# The pointer tables passed by value to the row and release kernels.
PEER_POINTERS = np.dtype([("ptr", np.uint64, (MAX_PEERS,))], align=True)


def pack_peer_send_config(*, recv, arrive, ready, src_info, error, epoch, timeout_ns, rank, world, top_k, hidden,
                          max_tokens) -> np.ndarray:
    """One PeerSendConfig as a size-1 array. recv/arrive: per-rank device addresses (ints)."""
    if len(recv) != world or len(arrive) != world:
        raise ValueError(f"need one recv and one arrive address per rank ({world}), got {len(recv)} and {len(arrive)}")
    if world > MAX_PEERS:
        raise ValueError(f"the peer sink serves at most {MAX_PEERS} ranks, got {world}")
    cfg = np.zeros(1, PEER_SEND_CONFIG)
    cfg["recv"][0, :world] = recv
    cfg["arrive"][0, :world] = arrive
    for name, value in (("ready", ready), ("src_info", src_info), ("error", error), ("epoch", epoch),
                        ("timeout_ns", timeout_ns), ("rank", rank), ("world", world), ("top_k", top_k),
                        ("hidden", hidden), ("max_tokens", max_tokens)):
        cfg[name] = value
    return cfg


def pack_peer_pointers(addresses) -> np.ndarray:
    """A PeerBases / PeerCounters table as a size-1 array."""
    if len(addresses) > MAX_PEERS:
        raise ValueError(f"at most {MAX_PEERS} peers, got {len(addresses)}")
    table = np.zeros(1, PEER_POINTERS)
    table["ptr"][0, : len(addresses)] = addresses
    return table
