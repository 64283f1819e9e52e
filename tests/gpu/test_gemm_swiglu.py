"""GEMM 1 with SwiGLU in its epilogue, the wgmma GEMM's ragged tiles (a partial m-tile
computes only the 64-row halves that hold rows, or, built with swapped tails, its rows
rounded up to 16) and its compile-time knobs, on one GPU against the two-kernel path, the
default build and float64 NumPy. GEMM 2's split build (EPSERVE_GEMM_SPLIT_K=2) also against
itself: launches back to back and replays of a CUDA graph, which share its flags and epoch;
and its rule (epserve/ffn/tiles.py, split_parts in the kernel) on both sides of its line."""

import numpy as np
import pytest

from epserve.check.testing import BF16, bf16_bits
from epserve.ffn import tiles

pytestmark = pytest.mark.gpu

# Tails of every swapped width (16 .. 128 in steps of 16, each at both ends: 1 and 16, 17
# and 32, ..., 113 and 127), whole tiles, whole tiles with a tail, empty experts.
RAGGED = [64, 65, 1, 0, 127, 128, 129, 192, 63, 300, 16, 17, 32, 33, 48, 49, 80, 96, 97, 112, 113, 255]


def _offsets(rows_per_expert):
    return np.concatenate([[0], np.cumsum(rows_per_expert)]).astype(np.int32)


def _swiglu64(h, intermediate):
    from epserve.check.reference import silu

    return silu(h[:, :intermediate]) * h[:, intermediate:]


@pytest.mark.parametrize("rows_per_expert,I,H", [
    (RAGGED, 128, 256),            # one column tile
    ([5, 200, 0, 64], 192, 128),   # I not a multiple of 128: the last tile's gate box runs into up rows
    ([700, 1300], 2048, 512),      # many column tiles, many tiles per CTA
    ([300] * 40, 256, 64),         # one k-slice, more tiles than SMs
    ([0, 0], 128, 64),             # no rows at all
])
def test_gemm1_swiglu_equals_gemm1_then_swiglu(rows_per_expert, I, H):
    import cupy

    from epserve.ffn import gemm

    rng = np.random.default_rng(sum(rows_per_expert) + I + H)
    E, M = len(rows_per_expert), sum(rows_per_expert)
    offsets = cupy.asarray(_offsets(rows_per_expert))
    A = cupy.asarray(rng.standard_normal((M, H), np.float32).astype(BF16))
    w13 = cupy.asarray((rng.standard_normal((E, 2 * I, H), np.float32) * (2 / np.sqrt(H))).astype(BF16))

    act = cupy.full((M + 5, I), np.nan, BF16)  # poisoned, with guard rows past M
    gemm.gemm1_swiglu(A, w13, act, offsets, E, I, H, impl="wgmma")
    got = cupy.asnumpy(act)
    assert np.isnan(got[M:].astype(np.float32)).all(), "GEMM 1 wrote past its last row"
    assert not np.isnan(got[:M].astype(np.float32)).any(), "some activations were never written"

    # The same GEMM storing [M, 2I], then the SwiGLU kernel: the same bits.
    h = cupy.full((M, 2 * I), np.nan, BF16)
    gemm.grouped_gemm("null", A, w13, h, offsets, E, 2 * I, H, impl="wgmma")
    two_kernels = cupy.full((M, I), np.nan, BF16)
    gemm.swiglu(h, two_kernels, M, I)
    assert np.array_equal(bf16_bits(act)[:M], bf16_bits(two_kernels))

    if M:
        A64, w64, off = cupy.asnumpy(A).astype(np.float64), cupy.asnumpy(w13).astype(np.float64), _offsets(rows_per_expert)
        ref = np.concatenate([_swiglu64(A64[off[e]:off[e + 1]] @ w64[e].T, I) for e in range(E)])
        err = np.linalg.norm(got[:M].astype(np.float64) - ref) / np.linalg.norm(ref)
        assert err < 1e-2, err

    again = cupy.full((M, I), np.nan, BF16)
    gemm.gemm1_swiglu(A, w13, again, offsets, E, I, H, impl="wgmma")
    assert np.array_equal(bf16_bits(again), bf16_bits(act)[:M])


