"""Kernel build: CUDA sources + defines -> NVRTC (sm_90a) -> cached cubin -> CuPy RawModule.

NVRTC is driven through cuda-python, so compilation works on a machine with no GPU and no
driver (CI compiles every variant this way). The cache key hashes every file the source
includes (its include closure under ``cuda/``), the options, the NVRTC version and epserve's
version; CuPy's own cache ignores included headers, which would serve stale code after a
header edit. The closure's text is handed to NVRTC from memory, so what is compiled is
exactly what was hashed. Ranks that compile at once each write a temporary file and rename
it into place, so a reader never sees half a cubin.

Includes are written relative to ``cuda/`` (``#include "common/ptx.cuh"``). In a checkout
that is the repository's cuda/; an installed wheel carries a copy as epserve/_cuda.
"""

from __future__ import annotations

import hashlib
import os
import re
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

from epserve import __version__
from epserve.errors import BuildError

# A file only epserve's kernel tree has: beside an installed epserve, ../cuda is
# cuda-python's package, not ours.
_MARKER = "sinks/peer_send_config.cuh"


def find_cuda_root() -> Path:
    """The kernel sources: cuda/ of the checkout epserve runs from, else the copy an
    installed wheel carries (epserve/_cuda, made by setup.py)."""
    package = Path(__file__).resolve().parents[1]  # epserve/, this file being epserve/runtime/build.py
    checkout, installed = package.parent / "cuda", package / "_cuda"
    for root in (checkout, installed):
        if (root / _MARKER).is_file():
            return root
    raise BuildError(f"epserve's kernel sources are missing: neither {checkout} (a checkout) nor {installed} "
                     f"(an installed wheel) holds {_MARKER}; reinstall epserve")


CUDA_ROOT = find_cuda_root()
ARCH = "sm_90a"  # wgmma/setmaxnreg-era Hopper; mma.sync kernels run on it too
_INCLUDE = re.compile(r'^\s*#\s*include\s*"([^"]+)"', re.MULTILINE)


