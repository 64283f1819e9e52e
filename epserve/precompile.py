"""Compile every kernel variant epserve ships for sm_90a, into the kernel cache.

    python -m epserve.precompile [--cache-dir DIR]

Needs NVRTC (installed with epserve), not a GPU: run it at image build time so the first
forward on every rank finds its kernels compiled, or to check that an installation can build
them. Prints one line per variant and the directory the sources came from; exits 1 if any
variant does not compile.
"""

from __future__ import annotations

import argparse
import os
import sys


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m epserve.precompile", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cache-dir", help="where to put the cubins (default: $EPSERVE_CACHE_DIR, else ~/.cache/epserve)")
    args = p.parse_args(argv)
    if args.cache_dir:
        os.environ["EPSERVE_CACHE_DIR"] = args.cache_dir

    from epserve.errors import BuildError
    from epserve.runtime import build, kernels

    print(f"# kernel sources: {build.CUDA_ROOT}")
    print(f"# cache: {build.cache_dir()}")
    failed = []
    for name in sorted(kernels.VARIANTS):
        source, defines = kernels.VARIANTS[name]
        try:
            art = build.compile_source(source, defines)
        except BuildError as exc:
            failed.append(name)
            print(f"{name}: FAILED: {exc}")
            continue
        target = f".target {build.ARCH}" in art.ptx.read_text()
        if not target:
            failed.append(name)
        print(f"{name}: {source}, {art.cubin.stat().st_size} bytes of cubin"
              f"{'' if target else f', WRONG: the PTX is not for {build.ARCH}'}")
    print(f"# {len(kernels.VARIANTS) - len(failed)} of {len(kernels.VARIANTS)} variants compiled for {build.ARCH}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
