"""FP8 experts on one GPU (issue 16): the quantizers bit for bit against their NumPy models,
the FP8 GEMMs against the float64 oracle of the same quantized inputs
(epserve/check/fp8_reference.py, relative error under 1e-2), GEMM 1's fused epilogue bit for
bit against the unfused path (FP8 GEMM storing [M, 2I] bf16, the SwiGLU kernel, the row
quantizer), reruns bit for bit, poisoned outputs (every row written, none past M), and
GEMM 2's peer build scattering the null build's rows. First, each diagnostic build of the
FP8 GEMM in a process of its own (launch/jobs/probe_gemm_fp8.py), so that a fault names the
part that made it (TMA loads, wgmma, or neither) and leaves this process's CUDA context whole."""

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from epserve.check import fp8_reference as f8
from epserve.check.reference import rel_error, silu
from epserve.check.testing import BF16

pytestmark = pytest.mark.gpu

# Ragged experts: empty ones, one row, tails at and around 64 (one warpgroup computes),
# whole tiles, whole tiles plus a tail; they start at rows 0, 64, 129, 130, 130, 257, 385,
# 514, 706, 769: every residue mod 4, which A's scale box (16-byte aligned starts) must handle.
RAGGED = [64, 65, 1, 0, 127, 128, 129, 192, 63, 300]
E4M3_NAN = 0x7F  # poison for e4m3 outputs
ROOT = Path(__file__).resolve().parents[2]
PROBE_JOB = ROOT / "launch" / "jobs" / "probe_gemm_fp8.py"


