"""A kernel build's SASS with its scheduling controls decoded, on any machine (no GPU needed):

    python launch/jobs/sass_listing.py gemm_fp8_null [--define EPSERVE_GEMM_FP8_...=V ...]
        [--match 'QGMMA|DEPBAR|SYNCS'] [--from 0x2100 --to 0x2a00] [--nvdisasm PATH]
    python launch/jobs/sass_listing.py probes/fp8_consumer_loop.cu --define EPSERVE_PROBE_LEVEL=3

The first argument is a variant of epserve.runtime.kernels.VARIANTS (built with its defines,
then --define on top) or a source under cuda/. Compiles it as the runtime does (NVRTC,
sm_90a, the cache), disassembles the cubin (`nvdisasm -c -hex`: on the PATH, or `pip install
nvidia-cuda-nvdisasm`) and prints each instruction with the controls ptxas gave it: the stall
cycles after issue, the yield bit, the scoreboards it sets (write / read) and waits on, and
the operand reuse flags (a b c). Then the build's machine-code digest, which
ab_gemm_fp8.py and probe_fp8_consumer_loop.py print too. notes/gemm.md (thirty-eighth session)
reads the FP8 GEMM's k-loop this way.
"""

from __future__ import annotations

import argparse
import re

from epserve.runtime import build, kernels, machine_code


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("build", help="a kernels.VARIANTS name, or a source path under cuda/")
    p.add_argument("--define", action="append", default=[], metavar="NAME=VALUE", help="repeatable")
    p.add_argument("--match", help="only instructions whose text matches this regex")
    p.add_argument("--from", dest="start", type=lambda s: int(s, 0), default=0, help="first address")
    p.add_argument("--to", dest="end", type=lambda s: int(s, 0), default=None, help="last address")
    p.add_argument("--kernel", help="only this kernel (default: all in the module)")
    p.add_argument("--nvdisasm", help="the nvdisasm to run (default: PATH, then the pip wheel)")
    args = p.parse_args()

    if args.build in kernels.VARIANTS:
        source, defines = kernels.VARIANTS[args.build]
    else:
        source, defines = args.build, {}
    extra = dict(d.split("=", 1) for d in args.define)
    if unread := build.unread_defines(source, extra):
        p.error(f"--define {unread}: not read by {source} or the headers it includes")
    art = build.compile_source(source, {**defines, **extra})
    if not (args.nvdisasm or machine_code.find_nvdisasm()):
        p.error("no nvdisasm: put one on the PATH, pass --nvdisasm, or pip install nvidia-cuda-nvdisasm")
    pattern = re.compile(args.match) if args.match else None

    print(f"# {args.build} {' '.join(args.define)}: {art.cubin.name}")
    print(f"# {'kernel':<32} {'addr':>6} stall y wb rb wait   reuse  instruction")
    for ins in machine_code.listing(art.cubin, args.nvdisasm):
        if args.kernel and ins.kernel != args.kernel:
            continue
        if ins.address < args.start or (args.end is not None and ins.address > args.end):
            continue
        if pattern and not pattern.search(ins.text):
            continue
        c = ins.control
        reuse = "".join(op if c.reuse >> i & 1 else "." for i, op in enumerate("abc"))
        wb = "-" if c.write_barrier is None else c.write_barrier
        rb = "-" if c.read_barrier is None else c.read_barrier
        print(f"  {ins.kernel:<32} {ins.address:06x} {c.stall:>5} {c.yield_bit} {wb:>2} {rb:>2} {c.wait_mask:06b} "
              f"{reuse:>6}  {ins.text}")
    print(f"# machine code digest: {machine_code.digest(art.cubin)}")


if __name__ == "__main__":
    main()