def test_gemm1_swiglu_mma_path_matches_float64():
    import cupy

    from epserve.ffn import gemm

    rng = np.random.default_rng(11)
    rows, I, H = [130, 0, 61], 192, 128
    E, M = len(rows), sum(rows)
    off = _offsets(rows)
    A = rng.standard_normal((M, H), np.float32).astype(BF16)
    w13 = (rng.standard_normal((E, 2 * I, H), np.float32) * (2 / np.sqrt(H))).astype(BF16)
    act = cupy.full((M, I), np.nan, BF16)
    gemm.gemm1_swiglu(cupy.asarray(A), cupy.asarray(w13), act, cupy.asarray(off), E, I, H, impl="mma")
    A64, w64 = A.astype(np.float64), w13.astype(np.float64)
    ref = np.concatenate([_swiglu64(A64[off[e]:off[e + 1]] @ w64[e].T, I) for e in range(E)])
    got = cupy.asnumpy(act).astype(np.float64)
    assert not np.isnan(got).any()
    assert np.linalg.norm(got - ref) / np.linalg.norm(ref) < 1e-2


@pytest.mark.parametrize("N,K", [(256, 128), (320, 192)])
def test_ragged_tails_match_float64(N, K):
    """Every tail kind through the plain wgmma GEMM: partial tiles compute only their real rows."""
    import cupy

    from epserve.ffn import gemm

    rng = np.random.default_rng(N + K)
    E, M = len(RAGGED), sum(RAGGED)
    off = _offsets(RAGGED)
    A = rng.standard_normal((M, K), np.float32).astype(BF16)
    B = (rng.standard_normal((E, N, K), np.float32) / np.sqrt(K)).astype(BF16)
    C = cupy.full((M + 3, N), np.nan, BF16)
    gemm.grouped_gemm("null", cupy.asarray(A), cupy.asarray(B), C, cupy.asarray(off), E, N, K, impl="wgmma")
    got = cupy.asnumpy(C).astype(np.float64)
    assert np.isnan(got[M:]).all(), "the GEMM wrote past its last row"
    A64, B64 = A.astype(np.float64), B.astype(np.float64)
    ref = np.concatenate([A64[off[e]:off[e + 1]] @ B64[e].T for e in range(E)])
    assert not np.isnan(got[:M]).any(), "some output elements were never written"
    assert np.allclose(got[:M], ref, rtol=1e-2, atol=1e-2 * np.abs(ref).max())


SPLIT_K = {"EPSERVE_GEMM_SPLIT_K": 2}
KNOBS = [{"EPSERVE_GEMM_CLUSTER": 2},
         {"EPSERVE_GEMM_CLUSTER": 2, "EPSERVE_GEMM_CLUSTER_SHARES_B": 1},
         {"EPSERVE_GEMM_SWAP_TAILS": 1},
         {"EPSERVE_GEMM_SWAP_TAILS": 1, "EPSERVE_GEMM_SWAP_STEP": 32},
         {"EPSERVE_GEMM_BN": 128},
         SPLIT_K]
GEMM2_ONLY = ("EPSERVE_GEMM_BN", "EPSERVE_GEMM_SPLIT_K")  # the kernel refuses them with SwiGLU (static_assert)
# Split K's own shapes (rows per expert, N, K) beside the default one: more tiles than SMs
# (81 m-tiles x 5 column tiles, the last one 64 wide) with an odd count of k-slices (7, split
# 3 + 4), and one k-slice (not split: the build runs whole tiles).
SPLIT_K_SHAPES = [(RAGGED * 3, 1088, 448), (RAGGED, 320, 64)]


def _knob_cases():
    for knob in KNOBS:
        for swiglu in (False, True):
            if not (swiglu and any(k in knob for k in GEMM2_ONLY)):
                yield pytest.param(knob, swiglu, None, id="+".join(f"{k}={v}" for k, v in knob.items()) +
                                   ("-gemm1" if swiglu else "-gemm2"))
    for rows, N, K in SPLIT_K_SHAPES:
        yield pytest.param(SPLIT_K, False, (rows, N, K), id=f"EPSERVE_GEMM_SPLIT_K=2-gemm2-{len(rows)}x{N}x{K}")


