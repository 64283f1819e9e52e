"""The FP8 oracle (epserve/check/fp8_reference.py) on the CPU: the quantizers' convention and
rounding, bit for bit where the rule is known by hand; the scales' layouts; the expert FFN
against the bf16 oracle where quantization loses nothing; and the kernel's per-k-block
promotion against the dequantized product it stands for."""

import numpy as np
import pytest

from epserve.check import fp8_reference as f8
from epserve.check.reference import _expert_ffn, rel_error
from epserve.check.testing import BF16


def test_rows_round_to_nearest_even_and_keep_the_block_max():
    # amax 448 makes the inverse scale exactly 1, so q is e4m3(x) itself.
    row = np.zeros((1, 128), np.float32)
    row[0, :6] = [448, 1.0625, 1.1875, -3.25, 0.0009765625, 0.0029296875]
    q, scales = f8.quantize_rows(row.astype(BF16))
    # 1.0625 and 1.1875 are ties between e4m3 neighbours (3 mantissa bits): to the even one;
    # -3.25 is exact; 2^-10 ties between 0 and the smallest subnormal 2^-9: to 0; 3 * 2^-10
    # ties between 2^-9 and 2^-8: to 2^-8 (mantissa even).
    assert q[0, :6].astype(np.float32).tolist() == [448, 1.0, 1.25, -3.25, 0.0, 0.00390625]
    assert scales.shape == (1, 4) and scales[0, 0] == 1.0 and (scales[0, 1:] == 0).all()


def test_block_scale_is_amax_over_448_and_the_max_maps_to_448():
    rng = np.random.default_rng(0)
    w = (rng.standard_normal((2, 256, 384)) * rng.uniform(1e-3, 10, (2, 1, 1))).astype(BF16)
    q, scales = f8.quantize_blocks(w)
    assert q.shape == w.shape and q.dtype == f8.E4M3 and scales.shape == (2, 2, 3) and scales.dtype == np.float32
    blocks = np.abs(w.astype(np.float32)).reshape(2, 2, 128, 3, 128).max(axis=(2, 4))
    assert np.array_equal(scales, blocks / np.float32(448))
    qmax = np.abs(q.astype(np.float32)).reshape(2, 2, 128, 3, 128).max(axis=(2, 4))
    assert (qmax == 448).all()
    # every element within half an e4m3 step (2^-4 relative) or the subnormal step
    deq = f8.dequantize_blocks(q, scales)
    x = w.astype(np.float64)
    step = np.repeat(np.repeat(scales.astype(np.float64), 128, -2), 128, -1) * 2.0**-9
    assert (np.abs(deq - x) <= np.abs(x) * 2.0**-4 + step).all()


def test_zero_block_gives_zeros_and_a_finite_scale():
    q, scales = f8.quantize_blocks(np.zeros((128, 128), BF16))
    assert (q.astype(np.float32) == 0).all()
    assert scales[0, 0] == np.float32(1e-10) / np.float32(448) and np.isfinite(scales).all()
    q, scales = f8.quantize_rows(np.zeros((3, 256), BF16))
    assert (q.astype(np.float32) == 0).all() and np.isfinite(scales).all()


def test_a_product_past_448_saturates_instead_of_becoming_nan():
    # amax values whose rounded inverse scale takes amax itself past 448
    amax = np.float32(1.0) + np.arange(1, 20000, dtype=np.float32) * np.float32(2.0**-20)
    over = amax[amax * (np.float32(448) / amax) > np.float32(448)]
    assert over.size, "no amax in the range overshoots; widen it"
    row = np.zeros((1, 128), np.float32)
    row[0, 0] = over[0]
    q, _ = f8.quantize_rows(row)  # float32 input: the rounding is the point here, not bf16
    assert q[0, 0].astype(np.float32) == 448


def test_rows_layout_is_k_block_major_with_a_padded_pitch():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((5, 384)).astype(BF16)
    q, scales = f8.quantize_rows(x)
    assert f8.scale_ld(5) == 8 and scales.shape == (3, 8)
    for m in range(5):
        for kb in range(3):
            block = x[m, 128 * kb:128 * (kb + 1)].astype(np.float32)
            assert scales[kb, m] == np.abs(block).max() / np.float32(448)
    assert (scales[:, 5:] == 0).all()
    assert rel_error(f8.dequantize_rows(q, scales), x.astype(np.float64)) < 0.05


@pytest.mark.parametrize("shape", [(100, 128), (128, 100)])
def test_sizes_that_are_not_whole_blocks_are_refused(shape):
    with pytest.raises(ValueError, match="multiple of 128"):
        f8.quantize_blocks(np.ones(shape, np.float32))


