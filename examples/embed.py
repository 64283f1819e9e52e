# Embedding EPService in a plain CuPy program (the README's example; tests/gpu runs it).
#   python launch/run.py -n 2 -- python -m mpi4py examples/embed.py
import cupy
from ml_dtypes import bfloat16

from epserve import EPService, MoEConfig

cfg = MoEConfig(num_experts=64, top_k=4, hidden=1024, intermediate=512, max_tokens_per_rank=512, world_size=2)
with EPService(cfg) as svc:  # one per rank: picks the GPU by local rank, maps the peers' buffers
    T, E_loc = 300, cfg.experts_per_rank
    x = cupy.random.standard_normal((T, cfg.hidden), dtype=cupy.float32).astype(bfloat16)
    scores = cupy.random.random((T, cfg.num_experts), dtype=cupy.float32)  # your router here
    topk_idx = cupy.argsort(-scores, axis=1)[:, : cfg.top_k].astype(cupy.int32)
    topk_weights = cupy.take_along_axis(scores, topk_idx, axis=1)
    w13 = (cupy.random.standard_normal((E_loc, 2 * cfg.intermediate, cfg.hidden), dtype=cupy.float32) / 32).astype(bfloat16)
    w2 = (cupy.random.standard_normal((E_loc, cfg.hidden, cfg.intermediate), dtype=cupy.float32) / 23).astype(bfloat16)
    out = svc.forward(x, topk_idx, topk_weights, w13, w2)  # [T, hidden] bf16; GEMM 2 writes into the peers
    print(f"rank {svc.rank}: out {out.shape} {out.dtype}, |out| = {float(cupy.abs(out.astype(cupy.float32)).mean()):.4f}")
