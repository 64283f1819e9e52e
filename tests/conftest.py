"""Test-wide behaviour of the `gpu` and `mpi` markers.

Tests marked `gpu` need a usable NVIDIA Hopper GPU (compute capability 9.0: the kernels are
built for sm_90a, which runs on nothing else). Where there is none (CI, a laptop) they are
skipped with the reason, and the terminal summary says how many were skipped and why, so a
green run without a GPU cannot be mistaken for a run that tested the kernels.

--fail-if-all-skipped turns a run in which no selected test ran into a failure, with the
reason: `make test-gpu` and `make dead-peer` use it, so that they cannot pass having tested
nothing on a machine without a GPU.

The GPU probe imports CuPy and asks the CUDA runtime only when a selected test needs a GPU,
and only once per session; importing this file touches neither.
"""

import pytest

from epserve.runtime.gpu_probe import gpu_unusable_reason

GPU_SKIP_PREFIX = "no NVIDIA GPU visible"


FAIL_IF_ALL_SKIPPED = "--fail-if-all-skipped"


def pytest_addoption(parser):
    parser.addoption(FAIL_IF_ALL_SKIPPED, action="store_true",
                     help="exit with status 1, saying why, when no selected test ran (all skipped, or none "
                          "selected): for runs whose point is tests that need a GPU (make test-gpu, make dead-peer)")


def pytest_configure(config):
    # Also declared in setup.cfg; repeated here so the markers exist whatever ini file
    # pytest picked up (running from another directory, --strict-markers).
    config.addinivalue_line("markers", "gpu: needs an NVIDIA Hopper GPU (compute capability 9.0)")
    config.addinivalue_line("markers", "mpi: starts several ranks under mpiexec")


def pytest_collection_finish(session):
    # MPI initialised in the pytest process (a test module importing mpi4py.MPI) makes Open
    # MPI's mpiexec fail, exit 1 with no output, for every job a later test launches: say so
    # here rather than in two dozen unexplained failures.
    import sys

    if "mpi4py.MPI" in sys.modules:
        raise pytest.UsageError("a test module imported mpi4py.MPI while being collected; under Open MPI every "
                                "job a test launches would then fail with no output. Import it inside the "
                                "launched job, or use a stand-in communicator")


@pytest.hookimpl(trylast=True)  # after -m/-k deselection: probe only for tests that will run
def pytest_collection_modifyitems(config, items):
    gpu_items = [item for item in items if item.get_closest_marker("gpu") is not None]
    if not gpu_items:
        return
    reason = gpu_unusable_reason()
    if reason is None:
        return
    skip = pytest.mark.skip(reason=f"{GPU_SKIP_PREFIX}: {reason}")
    for item in gpu_items:
        item.add_marker(skip)


def _skip_reason(report):
    longrepr = report.longrepr
    if isinstance(longrepr, tuple) and len(longrepr) == 3:
        return str(longrepr[2])
    return str(longrepr)


def _nothing_ran(config) -> bool:
    """With --fail-if-all-skipped: no test passed or failed (every one skipped or deselected)."""
    if not config.getoption(FAIL_IF_ALL_SKIPPED):
        return False
    stats = config.pluginmanager.get_plugin("terminalreporter").stats
    return not any(stats.get(outcome) for outcome in ("passed", "failed", "error"))


def pytest_sessionfinish(session, exitstatus):
    if exitstatus in (0, 5) and _nothing_ran(session.config):  # 5: pytest's "no tests collected"
        session.exitstatus = 1


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if _nothing_ran(config):
        reason = gpu_unusable_reason()
        why = f"{GPU_SKIP_PREFIX}: {reason}" if reason else "see the skip reasons above (pytest -rs)"
        terminalreporter.write_line(f"epserve: nothing was tested: every selected test was skipped ({why}); "
                                    f"{FAIL_IF_ALL_SKIPPED} makes that a failure. Run it on a machine with "
                                    "NVIDIA Hopper GPUs.", red=True)
    skipped = [
        report
        for report in terminalreporter.stats.get("skipped", [])
        if GPU_SKIP_PREFIX in _skip_reason(report)
    ]
    if skipped:
        terminalreporter.write_line(
            f"epserve: {len(skipped)} GPU test(s) skipped: {GPU_SKIP_PREFIX}: {gpu_unusable_reason()}"
        )


@pytest.fixture
def gpu_probe():
    """The cached probe: call it for None (GPU usable) or the reason there is none."""
    return gpu_unusable_reason
