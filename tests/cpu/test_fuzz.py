"""The fuzz case generator (epserve/check/fuzz.py) and the CPU side of its job (launch/jobs/fuzz.py
--list): deterministic, covering every edge it promises, within its size bounds, with
inputs the layer and the reference accept. No GPU, no MPI."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from epserve.check import fuzz
from epserve.check.fuzz import FuzzCase, generate
from epserve.check.reference import reference_layer
from epserve.check.testing import BF16
from epserve.config import KERNEL_TILE, MoEConfig
from epserve.dispatch.host_plan import count_recv_rows

ROOT = Path(__file__).resolve().parents[2]
JOB = ROOT / "launch" / "jobs" / "fuzz.py"
SWEEP_SEED, SWEEP_CASES, SWEEP_WORLD = 2024, 500, 2
FIELDS = ("x", "topk_idx", "topk_weights", "w13", "w2")


@pytest.fixture(scope="module")
def sweep():
    return [generate(SWEEP_SEED, i, SWEEP_WORLD) for i in range(SWEEP_CASES)]


@pytest.fixture(scope="module")
def sweep_drawn(sweep):
    """Per case: each rank's input shapes and dtypes, and the routings. The values are
    dropped as they are drawn: the whole sweep's weights would take gigabytes."""
    drawn = []
    for case in sweep:
        inputs = case.inputs()
        layout = [{f: (getattr(i, f).shape, getattr(i, f).dtype) for f in FIELDS} for i in inputs]
        drawn.append((layout, [i.topk_idx for i in inputs]))
    return drawn


def same_inputs(a, b):
    return all(np.array_equal(getattr(x, f).view(np.uint8), getattr(y, f).view(np.uint8))
               for x, y in zip(a, b) for f in FIELDS)


def test_a_case_is_a_function_of_seed_index_and_world():
    for index in (0, 1, 77):
        assert generate(5, index, 2) == generate(5, index, 2)
        assert same_inputs(generate(5, index, 2).inputs(), generate(5, index, 2).inputs())
    assert len({generate(5, i, 2) for i in range(50)}) == 50
    assert [generate(5, i, 2) for i in range(20)] != [generate(6, i, 2) for i in range(20)]


def test_the_sweep_covers_every_edge(sweep, sweep_drawn):
    assert {c.top_k for c in sweep} == set(range(1, fuzz.MAX_TOP_K + 1))
    assert any(0 in c.tokens for c in sweep), "no case with a rank that has no tokens"
    assert any(len(set(c.tokens)) > 1 for c in sweep)
    assert any(c.zipf > 0 for c in sweep) and any(c.zipf == 0 for c in sweep)
    assert any(c.unused > 0 for c in sweep) and any(c.unused == 0 for c in sweep)
    assert any(c.unused == 1 for c in sweep), "no case with every slot masked"
    assert any(c.experts is not None and not c.idle_ranks for c in sweep), "no expert subset"
    assert any(c.idle_ranks for c in sweep), "no rank that receives nothing"
    assert any(c.max_tokens_per_rank > max(c.tokens) for c in sweep), "no service with room to spare"
    # Some expert gets no row at all, in inputs actually drawn.
    assert any(len(set(np.concatenate([idx.ravel() for idx in routing]).tolist()) - {-1}) < c.num_experts
               for c, (_, routing) in zip(sweep, sweep_drawn))
    assert max(c.hidden for c in sweep) >= 4096 and max(c.intermediate for c in sweep) >= 2048
    assert min(c.hidden for c in sweep) == KERNEL_TILE and min(c.intermediate for c in sweep) == KERNEL_TILE


def test_sizes_are_tile_multiples_within_the_caps_and_budgets(sweep):
    for c in sweep:
        assert c.hidden % KERNEL_TILE == 0 and KERNEL_TILE <= c.hidden <= fuzz.HIDDEN_CAP, c
        assert c.intermediate % KERNEL_TILE == 0 and KERNEL_TILE <= c.intermediate <= fuzz.INTERMEDIATE_CAP, c
        assert all(0 <= t <= fuzz.MAX_TOKENS for t in c.tokens), c
        assert max(c.tokens) <= c.max_tokens_per_rank, c
        assert c.num_experts * 3 * c.hidden * c.intermediate <= fuzz.WEIGHT_BUDGET, c
        assert sum(c.tokens) * c.top_k * c.hidden * c.intermediate <= fuzz.ROW_WORK_BUDGET, c


