"""What every kernel launcher needs: pointer arguments, the SM count and the integers a
module publishes (tile sizes, thread counts)."""

from __future__ import annotations

import functools

import cupy
import numpy as np

from epserve.runtime.kernel_structs import u64

NULL = u64(0)  # a null pointer argument


def pointer(a):
    """A pointer argument: a CuPy array as itself (CuPy passes its data pointer), an address
    as a uint64 made once per value, None as null."""
    if a is None:
        return NULL
    if isinstance(a, (int, np.integer)):
        return u64(int(a))
    return a


@functools.lru_cache(maxsize=None)
def sm_count(device: int) -> int:
    return cupy.cuda.Device(device).attributes["MultiProcessorCount"]


def module_int(mod, name: str) -> int:
    host = np.zeros(1, np.int32)
    mem = mod.get_global(name)
    mem.copy_to_host(host.ctypes.data, 4)
    return int(host[0])
