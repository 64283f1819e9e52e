"""Which ranks share a node: the ranks of one node reach each other's memory through CUDA IPC,
ranks on different nodes only through the network (NCCL). Decided once, at setup, from every
rank's host name (one MPI allgather); EPSERVE_RANKS_PER_NODE forces a smaller node size, so
that one machine can play several nodes in tests (node n = ranks n*R .. n*R + R - 1).

A layout is valid when every node holds the same number of ranks and a node's ranks are
consecutive: rank r is local rank r % R of node r // R. That is how launchers place ranks
(mpirun --map-by node is not supported), and it keeps a rank's node and local index pure
arithmetic for the kernels."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass

from epserve.errors import ConfigError
from epserve.runtime.kernel_structs import MAX_PEERS

RANKS_PER_NODE_ENV = "EPSERVE_RANKS_PER_NODE"


@dataclass(frozen=True)
class NodeLayout:
    world: int
    ranks_per_node: int

    @property
    def nodes(self) -> int:
        return self.world // self.ranks_per_node

    def node_of(self, rank: int) -> int:
        return rank // self.ranks_per_node

    def local_index(self, rank: int) -> int:
        return rank % self.ranks_per_node

    def node_ranks(self, node: int) -> range:
        return range(node * self.ranks_per_node, (node + 1) * self.ranks_per_node)

    def same_node(self, a: int, b: int) -> bool:
        return self.node_of(a) == self.node_of(b)


def node_layout(hostnames, forced_ranks_per_node: int | None = None) -> NodeLayout:
    """The layout of ranks whose host names are `hostnames` (by rank). With
    forced_ranks_per_node, nodes are that size whatever the hosts say, but never larger than
    a real node: a forced node must not span two hosts (IPC cannot cross them)."""
    world = len(hostnames)
    if world == 0:
        raise ConfigError("no ranks")
    real = _ranks_per_host(hostnames)
    if forced_ranks_per_node is None:
        _require_node_size(real, world, f"the hosts run {real} ranks each")
        return NodeLayout(world, real)
    R = forced_ranks_per_node
    if R < 1 or world % R:
        raise ConfigError(f"{RANKS_PER_NODE_ENV}={R}: the node size must divide the {world} ranks")
    if real % R:
        raise ConfigError(f"{RANKS_PER_NODE_ENV}={R}: a forced node must lie inside one host, and hosts hold "
                          f"{real} ranks each")
    _require_node_size(R, world, f"{RANKS_PER_NODE_ENV}={R}")
    return NodeLayout(world, R)


def _require_node_size(R: int, world: int, why: str) -> None:
    """A node is the ranks that reach each other through CUDA IPC; the kernels' address tables
    hold at most MAX_PEERS of them (cuda/common/nodes.cuh)."""
    if R > MAX_PEERS:
        raise ConfigError(f"{why}, but a node holds at most {MAX_PEERS} ranks (the ranks of one node reach each "
                          f"other through CUDA IPC, and its kernels' address tables hold {MAX_PEERS}); run at most "
                          f"{MAX_PEERS} ranks per host, or set {RANKS_PER_NODE_ENV} to a divisor of {R} that is at "
                          f"most {MAX_PEERS} (the other \"nodes\" of a host are then reached by the off-node carrier, "
                          f"as on {world} ranks of several hosts)")


def _ranks_per_host(hostnames) -> int:
    """The ranks per host, after checking that every host holds the same number of
    consecutive ranks."""
    runs = []  # (host, ranks) for each run of consecutive ranks on one host
    for name in hostnames:
        if runs and runs[-1][0] == name:
            runs[-1][1] += 1
        else:
            runs.append([name, 1])
    hosts = [name for name, _ in runs]
    if len(set(hosts)) != len(hosts):
        raise ConfigError(f"the ranks of a host must be consecutive (rank r on node r // ranks_per_node); the ranks "
                          f"run on hosts in the order {hosts}: launch with ranks placed by slot, not by node")
    sizes = {count for _, count in runs}
    if len(sizes) != 1:
        raise ConfigError(f"every host must run the same number of ranks, got {dict((n, c) for n, c in runs)}")
    return sizes.pop()


def forced_ranks_per_node() -> int | None:
    """EPSERVE_RANKS_PER_NODE as an int, None when unset or empty."""
    text = os.environ.get(RANKS_PER_NODE_ENV, "").strip()
    if not text:
        return None
    try:
        value = int(text)
    except ValueError:
        raise ConfigError(f"{RANKS_PER_NODE_ENV}={text!r} is not a whole number of ranks") from None
    if value < 1:
        raise ConfigError(f"{RANKS_PER_NODE_ENV}={value}: a node holds at least one rank")
    return value


def gather_node_layout(comm) -> NodeLayout:
    """Collective, at setup: every rank's host name, then the layout every rank computes
    alike (so every rank raises the same ConfigError when the placement is unusable)."""
    return node_layout(comm.allgather(socket.gethostname()), forced_ranks_per_node())
