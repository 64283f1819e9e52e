"""A recorded call's launches, replayed with new inputs: the host's side of a repeated call
reduced to rewriting the pointers of the arrays that change and launching.

A call of a stage builds launch specs in Python (argument wrappers, kernel lookups, cached
tensor maps) before its prepared launches run, about 60 us of host time per forward at
decode shapes. Once the launches of a call are known (runtime.launch.Recording), a call with
the same shape and the same weights makes the same launches but for the per-call arrays'
addresses. A LaunchReplay holds its own prepared launches (not the LaunchSequences', which
later calls rewrite) and the argument slots where each per-call array goes.

It refuses a recording (LaunchReplay.of returns None) that it could replay wrong: one where
a per-call array's address sits anywhere but in an argument that is that very array (inside
a by-value struct or tensor map, or as a view into it), since rewriting the slots would not
reach it."""

from __future__ import annotations

import ctypes
import functools

import numpy as np
from cupy_backends.cuda.api import runtime as _runtime

from epserve.runtime.launch import PreparedLaunch, Recording


class LaunchReplay:
    def __init__(self, launches: list, slots: dict, pointers: dict):
        self._launches = launches  # PreparedLaunch, in the recorded order
        self._slots = slots        # name -> [(launch, argument index)]
        self._pointers = pointers  # name -> the address the slots hold now
        # The launches as one CUDA graph, made at the first replay: one graph launch and a
        # node update per launch whose arrays changed cost less host time than the launches.
        # None until made, False where the driver refused it (the launches are replayed).
        self._graph = None
        self._stale = set()  # launches rewritten since the graph's nodes were last updated
        self.graph_launches = 0

    @classmethod
    def of(cls, recording: Recording, inputs: dict) -> LaunchReplay | None:
        """The replay of `recording`, whose per-call arrays were `inputs` (name -> CuPy array),
        or None when it cannot be replayed safely."""
        if not recording.complete or not recording.specs:
            return None
        ranges = [(a.data.ptr, a.data.ptr + a.nbytes) for a in inputs.values() if a.nbytes]
        slots = {name: [] for name in inputs}
        launches = []
        for kernel, grid, block, args, shared_mem in recording.specs:
            launch = PreparedLaunch(kernel, grid, block, args, shared_mem)
            sizes = _param_sizes(launch._function)
            for index, arg in enumerate(args):
                name = next((n for n, a in inputs.items() if arg is a), None)
                if name is not None:
                    slots[name].append((launch, index))
                elif _reaches(arg, ranges, sizes[index] if sizes and index < len(sizes) else None):
                    return None
            launches.append(launch)
        return cls(launches, slots, {name: a.data.ptr for name, a in inputs.items()})

    def __call__(self, inputs: dict, stream: int) -> None:
        """The recorded launches on `stream`, with `inputs` (the same names, shapes and dtypes
        as recorded) in place of the recorded arrays."""
        for name, a in inputs.items():
            ptr = a.data.ptr
            if ptr != self._pointers[name]:
                for launch, index in self._slots[name]:
                    launch.set(index, a)
                    self._stale.add(launch)
                self._pointers[name] = ptr
        if self._graph is None:
            self._graph = KernelGraph.of(self._launches)
        # A stream being captured (EPService.capture) takes the launches themselves; the graph's
        # nodes of the launches rewritten meanwhile are brought up to date at its next launch.
        if self._graph and not _runtime.streamIsCapturing(stream):
            self._graph.launch(self._stale, stream)
            self._stale.clear()
            self.graph_launches += 1
            return
        for launch in self._launches:
            launch(stream)


