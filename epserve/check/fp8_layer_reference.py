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
