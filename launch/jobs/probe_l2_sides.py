"""Which L2 partition each SM is next to, by timing (cuda/probes/l2_sides.cu says how):

    python launch/jobs/probe_l2_sides.py [--lines 128] [--reps 3]

One GPU. Prints each SM's cycles a load (one line per SM, rep by rep), the split into a fast
group (the reference block's side) and a slow one at the widest gap, how far the reps agree,
and the side of every SM in %smid order, then whether the FP8 GEMMs would use it
(epserve/runtime/l2_sides.py measures it the same way at their first launch). notes/gemm.md
(fifteenth and twenty-second sessions) has what it found on an H200 and what ordering the FP8
GEMM's tiles by side did."""

from __future__ import annotations

import argparse

import cupy
import numpy as np

from epserve.runtime.l2_sides import ProbeError, agreement, from_reps, one_rep, probe_function, sides_of


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lines", type=int, default=128, help="128-byte lines in each block's region")
    p.add_argument("--reps", type=int, default=3)
    args = p.parse_args()
    dev = cupy.cuda.runtime.getDeviceProperties(0)
    sms = dev["multiProcessorCount"]
    fn = probe_function()
    rng = np.random.default_rng(0)
    print(f"# L2 sides: {dev['name'].decode()}, {sms} SMs, {args.lines} lines a region, {args.reps} reps")
    try:
        reps = [one_rep(fn, rng, sms, args.lines) for _ in range(args.reps)]
    except ProbeError as e:
        raise SystemExit(f"probe_l2_sides: {e}") from None
    print(f"{'smid':>5}" + "".join(f"{'rep ' + str(k) + ' cycles/load':>20}" for k in range(args.reps)))
    for sm in range(sms):
        print(f"{sm:>5}" + "".join(f"{r[1].get(sm, float('nan')):>20.1f}" for r in reps))
    first, gap = sides_of(*reps[0])
    print(f"# rep 0: reference SM {reps[0][0]}; widest gap {gap:.1f} cycles a load; "
          f"{sum(1 for s in first.values() if s == 0)} SMs on its side, {sum(first.values())} on the other")
    for k, (ref, per_sm) in enumerate(reps[1:], 1):
        sides, gap = sides_of(ref, per_sm)
        print(f"# rep {k}: reference SM {ref}; widest gap {gap:.1f}; agrees with rep 0 on "
              f"{agreement(first, ref, sides):.1%} of the SMs")
    print("# side by smid: " + "".join(str(first[sm]) for sm in range(sms)))
    table = from_reps(reps, sms)
    print("# the FP8 GEMM's table (epserve/runtime/l2_sides.py): "
          + (f"all zeros ({table.why_not})" if table.why_not else "rep 0's sides"))


if __name__ == "__main__":
    main()
