"""What every kernel launcher needs: pointer arguments, the SM count and the integers a
module publishes (tile sizes, thread counts)."""

from __future__ import annotations

import functools

import cupy
import numpy as np
from cupy_backends.cuda.api import driver as _driver

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


def resident_blocks(fn, threads: int, device: int, dynamic_smem: int = 0) -> int:
    """How many blocks of `threads` threads of RawKernel fn the device runs at once (the
    driver's occupancy for the kernel's registers and shared memory, times the SMs): the grid
    of a grid-stride kernel whose work should go in one round of blocks, not a round and a
    fraction."""
    return max(1, _blocks_per_sm(fn.kernel.ptr, threads, dynamic_smem)) * sm_count(device)


@functools.lru_cache(maxsize=None)
def _blocks_per_sm(function_ptr: int, threads: int, dynamic_smem: int) -> int:
    return _driver.occupancyMaxActiveBlocksPerMultiprocessor(function_ptr, threads, dynamic_smem)


def module_int(mod, name: str) -> int:
    host = np.zeros(1, np.int32)
    mem = mod.get_global(name)
    mem.copy_to_host(host.ctypes.data, 4)
    return int(host[0])


class PreparedLaunch:
    """One kernel launch whose argument block is built once. CuPy converts every argument of
    a RawKernel call on every call (about 5 us of host time for a launch of a dozen
    arguments); a prepared launch keeps the kernelParams array (one address per argument)
    and changes only the arguments that change between calls (`set`), then launches through
    the driver directly.

    Arguments, as the kernels take them: a CuPy array or None (a pointer, kept in a slot of
    this launch that `set` rewrites in place), or a by-value argument made by
    kernel_structs.launch_arg / i32 / u64, a NumPy scalar or a size-1 NumPy array (its bytes
    are read at every launch, so it must not change; `set` swaps in another one). The driver reads each
    parameter's size from the kernel, so only addresses are kept here."""

    def __init__(self, kernel, grid, block, args, shared_mem: int = 0):
        self.kernel = kernel
        self._function = kernel.kernel.ptr  # RawKernel -> cupy Function -> CUfunction
        self._dims = tuple(_three(grid)) + tuple(_three(block))
        self._shared_mem = int(shared_mem)
        self._pointers = np.zeros(len(args), np.uint64)  # the pointer arguments' values
        self._params = np.zeros(len(args), np.uintp)      # the address of each argument's bytes
        self._params_address = self._params.ctypes.data
        self._kept = [None] * len(args)                   # by-value arguments, alive while used
        for index, value in enumerate(args):
            self.set(index, value)

    def set(self, index: int, value) -> None:
        """Argument `index` becomes `value` from the next launch on."""
        if value is None or hasattr(value, "data") and hasattr(value.data, "ptr"):
            self._pointers[index] = 0 if value is None else value.data.ptr
            self._params[index] = self._pointers.ctypes.data + 8 * index
            self._kept[index] = None
        elif hasattr(value, "ptr"):  # CuPy's CNumpyArray (launch_arg): a pointer to kept bytes
            self._params[index] = value.ptr
            self._kept[index] = value
        elif isinstance(value, np.ndarray) and value.size == 1 and value.flags.c_contiguous:
            self._params[index] = value.ctypes.data
            self._kept[index] = value
        elif isinstance(value, np.generic):  # a NumPy scalar (np.int32(...)): its bytes, kept
            held = np.array([value])
            self._params[index] = held.ctypes.data
            self._kept[index] = held
        else:
            raise TypeError(f"argument {index}: a CuPy array, None, launch_arg(...), a NumPy scalar or a size-1 "
                            f"NumPy array, got {type(value).__name__}")

    def __call__(self, stream: int | None = None) -> None:
        """Launch on `stream` (a stream handle; the current CuPy stream when None)."""
        if stream is None:
            stream = cupy.cuda.get_current_stream().ptr
        # Looked up on the module at each call (not bound at import), so tests can record it.
        _driver.launchKernel(self._function, *self._dims, self._shared_mem, stream, self._params_address, 0)


def _same_bytes(old, new) -> bool:
    """Whether two arguments give the kernel the same bytes: launchers make their integer
    arguments afresh each call (i32(T)) and callers hand over new views of the same buffers,
    and rewriting an argument costs more host time than this comparison."""
    if isinstance(new, np.generic):
        return type(old) is type(new) and old == new
    data = getattr(new, "data", None)
    ptr = getattr(data, "ptr", None)
    return ptr is not None and getattr(getattr(old, "data", None), "ptr", None) == ptr


def _three(dims) -> list:
    dims = [int(d) for d in (dims if isinstance(dims, (tuple, list)) else (dims,))]
    if not 1 <= len(dims) <= 3:
        raise ValueError(f"a grid or block has 1 to 3 dimensions, got {dims}")
    return dims + [1] * (3 - len(dims))


class Recording:
    """The launches every prepared LaunchSequence makes while this is open, as specs (kernel,
    grid, block, args, shared_mem) in launch order: what a LaunchReplay (runtime/replay.py)
    is made from. `complete` turns False when some launch bypassed the prepared path."""

    def __init__(self):
        self.specs = []
        self.complete = True

    def __enter__(self):
        global _recording
        if _recording is not None:
            raise RuntimeError("a launch recording is already open")
        _recording = self
        return self

    def __exit__(self, *exc):
        global _recording
        _recording = None


_recording: Recording | None = None


class LaunchSequence:
    """The launches one call of a stage queues, prepared once per key (a token count, say)
    and replayed: each call hands over its launch specs, (kernel, grid, block, args,
    shared_mem), and only arguments that are not the very objects of the previous call are
    rewritten. With prepared=False every spec goes through CuPy's own call instead (what a
    job that wraps the kernels to time them needs)."""

    def __init__(self):
        self.prepared = True
        self._by_key = {}  # key -> [[PreparedLaunch, the args it holds, (kernel, grid, block, shared_mem)]]

    def run(self, key, specs, stream: int | None = None) -> None:
        recording = _recording
        if not self.prepared:
            if recording is not None:
                recording.complete = False
            for kernel, grid, block, args, shared_mem in specs:
                kernel(grid, block, args, shared_mem=shared_mem)
            return
        launches = self._by_key.get(key)
        if launches is None or len(launches) != len(specs) or any(
                entry[2] != (spec[0], spec[1], spec[2], spec[4]) for entry, spec in zip(launches, specs)):
            launches = self._by_key[key] = [
                [PreparedLaunch(*spec), spec[3], (spec[0], spec[1], spec[2], spec[4])] for spec in specs]
        else:
            for entry, spec in zip(launches, specs):
                held, args = entry[1], spec[3]
                if held is not args:
                    for index, (old, new) in enumerate(zip(held, args)):
                        if old is not new and not _same_bytes(old, new):
                            entry[0].set(index, new)
                    entry[1] = args
        if stream is None:
            stream = cupy.cuda.get_current_stream().ptr
        for entry in launches:
            entry[0](stream)
        if recording is not None:
            recording.specs.extend((e[2][0], e[2][1], e[2][2], e[1], e[2][3]) for e in launches)

    def forget(self) -> None:
        """Drop every prepared launch (after the kernels or buffers behind them changed)."""
        self._by_key.clear()