def cache_dir() -> Path:
    """Where cubins live: $EPSERVE_CACHE_DIR, else ~/.cache/epserve."""
    env = os.environ.get("EPSERVE_CACHE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "epserve"


def include_closure(source: str) -> dict[str, str]:
    """Every file `source` (a path under cuda/) pulls in, itself included: name -> text."""
    seen: dict[str, str] = {}
    stack = [source]
    while stack:
        name = stack.pop()
        if name in seen:
            continue
        path = CUDA_ROOT / name
        if not path.is_file():
            raise BuildError(f"{name}: no such file under {CUDA_ROOT} (includes are relative to cuda/)")
        text = path.read_text()
        seen[name] = text
        stack.extend(_INCLUDE.findall(text))
    return seen


def unread_defines(source: str, names) -> list[str]:
    """Those of `names` that neither cuda/`source` nor a header it includes tests (``#ifndef
    NAME`` or ``defined(NAME)``): an experiment's misspelt define would build the default code
    under another name."""
    text = "".join(include_closure(source).values())
    return [n for n in names if f"#ifndef {n}\n" not in text and f"defined({n})" not in text]


def nvrtc_version() -> tuple[int, int]:
    from cuda.bindings import nvrtc

    err, major, minor = nvrtc.nvrtcVersion()
    _check(err, "nvrtcVersion")
    return major, minor


def _check(err, what: str) -> None:
    from cuda.bindings import nvrtc

    if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        raise BuildError(f"{what} failed: {err}")


def _options(defines: dict[str, object], extra: tuple[str, ...]) -> list[str]:
    # ptxas -v puts registers, spills and shared memory in the cached log. --no-cache: NVRTC
    # 12.9+ keeps a cache of its own, and a hit there returns no log at all; ours is keyed
    # by the include closure already.
    # -default-device: every kernel source is device code, and NVRTC before 13.5 takes the
    # operator() of a generic lambda inside a kernel for a host function without it.
    opts = [f"-arch={ARCH}", "-std=c++17", "-default-device", "-lineinfo", "--ptxas-options=-v"]
    if nvrtc_version() >= (12, 9):
        opts.append("--no-cache")
    opts += [f"-D{k}" if v is None else f"-D{k}={v}" for k, v in sorted(defines.items())]
    return opts + list(extra)


@dataclass(frozen=True)
class Artifact:
    """A compiled kernel module on disk."""

    key: str
    cubin: Path
    ptx: Path
    log: str


def compile_source(source: str, defines: dict[str, object] | None = None, extra_options: tuple[str, ...] = ()) -> Artifact:
    """Compile cuda/`source` with `defines` for sm_90a, or take it from the cache.

    Raises BuildError with NVRTC's log when the source does not compile.
    """
    files = include_closure(source)
    opts = _options(defines or {}, tuple(extra_options))
    digest = hashlib.sha256()
    for part in (__version__, ARCH, repr(nvrtc_version()), "\0".join(opts)):
        digest.update(part.encode() + b"\0")
    for name in sorted(files):
        digest.update(name.encode() + b"\0" + files[name].encode() + b"\0")
    key = digest.hexdigest()[:32]
    stem = f"{Path(source).stem}-{key}"
    out = cache_dir()
    cubin, ptx, log = out / f"{stem}.cubin", out / f"{stem}.ptx", out / f"{stem}.log"
    if cubin.is_file() and ptx.is_file():
        return Artifact(key, cubin, ptx, log.read_text() if log.is_file() else "")

    cubin_bytes, ptx_bytes, log_text = _nvrtc_compile(source, files, opts)
    out.mkdir(parents=True, exist_ok=True)
    # ptx and log first: a present cubin means the whole entry is there.
    for path, data in ((ptx, ptx_bytes), (log, log_text.encode()), (cubin, cubin_bytes)):
        _write_atomically(path, data)
    return Artifact(key, cubin, ptx, log_text)


def _nvrtc_compile(source: str, files: dict[str, str], opts: list[str]) -> tuple[bytes, bytes, str]:
    from cuda.bindings import nvrtc

    headers = sorted(n for n in files if n != source)
    err, prog = nvrtc.nvrtcCreateProgram(
        files[source].encode(), source.encode(), len(headers),
        [files[h].encode() for h in headers], [h.encode() for h in headers],
    )
    _check(err, "nvrtcCreateProgram")
    try:
        (err,) = nvrtc.nvrtcCompileProgram(prog, len(opts), [o.encode() for o in opts])
        log_text = _program_log(prog)
        if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            raise BuildError(f"NVRTC could not compile cuda/{source} with {' '.join(opts)}:\n{log_text}")
        err, n = nvrtc.nvrtcGetCUBINSize(prog)
        _check(err, "nvrtcGetCUBINSize")
        cubin = b" " * n
        (err,) = nvrtc.nvrtcGetCUBIN(prog, cubin)
        _check(err, "nvrtcGetCUBIN")
        err, n = nvrtc.nvrtcGetPTXSize(prog)
        _check(err, "nvrtcGetPTXSize")
        ptx = b" " * n
        (err,) = nvrtc.nvrtcGetPTX(prog, ptx)
        _check(err, "nvrtcGetPTX")
        return cubin, ptx.rstrip(b"\0"), log_text
    finally:
        nvrtc.nvrtcDestroyProgram(prog)


def _program_log(prog) -> str:
    from cuda.bindings import nvrtc

    err, n = nvrtc.nvrtcGetProgramLogSize(prog)
    _check(err, "nvrtcGetProgramLogSize")
    buf = b" " * n
    (err,) = nvrtc.nvrtcGetProgramLog(prog, buf)
    _check(err, "nvrtcGetProgramLog")
    return buf.rstrip(b"\0").decode(errors="replace")


def _write_atomically(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


_modules: dict[tuple[str, int], object] = {}
_modules_lock = threading.Lock()


def load_module(source: str, defines: dict[str, object] | None = None, extra_options: tuple[str, ...] = ()):
    """compile_source, then load the cubin on the current device as a cupy.RawModule (cached)."""
    import cupy

    art = compile_source(source, defines, extra_options)
    device = cupy.cuda.runtime.getDevice()
    with _modules_lock:
        mod = _modules.get((art.key, device))
        if mod is None:
            mod = cupy.RawModule(path=str(art.cubin))
            _modules[(art.key, device)] = mod
        return mod