def _exact_inputs(rng, rows, E, H, I):
    """Quantized inputs whose dequantized values are the e4m3 values themselves (scale 1)."""
    def e4m3(shape, spread):
        return np.clip(rng.standard_normal(shape) * spread, -448, 448).astype(np.float32).astype(f8.E4M3)

    M = sum(rows)
    offsets = np.concatenate([[0], np.cumsum(rows)]).astype(np.int32)
    a_q = e4m3((M, H), 1.0)
    a_s = np.zeros((H // 128, f8.scale_ld(M)), np.float32)
    a_s[:, :M] = 1.0
    w13_q, w2_q = e4m3((E, 2 * I, H), 0.1), e4m3((E, H, I), 0.1)
    ones = lambda shape: np.ones(shape, np.float32)  # noqa: E731
    return a_q, a_s, offsets, w13_q, ones((E, 2 * I // 128, H // 128)), w2_q, ones((E, H // 128, I // 128))


def test_ffn_matches_the_bf16_oracle_where_quantization_is_exact():
    rng = np.random.default_rng(2)
    rows, E, H, I = [3, 0, 70, 9], 4, 256, 128
    a_q, a_s, offsets, w13_q, w13_s, w2_q, w2_s = _exact_inputs(rng, rows, E, H, I)
    ref = f8.reference_ffn_fp8(a_q, a_s, offsets, w13_q, w13_s, w2_q, w2_s)
    a = a_q.astype(np.float64)
    for e in range(E):
        lo, hi = offsets[e], offsets[e + 1]
        if lo == hi:
            continue
        h, act, _ = _expert_ffn(a[lo:hi], w13_q[e].astype(np.float64), w2_q[e].astype(np.float64))
        assert np.array_equal(ref["h"][lo:hi], f8.round_bf16(h))  # the products are exact in float64
        assert rel_error(ref["act"][lo:hi], act) < 2**-7
    # y is GEMM 2 of the re-quantized act: check it against its own definition
    deq = f8.dequantize_rows(ref["act_q"], ref["act_scales"])
    for e in range(E):
        lo, hi = offsets[e], offsets[e + 1]
        assert np.allclose(ref["y"][lo:hi], deq[lo:hi] @ w2_q[e].astype(np.float64).T, rtol=0, atol=1e-9)
    q, s = f8.quantize_rows(ref["act"])
    assert np.array_equal(ref["act_q"].view(np.uint8), q.view(np.uint8)) and np.array_equal(ref["act_scales"], s)


def test_ffn_on_quantized_bf16_inputs_is_near_the_unquantized_layer():
    rng = np.random.default_rng(3)
    rows, E, H, I = [40, 200], 2, 256, 256
    M = sum(rows)
    offsets = np.concatenate([[0], np.cumsum(rows)]).astype(np.int32)
    x = rng.standard_normal((M, H)).astype(BF16)
    w13 = (rng.standard_normal((E, 2 * I, H)) / np.sqrt(H)).astype(BF16)
    w2 = (rng.standard_normal((E, H, I)) / np.sqrt(I)).astype(BF16)
    ref = f8.reference_ffn_fp8(*f8.quantize_rows(x), offsets, *f8.quantize_blocks(w13), *f8.quantize_blocks(w2))
    exact = np.concatenate([_expert_ffn(x[offsets[e]:offsets[e + 1]].astype(np.float64), w13[e].astype(np.float64),
                                        w2[e].astype(np.float64))[2] for e in range(E)])
    err = rel_error(ref["y"], exact)
    assert 0.005 < err < 0.1, err  # e4m3 loses a few percent, never nothing, never most


def test_per_k_block_promotion_is_the_dequantized_product():
    """The FP8 GEMM's algorithm (gemm/block_scaled_mma.cuh): per 128-wide k-block an unscaled
    partial sum of e4m3 products, added in times (row scale of A) * (block scale of B)."""
    rng = np.random.default_rng(4)
    M, N, K = 37, 256, 512
    a_q, a_s = f8.quantize_rows(rng.standard_normal((M, K)).astype(BF16))
    b_q, b_s = f8.quantize_blocks((rng.standard_normal((N, K)) * 0.05).astype(BF16))
    A, B = a_q.astype(np.float64), b_q.astype(np.float64)
    total = np.zeros((M, N))
    for kb in range(K // 128):
        k = slice(128 * kb, 128 * (kb + 1))
        part = A[:, k] @ B[:, k].T
        total += part * a_s[kb, :M, None] * np.repeat(b_s[:, kb], 128)[None, :]
    want = f8.dequantize_rows(a_q, a_s) @ f8.dequantize_blocks(b_q, b_s).T
    assert np.allclose(total, want, rtol=1e-12, atol=1e-12 * np.abs(want).max())


def test_packed_fp8_rows_are_whole_128_byte_lines_holding_values_then_scales():
    pytest.importorskip("cupy")
    from epserve.ffn import fp8, fp8_stage

    for hidden, want in ((128, 256), (256, 384), (2048, 2176), (4096, 4224), (7168, 7424)):
        assert fp8.packed_row_bytes(hidden) == want
        assert want % 128 == 0 and hidden + hidden // 32 <= want < hidden + hidden // 32 + 128
        assert fp8_stage.dispatch_width(hidden) * 2 == want and fp8_stage.dispatch_width(hidden) % 8 == 0
    with pytest.raises(ValueError):
        fp8.packed_row_bytes(100)
