"""What each part of the FP8 GEMM's consumer loop costs the tensor pipe, with no memory
traffic (cuda/probes/fp8_consumer_loop.cu says what each level adds):

    python launch/jobs/probe_fp8_consumer_loop.py [--levels 0 1 2 3 4 5 6 7 8 9] [--k-blocks 4096]
        [--define EPSERVE_...=V]

One GPU, one CTA an SM. Prints, per level, the clock64 cycles a k-block takes (the slowest
warpgroup's mean over the CTAs; 1024 at the full FP8 rate: 2 warpgroups x 2 halves x 4
m64n128k32 wgmmas of 64 cycles each), the tensor utilisation that implies, and the ptxas
facts that explain it: R2UR instructions (a descriptor moved into uniform registers before a
wgmma) and the instruction count of the kernel (where there is an nvdisasm), and a digest of
the build's machine code: two builds (levels, --define) with one digest run the same
instructions; launch/jobs/sass_listing.py lists a level's SASS. notes/gemm.md (twelfth and
thirteenth sessions) has what it measured on an H200."""

from __future__ import annotations

import argparse

import cupy
import numpy as np

from epserve.runtime import build, machine_code
from epserve.runtime.launch import module_int

SOURCE = "probes/fp8_consumer_loop.cu"
KERNEL = "epserve_probe_fp8_consumer_loop"
IDEAL_CYCLES = 1024  # a k-block's MMA at the FP8 rate: 2 x 2 x 4 wgmmas of 64 cycles
LEVELS = {
    0: "the loop's pattern, one fixed stage",
    1: "+ a 3-stage ring's descriptors (low words)",
    2: "+ A scales (shared) and B scales (__ldg)",
    3: "+ full / empty mbarriers, a producer",
    4: "level 3, descriptors rebuilt per wgmma",
    5: "level 3 without the full-barrier wait",
    6: "level 2 + the empty arrivals alone",
    7: "level 3 + a consumer barrier a tile",
    8: "level 7, second warpgroup half a k-block behind",
    9: "level 3, the handshake under the wgmmas",
    10: "level 3, A from registers (RS wgmma)",
}


def sass_counts(cubin) -> tuple[int, int] | None:
    """(R2UR, instructions) of a cubin, where there is an nvdisasm (machine_code.find_nvdisasm)."""
    if machine_code.find_nvdisasm() is None:
        return None
    code = machine_code.listing(cubin)
    return sum("R2UR" in i.text for i in code), len(code)


def run_level(level: int, k_blocks: int, sms: int, tile_k_blocks: int = 16, random_data: bool = False,
              repeat: int = 0, defines: dict | None = None) -> dict:
    art = build.compile_source(SOURCE, {"EPSERVE_PROBE_LEVEL": level, "EPSERVE_PROBE_TILE_KB": tile_k_blocks,
                                        "EPSERVE_PROBE_RANDOM_DATA": int(random_data), **(defines or {})})
    mod = cupy.RawModule(path=str(art.cubin))
    fn = mod.get_function(KERNEL)
    smem = module_int(mod, "epserve_probe_smem_bytes")
    fn.max_dynamic_shared_size_bytes = smem
    cycles = cupy.zeros(2 * sms, cupy.int64)
    sink = cupy.zeros(384, cupy.float32)
    b_scales = cupy.ones(2 * k_blocks, cupy.float32)
    args = (np.int32(k_blocks), b_scales, cycles, sink)
    for _ in range(3):  # the last of three launches, warm
        fn((sms,), (384,), args, shared_mem=smem)
    cupy.cuda.get_current_stream().synchronize()
    wall_ns = float("nan")
    if repeat:  # back to back, as the power cap sees a GEMM: the time and the clock it settles to
        events = [cupy.cuda.Event() for _ in range(repeat + 1)]
        events[0].record()
        for i in range(repeat):
            fn((sms,), (384,), args, shared_mem=smem)
            events[i + 1].record()
        events[-1].synchronize()
        walls = [cupy.cuda.get_elapsed_time(events[i], events[i + 1]) * 1e6 for i in range(repeat)]
        wall_ns = float(np.median(walls[repeat // 2:]))  # the settled half
    per_cta = cycles.get().reshape(sms, 2).max(axis=1)
    per_k_block = float(per_cta.mean()) / k_blocks
    return {"cycles": per_k_block, "utilisation": IDEAL_CYCLES / per_k_block, "sass": sass_counts(art.cubin),
            "code": machine_code.digest(art.cubin),
            "ns": wall_ns / k_blocks, "mhz": float(per_cta.mean()) / wall_ns * 1e3}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--levels", type=int, nargs="+", default=sorted(LEVELS))
    p.add_argument("--k-blocks", type=int, default=4096)
    p.add_argument("--random-data", action="store_true", help="random e4m3 operands instead of values near 1")
    p.add_argument("--repeat", type=int, default=0,
                   help="also launch each level this many times back to back: ns a k-block and the SM clock, "
                        "settled under the power cap (medians of the second half)")
    p.add_argument("--define", action="append", default=[], metavar="NAME=VALUE",
                   help="a compile-time define the probe or a header it includes reads (#ifndef NAME); repeatable")
    p.add_argument("--tile-k-blocks", type=int, nargs="+", default=[16], help="levels 7 and 8: k-blocks between barriers")
    args = p.parse_args()
    defines = dict(d.split("=", 1) for d in args.define)
    if unread := build.unread_defines(SOURCE, defines):
        p.error(f"--define {unread}: not read by {SOURCE} or the headers it includes")
    dev = cupy.cuda.runtime.getDeviceProperties(0)
    sms = dev["multiProcessorCount"]
    data = "random e4m3 operands" if args.random_data else "operands near 1"
    built = ", " + " ".join(args.define) if args.define else ""
    print(f"# FP8 consumer loop, no memory traffic: {dev['name'].decode()}, {sms} CTAs, {args.k_blocks} k-blocks "
          f"each, {data}{built}")
    sustained = f"{'ns/k-block':>11}{'MHz':>6}" if args.repeat else ""
    print(f"{'level':>5}  {'what':<48}{'cycles/k-block':>15}{'tensor util':>12}{sustained}{'R2UR':>6}{'SASS lines':>11}  code")
    for level in args.levels:
        tiled = level in (7, 8)  # the levels with a barrier every tile
        for tile in args.tile_k_blocks if tiled else [16]:
            r = run_level(level, args.k_blocks, sms, tile, args.random_data, args.repeat, defines)
            r2ur, lines = r["sass"] or ("-", "-")
            what = LEVELS[level] + (f" ({tile})" if tiled else "")
            settled = f"{r['ns']:>11.1f}{r['mhz']:>6.0f}" if args.repeat else ""
            print(f"{level:>5}  {what:<48}{r['cycles']:>15.1f}{r['utilisation'] * 100:>11.1f}%{settled}{r2ur:>6}{lines:>11}  {r['code']}")


if __name__ == "__main__":
    main()
