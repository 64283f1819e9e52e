"""The NCCL transport's device planning (cuda/comm/dispatch.cu, epserve/dispatch/nccl.py),
mirrored in NumPy: route, the allgathered count rows, layout, pack, expand and the combine's
return positions give the host plan's rows (epserve/dispatch/host_plan.py) and bring every row home to
its own slot, within the fixed block capacities."""

import numpy as np
import pytest

from epserve.dispatch.host_plan import plan_dispatch, unpack_src_info
from epserve.dispatch.nccl import block_positions, combine_capacity, expected_dedup_fraction, padding_factors


def peer_block(d, rank):
    return d - (d > rank)


def route(idx, E, W):
    """route count + rank for one rank: its count row, slot_rank [T, k], tok_pos [T, W]."""
    e_loc = E // W
    T, k = idx.shape
    per_expert = np.zeros(E, np.int64)
    per_dest = np.zeros(W, np.int64)
    slot_rank = np.full((T, k), -1, np.int64)
    tok_pos = np.full((T, W), -1, np.int64)
    for t in range(T):
        for j in range(k):
            e = idx[t, j]
            if e >= 0:
                slot_rank[t, j] = per_expert[e]
                per_expert[e] += 1
        for d in sorted({e // e_loc for e in idx[t] if e >= 0}):
            tok_pos[t, d] = per_dest[d]
            per_dest[d] += 1
    return per_expert, per_dest, slot_rank, tok_pos


def simulate(routing, E, W, max_tokens, max_recv_rows):
    """Every rank's expand and combine, as the kernels do them."""
    e_loc = E // W
    k = routing[0].shape[1]
    cap = combine_capacity(max_tokens, k, e_loc, max_recv_rows)
    routes = [route(idx, E, W) for idx in routing]
    counts = np.stack([r[0] for r in routes])      # [W, E]: the allgathered table's expert columns
    tokens_to = np.stack([r[1] for r in routes])   # [W, W]: tokens s sends to d
    pos = block_positions(counts, e_loc)           # ret_base and home_base, one array
    results = []
    for me in range(W):
        from_s = counts[:, me * e_loc:(me + 1) * e_loc]            # [W, e_loc]
        offsets = np.concatenate([[0], np.cumsum(from_s.sum(0))])
        base = offsets[:-1][None, :] + np.cumsum(from_s, axis=0) - from_s
        M = int(offsets[-1])
        src_info = np.full(M, -1, np.int64)
        ret_idx = np.full(M, -2, np.int64)
        for s in range(W):  # expand: the tokens s sent here, in s's token order
            idx, (_, _, slot_rank, tok_pos) = routing[s], routes[s]
            order = np.argsort(np.where(tok_pos[:, me] >= 0, tok_pos[:, me], 1 << 30))[:tokens_to[s, me]]
            assert tokens_to[s, me] <= max_tokens  # fits its dispatch block
            for t in order:
                for j in range(k):
                    e = idx[t, j]
                    if e < 0 or e // e_loc != me:
                        continue
                    r = slot_rank[t, j]
                    m = base[s, e - me * e_loc] + r
                    src_info[m] = (s << 24) | (t << 4) | j
                    ret_idx[m] = -1 if s == me else peer_block(s, me) * cap + pos[s, e] + r
        idx, slot_rank = routing[me], routes[me][2]
        home_idx = np.full(idx.shape, -1, np.int64)
        for t, j in zip(*np.nonzero(idx >= 0)):
            d = idx[t, j] // e_loc
            if d != me:
                home_idx[t, j] = peer_block(d, me) * cap + pos[me, idx[t, j]] + slot_rank[t, j]
        results.append(dict(offsets=offsets, src_info=src_info, ret_idx=ret_idx, home_idx=home_idx, M=M))
    return results, cap


@pytest.mark.parametrize("W,E,k,seed", [(1, 8, 2, 0), (2, 8, 2, 1), (2, 16, 8, 2), (4, 16, 4, 3), (8, 64, 8, 4),
                                        (3, 12, 3, 5), (4, 8, 8, 6)])
def test_device_plan_matches_host_plan_and_returns_home(W, E, k, seed):
    rng = np.random.default_rng(seed)
    max_tokens = 40
    routing = []
    for s in range(W):
        T = int(rng.integers(0, max_tokens + 1))
        idx = np.stack([rng.permutation(E)[:k] for _ in range(T)]).astype(np.int64) if T else \
            np.zeros((0, k), np.int64)
        idx[rng.random(idx.shape) < 0.1] = -1
        routing.append(idx)
    recv_rows = max_tokens * W * min(k, E // W)
    results, cap = simulate(routing, E, W, max_tokens, recv_rows)
    for me, res in enumerate(results):
        plan = plan_dispatch(me, routing, E, W)
        np.testing.assert_array_equal(res["offsets"], plan.expert_offsets)
        np.testing.assert_array_equal(res["src_info"], plan.src_info)
    # The combine: row m of rank d goes into d's send block for its home s at ret_idx; s
    # receives d's block into its block peer_block(d) and reads slot (t, j) at home_idx.
    for d, res in enumerate(results):
        srank, stok, sslot = unpack_src_info(res["src_info"])
        for s in range(W):
            if s == d:
                assert (res["ret_idx"][srank == d] == -1).all()
                continue
            mine = srank == s
            ret = res["ret_idx"][mine]
            block = peer_block(s, d)
            assert ((ret >= block * cap) & (ret < (block + 1) * cap)).all()
            assert len(set(ret.tolist())) == ret.size  # no two rows share a position
            at = {int(p - block * cap): (int(t), int(j)) for p, t, j in zip(ret, stok[mine], sslot[mine])}
            home = results[s]["home_idx"]
            sb = peer_block(d, s)
            for t, j in zip(*np.nonzero(home >= 0)):
                if routing[s][t, j] // (E // W) != d:
                    continue
                p = int(home[t, j]) - sb * cap
                assert 0 <= p < cap and at[p] == (t, j)
            assert len(at) == int(((routing[s] >= 0) & (routing[s] // (E // W) == d)).sum())


def test_capacities_and_padding():
    # dsv3: E = 256, k = 8, 4096 tokens per rank
    assert combine_capacity(4096, 8, 128, 4096 * 2 * 8) == 4096 * 8
    assert combine_capacity(4096, 8, 128, 20000) == 20000
    assert combine_capacity(10, 8, 2, 10**6) == 20  # a token feeds at most E_loc experts of a rank
    assert expected_dedup_fraction(8, 8, 1) == 1.0
    d2, c2 = padding_factors(256, 8, 2, 4096)
    d8, c8 = padding_factors(256, 8, 8, 4096)
    assert 1.0 < d2 < 1.01 and c2 == pytest.approx(2.0)
    assert 1.4 < d8 < 1.6 and c8 == pytest.approx(8.0)
    # max_recv_rows bounds a block, but a rank's whole receive can come from one peer, so the
    # combine's blocks stay W times the balanced share unless max_recv_rows is below T * k.
    _, tight = padding_factors(256, 8, 8, 4096, max_recv_rows=int(1.25 * 4096 * 8))
    assert tight == pytest.approx(8.0)


def test_every_kernel_the_nccl_path_launches_is_in_the_dispatch_module(tmp_path, monkeypatch):
    import pathlib
    import re

    from epserve.runtime import build, kernels

    monkeypatch.setenv("EPSERVE_CACHE_DIR", str(tmp_path / "cache"))
    source, defines = kernels.VARIANTS["dispatch"]
    ptx = build.compile_source(source, defines).ptx.read_text()
    # The NCCL path's own kernels, and the route kernels it shares with the direct dispatch.
    here = pathlib.Path(__file__).resolve().parents[2] / "epserve" / "dispatch"
    names = set()
    for path in (here / "nccl.py", here / "route.py"):
        names |= set(re.findall(r'"(epserve_\w+)"', path.read_text()))
    assert {"epserve_nccl_dispatch_count_publish", "epserve_nccl_dispatch_rank_layout",
            "epserve_nccl_combine_unpack"} <= names
    for name in names:
        assert re.search(rf"\.entry {name}\(", ptx), name
