"""Combine: GEMM 2's rows back to their tokens' ranks and the weighted reduction over the k slots."""
