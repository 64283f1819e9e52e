"""epserve: an expert-parallel Mixture-of-Experts layer whose down-projection GEMM writes
each finished output tile straight into the GPU that owns those tokens.

    from epserve import EPService, MoEConfig
"""

__version__ = "0.1.0"
__all__ = ["EPService", "MoEConfig"]


def __getattr__(name):
    # Lazy, so that `import epserve.config` (CPU tools, the launcher's jobs) needs no CuPy.
    if name == "EPService":
        from epserve.layer.service import EPService

        return EPService
    if name == "MoEConfig":
        from epserve.config import MoEConfig

        return MoEConfig
    raise AttributeError(f"module 'epserve' has no attribute {name!r}")