def test_every_config_validates_and_inputs_have_the_layer_shapes(sweep, sweep_drawn):
    for c, (layout, _) in zip(sweep, sweep_drawn):
        cfg = c.config()
        assert isinstance(cfg, MoEConfig) and cfg.world_size == c.world_size
        assert cfg.top_k == c.top_k and cfg.max_tokens_per_rank == c.max_tokens_per_rank
        assert len(layout) == c.world_size
        e_loc, H, I, k = cfg.experts_per_rank, c.hidden, c.intermediate, c.top_k
        for T, got in zip(c.tokens, layout):
            assert got == {"x": ((T, H), BF16), "topk_idx": ((T, k), np.int32),
                           "topk_weights": ((T, k), np.float32), "w13": ((e_loc, 2 * I, H), BF16),
                           "w2": ((e_loc, H, I), BF16)}, c


def test_routing_keeps_to_the_case(sweep, sweep_drawn):
    for c, (_, routing) in zip(sweep, sweep_drawn):
        allowed = set(range(c.num_experts) if c.experts is None else c.experts) | {-1}
        for idx in routing:
            assert set(np.unique(idx).tolist()) <= allowed, c
            if c.unused == 0:
                assert (idx >= 0).all(), c
            if c.unused == 1:
                assert (idx == -1).all(), c
            for row in idx:  # a token's experts are distinct
                used = row[row >= 0]
                assert len(set(used.tolist())) == len(used), c
        for r in c.idle_ranks:
            assert count_recv_rows(r, routing, c.num_experts, c.world_size) == 0, c


@pytest.mark.parametrize("world", [1, 2, 3, 4, 8])
def test_other_world_sizes_give_valid_cases(world):
    for i in range(200):
        c = generate(11, i, world)
        c.config()
        assert c.num_experts % world == 0 and len(c.tokens) == world
        assert world > 1 or not c.idle_ranks


def test_the_reference_runs_on_small_cases(sweep):
    small = [c for c in sweep if sum(c.tokens) * c.hidden * c.intermediate <= 1 << 22][:5]
    assert len(small) == 5
    for c in small:
        inputs = c.inputs()
        layers = reference_layer([i.x for i in inputs], [i.topk_idx for i in inputs],
                                 [i.topk_weights for i in inputs], [i.w13 for i in inputs],
                                 [i.w2 for i in inputs], c.num_experts)
        for T, layer in zip(c.tokens, layers):
            assert layer["out"].shape == (T, c.hidden)
            assert np.isfinite(layer["out"]).all()


def test_replay_command_text():
    case = generate(3, 17, 2)
    assert case.replay_command() == (
        "python launch/run.py -n 2 -- python -m mpi4py launch/jobs/fuzz.py --seed 3 --start 17 --count 1")
    assert generate(3, 4, 4).replay_command(share_gpu=True) == (
        "python launch/run.py -n 4 --share-gpu -- python -m mpi4py launch/jobs/fuzz.py --seed 3 --start 4 "
        "--count 1 --share-gpu-ok")


def test_idle_ranks_follow_the_expert_pool():
    base = dict(seed=0, index=0, world_size=3, num_experts=6, top_k=2, hidden=64, intermediate=64,
                tokens=(1, 2, 3), max_tokens_per_rank=3, zipf=0.0, unused=0.0, data_seed=1)
    assert FuzzCase(experts=None, **base).idle_ranks == ()
    assert FuzzCase(experts=(0, 1, 4), **base).idle_ranks == (1,)
    assert FuzzCase(experts=(5,), **base).idle_ranks == (0, 1)


def run_list(*args):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, str(JOB), "--list", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120)


def test_list_prints_cases_and_replay_commands_without_gpu_or_mpi():
    done = run_list("--seed", "1", "--start", "0", "--count", "20")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    cases = [line for line in lines if line.startswith("case ")]
    replays = [line.split("replay: ", 1)[1] for line in lines if line.strip().startswith("replay: ")]
    assert len(cases) == 20 and len(lines) == 40
    for i in range(20):
        assert cases[i] == f"case {i}: {generate(1, i, 2).describe()}"
        assert replays[i] == generate(1, i, 2).replay_command()


def test_list_follows_start_and_world_size():
    done = run_list("--seed", "9", "--start", "30", "--count", "2", "--world-size", "4")
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[0] == f"case 30: {generate(9, 30, 4).describe()}"
    assert "python launch/run.py -n 4 -- " in done.stdout and "--start 31 --count 1" in done.stdout


def test_list_does_not_start_mpi():
    # The job run as a script inside a probe that then looks at what the run imported.
    probe = textwrap.dedent(f"""
        import runpy, sys
        sys.argv = [{str(JOB)!r}, "--list", "--seed", "1", "--count", "1"]
        sys.path.insert(0, {str(JOB.parent)!r})
        try:
            runpy.run_path(sys.argv[0], run_name="__main__")
        except SystemExit as exc:
            assert not exc.code, exc.code
        print("MPI initialized" if "mpi4py.MPI" in sys.modules else "no MPI")
    """)
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1] == "no MPI"


def test_bad_arguments_are_refused():
    done = run_list("--seed", "-1", "--count", "3")
    assert done.returncode == 2 and "must be >= 0" in done.stderr
