"""The combine's off-node send under GEMM 2 (EPSERVE_OFFNODE_OVERLAP=1; epserve/comm/off_node_overlap.py,
epserve/ffn/overlap_gemm.py), without a GPU: the tile order (a permutation, deterministic, the
m-tiles holding rows bound off-node first, each class in the scheduler's order, the default
order when nothing or everything goes off-node), the ordered tickets of split K, the room,
the staged-row counting (the sink's runs against the expect kernel's count), the carrier
group split by node (every transfer once, each send meeting its receive in the same pair of
node groups), the counters' place, the settings, and the launches' arguments against the
compiled kernels."""

import re
import types

import numpy as np
import pytest
from test_dispatch_launch_args import param_sizes  # the PTX's parameter widths, a sibling's helper

from epserve.comm import off_node_overlap as ovl
from epserve.comm.off_node import OffNodePlan
from epserve.comm.topology import NodeLayout
from epserve.errors import ConfigError
from epserve.ffn import overlap_gemm as og
from epserve.ffn.tiles import TILE_COLS, TILE_ROWS
from epserve.runtime import build, kernels

ROOT_CUDA = build.CUDA_ROOT


def random_offsets(rng, experts, rows, empty=0.2):
    counts = rng.integers(0, 3 * TILE_ROWS, experts)
    counts[rng.random(experts) < empty] = 0
    if rows is not None:
        counts = (counts * rows // max(1, counts.sum())).astype(int)
    return np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)


def src_rows(rng, offsets, world, sources_per_expert=True):
    """src_info's home ranks of the rows, expert-major and source-minor as the dispatch lays them."""
    homes = []
    for e in range(len(offsets) - 1):
        n = int(offsets[e + 1] - offsets[e])
        homes.append(np.sort(rng.integers(0, world, n)))
    return np.concatenate(homes).astype(np.int32) if homes else np.zeros(0, np.int32)