def _knob_variant(monkeypatch, base: str, knob: dict) -> str:
    from epserve.runtime import kernels

    source, defines = kernels.VARIANTS[base]
    name = f"{base}+" + "+".join(f"{k}={v}" for k, v in knob.items())
    monkeypatch.setitem(kernels.VARIANTS, name, (source, {**defines, **knob}))
    return name


@pytest.mark.parametrize("knob,swiglu,shape", list(_knob_cases()))  # pytest 10 takes no generator
def test_build_knobs_give_the_same_bits(knob, swiglu, shape, monkeypatch):
    """The wgmma GEMM's compile-time knobs change how tiles are fed and computed (CTA pairs
    sharing A or B by multicast, or single CTAs; partial m-tiles with A and B swapped; tiles
    128 columns wide instead of 256; tiles in two K halves, the second continuing from the
    first's stored accumulators), never the result: every build equals the default one bit
    for bit, on every tail width, on empty experts and 1-row tails, on experts whose last CTA
    pair has rows for one CTA only, and on a column count that leaves the last CTA pair half
    empty. GEMM 2's knobs (the 128-wide tile, split K) are not built with SwiGLU at all."""
    import cupy

    from epserve.ffn import gemm

    base = "gemm1_wgmma_swiglu" if swiglu else "gemm_wgmma_null"
    name = _knob_variant(monkeypatch, base, knob)
    rng = np.random.default_rng(7)
    rows = shape[0] if shape else RAGGED
    E, M = len(rows), sum(rows)
    off = cupy.asarray(_offsets(rows))
    if shape:
        N, K = shape[1:]
    else:
        N, K = (192, 128) if swiglu else (320, 192)  # N = 192 + 192 gate/up rows, or 256 + 64 columns
    A = cupy.asarray(rng.standard_normal((M, K), np.float32).astype(BF16))
    B_rows = 2 * N if swiglu else N
    B = cupy.asarray((rng.standard_normal((E, B_rows, K), np.float32) / np.sqrt(K)).astype(BF16))
    want = cupy.full((M, N), np.nan, BF16)
    got = cupy.full((M, N), np.nan, BF16)
    gemm._wgmma_gemm(base, A, B, E * B_rows, want, off, E, N, K, gemm._NO_PEERS, 0)
    split = knob is SPLIT_K
    gemm._wgmma_gemm(name, A, B, E * B_rows, got, off, E, N, K, gemm._NO_PEERS, 0,
                     split_policy=tiles.ALWAYS if split else tiles.BY_RULE)
    assert not np.isnan(cupy.asnumpy(want).astype(np.float32)).any(), "the default build left elements unwritten"
    assert np.array_equal(bf16_bits(got), bf16_bits(want))
    if split:  # the build ran its tiles in halves, except where K is one k-slice
        record = gemm.split_k_record()
        assert record["parts"] == (2 if K >= 128 else 1) and record["error"] == 0, record


