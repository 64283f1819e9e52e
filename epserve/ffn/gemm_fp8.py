"""Launchers of the FP8 expert GEMMs (cuda/gemm/grouped_gemm_fp8.cu) on the current CuPy
stream: GEMM 2 with the null or the peer sink (bf16 rows out, as the bf16 GEMM), and GEMM 1
with SwiGLU and act re-quantized for GEMM 2 in its epilogue. Arguments in the exact types
the CUDA signature takes; no validation of user input beyond the shapes the kernel needs
(the service will check once, before any data moves).

Operands: A is e4m3 [M, K] (uint8 storage) with scales [K / 128, ld] float32 (k-block-major,
ld >= M a multiple of 4: epserve.ffn.fp8.quantize_rows makes them); B and its 128 x 128
block scales as epserve.ffn.fp8.FP8Weights holds them. Rows are expert-contiguous by
expert_offsets [E + 1] int32 on the device, as for the bf16 GEMMs."""

from __future__ import annotations

import functools
import os

import cupy
import numpy as np

from epserve.errors import ConfigError
from epserve.ffn.fp8 import _i64
from epserve.ffn.gemm import _gemm_kernel, _tile_counter, peer_variant, run
from epserve.runtime import l2_sides, tma
from epserve.runtime.kernel_structs import PEER_SEND_CONFIG, i32, launch_arg
from epserve.runtime.kernels import FP8_SHIPPED
from epserve.runtime.launch import NULL, module_int, sm_count

BLOCK = 128
KERNEL = "epserve_grouped_gemm_fp8"
_NO_PEERS = launch_arg(np.zeros(1, PEER_SEND_CONFIG))

# Builds of the FP8 GEMM that differ in how tiles are computed, never in the bits
# (cuda/gemm/grouped_gemm_fp8.cu, top of the file, says what each knob does and why): name ->
# defines, each naming every knob it sets. The shipped variants (runtime/kernels.py) are
# "split" for GEMM 1 and "split+ahead" for GEMM 2: a tile of at most 64 real rows computed by
# both warpgroups (ninth session), the padding rows past an expert's end loaded as zeros
# (fifteenth session: 1.5-1.8% on GEMM 1 by power alone), tiles handed out by L2 side
# (twenty-second session: GEMM 1 0.9-2.7% and GEMM 2 0.4-1.7% faster, timed as the bench
# times them), the producer's decoded tile published to the consumers (twenty-third session:
# GEMM 2 0.8-2.6%, GEMM 1 unchanged) and, for GEMM 2, the next tile taken during this one's
# loads (twenty-fourth session: GEMM 2 2-4%, GEMM 1 4-7% slower). "plain" is the build
# without any of them; each "split-..." build is an earlier shipped build (its comment says
# which). Every other build measured was slower or no faster and was taken out (thirtieth
# session: notes/gemm.md lists them, commit 31feff3 holds their code).
# launch/jobs/ab_gemm_fp8.py and time_gemm_sustained.py time them against the shipped ones,
# tests/gpu/test_gemm_fp8.py holds each to the shipped build's bits, tests/cpu/test_build.py
# compiles them.
_PLAIN = {"EPSERVE_GEMM_FP8_SPLIT_TAILS": 0, "EPSERVE_GEMM_FP8_ZERO_PADDING": 0, "EPSERVE_GEMM_FP8_L2_SIDES": 0,
          "EPSERVE_GEMM_FP8_PUBLISH_TILE": 0, "EPSERVE_GEMM_FP8_TAKE_AHEAD": 0}
KNOBS: dict[str, dict[str, int]] = {
    "plain": _PLAIN,
    "split": {**_PLAIN, **FP8_SHIPPED},
    # the shipped build until the fifteenth session: padding rows loaded from the next expert
    "split-unzeroed": {**_PLAIN, "EPSERVE_GEMM_FP8_SPLIT_TAILS": 1},
    # the shipped build until the twenty-second session: every CTA takes tiles from the front
    "split-nosides": {**_PLAIN, **FP8_SHIPPED, "EPSERVE_GEMM_FP8_L2_SIDES": 0, "EPSERVE_GEMM_FP8_PUBLISH_TILE": 0},
    # the shipped build until the twenty-third session: the consumers decode each tile themselves
    "split-unpublished": {**_PLAIN, **FP8_SHIPPED, "EPSERVE_GEMM_FP8_PUBLISH_TILE": 0},
    # GEMM 2's shipped build: the next tile taken from the counter during this one's loads
    "split+ahead": {**_PLAIN, **FP8_SHIPPED, "EPSERVE_GEMM_FP8_TAKE_AHEAD": 1},
}
SHIPPED = {"gemm_fp8_null": "split+ahead", "gemm_fp8_peer": "split+ahead", "gemm1_fp8_swiglu": "split"}