# ---- the scheduler's walk and the order ---------------------------------------------------
@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("N", [256, 512, 1280, 7168])
def test_scheduler_model_covers_every_tile_once(seed, N):
    rng = np.random.default_rng(seed)
    offsets = random_offsets(rng, int(rng.integers(1, 9)), None)
    tiles = og.scheduler_tiles(offsets, N)
    want = {(e, int(offsets[e]) + m * TILE_ROWS, n * TILE_COLS) for e in range(len(offsets) - 1)
            for m in range(-(-(int(offsets[e + 1]) - int(offsets[e])) // TILE_ROWS)) for n in range(-(-N // TILE_COLS))}
    assert len(tiles) == len(want) and set(tiles) == want


@pytest.mark.parametrize("seed", range(10))
@pytest.mark.parametrize("N", [256, 1024, 7168])
def test_tile_order_is_a_stable_partition_with_off_node_first(seed, N):
    rng = np.random.default_rng(seed)
    world, R = 4, 2
    offsets = random_offsets(rng, int(rng.integers(1, 9)), None)
    homes = src_rows(rng, offsets, world)
    rank = int(rng.integers(0, world))
    off = homes // R != rank // R
    order = og.tile_order_model(offsets, N, off)
    tiles = og.scheduler_tiles(offsets, N)
    assert sorted(order.tolist()) == list(range(len(tiles)))  # a permutation
    assert np.array_equal(order, og.tile_order_model(offsets, N, off))  # deterministic
    flagged = [bool(off[m:min(m + TILE_ROWS, int(offsets[e + 1]))].any()) for e, m, _ in tiles]
    k = sum(flagged)
    assert all(flagged[i] for i in order[:k]) and not any(flagged[i] for i in order[k:])
    assert list(order[:k]) == sorted(order[:k]) and list(order[k:]) == sorted(order[k:])  # each class in order


def test_tile_order_is_the_default_when_nothing_or_everything_goes_off_node():
    offsets = np.array([0, 300, 300, 1000], np.int32)
    for value in (False, True):
        order = og.tile_order_model(offsets, 1024, np.full(1000, value))
        assert np.array_equal(order, np.arange(len(order)))


@pytest.mark.parametrize("parts", [1, 2])
def test_ordered_tickets_are_a_permutation_of_the_items_part_by_part(parts):
    order = np.array([3, 0, 4, 1, 2], np.int32)
    total = len(order)
    items = [og.ordered_item(t, total, order, room=8) for t in range(total * parts)]
    assert sorted(items) == list(range(total * parts))
    for t, item in enumerate(items):
        assert item // total == t // total  # every first half is still handed out before any second
    assert [og.ordered_item(t, total, order, room=4) for t in range(total * parts)] == list(range(total * parts))


@pytest.mark.parametrize("seed", range(8))
def test_order_room_holds_every_launch_up_to_the_capacity(seed):
    rng = np.random.default_rng(seed)
    experts, capacity, N = int(rng.integers(1, 33)), int(rng.integers(1, 5000)), 7168
    room = og.order_room(capacity, experts, N, max_mtiles=32 * 1024)
    for _ in range(20):
        offsets = random_offsets(rng, experts, capacity)
        assert len(og.scheduler_tiles(offsets, N)) <= room
    capped = og.order_room(capacity, experts, N, max_mtiles=3)
    assert capped == 3 * -(-N // TILE_COLS)


def test_order_kernel_table_is_the_hosts_cap():
    source = (ROOT_CUDA / kernels.WGMMA_GEMM_SOURCE).read_text()
    assert re.search(r"kOrderMaxMtiles = 32 \* 1024;", source)
    assert "epserve_gemm_order_max_mtiles = kOrderMaxMtiles" in source  # the host reads it from the module


# ---- counting the staged rows -------------------------------------------------------------
def staged_units(src_homes, offsets, N, off):
    """What the counting sink adds per home over a whole GEMM: for each tile, each run of rows
    bound off-node adds run x cols / 64 at its first row (count_off_node_rows)."""
    units = {}
    for e, m0, n_abs in og.scheduler_tiles(offsets, N):
        rows = min(TILE_ROWS, int(offsets[e + 1]) - m0)
        cols = min(TILE_COLS, N - n_abs)
        h = src_homes[m0:m0 + rows]
        for r in range(rows):
            if not off(h[r]) or (r > 0 and h[r - 1] == h[r]):
                continue
            run = 1
            while r + run < rows and h[r + run] == h[r]:
                run += 1
            units[int(h[r])] = units.get(int(h[r]), 0) + run * cols // 64
    return units


@pytest.mark.parametrize("seed", range(8))
def test_the_sinks_runs_add_up_to_the_expect_kernels_target(seed):
    rng = np.random.default_rng(seed)
    world, R, N = 8, 2, 1280
    rank = int(rng.integers(0, world))
    offsets = random_offsets(rng, int(rng.integers(1, 6)), None)
    homes = src_rows(rng, offsets, world)
    off = lambda h: h // R != rank // R  # noqa: E731
    expected = {int(h): int((homes == h).sum()) * N // 64 for h in range(world) if off(h) and (homes == h).any()}
    assert staged_units(homes, offsets, N, off) == expected


def test_counters_follow_the_combine_staging_blocks():
    """The kernels' off_node_rows_done: off_recv + (world - R) * max_tokens * k * H bf16."""
    for layout in (NodeLayout(2, 1), NodeLayout(8, 2), NodeLayout(16, 8)):
        for rank in range(layout.world):
            plan = OffNodePlan(layout, rank, 16 * layout.world, 4, 256, 128, 40)
            W, R = layout.world, layout.ranks_per_node
            assert ovl.done_counters_offset(plan) == (W - R) * 40 * 4 * 128 * 2
            assert ovl.done_counters_offset(plan) % 8 == 0
            assert ovl.done_counters_bytes(plan) == 8 * (W - R)
    source = (ROOT_CUDA / "sinks" / "off_node_rows_done.cuh").read_text()
    assert "(cfg.world - cfg.ranks_per_node) * cfg.max_tokens * cfg.top_k" in source


# ---- the carrier group by node ---------------------------------------------------------------
@pytest.mark.parametrize("layout", [NodeLayout(2, 1), NodeLayout(4, 2), NodeLayout(6, 2), NodeLayout(8, 2),
                                    NodeLayout(16, 4)], ids=str)
def test_groups_by_node_split_the_combine_group_and_meet_pairwise(layout):
    staging = types.SimpleNamespace(name="staging")
    R = layout.ranks_per_node
    plans = [OffNodePlan(layout, r, 16 * layout.world, 4, 256, 128, 40) for r in range(layout.world)]
    groups = {}
    for p in plans:
        sends, recvs = p.combine_group(staging, 1 << 40)
        gs = ovl.groups_by_node(p, sends, recvs)
        assert [g.node for g in gs] == [n for n in range(layout.world // R) if n != p.rank // R]  # node order
        assert sorted(map(id, (x for g in gs for x in g.sends))) == sorted(map(id, sends))
        assert sorted(map(id, (x for g in gs for x in g.recvs))) == sorted(map(id, recvs))
        for g in gs:
            assert g.first_rank == g.node * R and g.first_block == p.block(g.first_rank) and g.ranks == R
            assert [p.block(d) for d in range(g.first_rank, g.first_rank + R)] == list(
                range(g.first_block, g.first_block + R))  # the wait kernel's blocks
            assert {x.peer for x in g.sends} <= set(range(g.first_rank, g.first_rank + R))
        groups[p.rank] = {g.node: g for g in gs}
    for a in range(layout.world):  # a's send to b is in a's group for b's node, b's receive in b's for a's
        for b in range(layout.world):
            if a // R == b // R:
                continue
            send = [s for s in groups[a][b // R].sends if s.peer == b]
            recv = [r for r in groups[b][a // R].recvs if r.peer == a]
            assert len(send) == len(recv) == 1
            assert send[0].nbytes == recv[0].nbytes and send[0].offset == recv[0].peer_offset


# ---- settings -------------------------------------------------------------------------------
class FakeComm:
    def __init__(self, values):
        self.values = values

    def allgather(self, mine):
        return [mine if v is None else v for v in self.values]


def test_overlap_is_opt_in_and_agreed(monkeypatch):
    monkeypatch.delenv(ovl.OVERLAP_ENV, raising=False)
    monkeypatch.delenv(og.FREE_SMS_ENV, raising=False)
    assert ovl.agree_overlap(FakeComm([None, None]), 2) is None
    monkeypatch.setenv(ovl.OVERLAP_ENV, "1")
    assert ovl.agree_overlap(FakeComm([None, None]), 1) is None  # one node: nothing crosses
    assert ovl.agree_overlap(FakeComm([None, None]), 2) == og.DEFAULT_FREE_SMS
    monkeypatch.setenv(og.FREE_SMS_ENV, "6")
    assert ovl.agree_overlap(FakeComm([None, None]), 2) == 6
    with pytest.raises(ConfigError, match="different off-node overlap settings"):
        ovl.agree_overlap(FakeComm([None, ("off", None)]), 2)
    for bad, var in (("yes", ovl.OVERLAP_ENV), ("0", og.FREE_SMS_ENV), ("x", og.FREE_SMS_ENV)):
        monkeypatch.setenv(ovl.OVERLAP_ENV, "1")
        monkeypatch.setenv(og.FREE_SMS_ENV, "8")
        monkeypatch.setenv(var, bad)
        with pytest.raises(ConfigError):
            ovl.agree_overlap(FakeComm([None, None]), 2)


def test_free_sms_and_grid():
    assert og.overlap_grid(132, 8) == 124
    with pytest.raises(ConfigError):
        og.free_sms(sm_count=1)


# ---- the launches against the kernels ---------------------------------------------------------
def arg_size(a) -> int:
    """A one-element array passes by value; a longer one, or a fake Device, stands for a device
    array (a pointer)."""
    if not isinstance(a, np.ndarray):
        assert type(a).__name__ == "Device", type(a)
        return 8
    return a.nbytes if a.size == 1 else 8


@pytest.fixture(scope="module")
def ptx(tmp_path_factory):
    import os

    old = os.environ.get("EPSERVE_CACHE_DIR")
    os.environ["EPSERVE_CACHE_DIR"] = str(tmp_path_factory.mktemp("cache"))
    try:
        out = {}
        for name in ("off_node_overlap", "gemm_wgmma_peer_overlap", "staging"):
            source, defines = kernels.VARIANTS[name]
            out[name] = build.compile_source(source, defines).ptx.read_text()
        return out
    finally:
        if old is None:
            del os.environ["EPSERVE_CACHE_DIR"]
        else:
            os.environ["EPSERVE_CACHE_DIR"] = old


class Recorded:
    def __init__(self, name, calls):
        self.name, self.calls = name, calls

    def __call__(self, grid, block, args, **kw):
        self.calls.append((self.name, args))


def test_side_stream_launches_match_their_kernels(ptx, monkeypatch):
    from epserve.runtime.kernel_structs import PEER_SEND_CONFIG

    calls, exchanges = [], []
    monkeypatch.setattr(ovl.kernels, "function", lambda mod, name: Recorded(name, calls))
    monkeypatch.setattr(ovl, "i32", lambda v: np.full(1, v, np.int32))  # by-value arguments the test can measure
    monkeypatch.setattr(ovl, "u64", lambda v: np.full(1, v, np.uint64))

    class Stream:
        def __enter__(self):
            return self

        def __exit__(self, *a):
            return False

        def wait_event(self, e):
            pass

    fake_cupy = types.SimpleNamespace(cuda=types.SimpleNamespace(get_current_stream=lambda: Stream()))
    monkeypatch.setattr(ovl, "cupy", fake_cupy)
    from test_dispatch_launch_args import fake_stamps

    plan = OffNodePlan(NodeLayout(8, 2), 3, 64, 4, 256, 256, 40)
    stamps = fake_stamps(monkeypatch, 8)
    off = types.SimpleNamespace(
        plan=plan, timeout_ns=10**9, signals=types.SimpleNamespace(local=lambda a: 0x2000), relay=None,
        carrier=types.SimpleNamespace(exchange=lambda s, r, status=None: exchanges.append((s, r))), stamps=stamps,
        stamped_combine_group=lambda sizes=None: stamps.with_stamps(
            1, *plan.combine_group(types.SimpleNamespace(), 1 << 40, sizes), plan.peers),
        combine_valid=lambda status: status)
    send = ovl.OverlappedSend.__new__(ovl.OverlappedSend)
    send.off_node, send.free_sms, send._done, send.sends, send._groups = off, 8, 0x3000, 0, {}
    send._expected = np.zeros(len(plan.peers), np.uint64)
    send._side, send._join = Stream(), types.SimpleNamespace(record=lambda s: None)
    cfg = np.zeros(1, PEER_SEND_CONFIG)
    send.send(cfg, np.zeros(5, np.int32), 8, np.zeros(2, np.int32), compact=False)
    per_node = ["epserve_off_node_rows_wait", "epserve_off_node_stamp", "epserve_off_node_stamps_check"]
    assert [c[0] for c in calls] == ["epserve_off_node_rows_expect"] + per_node * 3
    for name, args in calls:
        module = "staging" if "stamp" in name else "off_node_overlap"
        assert [arg_size(a) for a in args] == param_sizes(ptx[module], name), name
    # the count of combines moves on at the call's last group only
    assert [int(args[4][0]) for name, args in calls if name.endswith("check")] == [0, 0, 1]
    assert len(exchanges) == 3 and send.sends == 1
    # each node's group ends with the stamps of its two ranks
    assert [[x.peer for x in s if x.staging is stamps.out] for s, _ in exchanges] == [[0, 1], [4, 5], [6, 7]]


def test_gemm_overlap_build_takes_the_order_after_the_default_parameters(ptx):
    """The overlap build's kernel: the default build's ten parameters, then the order and its
    room; the order kernel: expert_offsets, E, N, the PeerSendConfig, the order and its room
    (epserve/ffn/gemm.py _overlap_specs)."""
    from epserve.runtime.kernel_structs import PEER_SEND_CONFIG

    text = ptx["gemm_wgmma_peer_overlap"]
    gemm_params = param_sizes(text, "epserve_grouped_gemm_wgmma")
    assert len(gemm_params) == 12 and gemm_params[-2:] == [8, 4]
    assert param_sizes(text, "epserve_gemm_off_node_first_order") == [8, 4, 4, PEER_SEND_CONFIG.itemsize, 8, 4]


def test_with_the_overlap_every_combine_send_is_split_by_node(monkeypatch, tmp_path):
    """A combine sent after its kernel (the unfused push, a rank standing in) makes the same
    per-node groups, in node order, as the ranks sending under GEMM 2, so the groups match."""
    from test_dispatch_launch_args import Device, bare_off_node

    o, _ = bare_off_node(monkeypatch, tmp_path)
    o.plan = OffNodePlan(NodeLayout(8, 2), 3, 64, 4, 256, 256, 40)
    o.rank, o.world = 3, 8
    groups = []
    o.carrier = types.SimpleNamespace(exchange=lambda sends, recvs, status=None: groups.append((sends, recvs)))
    o._combine_staging, o._landing, o._groups = types.SimpleNamespace(ptr=0x4000), types.SimpleNamespace(ptr=0x5000), {}
    o.overlap = object()
    o.exchange_combine(Device((40, 4)), 40, 4, 256, 8, Device(), Device())
    assert [sorted({x.peer for x in s} | {x.peer for x in r}) for s, r in groups] == [[0, 1], [4, 5], [6, 7]]
    whole = o.stamped_combine_group()
    assert sum(len(s) for s, _ in groups) == len(whole[0]) and sum(len(r) for _, r in groups) == len(whole[1])
