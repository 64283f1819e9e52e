# EPService in a plain CuPy program: the README's example (tests/gpu/test_example.py runs it).
# One process per rank, started by MPI; two ranks here (they may share one GPU):
#   mpirun -n 2 python -m mpi4py examples/embed.py
#   python launch/run.py -n 2 -- python -m mpi4py examples/embed.py   # from a checkout: bounded, GPUs bound
import cupy
from ml_dtypes import bfloat16

from epserve import EPService, MoEConfig

cfg = MoEConfig(num_experts=64, top_k=4, hidden=1024, intermediate=512, max_tokens_per_rank=512, world_size=2)
with EPService(cfg) as svc:  # one per rank: picks the GPU by local rank, maps the peers' buffers
    T, H, I, E_loc = 300, cfg.hidden, cfg.intermediate, cfg.experts_per_rank
    # This rank's experts (svc.rank owns experts [svc.rank * E_loc, (svc.rank + 1) * E_loc)),
    # Linear layout: w13 holds the gate projection in rows [0, I) and the up projection in [I, 2I).
    w13 = (cupy.random.standard_normal((E_loc, 2 * I, H), dtype=cupy.float32) / H**0.5).astype(bfloat16)
    w2 = (cupy.random.standard_normal((E_loc, H, I), dtype=cupy.float32) / I**0.5).astype(bfloat16)
    # This rank's tokens and their routing: top_k global expert ids and weights per token.
    x = cupy.random.standard_normal((T, H), dtype=cupy.float32).astype(bfloat16)
    scores = cupy.random.random((T, cfg.num_experts), dtype=cupy.float32)  # your router here
    topk_idx = cupy.argsort(-scores, axis=1)[:, : cfg.top_k].astype(cupy.int32)
    topk_weights = cupy.take_along_axis(scores, topk_idx, axis=1)

    out = svc.forward(x, topk_idx, topk_weights, w13, w2)  # [T, H] bf16; GEMM 2 wrote it into the peers
    unfused = svc.forward(x, topk_idx, topk_weights, w13, w2, sink="null", dispatch="nccl")  # the baseline
    same = bool((out.view(cupy.uint16) == unfused.view(cupy.uint16)).all())
    size = float(cupy.abs(out.astype(cupy.float32)).mean())
    print(f"rank {svc.rank}: out {out.shape} {out.dtype}, mean |out| {size:.4f}, fused == unfused bitwise: {same}")