def build_variant(base: str) -> str:
    """The variant the layer launches for `base` ("gemm_fp8_null", "gemm_fp8_peer",
    "gemm1_fp8_swiglu", ...): `base` itself, or with $EPSERVE_GEMM_FP8_BUILD naming one of
    KNOBS, `base` built with it (an experimental build with the shipped build's bits, so the
    ranks need not agree), for the jobs and benchmarks that check or time a build in the whole
    layer. The bulk send warps' builds (gemm_fp8_peer_bulk, gemm_fp8_peer_ownbulk, the default) take
the knobs too."""
    knob = os.environ.get("EPSERVE_GEMM_FP8_BUILD", "")
    if not knob:
        return base
    if knob not in KNOBS:
        raise ConfigError(f"EPSERVE_GEMM_FP8_BUILD must be one of {sorted(KNOBS)}, got {knob!r}")
    from epserve.runtime import kernels

    name = f"{base}+{knob}"
    return name if name in kernels.VARIANTS else register_knob(base, knob)


def register_knob(base: str, knob: str) -> str:
    """Adds `base` built with KNOBS[knob] to kernels.VARIANTS (at run time: not shipped) and
    returns its name, for _specs."""
    from epserve.runtime import kernels

    source, defines = kernels.VARIANTS[base]
    name = f"{base}+{knob}"
    kernels.VARIANTS[name] = (source, {**defines, **KNOBS[knob]})
    return name


def grouped_gemm_fp8(sink: str, a, a_scales, b, b_scales, C, expert_offsets, num_experts: int, N: int, K: int,
                     cfg=None, gate: int = 0) -> None:
    """C[m] = dequant(a)[m] @ dequant(b[e])^T per expert, C bf16 [M, N]; `sink` "null" stores
    C, "peer" sends each finished tile's rows to recv through `cfg` (C may be None), as
    epserve.ffn.gemm.grouped_gemm does. a [M, K] e4m3, b [E, N, K] e4m3 with b_scales
    [E, N / 128, K / 128]; N and K multiples of 128. GEMM 2 of the layer: a = act, b = w2."""
    run(grouped_gemm_fp8_specs(sink, a, a_scales, b, b_scales, C, expert_offsets, num_experts, N, K, cfg, gate))


def grouped_gemm_fp8_specs(sink: str, a, a_scales, b, b_scales, C, expert_offsets, num_experts: int, N: int, K: int,
                           cfg=None, gate: int = 0) -> list:
    """grouped_gemm_fp8's launch as specs (see epserve.ffn.gemm.grouped_gemm_specs)."""
    if cfg is None:
        assert sink == "null", "the peer sink needs its PeerSendConfig"
        cfg = _NO_PEERS
    return _specs(build_variant(f"gemm_fp8_{peer_variant(sink)}"), a, a_scales, b, b_scales, num_experts * N, C, None,
                  expert_offsets, num_experts, N, K, cfg, gate)


def gemm1_swiglu_fp8(a, a_scales, w13, w13_scales, act, act_scales, expert_offsets, num_experts: int,
                     intermediate: int, hidden: int) -> None:
    """act = quantize_1x128(silu(g) * u) with [g | u] = dequant(a) @ dequant(w13[e])^T rounded
    to bf16, per expert: GEMM 1, SwiGLU and GEMM 2's input quantization in one kernel.
    a [M, H] e4m3 with a_scales [H / 128, >= M]; w13 [E, 2I, H] e4m3 with its block scales;
    act [M, I] uint8 (e4m3) and act_scales [I / 128, ld] float32 (ld >= M, a multiple of 4),
    written for rows [0, M) only. The same bits as the FP8 GEMM storing [M, 2I] in bf16, the
    SwiGLU kernel and epserve.ffn.fp8.quantize_rows."""
    run(gemm1_swiglu_fp8_specs(a, a_scales, w13, w13_scales, act, act_scales, expert_offsets, num_experts,
                               intermediate, hidden))


