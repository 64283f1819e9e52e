"""Which half of the L2 each SM sits next to, measured on the GPU in hand, for the FP8 GEMM's
tile order by side (cuda/gemm/grouped_gemm_fp8.cu, EPSERVE_GEMM_FP8_L2_SIDES).

Hopper's L2 is two partitions joined by a fabric. An SM reads through its near partition,
and lines homed in the far one cross the fabric once for each side whose SMs read them. The
FP8 GEMMs' busiest L2 unit is that fabric. Given each SM's side, the GEMM hands the front of
its tile order to one side's CTAs and the back to the other's, so each expert's weights are
mostly read on one side. That cut fabric traffic by a third, and took 0.9-2.7% off GEMM 1
and 0.4-1.7% off GEMM 2 when timed as the bench times them (notes/gemm.md, fifteenth and twenty-second
sessions).

The side of an SM is not a function of its %smid that holds across parts: the table differs
from die to die, so it is measured (cuda/probes/l2_sides.cu says how). The table only orders
tiles, and every table gives the GEMM the same bits. Where the measurement cannot be trusted
(reps that disagree, a GPU shared with another process, SMs missing) the table is all zeros:
every CTA then takes tiles from the front, the order before this module existed.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

SOURCE = "probes/l2_sides.cu"
KERNEL = "epserve_probe_l2_sides"
SMEM = 150 * 1024  # more than half an SM's shared memory: one block an SM
TABLE_ENTRIES = 256  # the GEMM's table: a side per %smid & 255
TABLE_SYMBOL = "epserve_gemm_sm_side"
MIN_AGREEMENT = 0.95  # of the SMs, between every rep and the first


class ProbeError(RuntimeError):
    """A probe launch whose result does not say which side each SM is on."""


@dataclass(frozen=True)
class Sides:
    table: np.ndarray  # uint8 [TABLE_ENTRIES]: each SM's side by %smid; all zeros where not measured
    gap: float = 0.0  # cycles a load between the two groups (rep 0)
    agreement: float = 0.0  # the smallest share of SMs on which a later rep agreed with rep 0
    why_not: str | None = None  # why the table is all zeros, if it is

    @property
    def counts(self) -> tuple[int, int]:
        return int((self.table == 0).sum()), int((self.table == 1).sum())


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


def probe_function():
    """The probe kernel on the current device, set up for one block an SM."""
    from epserve.runtime import kernels

    fn = kernels.module("l2_sides_probe").get_function(KERNEL)
    fn.max_dynamic_shared_size_bytes = SMEM
    return fn


def one_rep(fn, rng, sms: int, lines: int) -> tuple[int, dict]:
    """(the reference SM, {smid: cycles a load}) of one launch over fresh regions; ProbeError
    unless the blocks ran one an SM, on every SM."""
    import cupy

    chase = cupy.asarray(chase_regions(rng, sms, lines))
    flag = cupy.zeros(1, np.int32)
    smid = cupy.full(sms, -1, np.int32)
    cycles = cupy.zeros(sms, np.int64)
    sink = cupy.zeros(sms, np.uint32)
    fn((sms,), (256,), (chase, np.int32(lines), flag, smid, cycles, sink), shared_mem=SMEM)
    cupy.cuda.get_current_stream().synchronize()
    s, c = smid.get(), cycles.get()
    if (c[1:] < 0).any() or len(set(s.tolist())) != sms:
        raise ProbeError("the blocks were not one an SM, all resident at once (is the GPU shared?)")
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


def agreement(first: dict, ref: int, sides: dict) -> float:
    """The share of SMs on which a later rep (reference `ref`, which may sit on either side of
    rep 0's) puts each SM where rep 0 did."""
    flip = first.get(ref, 0)
    return sum((sides[sm] ^ flip) == first.get(sm) for sm in sides) / max(1, len(sides))


def from_reps(reps: list, sms: int) -> Sides:
    """The table from reps of one_rep: rep 0's sides, or all zeros (with the reason) where the
    reps disagree or do not split the SMs in two."""
    zeros = np.zeros(TABLE_ENTRIES, np.uint8)
    first, gap = sides_of(*reps[0])
    agree = min([agreement(first, ref, sides_of(ref, per_sm)[0]) for ref, per_sm in reps[1:]], default=1.0)
    table = zeros.copy()
    for sm, side in first.items():
        if 0 <= sm < TABLE_ENTRIES:
            table[sm] = side
    ones = int(table.sum())
    if agree < MIN_AGREEMENT:
        return Sides(zeros, gap, agree, f"the reps agree on {agree:.0%} of the SMs")
    if not sms // 4 <= ones <= sms - sms // 4:
        return Sides(zeros, gap, agree, f"{ones} of {sms} SMs on the far side: not two halves")
    return Sides(table, gap, agree)


def measure(reps: int = 3, lines: int = 128, seed: int = 0) -> Sides:
    """Each SM's side on the current device, by `reps` launches of the probe."""
    import cupy

    sms = cupy.cuda.Device().attributes["MultiProcessorCount"]
    try:
        fn = probe_function()
        rng = np.random.default_rng(seed)
        return from_reps([one_rep(fn, rng, sms, lines) for _ in range(reps)], sms)
    except ProbeError as e:
        return Sides(np.zeros(TABLE_ENTRIES, np.uint8), why_not=str(e))


@functools.lru_cache(maxsize=None)
def sides(device: int) -> Sides:
    """The measured sides of `device`, once per process."""
    import cupy

    with cupy.cuda.Device(device):
        return measure()


def write_table(module, device: int) -> None:
    """Writes `device`'s side table into a loaded FP8 GEMM module (one built with
    EPSERVE_GEMM_FP8_L2_SIDES), where its CTAs read it."""
    table = np.ascontiguousarray(sides(device).table)
    module.get_global(TABLE_SYMBOL).copy_from_host(table.ctypes.data, table.nbytes)
