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


@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
def test_kernels_addresses_land_in_the_staging(layout):
    """What the kernels compute from the tables (cuda/comm/dispatch_route.cuh publish,
    dispatch.cu send_tokens and release, sinks/row_scatter.cuh) falls inside this rank's
    staging block for the destination, or on this rank's own counters."""
    W = layout.world
    staging, scratch, ready, my_ready = 1 << 40, 2 << 40, 3 << 40, 4 << 40
    ipc = [[(d + 1) << 30 for d in range(W)] for _ in range(5)]
    for p in plans(layout):
        r, peers = p.rank, p.peers
        t = p.dispatch_tables(count_table=ipc[0], tokens=ipc[1], meta=ipc[2], count_arrive=ipc[3], ready=ipc[4],
                              staging=staging, scratch=scratch, my_dispatch_ready=ready)
        for d in range(W):
            if d not in peers:  # on this node: the IPC addresses, untouched
                assert [t[f][d] for f in ("count_table", "tokens", "meta", "count_arrive", "ready")] == \
                    [ipc[i][d] for i in range(5)]
                continue
            q = p.block(d)
            assert t["count_table"][d] + r * p.count_row_ints * 4 == staging  # publish: table[d] + rank * row
            for pos in (0, T - 1):
                row = t["tokens"][d] + (r * T + pos) * H * 2  # send: tokens[d] + (rank * max_tokens + pos) * H
                assert staging + p.tokens_offset(q) <= row < staging + p.tokens_offset(q) + p.tokens_block_bytes
                meta = t["meta"][d] + (r * T + pos) * p.meta_len * 4
                assert staging + p.meta_offset(q) <= meta < staging + p.meta_offset(q) + p.meta_block_bytes
            assert t["count_arrive"][d] + r * 8 == scratch
            assert t["ready"][d] + r * 8 == ready + d * 8  # the release advances this rank's own ready[d]
        s = p.send_tables(recv=ipc[0], arrive=ipc[3], staging=staging, scratch=scratch)
        for d in peers:
            assert s["recv"][d] == staging + p.block(d) * p.combine_block_bytes  # slot (t, j) as in d's recv
            assert s["arrive"][d] + r * 8 == scratch
        rt = p.ready_table(ipc[4], my_ready)
        assert all(rt[d] + r * 8 == my_ready + d * 8 for d in peers)
        chunks = p.chunk_arrive_table(ipc[3], scratch)
        assert all(chunks[d] == scratch for d in peers) and all(chunks[d] == ipc[3][d] for d in range(W)
                                                                  if d not in peers)


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
    def __init__(self, values):
        self.values = values

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


def test_world_limit_still_refused_clearly():
    """This first version keeps the peer structs' 8 ranks (docs/design.md, "Across nodes", Limits)."""
    with pytest.raises(ConfigError, match="world_size"):
        MoEConfig(32, 2, 64, 64, 16, world_size=16)
