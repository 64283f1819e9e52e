"""The across-nodes settings a user picks in the environment (EPSERVE_OFFNODE_CARRIER,
EPSERVE_OFFNODE_SIZES, EPSERVE_OFFNODE_ROUTE): read one, and agree on it at setup."""

from __future__ import annotations

import os

from epserve.errors import ConfigError


def env_choice(env: str, choices: tuple, what: str) -> str:
    """The value of `env`, one of `choices` (the first when unset or empty), or ConfigError
    saying that `what` (for example "the off-node route is one of ...") it must be."""
    name = os.environ.get(env, "").strip().lower() or choices[0]
    if name not in choices:
        raise ConfigError(f"{env}={name!r}: {what}")
    return name


def agree_across_nodes(comm, nodes: int, read, env: str, what: str) -> str | None:
    """Collective, at setup, before any CUDA call: None on one node, else the name read()
    gives, the same on every rank, or ConfigError on every rank (epserve.comm.mpi.agree_choice)."""
    from epserve.comm.mpi import agree_choice

    if nodes == 1:
        return None
    return agree_choice(comm, read, env, what)