@pytest.mark.parametrize("gemm", ["2", "1"])
@pytest.mark.parametrize("probe", ["plumbing", "tma", "mma", "checked"])
def test_fp8_diagnostic_builds_run(probe, gemm):
    """The FP8 GEMM's diagnostic builds on the ragged rows, each in its own process:
    plumbing (no TMA load, no wgmma) and tma (every load checked, no wgmma) write zeros,
    mma (wgmma, no load) runs, checked (every load checked) matches the float64 oracle. The
    first GPU run died with CUDA_ERROR_ILLEGAL_INSTRUCTION at the first launch, which the
    ordinary tests below cannot place; these can."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    cp = subprocess.run([sys.executable, str(PROBE_JOB), "--one", f"{probe}:{gemm}"], capture_output=True,
                        text=True, timeout=600, env=env, cwd=ROOT)
    assert cp.returncode == 0, f"probe {probe} (GEMM {gemm}) failed:\n{cp.stdout[-3000:]}\n{cp.stderr[-3000:]}"


def _offsets(rows):
    return np.concatenate([[0], np.cumsum(rows)]).astype(np.int32)


def _bits(a):
    import cupy

    return cupy.asnumpy(a).view(np.uint8)


def _e4m3(a):
    import cupy

    return cupy.asnumpy(a).view(f8.E4M3)


def _quantized(rng, rows, E, N, K, *, scale=1.0):
    """Random bf16 A [M, K] and B [E, N, K], quantized on the GPU; returns the CuPy arrays."""
    import cupy

    from epserve.ffn import fp8

    M = sum(rows)
    a = cupy.asarray((rng.standard_normal((M, K), np.float32) * scale).astype(BF16))
    b = cupy.asarray((rng.standard_normal((E, N, K), np.float32) / np.sqrt(K)).astype(BF16))
    a_q, a_s = fp8.quantize_rows(a)
    b_q, b_s = fp8.quantize_blocks(b)
    return a_q, a_s, b_q, b_s, cupy.asarray(_offsets(rows))


@pytest.mark.parametrize("shape", [(1, 128, 128), (3, 256, 384), (2, 512, 7168)])
def test_quantize_blocks_matches_numpy_bitwise(shape):
    import cupy

    from epserve.ffn import fp8

    rng = np.random.default_rng(shape[-1])
    w = rng.standard_normal(shape, np.float32) * rng.uniform(1e-4, 1e3, (shape[0], 1, 1)).astype(np.float32)
    w[0, :128, :128] = 0  # an all-zero block
    w = w.astype(BF16)
    q, s = fp8.quantize_blocks(cupy.asarray(w))
    want_q, want_s = f8.quantize_blocks(w)
    assert np.array_equal(_bits(q), want_q.view(np.uint8)) and np.array_equal(cupy.asnumpy(s), want_s)


@pytest.mark.parametrize("M,K", [(1, 128), (37, 256), (4099, 2048)])
def test_quantize_rows_matches_numpy_bitwise(M, K):
    import cupy

    from epserve.ffn import fp8

    rng = np.random.default_rng(M + K)
    x = rng.standard_normal((M, K), np.float32) * np.exp(rng.uniform(-12, 12, (M, 1))).astype(np.float32)
    x[0, :128] = 0
    x = x.astype(BF16)
    q, s = fp8.quantize_rows(cupy.asarray(x))
    want_q, want_s = f8.quantize_rows(x)
    assert np.array_equal(_bits(q), want_q.view(np.uint8)) and np.array_equal(cupy.asnumpy(s), want_s)


# K = 384 and 1152: k-block counts (3, 9) that leave a warp's last loads past the row
@pytest.mark.parametrize("M,K", [(1, 128), (37, 256), (6, 384), (11, 1152), (515, 7168)])
def test_packed_rows_hold_the_row_quantizers_bits_and_gemm1_reads_them_in_place(M, K):
    """The FP8 dispatch's packed rows: their values and (unpacked) scales are quantize_rows'
    bits, every byte of a row written, and GEMM 1 reading the values in place (a tensor map
    at the packed pitch) gives the bits it gives from the separate arrays."""
    import cupy

    from epserve.ffn import fp8, gemm, gemm_fp8

    rng = np.random.default_rng(M + K)
    x = cupy.asarray((rng.standard_normal((M, K), np.float32) * rng.uniform(0.01, 30.0, (M, 1))).astype(BF16))
    q, s = fp8.quantize_rows(x)
    row_bytes = fp8.packed_row_bytes(K)
    assert row_bytes % 16 == 0 and row_bytes >= K + K // 32
    packed = cupy.full((M + 3, row_bytes), 0xEE, np.uint8)  # poison: rows past M must stay so
    gemm.run([fp8.quantize_rows_packed_spec(x, packed, M)])
    got = cupy.asnumpy(packed)
    assert np.array_equal(got[:M, :K], cupy.asnumpy(q)), "packed values differ from quantize_rows'"
    assert np.array_equal(got[:M, K:K + K // 32].view(np.float32).T, cupy.asnumpy(s)[:, :M])
    assert (got[M:] == 0xEE).all(), "rows past M were written"
    assert (got[:M, K + K // 32:] == 0).all(), "a row's bytes after its scales are not zeros"
    unpacked = cupy.full((K // 128, f8.scale_ld(M + 3)), np.nan, np.float32)
    count = cupy.asarray(np.array([M], np.int32))
    gemm.run([fp8.unpack_row_scales_spec(packed, K, unpacked, M + 3, count)])  # stops at the count
    assert np.array_equal(cupy.asnumpy(unpacked)[:, :M], cupy.asnumpy(s)[:, :M])
    assert np.isnan(cupy.asnumpy(unpacked)[:, M:]).all(), "scales past the row count were written"

    E, I = 2, 128
    rows = [M // 2, M - M // 2]
    w13 = cupy.asarray((rng.standard_normal((E, 2 * I, K), np.float32) / np.sqrt(K)).astype(BF16))
    w_q, w_s = fp8.quantize_blocks(w13)
    offsets = cupy.asarray(_offsets(rows))
    outs = []
    for a_values, a_scales in ((q, s), (packed[:, :K], unpacked)):
        act = cupy.full((M + 3, I), E4M3_NAN, np.uint8)
        act_s = cupy.zeros((I // 128, f8.scale_ld(M + 3)), np.float32)
        gemm_fp8.gemm1_swiglu_fp8(a_values, a_scales, w_q, w_s, act, act_s, offsets, E, I, K)
        outs.append((_bits(act)[:M], cupy.asnumpy(act_s)[:, :M]))
    assert np.array_equal(outs[0][0], outs[1][0]) and np.array_equal(outs[0][1], outs[1][1])


def test_quantize_weights_keeps_the_layouts():
    import cupy

    from epserve import quantize_weights

    E, H, I = 2, 256, 128
    w13 = cupy.zeros((E, 2 * I, H), BF16)
    w2 = cupy.zeros((E, H, I), BF16)
    q = quantize_weights(w13, w2)
    assert q.w13.shape == (E, 2 * I, H) and q.w13_scales.shape == (E, 2 * I // 128, H // 128)
    assert q.w2.shape == (E, H, I) and q.w2_scales.shape == (E, H // 128, I // 128)
    assert (q.num_experts, q.hidden, q.intermediate) == (E, H, I)


@pytest.mark.parametrize("rows,N,K", [
    (RAGGED, 256, 256),          # one column tile, two k-blocks
    ([5, 200, 0, 64], 128, 128),  # a tile with no second half, one k-block
    ([0, 0, 0], 256, 128),        # no rows at all
    ([1000, 17, 129], 384, 512),  # a last column tile of 128
    ([2049, 3000], 1024, 2048),   # many tiles per CTA
    ([300] * 40, 256, 128),       # more tiles than SMs
])
def test_gemm2_fp8_matches_float64(rows, N, K):
    import cupy

    from epserve.ffn import gemm_fp8

    rng = np.random.default_rng(sum(rows) + N + K)
    E, M = len(rows), sum(rows)
    a_q, a_s, b_q, b_s, offsets = _quantized(rng, rows, E, N, K)
    C = cupy.full((M + 7, N), np.nan, BF16)  # poisoned, with guard rows past M
    gemm_fp8.grouped_gemm_fp8("null", a_q, a_s, b_q, b_s, C, offsets, E, N, K)
    got = cupy.asnumpy(C).astype(np.float64)
    assert np.isnan(got[M:]).all(), "the GEMM wrote past its last row"
    assert not np.isnan(got[:M]).any(), "some output elements were never written"
    if M:
        a = f8.dequantize_rows(_e4m3(a_q), cupy.asnumpy(a_s))
        b = f8.dequantize_blocks(_e4m3(b_q), cupy.asnumpy(b_s))
        off = _offsets(rows)
        ref = np.concatenate([a[off[e]:off[e + 1]] @ b[e].T for e in range(E)])
        assert rel_error(got[:M], ref) < 1e-2
    again = cupy.full((M, N), np.nan, BF16)
    gemm_fp8.grouped_gemm_fp8("null", a_q, a_s, b_q, b_s, again, offsets, E, N, K)
    assert np.array_equal(cupy.asnumpy(again).view(np.uint16), cupy.asnumpy(C[:M]).view(np.uint16))


def _gemm1(a_q, a_s, w_q, w_s, offsets, E, I, H, M):
    import cupy

    from epserve.ffn import gemm_fp8

    act = cupy.full((M + 5, I), E4M3_NAN, np.uint8)  # poisoned, with guard rows past M
    ld = f8.scale_ld(M + 5)
    act_s = cupy.full((I // 128, ld), np.nan, np.float32)
    gemm_fp8.gemm1_swiglu_fp8(a_q, a_s, w_q, w_s, act, act_s, offsets, E, I, H)
    return act, act_s


@pytest.mark.parametrize("rows,I,H", [
    (RAGGED, 128, 256),
    ([5, 200, 0, 64], 256, 128),
    ([700, 1300], 2048, 512),
    ([300] * 40, 128, 128),
    ([0, 0], 128, 128),
])
def test_gemm1_fp8_swiglu_matches_float64_and_the_unfused_bits(rows, I, H):
    import cupy

    from epserve.ffn import fp8, gemm, gemm_fp8

    rng = np.random.default_rng(sum(rows) + I + H)
    E, M = len(rows), sum(rows)
    a_q, a_s, w_q, w_s, offsets = _quantized(rng, rows, E, 2 * I, H)
    act, act_s = _gemm1(a_q, a_s, w_q, w_s, offsets, E, I, H, M)
    got_q, got_s = _bits(act), cupy.asnumpy(act_s)
    assert (got_q[M:] == E4M3_NAN).all() and np.isnan(got_s[:, M:]).all(), "GEMM 1 wrote past its last row"
    assert not np.isnan(_e4m3(act)[:M].astype(np.float32)).any() and not np.isnan(got_s[:, :M]).any(), \
        "some activations or scales were never written"

    # Unfused: the FP8 GEMM storing [M, 2I] bf16, the SwiGLU kernel, the row quantizer.
    h = cupy.full((M, 2 * I), np.nan, BF16)
    gemm_fp8.grouped_gemm_fp8("null", a_q, a_s, w_q, w_s, h, offsets, E, 2 * I, H)
    act_bf16 = cupy.full((M, I), np.nan, BF16)
    gemm.swiglu(h, act_bf16, M, I)
    q2, s2 = fp8.quantize_rows(act_bf16, scales=cupy.zeros((I // 128, act_s.shape[1]), np.float32))
    assert np.array_equal(got_q[:M], _bits(q2)), "fused GEMM 1 + SwiGLU + quantization differs from the unfused bits"
    assert np.array_equal(got_s[:, :M], cupy.asnumpy(s2)[:, :M])

    if M:
        a = f8.dequantize_rows(_e4m3(a_q), cupy.asnumpy(a_s))
        w = f8.dequantize_blocks(_e4m3(w_q), cupy.asnumpy(w_s))
        off = _offsets(rows)
        href = f8.round_bf16(np.concatenate([a[off[e]:off[e + 1]] @ w[e].T for e in range(E)]))
        act_ref = f8.round_bf16(silu(href[:, :I]) * href[:, I:])
        ref_q, ref_s = f8.quantize_rows(act_ref)
        got = f8.dequantize_rows(_e4m3(act)[:M], got_s[:, :M])
        assert rel_error(got, f8.dequantize_rows(ref_q, ref_s)) < 1e-2
        assert rel_error(got_s[:, :M], ref_s[:, :M]) < 1e-2

    act2, act_s2 = _gemm1(a_q, a_s, w_q, w_s, offsets, E, I, H, M)
    assert np.array_equal(_bits(act2), got_q) and np.array_equal(cupy.asnumpy(act_s2)[:, :M], got_s[:, :M])


# The share of act's e4m3 codes that may differ from the float64 chain, asserted besides the
# intervals (epserve/check/fp8_bounds.py says why a share alone is no oracle). On these
# inputs a NumPy model of Hopper's FP8 accumulator (13 fraction bits, truncated:
# tests/cpu/test_fp8_bounds.py) gives 1.1% and 1.3%, the first H200 run 1.10% and under 1%;
# the model with one bit fewer 2.6% and 2.9%. Past 5% the accumulator would be worse than
# 12 bits, which no published measurement of Hopper shows: worth a look, not a pass.
MAX_FLIPPED_SHARE = 0.05


@pytest.mark.parametrize("rows,H,I", [(RAGGED, 256, 128), ([600, 37, 1500], 1024, 512)])
def test_fp8_expert_ffn_matches_float64(rows, H, I):
    """GEMM 1 + SwiGLU + quantization, then GEMM 2, against the oracle's whole chain from the
    same quantized inputs. act's codes are checked against intervals, not by a share of equal
    codes: the FP8 wgmma keeps about 13 fraction bits of each k32 step (not fp32), so GEMM 1's
    h sits a little off the float64 h and the bf16 and e4m3 roundings after it turn that into
    whole-step code changes on about 1% of act (some across zero, where act's error is set by
    the sum's largest term, not by act). The first H200 run saw 1.10% and failed the old 1%
    threshold; tests/cpu/test_fp8_bounds.py reproduces that share with a model of the
    accumulator and 0% with an fp32 one. So, rigorously:
    - GEMM 1's h (the unfused FP8 GEMM's bf16 [M, 2I], the fused kernel's input bit for bit)
      within the bf16 roundings of exact h +- the accumulator's worst-case error bound;
    - the epilogue alone: act's codes and scales within the intervals the float64 epilogue
      gives from the kernel's own h (only __expf's few ulps widen them: < 0.1% ambiguous);
    - end to end: every code and scale within the intervals from exact h +- the bound;
    - the share of codes off the float64 chain under MAX_FLIPPED_SHARE (see there);
    - y within 1e-2 of the float64 chain."""
    import cupy

    from epserve import quantize_weights
    from epserve.check import fp8_bounds
    from epserve.ffn import fp8, gemm_fp8

    rng = np.random.default_rng(sum(rows) + H)
    E, M = len(rows), sum(rows)
    offsets_host = _offsets(rows)
    x = cupy.asarray(rng.standard_normal((M, H), np.float32).astype(BF16))
    w13 = cupy.asarray((rng.standard_normal((E, 2 * I, H), np.float32) / np.sqrt(H)).astype(BF16))
    w2 = cupy.asarray((rng.standard_normal((E, H, I), np.float32) / np.sqrt(I)).astype(BF16))
    w = quantize_weights(w13, w2)
    a_q, a_s = fp8.quantize_rows(x)
    offsets = cupy.asarray(offsets_host)
    act = cupy.full((M, I), E4M3_NAN, np.uint8)
    act_s = cupy.full((I // 128, f8.scale_ld(M)), np.nan, np.float32)
    gemm_fp8.gemm1_swiglu_fp8(a_q, a_s, w.w13, w.w13_scales, act, act_s, offsets, E, I, H)
    y = cupy.full((M, H), np.nan, BF16)
    gemm_fp8.grouped_gemm_fp8("null", act, act_s, w.w2, w.w2_scales, y, offsets, E, H, I)
    h = cupy.full((M, 2 * I), np.nan, BF16)
    gemm_fp8.grouped_gemm_fp8("null", a_q, a_s, w.w13, w.w13_scales, h, offsets, E, 2 * I, H)

    inputs = (_e4m3(a_q), cupy.asnumpy(a_s), offsets_host, _e4m3(w.w13), cupy.asnumpy(w.w13_scales))
    ref = f8.reference_ffn_fp8(*inputs, _e4m3(w.w2), cupy.asnumpy(w.w2_scales))
    assert rel_error(cupy.asnumpy(y).astype(np.float64), ref["y"]) < 1e-2

    a_deq, w_deq = f8.dequantize_rows(inputs[0], inputs[1]), f8.dequantize_blocks(inputs[3], inputs[4])
    h_exact = np.concatenate([a_deq[offsets_host[e]:offsets_host[e + 1]] @ w_deq[e].T for e in range(E)])
    eps = fp8_bounds.wgmma_error_bound(inputs[0], inputs[1], offsets_host, inputs[3], inputs[4])
    got_h = cupy.asnumpy(h).astype(np.float64)
    outside_h = ~((got_h >= f8.round_bf16(h_exact - eps)) & (got_h <= f8.round_bf16(h_exact + eps)))
    assert not outside_h.any(), f"{int(outside_h.sum())} of GEMM 1's h values beyond the accumulator's error bound"

    got_q, got_s = _e4m3(act), cupy.asnumpy(act_s)
    epilogue = fp8_bounds.outside_act_bounds(fp8_bounds.act_bounds(got_h, got_h), got_q, got_s)
    assert epilogue["codes"] == 0 and epilogue["scales"] == 0 and epilogue["ambiguous"] < 1e-3, \
        f"the epilogue differs from the float64 one on the kernel's own h: {epilogue}"
    chain = fp8_bounds.outside_act_bounds(fp8_bounds.act_bounds(h_exact - eps, h_exact + eps), got_q, got_s)
    assert chain["codes"] == 0 and chain["scales"] == 0, f"act beyond the float64 chain's bounds: {chain}"
    flipped = float((_bits(act) != ref["act_q"].view(np.uint8)).mean())
    print(f"act codes off the float64 chain: {flipped:.4f} (h values off: {(got_h != ref['h']).mean():.4f})")
    assert flipped < MAX_FLIPPED_SHARE, f"{flipped:.4f} of act's e4m3 values differ from the oracle's"


def test_gemm2_fp8_peer_sink_scatters_the_null_builds_rows():
    """The peer build hands its bf16 tiles to the same row scatter as the bf16 GEMM: the rows
    land in their recv slots equal to the null build's C, refused rows nowhere
    (tests/gpu/test_guards.py's one-rank setup, with K a whole FP8 block)."""
    import cupy

    from epserve.ffn import fp8, gemm_fp8
    from tests.gpu.test_guards import H, check, setup

    group, raw, signals, src_info, cfg, n_good = setup()
    try:
        M, K = src_info.size, 128
        rng = np.random.default_rng(7)
        a_q, a_s = fp8.quantize_rows(cupy.asarray(rng.standard_normal((M, K), np.float32).astype(BF16)))
        b_q, b_s = fp8.quantize_blocks(cupy.asarray((rng.standard_normal((1, H, K), np.float32) / 8).astype(BF16)))
        offsets = cupy.asarray(np.array([0, M], np.int32))
        gemm_fp8.grouped_gemm_fp8("peer", a_q, a_s, b_q, b_s, None, offsets, 1, H, K, cfg, 0)
        C = cupy.empty((M, H), BF16)
        gemm_fp8.grouped_gemm_fp8("null", a_q, a_s, b_q, b_s, C, offsets, 1, H, K)
        check(raw, signals, C[:n_good], n_good)
    finally:
        group.close()


# epserve.ffn.gemm_fp8.KNOBS by GEMM (the 128-wide tile is GEMM 2's only; tests/cpu/test_build.py
# checks that this list names every knob).
FP8_KNOB_BUILDS = [("2", "plain"), ("2", "split"), ("2", "split-unzeroed"), ("2", "split-nosides"),
                   ("2", "split-unpublished"), ("2", "split+ahead"), ("1", "plain"), ("1", "split"),
                   ("1", "split-unzeroed"), ("1", "split-nosides"), ("1", "split-unpublished"), ("1", "split+ahead")]


@pytest.mark.parametrize("gemm,knob", FP8_KNOB_BUILDS)
@pytest.mark.parametrize("rows,K", [(RAGGED, 256), ([300] * 40, 384), ([40, 1, 64, 3], 128), ([129, 200], 512),
                                    ([77, 0, 190], 640)])
def test_fp8_build_knobs_give_the_same_bits(knob, gemm, rows, K, monkeypatch):
    """The FP8 GEMM's builds (epserve.ffn.gemm_fp8.KNOBS; cuda/gemm/grouped_gemm_fp8.cu says
    what each does) change how tiles are computed, never the result: each build equals the
    shipped one ("split+ahead" for GEMM 2, "split" for GEMM 1) bit for bit. plain: none of the
    knobs. split: a tile of at most 64 real rows computed by both warpgroups, one 128-column half
    each (GEMM 1's up half handed over through shared memory), and the rows of an A box past
    its expert's end loaded as zeros (through a copy of A's tensor map cut there;
    split-unzeroed loads the next expert's rows there, as every build did before); nosides:
    every CTA takes tiles from the front of the order (the shipped build takes them by L2 side,
    with this GPU's measured table); unpublished: the consumers decode each tile from its index
    themselves (the shipped build's producer writes the decoded tile beside the index); ahead:
    the producer takes the next tile during this one's loads (K = 128: a tile of one k-block,
    taken ahead at once). The rows hold tails of 1 .. 64 rows (split) and
    65 .. 127 (not), whole tiles, empty experts, and more tiles than SMs (a CTA meets split
    and unsplit tiles in turn); K from 1 to 5 k-blocks; GEMM 2's N = 384 leaves its last 256-wide column tile without a
    second half."""
    import cupy

    from epserve.ffn import gemm_fp8
    from epserve.runtime import kernels

    base = "gemm1_fp8_swiglu" if gemm == "1" else "gemm_fp8_null"
    monkeypatch.setattr(kernels, "VARIANTS", dict(kernels.VARIANTS))  # register_knob's entry goes with the test
    name = gemm_fp8.register_knob(base, knob)
    rng = np.random.default_rng(11 + K)
    E, M = len(rows), sum(rows)
    outs = {}
    if gemm == "2":
        N = 384
        a_q, a_s, b_q, b_s, offsets = _quantized(rng, rows, E, N, K)
        for variant in (base, name):
            C = cupy.full((M + 7, N), np.nan, BF16)
            gemm_fp8.run(gemm_fp8._specs(variant, a_q, a_s, b_q, b_s, E * N, C, None, offsets, E, N, K,
                                         gemm_fp8._NO_PEERS, 0))
            outs[variant] = (cupy.asnumpy(C).view(np.uint16),)
        assert not np.isnan(cupy.asnumpy(C[:M]).astype(np.float32)).any(), "elements left unwritten"
    else:
        I = 256
        a_q, a_s, w_q, w_s, offsets = _quantized(rng, rows, E, 2 * I, K)
        for variant in (base, name):
            act = cupy.full((M + 5, I), E4M3_NAN, np.uint8)
            act_s = cupy.full((I // 128, f8.scale_ld(M + 5)), np.nan, np.float32)
            gemm_fp8.run(gemm_fp8._specs(variant, a_q, a_s, w_q, w_s, E * 2 * I, act, act_s, offsets, E, I, K,
                                         gemm_fp8._NO_PEERS, 0))
            outs[variant] = (_bits(act), cupy.asnumpy(act_s).view(np.uint32))
        assert not np.isnan(cupy.asnumpy(act_s)[:, :M]).any(), "scales left unwritten"
    for want, got in zip(outs[base], outs[name]):
        assert np.array_equal(got, want), f"the {knob} build differs from the default"


@pytest.mark.parametrize("gemm", ["1", "2"])
def test_the_l2_side_table_orders_tiles_and_moves_no_bit(gemm):
    """The shipped FP8 GEMMs take tiles by L2 side (epserve/runtime/l2_sides.py): the table this
    H200 measures splits its SMs in two halves that three reps agree on, and whatever the
    table says (every SM on one side, on the other, alternating, the measured one), each
    output bit equals the build that takes every tile from the front."""
    import cupy

    from epserve.ffn import gemm_fp8
    from epserve.runtime import kernels, l2_sides

    device = cupy.cuda.runtime.getDevice()
    sides = l2_sides.sides(device)
    sms = cupy.cuda.Device().attributes["MultiProcessorCount"]
    assert sides.why_not is None, sides.why_not
    near, far = sides.counts
    assert near - (256 - sms) + far == sms and sms // 4 <= far <= sms - sms // 4, sides.counts
    assert sides.agreement >= l2_sides.MIN_AGREEMENT

    base = "gemm1_fp8_swiglu" if gemm == "1" else "gemm_fp8_null"
    nosides = gemm_fp8.register_knob(base, "split-nosides")
    rng = np.random.default_rng(5)
    rows = [300, 257, 0, 64, 1, 190, 511, 128] * 6  # more tiles than SMs: both sides meet in the middle
    E, M, K = len(rows), sum(rows), 256
    N = 384 if gemm == "2" else 256
    a_q, a_s, b_q, b_s, offsets = _quantized(rng, rows, E, N if gemm == "2" else 2 * N, K)

    def run(variant):
        if gemm == "2":
            C = cupy.full((M, N), np.nan, BF16)
            gemm_fp8.run(gemm_fp8._specs(variant, a_q, a_s, b_q, b_s, E * N, C, None, offsets, E, N, K,
                                         gemm_fp8._NO_PEERS, 0))
            return (cupy.asnumpy(C).view(np.uint16),)
        act = cupy.full((M, N), E4M3_NAN, np.uint8)
        act_s = cupy.full((N // 128, f8.scale_ld(M)), np.nan, np.float32)
        gemm_fp8.run(gemm_fp8._specs(variant, a_q, a_s, b_q, b_s, E * 2 * N, act, act_s, offsets, E, N, K,
                                     gemm_fp8._NO_PEERS, 0))
        return (_bits(act), cupy.asnumpy(act_s).view(np.uint32))

    want = run(nosides)
    written = want[0].view(BF16).astype(np.float32) if gemm == "2" else want[1].view(np.float32)[:, :M]
    assert not np.isnan(written).any(), "outputs left unwritten"
    module = kernels.module(base)
    tables = {"measured": sides.table, "all far": np.ones(256, np.uint8), "all near": np.zeros(256, np.uint8),
              "alternating": (np.arange(256) % 2).astype(np.uint8)}
    try:
        for name, table in tables.items():
            module.get_global(l2_sides.TABLE_SYMBOL).copy_from_host(np.ascontiguousarray(table).ctypes.data, 256)
            for _ in range(2):  # and again: the counters were reset for the next launch
                for w, g in zip(want, run(base)):
                    assert np.array_equal(g, w), f"table {name}: the output differs from the front-only build"
    finally:
        l2_sides.write_table(module, device)
