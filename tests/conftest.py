"""Test-wide behaviour of the `gpu` and `mpi` markers.

Tests marked `gpu` need a usable NVIDIA Hopper GPU (compute capability 9.0: the kernels are
built for sm_90a, which runs on nothing else). Where there is none (CI, a laptop) they are
skipped with the reason, and the terminal summary says how many were skipped and why, so a
green run without a GPU cannot be mistaken for a run that tested the kernels.

The GPU probe imports CuPy and asks the CUDA runtime only when a selected test needs a GPU,
and only once per session; importing this file touches neither.
"""

import pytest

from epserve.gpu_probe import gpu_unusable_reason

GPU_SKIP_PREFIX = "no NVIDIA GPU visible"


def pytest_configure(config):
    # Also declared in setup.cfg; repeated here so the markers exist whatever ini file
    # pytest picked up (running from another directory, --strict-markers).
    config.addinivalue_line("markers", "gpu: needs an NVIDIA Hopper GPU (compute capability 9.0)")
    config.addinivalue_line("markers", "mpi: starts several ranks under mpiexec")


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


def pytest_terminal_summary(terminalreporter, exitstatus, config):
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
