"""Is there a GPU epserve can run on here? Used by the tests (to skip, saying why), by `make run`
and by the GPU commands (to stop with one clear line before any rank starts).

    python -m epserve.runtime.gpu_probe     # exit 0 if usable, else print why and exit 1
"""

import functools
import sys

REQUIRED_COMPUTE_CAPABILITY = (9, 0)


@functools.lru_cache(maxsize=None)
def gpu_unusable_reason():
    """None when a Hopper GPU is usable here, else a short sentence saying why not."""
    try:
        import cupy
    except Exception as exc:  # ImportError, or a CUDA library that failed to load
        return f"cannot import cupy ({type(exc).__name__}: {exc})"
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:  # no driver, driver too old, no device
        if not _driver_loadable():
            return "no NVIDIA driver (libcuda.so.1 cannot be loaded)"
        return f"CUDA runtime reports no device ({type(exc).__name__}: {exc})"
    if count < 1:
        return "CUDA runtime reports 0 devices"
    for index in range(count):
        try:
            props = cupy.cuda.runtime.getDeviceProperties(index)
        except Exception as exc:
            return f"cannot query device {index} ({type(exc).__name__}: {exc})"
        capability = (int(props["major"]), int(props["minor"]))
        if capability != REQUIRED_COMPUTE_CAPABILITY:
            name = props.get("name", b"?")
            name = name.decode(errors="replace") if isinstance(name, bytes) else str(name)
            want = "%d.%d" % REQUIRED_COMPUTE_CAPABILITY
            return (
                f"device {index} ({name}) has compute capability {capability[0]}.{capability[1]}, "
                f"the sm_90a kernels need {want} (Hopper)"
            )
    return None


def _driver_loadable():
    import ctypes

    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    return True


def gpu_count() -> int:
    """CUDA devices this process sees (0 when there is no driver or no device)."""
    if gpu_unusable_reason() is not None:
        return 0
    import cupy

    return cupy.cuda.runtime.getDeviceCount()


def stopped_without_gpu(program: str = "epserve") -> bool:
    """False when a Hopper GPU is usable here; else print one line to stderr saying `program`
    needs one and why there is none (instead of a traceback from deep inside), and return True."""
    reason = gpu_unusable_reason()
    if reason is None:
        return False
    print(f"{program} needs an NVIDIA Hopper GPU (compute capability 9.0) and none is usable here: {reason}.",
          file=sys.stderr)
    return True


def main() -> int:
    return 1 if stopped_without_gpu() else 0


if __name__ == "__main__":
    sys.exit(main())
