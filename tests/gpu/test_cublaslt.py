"""cuBLASLt's block-scaled FP8 GEMM (epserve/bench/cublaslt.py), the library baseline of the
FP8 presets: reachable on Hopper with cuBLAS 12.9+, the per-expert scale layout exact, and
each expert's product against the float64 oracle of the same quantized inputs (relative
error under 1e-2), every output row written and none past M."""

import numpy as np
import pytest

from epserve.check import fp8_reference as f8
from epserve.check.reference import rel_error
from epserve.check.testing import BF16

pytestmark = pytest.mark.gpu


def test_block_scaled_fp8_is_reachable_on_hopper():
    import cupy

    from epserve.bench import cublaslt

    if cupy.cuda.Device().compute_capability != "90" or cublaslt.version() < cublaslt.MIN_VERSION:
        pytest.skip("needs sm_90 and cuBLAS 12.9 or later")
    assert cublaslt.unavailable() is None


def _operands(rng, rows, N, K):
    import cupy

    from epserve.ffn import fp8

    E, M = len(rows), sum(rows)
    a = cupy.asarray(rng.standard_normal((max(M, 1), K)).astype(np.float32)).astype(BF16)
    w = cupy.asarray((rng.standard_normal((E, N, K)) / np.sqrt(K)).astype(np.float32)).astype(BF16)
    a_q, a_s = fp8.quantize_rows(a)
    w_q, w_s = fp8.quantize_blocks(w)
    return a_q, a_s, w_q, w_s


def _offsets(rows):
    return np.concatenate([[0], np.cumsum(rows)]).astype(np.int32)


def test_scales_by_expert_layout():
    import cupy

    from epserve.bench import cublaslt

    rows = [3, 0, 17, 1, 64, 6]
    off = _offsets(rows)
    M, k_blocks, ld = int(off[-1]), 5, 96
    scales = cupy.asarray(np.random.default_rng(3).standard_normal((k_blocks, ld)).astype(np.float32))
    scaled, starts = cublaslt.scales_by_expert(scales, off, cupy.asarray(off), M)
    got, s = cupy.asnumpy(scaled), cupy.asnumpy(scales)
    for e, r in enumerate(rows):
        assert starts[e] % 4 == 0
        block = got[starts[e]:starts[e] + k_blocks * r].reshape(k_blocks, r)
        assert np.array_equal(block, s[:, off[e]:off[e] + r])


@pytest.mark.parametrize("rows,N,K", [
    ([16, 0, 128, 48, 256], 256, 512),
    ([64, 80, 304], 384, 1024),
])
def test_grouped_fp8_matches_float64(rows, N, K):
    import cupy

    from epserve.bench import cublaslt

    if cublaslt.unavailable() is not None:
        pytest.skip(cublaslt.unavailable())
    rng = np.random.default_rng(sum(rows) + N + K)
    a_q, a_s, w_q, w_s = _operands(rng, rows, N, K)
    off = _offsets(rows)
    M = int(off[-1])
    with pytest.raises(ValueError, match="multiples of 16"):
        cublaslt.grouped_gemm_fp8(a_q, a_s, [0, 0], w_q[:1], w_s[:1], cupy.empty((M, N), BF16), [0, 15])
    C = cupy.full((M + 3, N), np.nan, BF16)  # poisoned, with guard rows past M
    scaled, starts = cublaslt.scales_by_expert(a_s, off, cupy.asarray(off), M)
    cublaslt.grouped_gemm_fp8(a_q, scaled, starts, w_q, w_s, C, off)
    got = cupy.asnumpy(C).astype(np.float64)
    assert np.isnan(got[M:]).all(), "cuBLASLt wrote past the last row"
    assert not np.isnan(got[:M]).any(), "some output elements were never written"
    a = f8.dequantize_rows(cupy.asnumpy(a_q).view(f8.E4M3)[:M], cupy.asnumpy(a_s))
    w = f8.dequantize_blocks(cupy.asnumpy(w_q).view(f8.E4M3), cupy.asnumpy(w_s))
    ref = np.concatenate([a[off[e]:off[e + 1]] @ w[e].T for e in range(len(rows))])
    assert rel_error(got[:M], ref) < 1e-2
    again = cupy.full((M, N), np.nan, BF16)

    def loop():
        cublaslt.grouped_gemm_fp8(a_q, scaled, starts, w_q, w_s, again, off)

    replay = cublaslt.captured(loop)  # the loop recorded as a CUDA graph: replayed, the same bits
    again.fill(np.nan)
    replay()
    assert np.array_equal(cupy.asnumpy(again).view(np.uint16), cupy.asnumpy(C[:M]).view(np.uint16))
