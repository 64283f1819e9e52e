"""epserve: an expert-parallel Mixture-of-Experts layer whose down-projection GEMM writes
each finished output tile straight into the GPU that owns those tokens.

    from epserve import EPService, MoEConfig
    from epserve import quantize_weights   # FP8 experts: e4m3 weights with 128 x 128 scales
"""

__version__ = "0.1.0"
__all__ = ["EPService", "MoEConfig", "quantize_weights"]


def __getattr__(name):
    # Lazy, so that `import epserve.config` (CPU tools, the launcher's jobs) needs no CuPy.
    if name == "EPService":
        from epserve.layer.service import EPService

        return EPService
    if name == "MoEConfig":
        from epserve.config import MoEConfig

        return MoEConfig
    if name == "quantize_weights":
        from epserve.ffn.fp8 import quantize_weights

        return quantize_weights
    raise AttributeError(f"module 'epserve' has no attribute {name!r}")