class KernelGraph:
    """Prepared launches as a chain of kernel nodes in one CUDA graph, built through the
    driver (cuda.bindings) from the launches' own argument blocks. A launch whose arguments
    were rewritten (PreparedLaunch.set) is passed to `launch`, which updates its node in the
    executable graph (the driver copies the arguments then, as it did when the node was
    made) before launching the graph. Updates reach only later launches of the graph, never
    one already queued."""

    def __init__(self, cu, graph, graph_exec, nodes: dict):
        self._cu, self._graph, self._exec, self._nodes = cu, graph, graph_exec, nodes
        self._handle = int(graph_exec)

    @classmethod
    def of(cls, launches: list) -> KernelGraph | bool:
        """The graph of `launches`, or False where the driver cannot make it."""
        try:
            from cuda.bindings import driver as cu

            err, graph = cu.cuGraphCreate(0)
        except Exception:  # no cuda-python, or no driver behind it
            return False
        if err != cu.CUresult.CUDA_SUCCESS:
            return False
        nodes, last = {}, None
        for launch in launches:
            params = cu.CUDA_KERNEL_NODE_PARAMS()
            params.func = cu.CUfunction(launch._function)
            (params.gridDimX, params.gridDimY, params.gridDimZ,
             params.blockDimX, params.blockDimY, params.blockDimZ) = launch._dims
            params.sharedMemBytes = launch._shared_mem
            params.kernelParams = launch._params_address
            deps = [last] if last is not None else None
            err, node = cu.cuGraphAddKernelNode(graph, deps, len(deps or ()), params)
            if err != cu.CUresult.CUDA_SUCCESS:
                cu.cuGraphDestroy(graph)
                return False
            nodes[id(launch)] = (node, params, launch)
            last = node
        err, graph_exec = cu.cuGraphInstantiate(graph, 0)
        if err != cu.CUresult.CUDA_SUCCESS:
            cu.cuGraphDestroy(graph)
            return False
        return cls(cu, graph, graph_exec, nodes)

    def launch(self, changed, stream: int) -> None:
        """Update the nodes of the `changed` launches (a set), then launch the graph on `stream`."""
        cu = self._cu
        for launch in changed:
            node, params, _ = self._nodes[id(launch)]
            err, = cu.cuGraphExecKernelNodeSetParams(self._exec, node, params)
            if err != cu.CUresult.CUDA_SUCCESS:
                raise RuntimeError(f"updating a kernel node of a replayed forward failed: {err}")
        _runtime.graphLaunch(self._handle, stream)

    def __del__(self):
        try:
            self._cu.cuGraphExecDestroy(self._exec)
            self._cu.cuGraphDestroy(self._graph)
        except Exception:  # interpreter shutdown: the driver may be gone already
            pass


def _reaches(arg, ranges, size: int | None) -> bool:
    """Whether argument `arg` holds an address inside one of `ranges` (or may: a by-value
    argument whose bytes cannot be read counts as one that does)."""
    if arg is None:
        return False
    data = getattr(arg, "data", None)
    if hasattr(data, "ptr"):  # a CuPy array: a view of a per-call array is not that array
        return any(lo <= data.ptr < hi for lo, hi in ranges)
    if isinstance(arg, (np.ndarray, np.generic)):
        raw = np.asarray(arg).tobytes()
    elif hasattr(arg, "ptr") and size is not None:  # launch_arg's wrapper: `size` bytes at ptr
        raw = ctypes.string_at(arg.ptr, size)
    else:
        return True
    words = np.frombuffer(raw[:len(raw) // 8 * 8], np.uint64)
    return any(bool(((words >= lo) & (words < hi)).any()) for lo, hi in ranges)


@functools.lru_cache(maxsize=None)
def _param_sizes(function: int) -> tuple | None:
    """The byte size of each parameter of a kernel (the driver's cuFuncGetParamInfo), or None
    where the driver cannot say."""
    try:
        from cuda.bindings import driver as cu
    except ImportError:
        return None
    sizes, fn = [], cu.CUfunction(function)
    for index in range(256):
        err, _, size = cu.cuFuncGetParamInfo(fn, index)
        if err != cu.CUresult.CUDA_SUCCESS:
            break
        sizes.append(int(size))
    return tuple(sizes) if sizes else None
