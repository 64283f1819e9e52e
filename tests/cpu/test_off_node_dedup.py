"""The relay's deduplication (EPSERVE_OFFNODE_DEDUP=1; epserve/comm/off_node_dedup.py,
epserve/comm/dedup_model.py, cuda/comm/off_node_dedup.cu) without a GPU: the setting's agreement
and refusals, the packed blocks' layout and the carrier's group matched send for receive and
landing where the rail peer's kernel reads, the packing arithmetic (the kernels' bit sets and
popcount bases, in NumPy) against a plain model for random routings, the rail peer's fan-out
giving every node rank the rows the per-rank relay gives it, the network bytes, the launches
against their kernels' parameters, and the kernels' NVRTC build for sm_90a."""

import gc
import types
import weakref

import numpy as np
import pytest
from test_off_node_relay import LAYOUTS, Comm, Staging, matched  # a sibling's helpers

from epserve.comm import dedup_model
from epserve.comm import off_node_dedup as dedup_mod
from epserve.comm import off_node_relay as relay_mod
from epserve.comm.dedup_model import network_bytes, pack_node, staged_tokens
from epserve.comm.off_node import OffNodePlan
from epserve.comm.off_node_dedup import DEDUP_ENV, DedupPlan, agree_dedup, dedup_setting
from epserve.comm.off_node_relay import RelayPlan
from epserve.comm.topology import NodeLayout
from epserve.errors import ConfigError
from epserve.runtime import build, kernels

E, K, H, T = 64, 4, 256, 40


def dedup_plans(W, R, max_tokens=T):
    return [DedupPlan(RelayPlan(OffNodePlan(NodeLayout(W, R), r, E, K, H, H, max_tokens))) for r in range(W)]


# ---- the setting ----------------------------------------------------------------------------

def test_the_dedup_setting(monkeypatch):
    monkeypatch.delenv(DEDUP_ENV, raising=False)
    assert dedup_setting() == "0"
    monkeypatch.setenv(DEDUP_ENV, " 1 ")
    assert dedup_setting() == "1"
    monkeypatch.setenv(DEDUP_ENV, "yes")
    with pytest.raises(ConfigError, match="EPSERVE_OFFNODE_DEDUP='yes'"):
        dedup_setting()


def test_the_ranks_agree_on_dedup_and_refuse_where_it_does_not_apply(monkeypatch):
    monkeypatch.setenv(DEDUP_ENV, "1")
    assert agree_dedup(Comm([]), 1, None, None, None) is False  # one node: nothing crosses
    assert agree_dedup(Comm([("1", None)]), 2, "relay", "capacity", None) is True
    with pytest.raises(ConfigError, match="different off-node deduplication settings"):
        agree_dedup(Comm([("0", None)]), 2, "relay", "capacity", None)
    with pytest.raises(ConfigError, match="needs EPSERVE_OFFNODE_ROUTE=relay"):
        agree_dedup(Comm([("1", None)]), 2, "direct", "capacity", None)
    with pytest.raises(ConfigError, match="serves the capacity blocks with the send after GEMM 2 only"):
        agree_dedup(Comm([("1", None)]), 2, "relay", "host", None)
    with pytest.raises(ConfigError, match="serves the capacity blocks with the send after GEMM 2 only"):
        agree_dedup(Comm([("1", None)]), 2, "relay", "capacity", 8)
    monkeypatch.setenv(DEDUP_ENV, "2")
    with pytest.raises(ConfigError, match="rank 0: EPSERVE_OFFNODE_DEDUP='2'"):
        agree_dedup(Comm([("0", None)]), 2, "relay", "capacity", None)
    monkeypatch.delenv(DEDUP_ENV)
    assert agree_dedup(Comm([("0", None)]), 2, "direct", "host", 8) is False  # off: nothing to refuse


# ---- the packed blocks and the carrier's group ------------------------------------------------

