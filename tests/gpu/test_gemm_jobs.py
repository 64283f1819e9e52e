"""The GEMM timing jobs' launches (launch/jobs/time_gemm_sustained.py's builders, which
ab_gemm_fp8.py and trace_gemm_fp8.py use too) keep their operands: a GEMM's tensor maps hold
only their arrays' addresses, and until the twenty-fifth session the builders dropped the
arrays on return, so CuPy's pool handed that memory to the next allocations (other builds'
outputs, temporary copies) while the launches still read it. Here the memory is taken and
overwritten between two launches of each build, which must give the same bits."""

import sys
from pathlib import Path

import numpy as np
import pytest

from epserve.check.fp8_reference import scale_ld
from epserve.check.testing import BF16

pytestmark = pytest.mark.gpu

JOBS = Path(__file__).resolve().parents[2] / "launch" / "jobs"


@pytest.fixture()
def jobs_path():
    sys.path.insert(0, str(JOBS))  # the jobs import each other by name
    try:
        yield
    finally:
        sys.path.remove(str(JOBS))


def test_the_builders_launches_survive_their_operands_memory_being_reused(jobs_path):
    import cupy
    from time_gemm_sustained import gemm1_runs, gemm2_runs

    from epserve.ffn import fp8

    rs = cupy.random.RandomState(3)
    E, H, I = 4, 512, 256
    offsets_host = np.array([0, 100, 300, 301, 480], np.int32)
    M = int(offsets_host[-1])
    w13 = (rs.standard_normal((E, 2 * I, H), dtype=np.float32) / np.sqrt(H)).astype(BF16)
    w2 = (rs.standard_normal((E, H, I), dtype=np.float32) / np.sqrt(I)).astype(BF16)
    weights = fp8.quantize_weights(w13, w2)
    launches = []
    for build in (gemm1_runs, gemm2_runs):
        runs, _ = build(rs, offsets_host, weights, H, I, [], w13 if build is gemm1_runs else w2, [])
        launches += [runs["FP8, shipped"], runs["bf16 wgmma"]]
    firsts = []
    for launch, outs, _ in launches:
        launch()
        firsts.append([o.copy() for o in outs])
    # Every size the builders allocated for their operands (A in bf16, its e4m3 rows and
    # scales), taken from the pool and overwritten: a freed operand's block is among them.
    junk = [cupy.full(n, 0xAB, np.uint8) for K in (H, I) for n in (M * K * 2, M * K, (K // 128) * scale_ld(M) * 4)
            for _ in range(4)]
    cupy.cuda.Device().synchronize()
    for (launch, outs, _), first in zip(launches, firsts):
        launch()
        for got, want in zip(outs, first):
            assert np.array_equal(cupy.asnumpy(got).view(np.uint8), cupy.asnumpy(want).view(np.uint8))
    del junk
