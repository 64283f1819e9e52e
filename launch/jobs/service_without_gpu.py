"""EPService on ranks that have no GPU (CI), up to the point where one is needed:

    python launch/run.py -n 2 -- python -m mpi4py launch/jobs/service_without_gpu.py {agree|mismatch|two-nodes|gemm-setting}

agree: every rank builds the same MoEConfig; EPService must fail on every rank at device
selection with RankFailedError saying there is no GPU. mismatch: rank 1's config differs;
every rank must raise RankMismatchError naming the field, before any CUDA call. two-nodes:
EPSERVE_RANKS_PER_NODE=1 makes each rank a node of its own, and rank 1 names an unknown
off-node carrier (EPSERVE_OFFNODE_CARRIER); every rank must raise ConfigError naming it, before
any CUDA call. gemm-setting: rank 0 names an unknown EPSERVE_GEMM2_SPLIT_K; every rank must
raise ConfigError naming it, before any CUDA call. Each rank prints one line
`rank R: <ExceptionClass>: <message>`."""

import os
import sys

from epserve import EPService, MoEConfig
from epserve.comm.mpi import world
from epserve.errors import EPServeError


def main(mode: str) -> int:
    comm = world()
    rank = comm.Get_rank()
    if mode == "two-nodes":
        os.environ["EPSERVE_RANKS_PER_NODE"] = "1"
        if rank == 1:
            os.environ["EPSERVE_OFFNODE_CARRIER"] = "pigeon"
    if mode == "gemm-setting" and rank == 0:
        os.environ["EPSERVE_GEMM2_SPLIT_K"] = "sometimes"
    hidden = 512 if mode == "mismatch" and rank == 1 else 256
    cfg = MoEConfig(num_experts=8, top_k=2, hidden=hidden, intermediate=128, max_tokens_per_rank=64,
                    world_size=comm.Get_size())
    try:
        EPService(cfg, comm).close()
    except EPServeError as exc:
        sys.stdout.write(f"rank {rank}: {type(exc).__name__}: {exc}\n".replace("\n", " ").rstrip() + "\n")
        return 0
    sys.stdout.write(f"rank {rank}: no error\n")
    return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
