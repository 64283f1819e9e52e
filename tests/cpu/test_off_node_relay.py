"""The relay route across nodes (EPSERVE_OFFNODE_ROUTE=relay; epserve/comm/off_node_relay.py,
cuda/comm/off_node_relay.cu): the rails, the carrier's groups matched send for receive, every
block of the direct route arriving where the direct route puts it (a model of the carrier and
of the relay kernels' block arithmetic), the setting's agreement, and the launches against
their kernels' parameters."""

import types

import numpy as np
import pytest

from epserve.comm import off_node_relay as relay_mod
from epserve.comm.off_node import OffNodePlan
from epserve.comm.off_node_relay import RelayPlan, agree_route, relay_sizes, route_name
from epserve.comm.off_node_sizes import sizes_from_count_rows
from epserve.comm.topology import NodeLayout
from epserve.errors import ConfigError
from epserve.runtime import build, kernels

E, K, H, T = 64, 4, 256, 40
LAYOUTS = [(2, 1), (4, 2), (8, 2), (8, 4), (16, 8), (32, 8), (12, 4)]


def plans(W, R):
    return [RelayPlan(OffNodePlan(NodeLayout(W, R), r, E, K, H, H, T)) for r in range(W)]


class Staging:
    """A stand-in for a carrier's staging buffer: the same object on every rank, as the
    carrier's collective staging is."""


def matched(groups):
    """Every rank's sends, each met by the receive its peer lists for this rank at the same
    position among that peer's receives from it, of the same size and naming the send's place."""
    for r, (sends, recvs) in enumerate(groups):
        for s in sends:
            theirs = [x for x in groups[s.peer][1] if x.peer == r]
            mine = [x for x in sends if x.peer == s.peer]
            assert len(theirs) == len(mine)
            got = theirs[mine.index(s)]
            assert (got.nbytes, got.peer_offset, got.staging) == (s.nbytes, s.offset, s.staging), (r, s, got)
    return True


@pytest.mark.parametrize("W,R", LAYOUTS)
def test_one_peer_per_other_node_the_rank_of_the_same_local_index(W, R):
    for p in plans(W, R):
        rails = [p.rail(c) for c in p.other_nodes]
        assert len(rails) == W // R - 1
        assert all(d % R == p.local and not p.off.layout.same_node(d, p.off.rank) for d in rails)


@pytest.mark.parametrize("W,R", LAYOUTS)
def test_every_send_meets_its_receive(W, R):
    ps, staging, relay = plans(W, R), Staging(), Staging()
    assert matched([p.count_group(staging, 1 << 40) for p in ps])
    assert matched([p.rows_group(staging, 1 << 40) for p in ps])
    assert matched([p.combine_group(relay, 1 << 40) for p in ps])
    for p in ps:  # one transfer per node pair and rail, each way
        for sends, recvs in (p.count_group(staging, 0), p.rows_group(staging, 0), p.combine_group(relay, 0)):
            assert len(sends) == len(recvs) == W // R - 1


