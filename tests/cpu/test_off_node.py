"""The off-node plan (epserve/comm/off_node.py) and the carrier choice (epserve/comm/carriers.py),
without a GPU: which ranks are off-node, the staging layout, the kernels' proxy addresses, and
that every send of a carrier group meets its receive (same size, same place) on the other side."""

import pytest

from epserve.comm.carriers import CARRIER_ENV, Recv, carrier_name, make_carrier
from epserve.comm.off_node import OffNodePlan, agree_carrier
from epserve.comm.topology import NodeLayout
from epserve.config import MoEConfig
from epserve.errors import ConfigError

LAYOUTS = [NodeLayout(2, 1), NodeLayout(4, 2), NodeLayout(4, 1), NodeLayout(8, 4), NodeLayout(8, 2),
           NodeLayout(6, 3)]
E, K, H, HC, T = 16, 4, 256, 128, 40  # the dispatch row may be narrower or wider than GEMM 2's (FP8)


def plans(layout):
    return [OffNodePlan(layout, r, E * layout.world // 2, K, H, HC, T) for r in range(layout.world)]


@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
def test_off_node_peers_and_their_blocks(layout):
    R = layout.ranks_per_node
    for p in plans(layout):
        peers = p.peers
        assert peers == [d for d in range(layout.world) if d // R != p.rank // R]
        assert len(peers) == layout.world - R
        assert [p.block(d) for d in peers] == list(range(len(peers)))  # blocks in rank order, dense
        for d in peers:  # the formula the kernels use (cuda/comm/staging.cu off_node_block)
            assert p.block(d) == (d if d < p.rank // R * R else d - R)


def test_one_node_has_no_off_node_peers():
    assert OffNodePlan(NodeLayout(4, 4), 1, 8, 2, 64, 64, 8).peers == []


@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
def test_staging_sizes(layout):
    for p in plans(layout):
        n = len(p.peers)
        assert p.tokens_block_bytes == T * H * 2 and p.meta_block_bytes == T * (1 + 2 * K) * 4
        assert p.dispatch_staging_bytes >= p.count_row_ints * 4 + n * (p.tokens_block_bytes + p.meta_block_bytes)
        assert p.combine_block_bytes == T * K * HC * 2
        assert p.combine_staging_bytes == n * p.combine_block_bytes
        for q in range(n):  # token blocks 16-byte aligned (16-byte stores); the blocks do not overlap
            assert p.tokens_offset(q) % 16 == 0
            assert p.meta_offset(q) + p.meta_block_bytes <= p.tokens_offset(q + 1)


# More than 8 ranks: nodes of 8 (the most a node holds; the kernels' address tables' size).
WIDE = [NodeLayout(16, 8), NodeLayout(32, 8), NodeLayout(128, 8)]


def node_index(d, first, R):
    """cuda/common/nodes.cuh node_index: d's local index on the node [first, first + R), or -1."""
    return d - first if 0 <= d - first < R else -1


def off_node_block(d, first, R):
    """cuda/common/nodes.cuh off_node_block."""
    return d if d < first else d - R


@pytest.mark.parametrize("layout", LAYOUTS + WIDE, ids=str)
def test_rank_to_slot_and_block(layout):
    """What the kernels compute from (node_first, ranks_per_node): a rank of this node is its
    local index in the address tables (PeerGroup.node_table), any other its staging block."""
    from epserve.comm.peers import PeerGroup

    W, R = layout.world, layout.ranks_per_node
    for p in plans(layout):
        first = p.rank // R * R
        group = PeerGroup(FakeComm([None] * W, rank=p.rank), layout)
        assert group.node_ranks == range(first, first + R)
        by_rank = [0x1000 + d for d in range(W)]
        table = group.node_table(by_rank)
        assert len(table) == R <= 8
        for d in range(W):
            q = node_index(d, first, R)
            if layout.same_node(p.rank, d):
                assert table[q] == by_rank[d] and q == layout.local_index(d)
            else:
                assert q == -1 and off_node_block(d, first, R) == p.block(d)


@pytest.mark.parametrize("layout", LAYOUTS + WIDE, ids=str)
def test_kernels_addresses_land_in_the_staging(layout):
    """What the kernels compute for a rank of another node (cuda/comm/dispatch.cu token_dst
    and meta_dst, dispatch_route.cuh's publish, sinks/row_scatter.cuh), from the struct fields
    the plan gives: inside this rank's staging block for that rank, blocks disjoint, and the
    place the carrier sends from."""
    staging, off_recv = 1 << 40, 2 << 40
    for p in plans(layout):
        f = p.dispatch_staging(staging)
        assert f["off_count_row"] == staging  # publish: the count row at the staging's start
        assert f["off_blocks"] % 16 == 0 and f["off_block_bytes"] % 16 == 0  # 16-byte stores
        for d in p.peers:
            q = p.block(d)
            for pos in (0, T - 1):
                row = p.token_row_address(f, d, pos)
                assert staging + p.tokens_offset(q) <= row
                assert row + H * 2 <= staging + p.tokens_offset(q) + p.tokens_block_bytes
                meta = p.meta_address(f, d, pos)
                assert staging + p.meta_offset(q) <= meta
                assert meta + p.meta_len * 4 <= staging + p.meta_offset(q) + p.meta_block_bytes
            assert p.token_row_address(f, d, 0) == staging + p.tokens_offset(q)  # the carrier sends from here
            assert p.meta_address(f, d, 0) == staging + p.meta_offset(q)
            first_slot = p.combine_slot_address(off_recv, d, 0, 0)
            last_slot = p.combine_slot_address(off_recv, d, T - 1, K - 1, HC - 8)
            assert first_slot == off_recv + q * p.combine_block_bytes  # the combine group sends block q
            assert last_slot + 16 == off_recv + (q + 1) * p.combine_block_bytes
        assert p.dispatch_staging_bytes == p.tokens_offset(len(p.peers))


def test_staging_sizes_at_128_ranks():
    """The staging at the limit: 120 off-node blocks, the count row of E + W + 1 ints."""
    p = OffNodePlan(NodeLayout(128, 8), 77, 1024, 8, 7168, 7168, 128)
    assert len(p.peers) == 120 and p.count_row_ints == 1024 + 128 + 1
    assert [p.block(d) for d in (0, 71, 80, 127)] == [0, 71, 72, 119]
    assert p.combine_staging_bytes == 120 * 128 * 8 * 7168 * 2


class Buf:
    """A staging buffer stand-in: the same object on every rank (as allocation order makes it)."""


def matched(layout, group_of):
    """For every ordered pair of off-node ranks, the sends of one to the other and the other's
    receives from it, in order: same sizes, and each receive reads where its send lies."""
    ps = plans(layout)
    groups = [group_of(p) for p in ps]
    for s, (sends, _) in enumerate(groups):
        for d in ps[s].peers:
            out = [x for x in sends if x.peer == d]
            into = [x for x in groups[d][1] if x.peer == s]
            assert out and [x.nbytes for x in out] == [x.nbytes for x in into]
            assert [x.offset for x in out] == [x.peer_offset for x in into]
            assert all(x.staging is y.staging for x, y in zip(out, into))
        assert {x.peer for x in sends} == set(ps[s].peers)
    return ps, groups


@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
def test_carrier_groups_match_send_for_receive(layout):
    dispatch, combine = Buf(), Buf()
    table, tokens, meta, landing = 10 << 30, 11 << 30, 12 << 30, 13 << 30
    ps, counts = matched(layout, lambda p: p.count_group(dispatch, table))
    for p, (_, recvs) in zip(ps, counts):  # into this rank's count table at the sender's row
        assert [r.dst for r in recvs] == [table + s * p.count_row_ints * 4 for s in p.peers]
    ps, rows = matched(layout, lambda p: p.rows_group(dispatch, tokens, meta))
    for p, (_, recvs) in zip(ps, rows):  # into the sender's block of this rank's token regions
        assert [r.dst for r in recvs] == [a for s in p.peers for a in (tokens + s * p.tokens_block_bytes,
                                                                        meta + s * p.meta_block_bytes)]
    ps, comb = matched(layout, lambda p: p.combine_group(combine, landing))
    for p, (_, recvs) in zip(ps, comb):  # landing block = the land kernel's off_node_block(owner)
        assert [r.dst for r in recvs] == [landing + p.block(s) * p.combine_block_bytes for s in p.peers]
    assert all(isinstance(r, Recv) for _, recvs in comb for r in recvs)


def test_carrier_name(monkeypatch):
    monkeypatch.delenv(CARRIER_ENV, raising=False)
    assert carrier_name() == "nccl"
    monkeypatch.setenv(CARRIER_ENV, " IPC ")
    assert carrier_name() == "ipc"
    monkeypatch.setenv(CARRIER_ENV, "tcp")
    with pytest.raises(ConfigError, match=CARRIER_ENV):
        carrier_name()


def test_carriers_refuse_where_they_cannot_run():
    with pytest.raises(ConfigError, match="share a GPU"):
        make_carrier("nccl", group=None, nccl_comm=None, shared_gpu=True, hosts_differ=False, error_ptr=0,
                     timeout_ns=1)
    with pytest.raises(ConfigError, match="other hosts"):
        make_carrier("ipc", group=None, nccl_comm=None, shared_gpu=False, hosts_differ=True, error_ptr=0,
                     timeout_ns=1)


class FakeComm:
    def __init__(self, values, rank=0):
        self.values, self.rank = values, rank

    def Get_rank(self):
        return self.rank

    def Get_size(self):
        return len(self.values)

    def allgather(self, mine):
        return [mine if v is None else v for v in self.values]


def test_agree_carrier(monkeypatch):
    monkeypatch.setenv(CARRIER_ENV, "ipc")
    assert agree_carrier(FakeComm([None, None]), NodeLayout(2, 2)) is None  # one node: no carrier
    assert agree_carrier(FakeComm([None, None]), NodeLayout(2, 1)) == "ipc"
    with pytest.raises(ConfigError, match="different off-node carriers"):
        agree_carrier(FakeComm([None, ("nccl", None)]), NodeLayout(2, 1))
    with pytest.raises(ConfigError, match="rank 1: bad"):
        agree_carrier(FakeComm([None, (None, "bad")]), NodeLayout(2, 1))


def test_world_limit_is_what_src_info_names():
    """Up to 128 ranks (src_info's 7 rank bits), nodes of at most 8 (docs/design.md, "Limits")."""
    MoEConfig(32, 2, 64, 64, 16, world_size=16)
    MoEConfig(128, 2, 64, 64, 16, world_size=128)
    with pytest.raises(ConfigError, match="world_size = 256 .*at most 128"):
        MoEConfig(256, 2, 64, 64, 16, world_size=256)
