"""Off-node sizes through the host (EPSERVE_OFFNODE_SIZES=host; epserve/comm/off_node_sizes.py),
without a GPU: a numpy model of the dispatch's count rows, slot ranks and expert-major row
order for every rank, from which both ends of every off-node transfer compute its size and
every compact return position; they must agree, and the positions must fill each block
exactly. The kernels (cuda/comm/staging.cu) compute the same formulas."""

import numpy as np
import pytest

from epserve.comm import off_node_sizes as sizes_mod
from epserve.comm.off_node import OffNodePlan
from epserve.comm.off_node_sizes import SIZES_ENV, agree_sizes, sizes_from_count_rows, sizes_name
from epserve.comm.topology import NodeLayout
from epserve.errors import ConfigError

LAYOUTS = [NodeLayout(2, 1), NodeLayout(4, 2), NodeLayout(4, 1), NodeLayout(6, 3), NodeLayout(16, 8)]
K, H, HC = 4, 64, 128


class Model:
    """What every rank's dispatch computes for a routing (the direct dispatch's route and
    layout, cuda/comm/dispatch_layout.cuh), in numpy."""

    def __init__(self, routing, num_experts):
        self.routing, self.E = routing, num_experts
        self.W = len(routing)
        self.e_loc = num_experts // self.W
        self.table = np.stack([self.count_row(s) for s in range(self.W)])

    def count_row(self, s):
        idx, E, W = self.routing[s], self.E, self.W
        experts = np.bincount(idx[idx >= 0], minlength=E)
        tokens = [int(((idx >= 0) & (idx // self.e_loc == d)).any(axis=1).sum()) for d in range(W)]
        return np.concatenate([experts, tokens, [0]]).astype(np.int32)

    def slot_rank(self, s):
        """Each slot's rank among rank s's slots of the same expert, in (token, slot) order."""
        idx = self.routing[s]
        seen = np.zeros(self.E, np.int64)
        out = np.full(idx.shape, -1, np.int64)
        for t, j in np.ndindex(*idx.shape):
            e = idx[t, j]
            if e >= 0:
                out[t, j] = seen[e]
                seen[e] += 1
        return out

    def owner_rows(self, o):
        """Owner o's dispatched rows (expert-major, then source, token, slot): each row's
        (source, token, slot, local expert), and base [W][E_loc]."""
        rows, base = [], np.zeros((self.W, self.e_loc), np.int64)
        for e in range(self.e_loc):
            for s in range(self.W):
                base[s, e] = len(rows)
                idx = self.routing[s]
                rows += [(s, t, j, e) for t, j in zip(*np.nonzero(idx == o * self.e_loc + e))]
        return rows, base


def draw(layout, seed, tokens=13, experts_per_rank=3, unused=0.2, repeat=0.1):
    rng = np.random.default_rng(seed)
    E = experts_per_rank * layout.world
    routing = []
    for _ in range(layout.world):
        T = int(rng.integers(0, tokens + 1))
        idx = rng.integers(0, E, (T, K)).astype(np.int32)
        idx[rng.random((T, K)) < unused] = -1
        if T and K > 1:  # some tokens name an expert twice: the route ranks such slots too
            dup = rng.random(T) < repeat
            idx[dup, 1] = idx[dup, 0]
        routing.append(idx)
    return Model(routing, E), tokens


def all_sizes(layout, model, max_tokens):
    plans = [OffNodePlan(layout, r, model.E, K, H, HC, max_tokens) for r in range(layout.world)]
    return plans, [sizes_from_count_rows(model.table, r, plans[r].peers, model.E, max_tokens, K)
                   for r in range(layout.world)]


@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
@pytest.mark.parametrize("seed", range(3))
def test_both_ends_agree_on_every_size(layout, seed):
    model, max_tokens = draw(layout, seed)
    plans, sizes = all_sizes(layout, model, max_tokens)
    for r, p in enumerate(plans):
        for d in p.peers:
            assert sizes[r].tokens_to[d] == sizes[d].tokens_from[r] == model.table[r, model.E + d]
            assert sizes[r].returns_to[d] == sizes[d].returns_from[r]  # the rows d sent r's experts
            assert sizes[d].returns_from[r] == int(((model.routing[d] >= 0) &
                                                    (model.routing[d] // model.e_loc == r)).sum())


@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
@pytest.mark.parametrize("seed", range(3))
def test_compact_return_positions_agree_and_fill_each_block(layout, seed):
    """The owner's position of each row bound home (ret_base + its rank among its source's
    rows of its expert) is the home's position of the same slot (home_base + slot_rank),
    and each block's positions are exactly 0 .. size - 1."""
    model, max_tokens = draw(layout, seed)
    plans, sizes = all_sizes(layout, model, max_tokens)
    E, e_loc = model.E, model.e_loc
    for o, p in enumerate(plans):
        rows, base = model.owner_rows(o)
        ret = sizes_mod.owner_ret_base(model.table, o, E)
        by_home = {h: [] for h in p.peers}
        for m, (s, t, j, e) in enumerate(rows):
            if s not in by_home:
                continue
            q = ret[s * e_loc + e] + (m - base[s, e])
            home_q = sizes_mod.home_base(model.table[s], layout.world, E)[o * e_loc + e] + model.slot_rank(s)[t, j]
            assert q == home_q, (o, s, t, j)
            info = sizes_mod.return_src_info(s, int(q), K)  # what the sink decodes: in bounds, slot q
            assert info >> 24 == s and ((info >> 4) & 0xFFFFF) < max_tokens and (info & 0xF) < K
            assert ((info >> 4) & 0xFFFFF) * K + (info & 0xF) == q
            by_home[s].append(int(q))
        for h, qs in by_home.items():
            assert sorted(qs) == list(range(sizes[o].returns_to[h])), (o, h)


def test_segment_exclusive_scan():
    v = np.arange(1, 13)
    assert sizes_mod.segment_exclusive_scan(v, 4).tolist() == [0, 1, 3, 6, 0, 5, 11, 18, 0, 9, 19, 30]
    assert sizes_mod.segment_exclusive_scan(v, 1).tolist() == [0] * 12


def test_a_row_with_an_error_code_counts_as_empty():
    """A rejected rank's row (the kernels publish zeros and the code): both ends move nothing
    from it; the rows the others route to it still move (a stopped call moves stale rows
    that nobody reads, the same on both ends)."""
    layout = NodeLayout(2, 1)
    model, max_tokens = draw(layout, 5, tokens=20)
    model.table[1, -1] = 100  # EPSERVE_INPUT_REJECTED
    (p0, p1), (s0, s1) = all_sizes(layout, model, max_tokens)
    assert s0.tokens_from[1] == s1.tokens_to[0] == 0
    assert s0.returns_to[1] == s1.returns_from[0] == 0
    assert s0.tokens_to[1] == s1.tokens_from[0] == model.table[0, model.E + 1]


def test_sizes_are_clamped_to_the_blocks():
    table = np.zeros((2, 2 * 3 + 2 + 1), np.int32)
    table[0, :6] = 10**6
    table[0, 6:8] = -5, 10**6
    s = sizes_from_count_rows(table, 1, [0], 6, 8, K)
    assert s.tokens_from[0] == 8 and s.returns_to[0] == 8 * K
    s = sizes_from_count_rows(table, 0, [1], 6, 8, K)
    assert s.tokens_to[1] == 8 and s.returns_from[1] == 8 * K


@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
def test_sized_groups_match_send_for_receive(layout):
    """Every sized send meets its receive on the other side (same size, read where it lies),
    transfers of zero bytes are left out on both ends, and the sizes are the routed rows'."""
    model, max_tokens = draw(layout, 11, unused=0.5)
    plans, sizes = all_sizes(layout, model, max_tokens)
    staging, tokens, meta, landing = object(), 11 << 30, 12 << 30, 13 << 30
    for kind in ("rows", "combine"):
        groups = [p.rows_group(staging, tokens, meta, sz) if kind == "rows" else p.combine_group(staging, landing, sz)
                  for p, sz in zip(plans, sizes)]
        for s, (sends, _) in enumerate(groups):
            for d in plans[s].peers:
                out = [x for x in sends if x.peer == d]
                into = [x for x in groups[d][1] if x.peer == s]
                assert [x.nbytes for x in out] == [x.nbytes for x in into]
                assert [x.offset for x in out] == [x.peer_offset for x in into]
                assert all(x.nbytes > 0 for x in out)
                n = sizes[s].tokens_to[d] if kind == "rows" else sizes[s].returns_to[d]
                want = [n * H * 2, n * (1 + 2 * K) * 4] if kind == "rows" else [n * HC * 2]
                assert [x.nbytes for x in out] == [b for b in want if b]
        capacity = [p.rows_group(staging, tokens, meta) for p in plans]  # the default: whole blocks, unchanged
        assert all(x.nbytes == plans[0].tokens_block_bytes for sends, _ in capacity for x in sends[::2])


def test_sizes_name(monkeypatch):
    monkeypatch.delenv(SIZES_ENV, raising=False)
    assert sizes_name() == "capacity"
    monkeypatch.setenv(SIZES_ENV, " Host ")
    assert sizes_name() == "host"
    monkeypatch.setenv(SIZES_ENV, "device")
    with pytest.raises(ConfigError, match=SIZES_ENV):
        sizes_name()


class FakeComm:
    def __init__(self, values):
        self.values = values

    def allgather(self, mine):
        return [mine if v is None else v for v in self.values]


def test_agree_sizes(monkeypatch):
    monkeypatch.setenv(SIZES_ENV, "host")
    assert agree_sizes(FakeComm([None, None]), 1) is None  # one node: nothing crosses
    assert agree_sizes(FakeComm([None, None]), 2) == "host"
    with pytest.raises(ConfigError, match="different off-node sizes"):
        agree_sizes(FakeComm([None, ("capacity", None)]), 2)
    with pytest.raises(ConfigError, match="rank 1: bad"):
        agree_sizes(FakeComm([None, (None, "bad")]), 2)