@pytest.mark.parametrize("W,R", LAYOUTS)
def test_dispatch_blocks_reach_the_token_regions_the_direct_route_fills(W, R):
    """A model of the carrier (bytes at an offset of the sender's staging land at the
    receiver's address) and of epserve_relay_token_blocks (relay block (other_node_index(c) R
    + q) into node rank q's token region at block s): every off-node pair (s, d) ends with
    s's staging block for d in d's token region at s, as the direct route's carrier leaves it."""
    ps = plans(W, R)
    bb = ps[0].block_bytes
    base = ps[0].off.tokens_offset(0)
    staging = {s: {base + ps[s].off.block(d) * bb: ("block", s, d) for d in ps[s].off.peers} for s in range(W)}
    relay = {r: {} for r in range(W)}  # relay area offset -> block
    for r, p in enumerate(ps):
        sends, recvs = p.rows_group(staging, 0)
        for rv in recvs:
            for i in range(rv.nbytes // bb):  # whole blocks
                relay[r][rv.dst + i * bb] = staging[rv.peer][rv.peer_offset + i * bb]
    regions = {}
    for r, p in enumerate(ps):  # the relay kernel of rank r
        a = p.node
        for c in p.other_nodes:
            s = c * R + p.local
            for q in range(R):
                regions[(a * R + q, s)] = relay[r][(RelayPlan.other_index(c, a) * R + q) * bb]
    want = {(d, s): ("block", s, d) for s in range(W) for d in ps[s].off.peers}
    assert regions == want


@pytest.mark.parametrize("W,R", LAYOUTS)
def test_combine_blocks_reach_the_landing_blocks_the_direct_route_fills(W, R):
    """A model of epserve_relay_combine_rows (owner d's staged block for home h into the relay
    area of d's node rank of h's local index, block (other_node_index(node(h)) R + local(d)))
    and of the carrier: every off-node pair (owner d, home h) ends with d's block for h in h's
    landing block of d, as the direct route's carrier leaves it."""
    ps, relay_staging = plans(W, R), Staging()
    cb = ps[0].off.combine_block_bytes
    areas = {r: {} for r in range(W)}
    for d, p in enumerate(ps):
        for h in p.off.peers:
            rail_peer = p.node * R + h % R
            areas[rail_peer][(RelayPlan.other_index(h // R, p.node) * R + p.local) * cb] = ("rows", d, h)
    landing = {r: {} for r in range(W)}
    for r, p in enumerate(ps):
        sends, recvs = p.combine_group(relay_staging, 0)
        for rv in recvs:
            for i in range(rv.nbytes // cb):
                landing[r][rv.dst + i * cb] = areas[rv.peer][rv.peer_offset + i * cb]
    for h, p in enumerate(ps):
        assert landing[h] == {p.off.block(d) * cb: ("rows", d, h) for d in p.off.peers}


def routed_table(W, seed):
    """A count table [W][E + W + 1] of random routing: rows per expert, tokens per destination
    rank (the direct dispatch's count rows; tests/cpu/test_off_node_sizes.py models them in full)."""
    rng = np.random.default_rng(seed)
    table = np.zeros((W, E + W + 1), np.int32)
    for s in range(W):
        idx = rng.integers(-1, E, (int(rng.integers(0, T + 1)), K))
        table[s, :E] = np.bincount(idx[idx >= 0], minlength=E)
        table[s, E:E + W] = [((idx >= 0) & (idx // (E // W) == d)).any(axis=1).sum() for d in range(W)]
    return table


@pytest.mark.parametrize("W,R", LAYOUTS)
@pytest.mark.parametrize("seed", [1, 2])
def test_routed_sizes_agree_at_both_ends_and_with_the_direct_route(W, R, seed):
    """EPSERVE_OFFNODE_SIZES=host: each rank reads its own and its rail peers' rows only; every
    sized send meets its receive, and each block carries what the direct route's sized groups
    carry for the same pair of ranks (token rows s -> d, return rows o -> h)."""
    table, ps, staging, relay = routed_table(W, seed), plans(W, R), Staging(), Staging()
    sizes = [relay_sizes(table, p) for p in ps]
    direct = [sizes_from_count_rows(table, r, ps[r].off.peers, E, T, K) for r in range(W)]
    assert matched([p.rows_group(staging, 1 << 40, z) for p, z in zip(ps, sizes)])
    assert matched([p.combine_group(relay, 1 << 40, z) for p, z in zip(ps, sizes)])
    for r, (p, z) in enumerate(zip(ps, sizes)):
        assert z.tokens_to == direct[r].tokens_to and z.returns_from == direct[r].returns_from
        for (s, d), n in z.relayed_in.items():
            assert n == direct[s].tokens_to[d]
        for (h, o), n in z.relayed_out.items():
            assert n == direct[o].returns_to[h]
        read = {r} | {p.rail(c) for c in p.other_nodes}  # the rows relay_sizes may read
        blank = table.copy()
        blank[[x for x in range(W) if x not in read]] = -7
        assert relay_sizes(blank, p) == z


@pytest.mark.parametrize("W,R", LAYOUTS)
def test_routed_sizes_agree_when_a_rank_stands_in(W, R):
    """A rank whose input was rejected (or held a bad expert id) publishes zeros and an error
    code: both ends of every transfer read that row as empty, so the sized groups of the call
    the verdict stops still meet send for receive (the rank standing in and the others make the
    same groups; tests/cpu/test_off_node_teardown.py has what made the NCCL job hang)."""
    ps, staging, relay = plans(W, R), Staging(), Staging()
    for culprit in {0, W - 1, R}:
        if culprit >= W:
            continue
        table = routed_table(W, culprit)
        table[culprit] = 0
        table[culprit, -1] = 100  # EPSERVE_INPUT_REJECTED
        sizes = [relay_sizes(table, p) for p in ps]
        assert matched([p.rows_group(staging, 1 << 40, z) for p, z in zip(ps, sizes)])
        assert matched([p.combine_group(relay, 1 << 40, z) for p, z in zip(ps, sizes)])
        assert not any(sizes[culprit].tokens_to.values()) and not any(sizes[culprit].returns_from.values())
        for z in sizes:  # what comes from, or goes home to, the rank standing in is empty everywhere
            assert not any(n for (s, _), n in z.relayed_in.items() if s == culprit)
            assert not any(n for (h, _), n in z.relayed_out.items() if h == culprit)


def test_relay_areas_hold_r_blocks_per_other_node():
    p = plans(8, 2)[3]
    assert p.dispatch_relay_bytes == 3 * 2 * p.block_bytes
    assert p.combine_relay_bytes == 3 * 2 * p.off.combine_block_bytes == p.off.combine_staging_bytes


def test_the_route_setting(monkeypatch):
    monkeypatch.delenv(relay_mod.ROUTE_ENV, raising=False)
    assert route_name() == "direct"
    monkeypatch.setenv(relay_mod.ROUTE_ENV, " Relay ")
    assert route_name() == "relay"
    monkeypatch.setenv(relay_mod.ROUTE_ENV, "hops")
    with pytest.raises(ConfigError, match="EPSERVE_OFFNODE_ROUTE='hops'"):
        route_name()


class Comm:
    def __init__(self, others):
        self.others = others

    def allgather(self, mine):
        return [mine] + self.others


def test_the_ranks_agree_on_the_route(monkeypatch):
    monkeypatch.setenv(relay_mod.ROUTE_ENV, "relay")
    assert agree_route(Comm([]), 1) is None  # one node: no route
    assert agree_route(Comm([("relay", None)]), 2) == "relay"
    with pytest.raises(ConfigError, match="different off-node routes"):
        agree_route(Comm([("direct", None)]), 2)
    monkeypatch.setenv(relay_mod.ROUTE_ENV, "hops")
    with pytest.raises(ConfigError, match="rank 0: EPSERVE_OFFNODE_ROUTE='hops'"):
        agree_route(Comm([("direct", None)]), 2)
    monkeypatch.delenv(relay_mod.ROUTE_ENV)
    assert agree_route(Comm([("direct", None)]), 2) == "direct"


class Ptr:
    """A device pointer argument (a CuPy array, or a slice of one): 8 bytes."""

    def __getitem__(self, s):
        return Ptr()


class Called:
    calls = []

    def __init__(self, name):
        self.name = name

    def __call__(self, grid, block, args):
        Called.calls.append((self.name, args))


def param_sizes(ptx: str, kernel: str) -> list[int]:
    from test_dispatch_launch_args import param_sizes as sizes  # a sibling's helper

    return sizes(ptx, kernel)


def bare_relay(monkeypatch, tmp_path, modules=("off_node_relay", "staging")):
    """A Relay of rank 3 of four nodes of 2, made without a GPU: its kernel calls are kept
    (Called), its carrier groups listed in `exchanges`; and the PTX of `modules`."""
    from test_dispatch_launch_args import fake_stamps

    monkeypatch.setenv("EPSERVE_CACHE_DIR", str(tmp_path))
    ptx = {m: build.compile_source(*kernels.VARIANTS[m]).ptx.read_text() for m in modules}
    monkeypatch.setattr(relay_mod.kernels, "function", lambda module, name: Called(name))
    monkeypatch.setattr(relay_mod, "i32", lambda v: np.full(1, v, np.int32))
    monkeypatch.setattr(relay_mod, "u64", lambda v: np.full(1, v, np.uint64))
    Called.calls = []
    exchanges = []
    plan = OffNodePlan(NodeLayout(8, 2), 3, E, K, H, H, T)
    off = types.SimpleNamespace(
        plan=plan, rank=3, world=8, timeout_ns=10**9, signals=types.SimpleNamespace(local=lambda a: 0x2000),
        carrier=types.SimpleNamespace(exchange=lambda s, r, status=None: exchanges.append((s, r))),
        stamps=fake_stamps(monkeypatch, 8))
    r = relay_mod.Relay.__new__(relay_mod.Relay)
    r.off, r.plan, r._groups, r._sms = off, RelayPlan(plan), {}, 132
    r._dispatch_area = types.SimpleNamespace(ptr=0x3000)
    r._combine_area, r._counters = Staging(), types.SimpleNamespace(ptr=0x4000)
    r._dispatch_arrive = r._combine_arrive = r._combine_areas = r._epochs = r._done = Ptr()
    r._area_ok = r._relayed = Ptr()
    return r, off, exchanges, ptx


def test_launches_match_their_kernels(monkeypatch, tmp_path):
    from epserve.runtime.kernel_structs import DISPATCH_CONFIG, PEER_SEND_CONFIG

    r, off, exchanges, ptx = bare_relay(monkeypatch, tmp_path)
    dcfg, scfg = np.zeros(1, DISPATCH_CONFIG), np.zeros(1, PEER_SEND_CONFIG)
    r.exchange_counts(Staging(), 0x5000, dcfg)
    r.exchange_rows(Staging(), dcfg, Ptr(), Ptr(), E // 8)
    r.exchange_combine(scfg, Ptr(), E // 8, 0x6000, Ptr())
    r.exchange_combine(scfg, None, E // 8, 0x6000, None)  # a rank standing in
    stamped = ["epserve_off_node_stamp", "epserve_off_node_stamps_check"]
    combine = ["epserve_relay_combine_ready", "epserve_relay_combine_rows", "epserve_relay_combine_wait"] + stamped
    assert [name for name, _ in Called.calls] == [
        "epserve_relay_count_rows", *stamped, "epserve_relay_token_blocks", "epserve_relay_rows_wait",
        *combine, *combine]
    assert len(exchanges) == 4  # counts, rows, and a combine group per combine
    # the token-row and combine groups end with a stamp to and from each rail peer (ranks 1, 5, 7)
    for sends, recvs in exchanges[1:]:
        assert [x.peer for x in sends if x.staging is off.stamps.out] == [1, 5, 7]
        assert [x.peer for x in recvs if x.staging is off.stamps.out] == [1, 5, 7]
    # the node after node order of the send under GEMM 2 (EPSERVE_OFFNODE_OVERLAP=1): a relay,
    # a wait and a group per other node, the first step alone deciding which areas are free,
    # the last wait alone moving the count of combines on
    n = len(Called.calls)
    r.exchange_combine(scfg, Ptr(), E // 8, 0x6000, Ptr(), by_node=True)
    names = [name for name, _ in Called.calls[n:]]
    assert names.count("epserve_relay_combine_ready") == 1 and names[0] == "epserve_relay_combine_ready"
    waits = [args for name, args in Called.calls[n:] if name == "epserve_relay_combine_wait"]
    assert [int(a[5][0]) for a in waits] == [0, 2, 3] and [int(a[6][0]) for a in waits] == [0, 0, 1]
    checks = [args for name, args in Called.calls[n:] if name == "epserve_off_node_stamps_check"]
    assert [int(a[4][0]) for a in checks] == [0, 0, 1]
    assert len(exchanges) == 4 + 3
    for name, args in Called.calls:
        module = "staging" if "stamp" in name else "off_node_relay"
        assert [8 if isinstance(a, Ptr) else np.asarray(a).nbytes for a in args] == param_sizes(ptx[module], name), name
