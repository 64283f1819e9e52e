"""The grouped GEMM (null sink), SwiGLU and the row mover on one GPU, against float64 NumPy."""

import re

import numpy as np
import pytest

from epserve.check.testing import BF16
from epserve.runtime import build, kernels

pytestmark = pytest.mark.gpu


def grouped_reference(A, B, offsets):
    A64, B64 = A.astype(np.float64), B.astype(np.float64)
    out = np.zeros((A.shape[0], B.shape[1]))
    for e in range(B.shape[0]):
        lo, hi = offsets[e], offsets[e + 1]
        out[lo:hi] = A64[lo:hi] @ B64[e].T
    return out


@pytest.mark.parametrize("impl", ["mma", "wgmma"])
@pytest.mark.parametrize("rows_per_expert,N,K", [
    ([128, 0, 300, 1], 256, 128),        # empty expert, one-row expert, partial tiles
    ([5], 64, 64),                       # one half-filled column tile
    ([0, 0, 0], 128, 64),                # no rows at all
    ([1000, 17, 129, 0, 512], 192, 512), # N not a multiple of 128
    ([2049, 3000], 1024, 2048),          # several k-slices and many tiles per CTA
    ([300] * 40, 320, 256),              # more tiles than SMs: the persistent loop wraps
])
def test_grouped_gemm_matches_float64(rows_per_expert, N, K, impl):
    import cupy

    from epserve.ffn import gemm

    rng = np.random.default_rng(sum(rows_per_expert) + N + K)
    E, M = len(rows_per_expert), sum(rows_per_expert)
    offsets = np.concatenate([[0], np.cumsum(rows_per_expert)]).astype(np.int32)
    A = rng.standard_normal((M, K), np.float32).astype(BF16)
    B = (rng.standard_normal((E, N, K), np.float32) / np.sqrt(K)).astype(BF16)
    C = cupy.full((M + 7, N), np.nan, BF16)  # poisoned, with guard rows past M
    gemm.grouped_gemm("null", cupy.asarray(A), cupy.asarray(B), C, cupy.asarray(offsets), E, N, K, impl=impl)
    got = cupy.asnumpy(C).astype(np.float64)
    assert np.isnan(got[M:]).all(), "the GEMM wrote past its last row"
    ref = grouped_reference(A, B, offsets)
    assert not np.isnan(got[:M]).any(), "some output elements were never written"
    if M:
        err = np.linalg.norm(got[:M] - ref) / np.linalg.norm(ref)
        assert err < 1e-2, err
        # bf16 rounding of the output alone bounds each element's error
        assert np.allclose(got[:M], ref, rtol=1e-2, atol=1e-2 * np.abs(ref).max())
    again = cupy.full((M + 7, N), np.nan, BF16)
    gemm.grouped_gemm("null", cupy.asarray(A), cupy.asarray(B), again, cupy.asarray(offsets), E, N, K, impl=impl)
    assert np.array_equal(cupy.asnumpy(again).view(np.uint16)[:M], cupy.asnumpy(C).view(np.uint16)[:M])


def test_swiglu_matches_float64():
    import cupy

    from epserve.check.reference import silu
    from epserve.ffn import gemm

    rng = np.random.default_rng(3)
    M, I = 333, 192
    h = (rng.standard_normal((M, 2 * I), np.float32) * 3).astype(BF16)
    act = cupy.full((M, I), np.nan, BF16)
    gemm.swiglu(cupy.asarray(h), act, M, I)
    h64 = h.astype(np.float64)
    ref = silu(h64[:, :I]) * h64[:, I:]
    got = cupy.asnumpy(act).astype(np.float64)
    assert np.allclose(got, ref, rtol=1e-2, atol=1e-2)


def test_copy_rows_gathers_and_scatters():
    import cupy

    from epserve.comm import row_moves

    rng = np.random.default_rng(4)
    src = rng.integers(0, 2**16, (50, 96), dtype=np.uint16)
    perm = rng.permutation(50).astype(np.int32)
    dst = cupy.zeros((50, 96), np.uint16)
    row_moves.copy_rows(dst, cupy.asarray(src), None, cupy.asarray(perm), 50, 192)
    assert np.array_equal(cupy.asnumpy(dst), src[perm])
    back = cupy.zeros((50, 96), np.uint16)
    row_moves.copy_rows(back, dst, cupy.asarray(perm), None, 50, 192)
    assert np.array_equal(cupy.asnumpy(back), src)


@pytest.mark.parametrize("name", sorted(kernels.VARIANTS))
def test_every_module_loads_on_the_gpu(name):
    """The module the runtime loads is this variant's sm_90a build: every kernel its PTX
    defines is in it, as Hopper code."""
    source, defines = kernels.VARIANTS[name]
    entries = re.findall(r"^\.visible \.entry (\w+)\(", build.compile_source(source, defines).ptx.read_text(), re.M)
    assert entries, f"{source} defines no kernel"
    module = kernels.module(name)
    for entry in entries:
        kernel = module.get_function(entry)  # raises when the loaded module lacks it
        assert kernel.binary_version == 90, (entry, kernel.binary_version)
        assert kernel.num_regs > 0, entry
