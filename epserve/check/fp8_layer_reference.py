"""The float64 oracle of the whole layer with FP8 experts (MoEConfig.expert_dtype "fp8"), on
the CPU: the bf16 dispatch of epserve/check/reference.py, the received rows quantized 1 x 128
(bit for bit as the GPU does), the FP8 expert FFN of epserve/check/fp8_reference.py on the
same quantized weights and scales, and the same combine. It rounds where the GPU path rounds
before a quantization (gate and up, and act, to bf16); y, recv and out stay float64, and the
GPU's bf16 roundings there and its FP8 accumulation (epserve/check/fp8_bounds.py) are what
the 1e-2 tolerance of the tests covers.

Inputs as for reference_layer, but the weights are each rank's quantized ones, NumPy arrays:
    fp8_weights[r] = (w13_q, w13_scales, w2_q, w2_scales)   float8_e4m3fn and float32
(fp8_reference.quantize_blocks of the bf16 weights gives the GPU's quantize_weights bits).
"""

from __future__ import annotations

import numpy as np

from epserve.check import fp8_reference as f8
from epserve.check.reference import combine_layers, dispatched_rows


def quantized_weights(w13, w2):
    """(w13_q, w13_scales, w2_q, w2_scales) of one rank's bf16 weights, as the GPU makes them."""
    return (*f8.quantize_blocks(w13), *f8.quantize_blocks(w2))


def reference_layer_fp8(xs, topk_idxs, topk_weights, fp8_weights, num_experts):
    """Per rank r a dict: expert_offsets, src_info, a_q and a_scales (the quantized received
    rows), h, act, act_q, act_scales, y (fp8_reference.reference_ffn_fp8's), recv and out."""
    xs = [np.asarray(x) for x in xs]  # bf16 stays bf16: the quantizer models the GPU's from it
    topk_idxs = [np.asarray(idx).astype(np.int64) for idx in topk_idxs]
    topk_weights = [np.asarray(w).astype(np.float64) for w in topk_weights]
    if len(fp8_weights) != len(xs):
        raise ValueError(f"{len(fp8_weights)} ranks' weights for {len(xs)} ranks' tokens")
    layers = []
    for rank, (w13_q, w13_s, w2_q, w2_s) in enumerate(fp8_weights):
        plan, a = dispatched_rows(rank, xs, topk_idxs, num_experts)
        a_q, a_s = f8.quantize_rows(a)
        ffn = f8.reference_ffn_fp8(a_q, a_s, plan.expert_offsets, w13_q, w13_s, w2_q, w2_s)
        layers.append({"expert_offsets": plan.expert_offsets, "src_info": plan.src_info, "a_q": a_q,
                       "a_scales": a_s, **ffn})
    return combine_layers(layers, [x.astype(np.float64) for x in xs], topk_idxs, topk_weights)


def finish_from_act(layers, acts, fp8_weights, xs, topk_idxs, topk_weights):
    """The chain after GEMM 1 from given act codes: per rank r, acts[r] = (act_q [M_r, I]
    float8_e4m3fn, act_scales [I / 128, >= M_r]) in place of the chain's own requantized act
    (a kernel's, checked against fp8_bounds.act_outside_chain first), then GEMM 2 in float64 on
    the chain's weights and the chain's combine. Why (epserve/check/fp8_bounds.py): Hopper's
    FP8 accumulation moves about 1% of act's e4m3 codes a whole step from the float64 chain's,
    which can take a small layer's output past 1e-2 of the whole chain though every code is
    inside its interval; from the same codes, the rest of the layer sits within its bf16
    roundings. Returns new per-rank dicts with src_info, y, recv and out."""
    finished = []
    for layer, (act_q, act_scales), (_, _, w2_q, w2_s) in zip(layers, acts, fp8_weights):
        y = f8.grouped_matmul(f8.dequantize_rows(act_q, act_scales), layer["expert_offsets"],
                              f8.dequantize_blocks(w2_q, w2_s))
        finished.append({"src_info": layer["src_info"], "y": y})
    return combine_layers(finished, [np.asarray(x).astype(np.float64) for x in xs],
                          [np.asarray(i).astype(np.int64) for i in topk_idxs],
                          [np.asarray(w).astype(np.float64) for w in topk_weights])