@pytest.mark.parametrize("W,R", LAYOUTS)
def test_packed_blocks_are_aligned_and_hold_each_token_once(W, R):
    for p in dedup_plans(W, R):
        off = p.off
        assert p.index_offset % 16 == 0 and p.meta_offset % 16 == 0 and p.block_bytes % 16 == 0
        assert p.index_offset >= T * H * 2  # max_tokens rows: a sender has at most max_tokens tokens
        assert p.meta_offset - p.index_offset >= R * T * 4
        assert p.block_bytes - p.meta_offset >= R * T * off.meta_len * 4
        assert p.blocks_bytes == (W // R - 1) * p.block_bytes
        assert p.scratch_bytes == (W // R - 1) * (R + 2) * ((T + 31) // 32) * 4
        # the rows cross once per node, not once per rank; with one rank a node only the index is added
        per_rank = len(p.relay.other_nodes) * R * p.relay.block_bytes
        if R > 1:
            assert p.blocks_bytes < per_rank
        else:
            assert 0 < p.blocks_bytes - per_rank <= len(p.relay.other_nodes) * (T * 4 + 32)


@pytest.mark.parametrize("W,R", LAYOUTS)
def test_every_packed_send_meets_its_receive(W, R):
    ps, staging = dedup_plans(W, R), Staging()
    groups = [p.rows_group(staging, 1 << 40) for p in ps]
    assert matched(groups)
    for sends, recvs in groups:  # one transfer per node pair and rail, each way
        assert len(sends) == len(recvs) == W // R - 1


@pytest.mark.parametrize("W,R", LAYOUTS)
def test_packed_blocks_land_where_the_rail_peer_reads_them(W, R):
    """A model of the carrier (the bytes at an offset of the sender's packed staging land at the
    receiver's address) and of epserve_relay_packed_rows (rank r reads other node c's rail
    source's block at relay + other_node_index(c, node(r)) * block_bytes): each rail source s's
    packed block for r's node is where r reads it."""
    ps = dedup_plans(W, R)
    bb = ps[0].block_bytes
    staged = {s: {RelayPlan.other_index(c, p.relay.node) * bb: ("packed", s, c) for c in p.relay.other_nodes}
              for s, p in enumerate(ps)}
    for r, p in enumerate(ps):
        landed = {}
        for rv in p.rows_group(staged, 0)[1]:
            landed[rv.dst] = staged[rv.peer][rv.peer_offset]
        a = p.relay.node
        for c in p.relay.other_nodes:
            s = c * R + p.relay.local
            assert landed[RelayPlan.other_index(c, a) * bb] == ("packed", s, a)


# ---- the packing arithmetic -------------------------------------------------------------------

def routing(rng, tokens: int, world: int, experts: int = E, k: int = K) -> np.ndarray:
    idx = rng.integers(-1, experts, (tokens, k)).astype(np.int32)
    idx[rng.random(tokens) < 0.1] = -1  # some tokens routed nowhere
    return idx


def plain_model(tokens_of):
    """Packed rows: the node's distinct tokens in order; index: each position's token's place
    there; the row of packed row p comes from the lowest node rank that takes its token."""
    union = np.unique(np.concatenate(tokens_of)) if tokens_of else np.zeros(0, np.int32)
    index = [np.searchsorted(union, t).astype(np.int32) for t in tokens_of]
    sources = []
    for t in union:
        q = next(q for q, tokens in enumerate(tokens_of) if t in tokens)
        sources.append((q, int(np.searchsorted(tokens_of[q], t))))
    return union, index, sources


@pytest.mark.parametrize("W,R", LAYOUTS)
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_packing_is_the_plain_models(W, R, seed):
    rng = np.random.default_rng(seed * 100 + W + R)
    max_tokens = int(rng.choice([T, 33, 64, 100]))
    ps = dedup_plans(W, R, max_tokens)
    for s, p in enumerate(ps):
        staged = staged_tokens(routing(rng, int(rng.integers(0, max_tokens + 1)), W), E, W)
        for c in p.relay.other_nodes:
            tokens_of = staged[c * R:(c + 1) * R]
            got = pack_node(tokens_of, max_tokens)
            union, index, sources = plain_model(tokens_of)
            assert got.rows == len(union) <= max_tokens
            assert all(np.array_equal(a, b) for a, b in zip(got.index, index))
            assert got.sources == sources


def test_packing_at_word_edges():
    """Tokens at bits 0 and 31 of their words, a last word cut short, a rank that takes nothing,
    and every token taken by every rank."""
    max_tokens = 70
    cases = [
        [np.array([0, 31, 32, 63, 64, 69], np.int32), np.array([], np.int32), np.array([31, 69], np.int32)],
        [np.arange(max_tokens, dtype=np.int32)] * 3,
        [np.array([], np.int32)] * 2,
    ]
    for tokens_of in cases:
        got = pack_node(tokens_of, max_tokens)
        union, index, sources = plain_model(tokens_of)
        assert got.rows == len(union)
        assert all(np.array_equal(a, b) for a, b in zip(got.index, index))
        assert got.sources == sources


@pytest.mark.parametrize("W,R", [(4, 2), (8, 2), (8, 4), (16, 8)])
def test_the_fan_out_gives_each_rank_the_per_rank_relays_rows(W, R):
    """The whole path on made-up rows: the move stages x[t] at d's block, the packer stores each
    packed row from its source position, the rail peer writes node rank q's position pos from
    packed row index[q][pos]: q's token region then holds its staging block's rows, as the
    per-rank relay leaves it."""
    rng = np.random.default_rng(W * 10 + R)
    for s in range(W):
        T_s = int(rng.integers(0, T + 1))
        x = rng.integers(0, 2**16, (T_s, 8)).astype(np.uint16)
        staged = staged_tokens(routing(rng, T_s, W), E, W)
        relay = RelayPlan(OffNodePlan(NodeLayout(W, R), s, E, K, H, H, T))
        for c in relay.other_nodes:
            tokens_of = staged[c * R:(c + 1) * R]
            blocks = [x[t] for t in tokens_of]  # the staging blocks' rows
            packed = pack_node(tokens_of, T)
            rows = np.full((T, 8), 0xFFFF, np.uint16)
            for p, (q, pos) in enumerate(packed.sources):
                rows[p] = blocks[q][pos]
            for q in range(R):
                region = rows[packed.index[q]]
                assert np.array_equal(region, blocks[q])


def test_network_bytes_count_each_row_once_per_node():
    layout = NodeLayout(8, 4)
    rng = np.random.default_rng(5)
    rt = [routing(rng, T, 8) for _ in range(8)]
    got = network_bytes(rt, layout, E, K, H, T)
    row, meta = H * 2, (1 + 2 * K) * 4
    per_rank = packed = 0
    for s, idx in enumerate(rt):
        owner = np.where(idx >= 0, idx // (E // 8), -1)
        for c in range(2):
            if c == s // 4:
                continue
            takes = [(owner == d).any(axis=1) for d in range(c * 4, c * 4 + 4)]
            n = sum(int(t.sum()) for t in takes)
            per_rank += n * (row + meta)
            packed += int(np.logical_or.reduce(takes).sum()) * row + n * (meta + 4)
    assert (got.per_rank_routed, got.packed_routed) == (per_rank, packed)
    assert got.packed_routed < got.per_rank_routed and got.packed_capacity < got.per_rank_capacity
    p = dedup_plans(8, 4)[0]
    assert got.packed_capacity == 8 * p.blocks_bytes
    assert got.per_rank_capacity == 8 * 4 * p.relay.block_bytes
    assert "saved" in got.line()
    # nodes of one rank: nothing to deduplicate, the index costs 4 bytes a row
    one = network_bytes(rt, NodeLayout(8, 1), E, K, H, T)
    rows = one.per_rank_routed // (row + meta)
    assert one.packed_routed == one.per_rank_routed + 4 * rows


# ---- the launches and the build ---------------------------------------------------------------

def test_launches_match_their_kernels(monkeypatch, tmp_path):
    from test_off_node_relay import Called, Ptr, bare_relay, param_sizes

    from epserve.runtime.kernel_structs import DISPATCH_CONFIG

    r, off, exchanges, ptx = bare_relay(monkeypatch, tmp_path, ("off_node_relay", "off_node_dedup", "staging"))
    monkeypatch.setattr(dedup_mod, "u64", lambda v: np.full(1, v, np.uint64))
    d = dedup_mod.DedupRows.__new__(dedup_mod.DedupRows)
    d.plan, d._sms = DedupPlan(r.plan), 132
    d._staging, d._area, d._scratch = Staging(), types.SimpleNamespace(ptr=0x5000), types.SimpleNamespace(ptr=0x6000)
    d._staging.ptr = 0x7000
    p = d.plan
    d._offsets = (np.int64(p.block_bytes), np.int64(p.index_offset), np.int64(p.meta_offset))
    r.dedup = d
    dcfg = np.zeros(1, DISPATCH_CONFIG)
    r.exchange_rows(Staging(), dcfg, Ptr(), Ptr(), E // 8)
    assert [name for name, _ in Called.calls] == [
        "epserve_dedup_mark", "epserve_dedup_pack", "epserve_off_node_stamp", "epserve_off_node_stamps_check",
        "epserve_relay_packed_rows", "epserve_relay_rows_wait"]
    (sends, recvs), = exchanges  # the packed blocks, one per rail peer (ranks 1, 5, 7), then the stamps
    assert [(x.peer, x.nbytes) for x in sends if x.staging is d._staging] == [(1, p.block_bytes), (5, p.block_bytes),
                                                                             (7, p.block_bytes)]
    assert [x.peer for x in sends if x.staging is off.stamps.out] == [1, 5, 7]
    assert [x.peer for x in recvs if x.staging is off.stamps.out] == [1, 5, 7]
    module = {"epserve_off_node_stamp": "staging", "epserve_off_node_stamps_check": "staging",
              "epserve_relay_rows_wait": "off_node_relay"}
    for name, args in Called.calls:
        sizes = [8 if isinstance(a, Ptr) else np.asarray(a).nbytes for a in args]
        assert sizes == param_sizes(ptx[module.get(name, "off_node_dedup")], name), name


def test_the_kernels_build_for_sm90a_without_spills(monkeypatch, tmp_path):
    monkeypatch.setenv("EPSERVE_CACHE_DIR", str(tmp_path))
    art = build.compile_source(*kernels.VARIANTS["off_node_dedup"])
    ptx = art.ptx.read_text()
    for name in ("epserve_dedup_mark", "epserve_dedup_pack", "epserve_relay_packed_rows"):
        assert f".entry {name}(" in ptx, name
    assert ".target sm_90a" in ptx
    assert "spill stores" in art.log and all(" 0 bytes spill stores" in line for line in art.log.splitlines()
                                             if "spill stores" in line), art.log
    # the mark kernel's block scan is the layout's, sized by its thread count
    assert dedup_mod.MARK_THREADS == 512 and ".maxntid 512, 1, 1" in ptx


# ---- no reference cycle -------------------------------------------------------------------------

def test_a_deduplicating_off_node_goes_without_the_garbage_collector(monkeypatch):
    """As tests/cpu/test_off_node_teardown.py requires of every OffNode: the deduplicating relay
    holds nothing that holds the OffNode, so its carrier goes with it, collector off."""
    import test_off_node_teardown as teardown

    from epserve.comm import off_node as off_mod
    from epserve.comm import off_node_overlap as overlap_mod
    from epserve.comm import off_node_stamps as stamps_mod
    from epserve.comm.off_node import OffNode

    fake = teardown.fake_cupy()
    for mod in (off_mod, stamps_mod, relay_mod, overlap_mod, dedup_mod):
        monkeypatch.setattr(mod, "cupy", fake)
    enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        layout = NodeLayout(4, 2)
        plan = OffNodePlan(layout, 3, E, K, H, H, T)
        group = types.SimpleNamespace(node_ranks=range(2, 4), allocate=teardown.Buffer,
                                      comm=types.SimpleNamespace(Barrier=lambda: None))
        carrier = teardown.Carrier()
        off = OffNode(plan, carrier, types.SimpleNamespace(local=lambda a: 0x2000 + a), 20.0, "capacity",
                      max_recv_rows=4 * T, route="relay", group=group, dedup=True)
        assert off.dedup and off.relay.dedup.plan.blocks_bytes == DedupPlan(RelayPlan(plan)).blocks_bytes
        comm, held = weakref.ref(carrier.comm), weakref.ref(off)
        del carrier, off
        assert held() is None and comm() is None
    finally:
        if enabled:
            gc.enable()
        gc.collect()


def test_the_model_module_needs_no_gpu():
    assert not hasattr(dedup_model, "cupy")


# ---- the check job's read-back of the packed blocks ---------------------------------------------

def load_dedup_checks():
    import importlib.util
    import sys
    from pathlib import Path

    jobs = Path(__file__).resolve().parents[2] / "launch" / "jobs"
    spec = importlib.util.spec_from_file_location("dedup_checks", jobs / "dedup_checks.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("dedup_checks", module)
    spec.loader.exec_module(module)
    return module


def test_the_check_jobs_read_back_finds_a_wrong_packing(monkeypatch):
    """launch/jobs/dedup_checks.py on a made-up device memory (a host arena): a packing made as
    the kernels make it passes; a wrong index, a wrong row or wrong routing is reported."""
    checks = load_dedup_checks()
    W, R, rank, base = 8, 2, 3, 1 << 20
    plan = OffNodePlan(NodeLayout(W, R), rank, E, K, H, H, T)
    dplan = DedupPlan(RelayPlan(plan))
    row, meta_len = H * 2, plan.meta_len
    packed_at = base + plan.dispatch_staging_bytes
    mem = np.zeros(plan.dispatch_staging_bytes + dplan.blocks_bytes, np.uint8)
    rng = np.random.default_rng(11)
    idx = routing(rng, T, W)
    staged = staged_tokens(idx, E, W)
    fields = plan.dispatch_staging(base)
    x = rng.integers(0, 256, (T, row)).astype(np.uint8)
    for c in dplan.relay.other_nodes:
        tokens_of = staged[c * R:(c + 1) * R]
        model = pack_node(tokens_of, T)
        blk = packed_at - base + dplan.relay.other_index(c, dplan.relay.node) * dplan.block_bytes
        for q, tokens in enumerate(tokens_of):
            d, n = c * R + q, len(tokens)
            at = fields["off_blocks"] - base + plan.block(d) * fields["off_block_bytes"]
            mem[at:at + n * row] = x[tokens].reshape(-1)
            meta = rng.integers(-1, 5, (n, meta_len)).astype(np.int32)
            meta[:, 0] = tokens
            mem[at + T * row:at + T * row + meta.nbytes] = meta.view(np.uint8).reshape(-1)
            i = blk + dplan.index_offset + q * T * 4
            mem[i:i + n * 4] = model.index[q].view(np.uint8)
            m = blk + dplan.meta_offset + q * T * meta_len * 4
            mem[m:m + meta.nbytes] = meta.view(np.uint8).reshape(-1)
        for p, (q, pos) in enumerate(model.sources):
            mem[blk + p * row:blk + (p + 1) * row] = x[tokens_of[q][pos]]
    monkeypatch.setattr(checks, "device_bytes", lambda ptr, n: mem[ptr - base:ptr - base + n].copy())
    monkeypatch.setattr(checks, "cupy", types.SimpleNamespace(
        cuda=types.SimpleNamespace(runtime=types.SimpleNamespace(deviceSynchronize=lambda: None))))
    off = types.SimpleNamespace(plan=plan, dispatch_staging=lambda: fields,
                                relay=types.SimpleNamespace(dedup=types.SimpleNamespace(plan=dplan,
                                                                                       staging_ptr=packed_at)))
    svc = types.SimpleNamespace(off_node=off)
    assert checks.packed_blocks_checks(svc, idx, E) == []
    first = packed_at - base  # node 0's packed block (rank 3 is on node 1)
    for where, what in ((first + dplan.index_offset, "packed index"), (first, "packed row"),
                        (first + dplan.meta_offset + 4, "packed routing")):
        saved = mem[where:where + 4].copy()
        mem[where:where + 4] ^= 0x5A
        assert any(what in f for f in checks.packed_blocks_checks(svc, idx, E)), what
        mem[where:where + 4] = saved
    assert "saved" in checks.rail_bytes_line(svc, [idx] * W, E)