def test_split_k_launches_back_to_back_and_graph_replays(monkeypatch):
    """Split K's flags are never reset: each holds the epoch of the launch that set it, and the
    kernel's last CTA advances the epoch. So launches queued back to back on one stream, and
    replays of a captured CUDA graph between eager launches on the capture stream, must each
    equal the default build on their own inputs (a second half that took a stale flag would
    continue from the previous launch's accumulators), the epoch must count every launch and
    no wait may have timed out. More tiles than SMs, ragged rows, 7 k-slices (3 + 4)."""
    import cupy

    from epserve.ffn import gemm

    name = _knob_variant(monkeypatch, "gemm_wgmma_null", SPLIT_K)
    rng = np.random.default_rng(12)
    rows, N, K = SPLIT_K_SHAPES[0]
    E, M = len(rows), sum(rows)
    off = cupy.asarray(_offsets(rows))
    B = cupy.asarray((rng.standard_normal((E, N, K), np.float32) / np.sqrt(K)).astype(BF16))
    inputs = [cupy.asarray(rng.standard_normal((M, K), np.float32).astype(BF16)) for _ in range(6)]

    def launch(variant, A, C):
        gemm._wgmma_gemm(variant, A, B, E * N, C, off, E, N, K, gemm._NO_PEERS, 0, split_policy=tiles.ALWAYS)

    want = []
    for A in inputs:
        C = cupy.full((M, N), np.nan, BF16)
        launch("gemm_wgmma_null", A, C)
        want.append(bf16_bits(C))
    cupy.cuda.Device().synchronize()  # the inputs, made on the default stream, which the next one does not follow

    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        # Two launches queued back to back, no host sync between them.
        got = [cupy.full((M, N), np.nan, BF16) for _ in range(2)]
        launch(name, inputs[0], got[0])
        launch(name, inputs[1], got[1])
        stream.synchronize()
        for i in range(2):
            assert np.array_equal(bf16_bits(got[i]), want[i]), f"back-to-back launch {i}"
        state = gemm._SPLIT_BUFFERS[(cupy.cuda.runtime.getDevice(), stream.ptr)][1]
        epoch0 = int(state[0])
        assert epoch0 == 2, f"two launches advanced the epoch to {epoch0}"

        # A graph of one launch over A_g -> C_g, captured after the eager launches above
        # (the per-stream buffers exist), replayed 3 times on new inputs, with an eager launch
        # on the same stream (same flags) between the replays.
        A_g, C_g = cupy.empty((M, K), BF16), cupy.full((M, N), np.nan, BF16)
        A_g.view(np.uint16)[...] = inputs[2].view(np.uint16)
        stream.begin_capture()
        try:
            launch(name, A_g, C_g)
        finally:
            graph = stream.end_capture()
        eager = cupy.full((M, N), np.nan, BF16)
        for r, i in enumerate((2, 3, 4)):
            A_g.view(np.uint16)[...] = inputs[i].view(np.uint16)
            C_g.fill(np.nan)
            graph.launch(stream=stream)
            stream.synchronize()
            assert np.array_equal(bf16_bits(C_g), want[i]), f"graph replay {r}"
            eager.fill(np.nan)
            launch(name, inputs[5 - r % 2], eager)
            stream.synchronize()
            assert np.array_equal(bf16_bits(eager), want[5 - r % 2]), f"eager launch after replay {r}"
        host = cupy.asnumpy(state[:4])
        assert host[0] == epoch0 + 6, f"6 launches after the first two, epoch {host[0]} (was {epoch0})"
        assert host[1] == 0, f"a second half's wait timed out (tile {host[2]})"
        assert host[3] == 2, "the launches ran whole tiles"


@pytest.mark.parametrize("waves", [1.2, 2.0, 2.2, 4.2, 4.9, 5.4])
def test_split_k_rule_splits_where_the_host_mirror_says(waves):
    """GEMM 2's shipped split build, by rule: the kernel splits a launch's tiles exactly where
    tiles.split_k_parts (the host's mirror of split_parts) says, from the exact tile count,
    and never beyond the workspace's room (5.4 waves), with the default build's bits either
    way. Experts of 128 rows (one m-tile each) over 8 column tiles, K of 8 k-slices."""
    import cupy

    from epserve.ffn import gemm
    from epserve.runtime.launch import sm_count

    ctas = sm_count(cupy.cuda.runtime.getDevice())
    N, K = 2048, 512
    E = max(1, round(waves * ctas / (N // 256)))
    rows = [128] * E
    M = sum(rows)
    rng = np.random.default_rng(int(waves * 10))
    off = cupy.asarray(_offsets(rows))
    A = cupy.asarray(rng.standard_normal((M, K), np.float32).astype(BF16))
    B = cupy.asarray((rng.standard_normal((E, N, K), np.float32) / np.sqrt(K)).astype(BF16))
    want, got = cupy.full((M, N), np.nan, BF16), cupy.full((M, N), np.nan, BF16)
    gemm._wgmma_gemm("gemm_wgmma_null", A, B, E * N, want, off, E, N, K, gemm._NO_PEERS, 0)
    gemm._wgmma_gemm("gemm_wgmma_null_split", A, B, E * N, got, off, E, N, K, gemm._NO_PEERS, 0,
                     split_policy=tiles.BY_RULE)
    record = gemm.split_k_record()
    expected = tiles.split_k_parts(E * (N // 256), ctas, K // 64, 2, tiles.room_tiles(ctas), tiles.BY_RULE)
    assert record["parts"] == expected and record["error"] == 0, (record, expected, E)
    assert np.array_equal(bf16_bits(got), bf16_bits(want))
