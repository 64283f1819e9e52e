"""Every kernel module epserve ships: its source under cuda/ and its defines. The runtime
loads modules from here and the CI build test compiles each entry, so a variant that is
shipped is a variant that is compiled in CI."""

from __future__ import annotations

import functools

from epserve.runtime.build import load_module

SINKS = {"null": "NullPeerSink", "peer": "EpPeerSink"}

GEMM_SOURCE = "gemm/grouped_gemm.cu"  # mma.sync + cp.async: any sm_80+ path, the reference of the two
WGMMA_GEMM_SOURCE = "gemm/grouped_gemm_wgmma.cu"  # TMA + wgmma, warp-specialized: Hopper's fast path
COMBINE_SOURCE = "comm/combine.cu"
ROWS_SOURCE = "comm/rows.cu"
SWIGLU_SOURCE = "ffn/swiglu.cu"
DISPATCH_SOURCE = "comm/dispatch.cu"
STAGING_SOURCE = "comm/staging.cu"  # across nodes: around the off-node carrier, and the IPC test carrier
OFF_NODE_OVERLAP_SOURCE = "comm/off_node_overlap.cu"  # across nodes: the combine's send under GEMM 2
OFF_NODE_RELAY_SOURCE = "comm/off_node_relay.cu"  # across nodes: along the rails, then over NVLink
OFF_NODE_DEDUP_SOURCE = "comm/off_node_dedup.cu"  # the relay with each token once per node (EPSERVE_OFFNODE_DEDUP=1)
# Across nodes with EPSERVE_OFFNODE_OVERLAP=1: GEMM 2's sink also counts the rows it staged for
# each off-node home, and the tiles of m-tiles holding such rows go first (a permutation).
OVERLAP = {"EPSERVE_SINK": "EpPeerSinkCountingOffNode", "EPSERVE_GEMM_OFFNODE_FIRST": 1}
BULK = {"EPSERVE_SINK": "EpPeerSinkBulk", "EPSERVE_SINK_BULK": 1}
OWN_BULK = {"EPSERVE_SINK": "EpPeerSinkBulk", "EPSERVE_SINK_BULK": 2}  # only this rank's own rows by bulk copies
FP8_GEMM_SOURCE = "gemm/grouped_gemm_fp8.cu"  # block-scaled e4m3 wgmma, the bf16 wgmma GEMM's structure
# The shipped FP8 GEMM builds' knobs: split tails, padding rows loaded as zeros, tiles handed
# out by L2 side (epserve/runtime/l2_sides.py writes the side table into each loaded module),
# the decoded tile published; epserve/ffn/gemm_fp8.py KNOBS["split"] is this build (GEMM 1's).
FP8_SHIPPED = {"EPSERVE_GEMM_FP8_SPLIT_TAILS": 1, "EPSERVE_GEMM_FP8_ZERO_PADDING": 1, "EPSERVE_GEMM_FP8_L2_SIDES": 1,
               "EPSERVE_GEMM_FP8_PUBLISH_TILE": 1, "EPSERVE_GEMM_FP8_TAKE_AHEAD": 0}
# GEMM 2 (not GEMM 1) also takes its next tile during this one's loads: the first stage of a
# tile no longer arrives late in its 3-stage ring (GEMM 2 2-4% faster); GEMM 1, whose 56
# k-blocks a tile and 4 stages hid that wait already, ran 4-7% slower with it
# (notes/gemm.md, twenty-fourth session). KNOBS["split+ahead"] is this build.
FP8_GEMM2_SHIPPED = {**FP8_SHIPPED, "EPSERVE_GEMM_FP8_TAKE_AHEAD": 1}
FP8_QUANTIZE_SOURCE = "ffn/quantize_fp8.cu"

