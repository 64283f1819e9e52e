"""Node layouts from host names (epserve/comm/topology.py): who can reach whom by IPC."""

import pytest

from epserve.comm.topology import RANKS_PER_NODE_ENV, NodeLayout, forced_ranks_per_node, gather_node_layout, node_layout
from epserve.errors import ConfigError


def test_one_host_is_one_node():
    layout = node_layout(["a"] * 4)
    assert layout == NodeLayout(4, 4) and layout.nodes == 1
    assert all(layout.same_node(0, r) for r in range(4))


def test_two_hosts_of_four():
    layout = node_layout(["a"] * 4 + ["b"] * 4)
    assert layout.nodes == 2 and layout.ranks_per_node == 4
    assert [layout.node_of(r) for r in range(8)] == [0] * 4 + [1] * 4
    assert [layout.local_index(r) for r in range(8)] == [0, 1, 2, 3] * 2
    assert list(layout.node_ranks(1)) == [4, 5, 6, 7]
    assert not layout.same_node(3, 4)


def test_a_forced_node_size_splits_one_host():
    layout = node_layout(["a"] * 4, forced_ranks_per_node=2)
    assert layout.nodes == 2 and list(layout.node_ranks(1)) == [2, 3]
    assert node_layout(["a", "a"], forced_ranks_per_node=1).nodes == 2  # two ranks, two "nodes"


@pytest.mark.parametrize("hosts,forced,match", [
    (["a", "b", "a", "b"], None, "consecutive"),          # placed by node: rank r's node is not r // R
    (["a", "a", "a", "b"], None, "same number"),
    (["a"] * 4, 3, "divide"),
    (["a"] * 2 + ["b"] * 2, 4, "inside one host"),         # a forced node may not span hosts
    (["a"] * 4 + ["b"] * 4, 3, "divide"),
])
def test_unusable_placements_are_refused_with_the_reason(hosts, forced, match):
    with pytest.raises(ConfigError, match=match):
        node_layout(hosts, forced)


def test_the_setting_is_read_and_checked(monkeypatch):
    monkeypatch.delenv(RANKS_PER_NODE_ENV, raising=False)
    assert forced_ranks_per_node() is None
    monkeypatch.setenv(RANKS_PER_NODE_ENV, " 2 ")
    assert forced_ranks_per_node() == 2
    for bad in ("two", "0", "-1"):
        monkeypatch.setenv(RANKS_PER_NODE_ENV, bad)
        with pytest.raises(ConfigError, match=RANKS_PER_NODE_ENV):
            forced_ranks_per_node()


def test_every_rank_computes_the_same_layout_from_one_allgather(monkeypatch):
    class Comm:  # a stand-in: MPI must not start inside pytest (tests/conftest.py)
        calls = 0

        def allgather(self, value):
            Comm.calls += 1
            return [value] * 4  # four ranks on this host

    monkeypatch.setenv(RANKS_PER_NODE_ENV, "2")
    assert gather_node_layout(Comm()) == NodeLayout(4, 2) and Comm.calls == 1


@pytest.mark.parametrize("hosts,forced", [
    (["a"] * 16, None),                 # one host of 16: a node of 16
    (["a"] * 16 + ["b"] * 16, None),    # two hosts of 16
    (["a"] * 16, 16),                   # forced to 16
])
def test_a_node_holds_at_most_eight_ranks(hosts, forced):
    """The kernels' address tables hold the ranks of one node (8; cuda/common/nodes.cuh): a
    larger node is refused at setup, alike on every rank (its inputs are gathered), saying what
    to do instead."""
    with pytest.raises(ConfigError, match=r"at most 8 ranks.*EPSERVE_RANKS_PER_NODE to a divisor of 16"):
        node_layout(hosts, forced)


@pytest.mark.parametrize("world", [16, 32, 128])
def test_more_than_eight_ranks_as_nodes_of_eight(world):
    assert node_layout(["a"] * world, 8) == NodeLayout(world, 8)
    assert node_layout([f"h{r // 8}" for r in range(world)]) == NodeLayout(world, 8)
    assert node_layout(["a"] * world, 4).nodes == world // 4
