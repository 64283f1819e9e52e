"""Which L2 partition each SM is next to, by timing (cuda/probes/l2_sides.cu says how):

    python launch/jobs/probe_l2_sides.py [--lines 128] [--reps 3]

One GPU. Prints each SM's cycles a load (one line per SM, rep by rep), the split into a fast
group (the reference block's side) and a slow one at the widest gap, how far the reps agree,
and the side of every SM in %smid order. notes/gemm.md (fifteenth session) has what it found
on an H200 and what ordering the FP8 GEMM's tiles by side did."""

from __future__ import annotations

import argparse

import cupy
import numpy as np

from epserve.runtime import build

SOURCE = "probes/l2_sides.cu"
KERNEL = "epserve_probe_l2_sides"
SMEM = 150 * 1024  # more than half an SM's shared memory: one block an SM


def chase_regions(rng, blocks: int, lines: int) -> np.ndarray:
    """[blocks, lines, 32] words: in each region, word 0 of line j is the next line of a random
    cycle through all lines."""
    chase = np.zeros((blocks, lines, 32), np.uint32)
    for b in range(blocks):
        order = rng.permutation(lines)
        nxt = np.empty(lines, np.uint32)
        nxt[order] = np.roll(order, -1)
        chase[b, :, 0] = nxt
    return chase


def one_rep(fn, rng, sms: int, lines: int) -> tuple[int, dict]:
    """(the reference SM, {smid: cycles a load}) of one launch, over fresh regions."""
    chase = cupy.asarray(chase_regions(rng, sms, lines))
    flag = cupy.zeros(1, np.int32)
    smid = cupy.full(sms, -1, np.int32)
    cycles = cupy.zeros(sms, np.int64)
    sink = cupy.zeros(sms, np.uint32)
    fn((sms,), (256,), (chase, np.int32(lines), flag, smid, cycles, sink), shared_mem=SMEM)
    cupy.cuda.get_current_stream().synchronize()
    s, c = smid.get(), cycles.get()
    if (c[1:] < 0).any() or len(set(s.tolist())) != sms:
        raise SystemExit("probe_l2_sides: the blocks were not one an SM, all resident at once; is the GPU shared?")
    return int(s[0]), {int(s[b]): c[b] / lines for b in range(1, sms)}


def widest_gap(values: np.ndarray) -> tuple[float, float]:
    """(threshold, gap): the midpoint and width of the widest gap between sorted values."""
    v = np.sort(values)
    i = int(np.argmax(np.diff(v)))
    return (v[i] + v[i + 1]) / 2, v[i + 1] - v[i]


def sides_of(ref: int, per_sm: dict) -> tuple[dict, float]:
    """{smid: 0 on the reference's side, 1 on the other}, and the gap in cycles a load."""
    threshold, gap = widest_gap(np.array(list(per_sm.values())))
    sides = {sm: int(c > threshold) for sm, c in per_sm.items()}
    sides[ref] = 0
    return sides, gap


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lines", type=int, default=128, help="128-byte lines in each block's region")
    p.add_argument("--reps", type=int, default=3)
    args = p.parse_args()
    dev = cupy.cuda.runtime.getDeviceProperties(0)
    sms = dev["multiProcessorCount"]
    art = build.compile_source(SOURCE, {})
    fn = cupy.RawModule(path=str(art.cubin)).get_function(KERNEL)
    fn.max_dynamic_shared_size_bytes = SMEM
    rng = np.random.default_rng(0)
    print(f"# L2 sides: {dev['name'].decode()}, {sms} SMs, {args.lines} lines a region, {args.reps} reps")
    reps = [one_rep(fn, rng, sms, args.lines) for _ in range(args.reps)]
    print(f"{'smid':>5}" + "".join(f"{'rep ' + str(k) + ' cycles/load':>20}" for k in range(args.reps)))
    for sm in range(sms):
        print(f"{sm:>5}" + "".join(f"{r[1].get(sm, float('nan')):>20.1f}" for r in reps))
    first, gap = sides_of(*reps[0])
    print(f"# rep 0: reference SM {reps[0][0]}; widest gap {gap:.1f} cycles a load; "
          f"{sum(1 for s in first.values() if s == 0)} SMs on its side, {sum(first.values())} on the other")
    for k, (ref, per_sm) in enumerate(reps[1:], 1):
        sides, gap = sides_of(ref, per_sm)
        flip = first[ref]  # this rep's reference may sit on either side of rep 0's
        agree = sum((sides[sm] ^ flip) == first[sm] for sm in sides)
        print(f"# rep {k}: reference SM {ref}; widest gap {gap:.1f}; agrees with rep 0 on {agree} of {len(sides)} SMs")
    print("# side by smid: " + "".join(str(first[sm]) for sm in range(sms)))


if __name__ == "__main__":
    main()