# name -> (source, defines)
VARIANTS: dict[str, tuple[str, dict[str, object]]] = {
    **{f"gemm_{sink}": (GEMM_SOURCE, {"EPSERVE_SINK": cls}) for sink, cls in SINKS.items()},
    **{f"gemm_wgmma_{sink}": (WGMMA_GEMM_SOURCE, {"EPSERVE_SINK": cls}) for sink, cls in SINKS.items()},
    # GEMM 2 in two K halves where its tiles make few waves (epserve/ffn/tiles.py chooses)
    **{f"gemm_wgmma_{sink}_split": (WGMMA_GEMM_SOURCE, {"EPSERVE_SINK": cls, "EPSERVE_GEMM_SPLIT_K": 2})
       for sink, cls in SINKS.items()},
    # across nodes, the combine's off-node send under GEMM 2 (EPSERVE_OFFNODE_OVERLAP=1)
    "gemm_wgmma_peer_overlap": (WGMMA_GEMM_SOURCE, OVERLAP),
    "gemm_wgmma_peer_split_overlap": (WGMMA_GEMM_SOURCE, {**OVERLAP, "EPSERVE_GEMM_SPLIT_K": 2}),
    # GEMM 1 with SwiGLU in its epilogue: act stays on this GPU, so its sink is the null one
    "gemm1_wgmma_swiglu": (WGMMA_GEMM_SOURCE, {"EPSERVE_SINK": SINKS["null"], "EPSERVE_GEMM_SWIGLU": 1}),
    # FP8 experts (issue 16): GEMM 2 with either sink, GEMM 1 with SwiGLU and act quantized
    # for GEMM 2 in its epilogue, and the quantizers of weights and activations
    # FP8 GEMMs: a tile of at most 64 real rows split over both warpgroups, and the padding rows
    # past an expert's end loaded as zeros: epserve/ffn/gemm_fp8.py KNOBS
    **{f"gemm_fp8_{sink}": (FP8_GEMM_SOURCE, {"EPSERVE_SINK": cls, **FP8_GEMM2_SHIPPED})
       for sink, cls in SINKS.items()},
    # GEMM 2's peer sink with bulk asynchronous copies for every row (EPSERVE_SINK_STORES=bulk,
    # opt-in: epserve/ffn/gemm.py peer_stores; cuda/sinks/row_scatter_bulk.cuh)
    "gemm_wgmma_peer_bulk": (WGMMA_GEMM_SOURCE, BULK),
    "gemm_wgmma_peer_bulk_split": (WGMMA_GEMM_SOURCE, {**BULK, "EPSERVE_GEMM_SPLIT_K": 2}),
    "gemm_fp8_peer_bulk": (FP8_GEMM_SOURCE, {**BULK, **FP8_GEMM2_SHIPPED}),
    # ... and for this rank's own rows only (EPSERVE_SINK_STORES=own-bulk, the default)
    "gemm_wgmma_peer_ownbulk": (WGMMA_GEMM_SOURCE, OWN_BULK),
    "gemm_wgmma_peer_ownbulk_split": (WGMMA_GEMM_SOURCE, {**OWN_BULK, "EPSERVE_GEMM_SPLIT_K": 2}),
    "gemm_fp8_peer_ownbulk": (FP8_GEMM_SOURCE, {**OWN_BULK, **FP8_GEMM2_SHIPPED}),
    "gemm1_fp8_swiglu": (FP8_GEMM_SOURCE, {"EPSERVE_SINK": SINKS["null"], "EPSERVE_GEMM_SWIGLU": 1, **FP8_SHIPPED}),
    "quantize_fp8": (FP8_QUANTIZE_SOURCE, {}),
    # which L2 side each SM is on, for the FP8 GEMMs' tile order (epserve/runtime/l2_sides.py)
    "l2_sides_probe": ("probes/l2_sides.cu", {}),
    # the SM clock after each benchmark row (epserve/bench/clock.py)
    "sm_clock_probe": ("probes/sm_clock.cu", {}),
    "combine": (COMBINE_SOURCE, {}),
    "rows": (ROWS_SOURCE, {}),
    "swiglu": (SWIGLU_SOURCE, {}),
    "dispatch": (DISPATCH_SOURCE, {}),
    # FP8 experts: the direct dispatch's move quantizes bf16 tokens into packed FP8 rows on the
    # way (the bits of quantize_fp8's packed rows); its other kernels are the plain build's
    "dispatch_quantize": (DISPATCH_SOURCE, {"EPSERVE_DISPATCH_QUANTIZE": 1}),
    "staging": (STAGING_SOURCE, {}),
    "off_node_overlap": (OFF_NODE_OVERLAP_SOURCE, {}),
    "off_node_relay": (OFF_NODE_RELAY_SOURCE, {}),
    "off_node_dedup": (OFF_NODE_DEDUP_SOURCE, {}),
}


def module(name: str):
    """The loaded cupy.RawModule of variant `name` on the current device."""
    source, defines = VARIANTS[name]
    return load_module(source, defines)


def function(name: str, kernel: str):
    """Kernel `kernel` of variant `name` on the current device, looked up once per process
    and device: load_module re-hashes the include closure on every call, which costs more
    host time per launch than a small kernel runs."""
    import cupy

    return _function(name, kernel, cupy.cuda.runtime.getDevice())


@functools.lru_cache(maxsize=None)
def _function(name: str, kernel: str, device: int):
    return module(name).get_function(kernel)