def gemm1_swiglu_fp8_specs(a, a_scales, w13, w13_scales, act, act_scales, expert_offsets, num_experts: int,
                           intermediate: int, hidden: int) -> list:
    """gemm1_swiglu_fp8's launch as specs."""
    I, H = intermediate, hidden
    assert act_scales.shape[0] == I // BLOCK and act_scales.shape[1] % 4 == 0, act_scales.shape
    return _specs(build_variant("gemm1_fp8_swiglu"), a, a_scales, w13, w13_scales, num_experts * 2 * I, act, act_scales,
                  expert_offsets, num_experts, I, H, _NO_PEERS, 0)


def _specs(variant: str, a, a_scales, b, b_scales, b_rows: int, C, c_scales, expert_offsets, num_experts: int,
           N: int, K: int, cfg, gate: int) -> list:
    assert N % BLOCK == 0 and K % BLOCK == 0 and N > 0 and K > 0, (N, K)
    assert a.dtype == np.uint8 and b.dtype == np.uint8 and a.shape[1] == K, (a.dtype, b.dtype, a.shape, K)
    assert a_scales.dtype == np.float32 and a_scales.shape[0] == K // BLOCK and a_scales.shape[1] % 4 == 0, \
        a_scales.shape
    M = a.shape[0]
    assert a_scales.shape[1] >= M and b.shape[-1] == K and b.size == b_rows * K, (a_scales.shape, M, b.shape, b_rows)
    if M == 0:
        return []  # no rows, no tiles (and a tensor map cannot have an empty dimension)
    # A may be a view of wider rows (the FP8 dispatch's packed rows: values, then scales).
    assert a.strides[1] == 1 and a.strides[0] >= K and a.strides[0] % 16 == 0, a.strides
    device = cupy.cuda.runtime.getDevice()
    fn, smem, threads, grid, b_box, sa_box = _kernel(variant, device)
    map_a = _fp8_map(a.data.ptr, M, K, 64, a.strides[0])
    map_sa = _scales_map(a_scales.data.ptr, K // BLOCK, M, a_scales.shape[1], sa_box)
    map_b = _fp8_map(b.data.ptr, b_rows, K, b_box)
    counter = _tile_counter(device, cupy.cuda.get_current_stream().ptr)
    c_ld = _i64(0 if c_scales is None else c_scales.shape[1])
    args = (map_a, map_sa, map_b, b_scales, NULL if C is None else C, NULL if c_scales is None else c_scales, c_ld,
            expert_offsets, i32(num_experts), i32(N), i32(K), cfg, i32(gate), counter)
    return [(fn, grid, threads, args, smem)]


@functools.lru_cache(maxsize=None)
def _kernel(variant: str, device: int):
    """Everything a launch needs that depends on the variant and device alone: one CTA per SM."""
    fn, smem, threads = _gemm_kernel(variant, KERNEL, device)
    from epserve.runtime import kernels

    mod = kernels.module(variant)
    b_box = module_int(mod, "epserve_gemm_b_box_rows")
    sa_box = module_int(mod, "epserve_gemm_scale_box_cols")
    if module_int(mod, "epserve_gemm_l2_sides"):  # its CTAs take tiles by L2 side: give it the sides
        l2_sides.write_table(mod, device)
    return fn, smem, (threads,), (sm_count(device),), b_box, sa_box


@functools.lru_cache(maxsize=256)
def _fp8_map(ptr: int, rows: int, cols: int, box_rows: int, pitch: int | None = None):
    """Tensor maps are pure functions of these (see epserve.ffn.gemm._rows_map): made once per buffer."""
    return launch_arg(tma.fp8_rows_map(ptr, rows, cols, box_rows, pitch))


@functools.lru_cache(maxsize=256)
def _scales_map(ptr: int, k_blocks: int, rows: int, ld: int, box_cols: int):
    """A's scales [k_blocks, ld] over columns [0, rows): the kernel loads a tile's scales
    from its first row rounded down to 4 (a TMA box's innermost start must be 16-byte
    aligned), box_cols (its epserve_gemm_scale_box_cols: 132) at a time."""
    return launch_arg(tma.f32_rows_map(ptr, k_blocks, rows, ld, box_cols=box_cols))
