"""Caller arrays -> CuPy arrays, without copies, or a clear ConfigError.

Accepted: CuPy arrays, objects with `__cuda_array_interface__` (any framework), and objects
with `__dlpack__`. bf16 arrives as ml_dtypes.bfloat16, or as 2-byte storage: `uint16`, or
the `<V2` typestr that `__cuda_array_interface__` gives bf16 (the protocol has no bf16 code).
Arrays must be C-contiguous, on the service's GPU, of the expected dtype and shape; nothing
is converted or copied silently.
"""

from __future__ import annotations

import cupy
import ml_dtypes
import numpy as np

from epserve.errors import ConfigError

BF16 = np.dtype(ml_dtypes.bfloat16)


def _from_cuda_array_interface(obj) -> cupy.ndarray:
    cai = obj.__cuda_array_interface__
    shape = tuple(cai["shape"])
    typestr = cai["typestr"]
    dtype = np.dtype("u2") if typestr in ("<V2", "|V2") else np.dtype(typestr)
    if cai.get("mask") is not None:
        raise ConfigError("masked __cuda_array_interface__ arrays are not supported")
    strides = cai.get("strides")
    ptr = cai["data"][0]
    size = int(np.prod(shape)) * dtype.itemsize
    mem = cupy.cuda.UnownedMemory(ptr, size, obj, device_id=cupy.cuda.runtime.getDevice())
    return cupy.ndarray(shape, dtype, cupy.cuda.MemoryPointer(mem, 0), strides=strides)


def as_cupy(obj, name: str) -> cupy.ndarray:
    """A CuPy view of `obj` (no copy)."""
    if isinstance(obj, cupy.ndarray):
        return obj
    if hasattr(obj, "__cuda_array_interface__"):
        return _from_cuda_array_interface(obj)
    if hasattr(obj, "__dlpack__"):
        try:
            return cupy.from_dlpack(obj)
        except Exception as exc:
            raise ConfigError(f"{name}: cannot take it through DLPack: {exc}") from exc
    raise ConfigError(f"{name} must be a GPU array (CuPy, __cuda_array_interface__ or __dlpack__), "
                      f"got {type(obj).__name__}")


_DTYPES = {"bf16": BF16, "int32": np.dtype(np.int32), "float32": np.dtype(np.float32)}
_U16 = np.dtype(np.uint16)


def _device_of(a: cupy.ndarray) -> int:
    if a.size == 0:
        return cupy.cuda.runtime.getDevice()
    mem = a.data.mem
    if isinstance(mem, cupy.cuda.UnownedMemory):
        # Someone else's memory: the device it was wrapped with may not be where it lives.
        return cupy.cuda.runtime.pointerGetAttributes(a.data.ptr).device
    return mem.device_id  # CuPy's own allocation: made on this device


def checked_array(obj, name: str, dtype: str, shape: tuple) -> cupy.ndarray:
    """`obj` as a contiguous CuPy array of `dtype` ("bf16", "int32" or "float32") and `shape`
    (None in a dimension accepts any size) on the current device; else ConfigError.
    Called for every input of every call, so its common case (a CuPy array that passes) is kept short."""
    if obj is None:
        raise ConfigError(f"{name} is required")
    a = obj if type(obj) is cupy.ndarray else as_cupy(obj, name)
    want = _DTYPES.get(dtype)
    if want is None:
        want = np.dtype(dtype)
    if a.dtype != want:
        if want == BF16 and a.dtype == _U16:
            a = a.view(BF16)
        elif want == BF16:
            raise ConfigError(f"{name} must be bf16 (ml_dtypes.bfloat16, or uint16/<V2 storage), got {a.dtype}")
        else:
            raise ConfigError(f"{name} must be {dtype}, got {a.dtype}")
    got = a.shape
    bad = len(got) != len(shape)
    if not bad:
        for g, w in zip(got, shape):
            if w is not None and g != w:
                bad = True
                break
    if bad:
        want_shape = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
        raise ConfigError(f"{name} must have shape {want_shape}, got {list(got)}")
    if not a._c_contiguous:  # a.flags builds an object per call
        raise ConfigError(f"{name} must be C-contiguous (strides {a.strides} for shape {a.shape})")
    here = cupy.cuda.runtime.getDevice()
    where = _device_of(a)
    if where != here:
        raise ConfigError(f"{name} is on GPU {where}, but this rank's service runs on GPU {here}")
    return a
