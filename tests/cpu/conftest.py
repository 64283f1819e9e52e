"""Fixtures the CPU tests of prepared and replayed launches share."""

import pytest


@pytest.fixture
def launches(monkeypatch):
    """The driver's launch replaced by a recorder: each launch's (function, grid, block,
    shared memory, stream, extra) and the address of its argument block, in order."""
    from cupy_backends.cuda.api import driver

    seen = []

    def record(function, gx, gy, gz, bx, by, bz, shared_mem, stream, params, extra):
        seen.append(((function, gx, gy, gz, bx, by, bz, shared_mem, stream, extra), params))

    monkeypatch.setattr(driver, "launchKernel", record)
    return seen
