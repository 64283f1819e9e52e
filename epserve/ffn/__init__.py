"""The expert FFN: the grouped GEMMs (GEMM 1 with SwiGLU, GEMM 2 with its peer sink) and their launchers."""
