"""GEMM 1 with SwiGLU in its epilogue, the wgmma GEMM's ragged tiles (a partial m-tile
computes only the 64-row halves that hold rows, or, built with swapped tails, its rows
rounded up to 16) and its compile-time knobs, on one GPU against the two-kernel path, the
default build and float64 NumPy."""

import numpy as np
import pytest

from epserve.check.testing import BF16, bf16_bits

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


_BOTH_GEMMS = [{"EPSERVE_GEMM_CLUSTER": 2},
               {"EPSERVE_GEMM_CLUSTER": 2, "EPSERVE_GEMM_CLUSTER_SHARES_B": 1},
               {"EPSERVE_GEMM_SWAP_TAILS": 1},
               {"EPSERVE_GEMM_SWAP_TAILS": 1, "EPSERVE_GEMM_SWAP_STEP": 32}]
_GEMM2_ONLY = [{"EPSERVE_GEMM_BN": 128}]  # the kernel refuses these with SwiGLU


@pytest.mark.parametrize("knob,swiglu", [(k, s) for k in _BOTH_GEMMS for s in (False, True)]
                         + [(k, False) for k in _GEMM2_ONLY])
def test_build_knobs_give_the_same_bits(knob, swiglu, monkeypatch):
    """The wgmma GEMM's compile-time knobs change how tiles are fed and computed (CTA pairs
    sharing A or B by multicast, or single CTAs; partial m-tiles with A and B swapped; tiles
    128 columns wide instead of 256), never
    the result: every build equals the default one bit for bit, on every tail width, on
    experts whose last CTA pair has rows for one CTA only, and on a column count that leaves
    the last CTA pair half empty."""
    import cupy

    from epserve.ffn import gemm
    from epserve.runtime import kernels

    base = "gemm1_wgmma_swiglu" if swiglu else "gemm_wgmma_null"
    source, defines = kernels.VARIANTS[base]
    name = f"{base}+" + "+".join(f"{k}={v}" for k, v in knob.items())
    monkeypatch.setitem(kernels.VARIANTS, name, (source, {**defines, **knob}))
    rng = np.random.default_rng(7)
    E, M = len(RAGGED), sum(RAGGED)
    off = cupy.asarray(_offsets(RAGGED))
    N, K = (192, 128) if swiglu else (320, 192)  # N = 192 + 192 gate/up rows, or 256 + 64 columns
    A = cupy.asarray(rng.standard_normal((M, K), np.float32).astype(BF16))
    B_rows = 2 * N if swiglu else N
    B = cupy.asarray((rng.standard_normal((E, B_rows, K), np.float32) / np.sqrt(K)).astype(BF16))
    want = cupy.full((M, N), np.nan, BF16)
    got = cupy.full((M, N), np.nan, BF16)
    gemm._wgmma_gemm(base, A, B, E * B_rows, want, off, E, N, K, gemm._NO_PEERS, 0)
    gemm._wgmma_gemm(name, A, B, E * B_rows, got, off, E, N, K, gemm._NO_PEERS, 0)
    assert not np.isnan(cupy.asnumpy(want).astype(np.float32)).any(), "the default build left elements unwritten"
    assert np.array_equal(bf16_bits(got), bf16_bits(want))
