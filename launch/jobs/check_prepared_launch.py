"""One rank: forward through prepared launches (twice, so the second call rewrites
arguments) against forward through CuPy's own launches, bitwise:

    python launch/run.py -n 1 -- python -m mpi4py launch/jobs/check_prepared_launch.py
"""
import cupy
import numpy as np

from epserve import EPService, MoEConfig
from epserve.check.testing import layer_inputs

cfg = MoEConfig(64, 4, 1024, 512, 256, world_size=1)
with EPService(cfg) as svc:
    outs = []
    for seed in (3, 4):
        inp = layer_inputs(seed, [200], 64, 4, 1024, 512)[0]
        x, idx, w = cupy.asarray(inp.x), cupy.asarray(inp.topk_idx), cupy.asarray(inp.topk_weights)
        w13, w2 = cupy.asarray(inp.w13), cupy.asarray(inp.w2)
        fast = [svc.forward(x, idx, w, w13, w2) for _ in range(2)]
        for seq in (svc.direct.launches, svc.combiner._launches, svc._gemm1):
            seq.prepared = False
        slow = svc.forward(x, idx, w, w13, w2)
        for seq in (svc.direct.launches, svc.combiner._launches, svc._gemm1):
            seq.prepared = True
        same = all(bool((f.view(np.uint16) == slow.view(np.uint16)).all()) for f in fast)
        finite = bool(cupy.isfinite(slow.astype(np.float32)).all())
        print(f"seed {seed}: prepared == CuPy launches bitwise: {same}; finite: {finite}", flush=True)
        assert same and finite
