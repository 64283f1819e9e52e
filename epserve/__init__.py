"""epserve: an expert-parallel Mixture-of-Experts layer whose down-projection GEMM writes
each finished output tile straight into the GPU that owns those tokens."""

__version__ = "0.1.0"
