"""The expert GEMMs as a serving layer runs them: back to back, long enough for the GPU to
settle at its power limit, with the power, clock and throttle reasons of each block:

    python launch/jobs/time_gemm_sustained.py [--preset dsv3-prefill] [--ranks 2] [--routing balanced]
        [--launches 150] [--rounds 4] [--knobs split-unzeroed ...] [--bf16] [--dense 8192]

One GPU, rank 0's rows per expert when `--ranks` ranks route the preset's tokens (as
launch/jobs/time_gemm.py and time_gemm_fp8.py). Each build of FP8 GEMM 1 (+ SwiGLU + act
quantization) and FP8 GEMM 2 (null sink) runs in blocks of `--launches` launches; a block's
time is the median of its last two thirds (the first third is the clock settling after the
previous block). Blocks alternate between builds, in reverse order every other round (A B B A
...), so a drift over the job falls on every build alike; a row gives each round's block and
their median. `--knobs` adds experimental builds (epserve.ffn.gemm_fp8.KNOBS), each checked
element by element against the shipped build (#wrong: elements that differ in any bit);
`--bf16` adds the bf16 wgmma GEMMs on the same rows, `--bf16-knobs` their experimental builds
(checked against the shipped bf16 build the same way). `--dense N` adds a dense FP8 GEMM of
N^3, ours and cuBLASLt's, timed the same way: what the part sustains at its power limit on the
problem a library is tuned for.

Why blocks: an H200 running these GEMMs sits at its 700 W limit with the SM clock near
1.4 GHz, and the clock follows power averaged over much longer than one launch. Builds timed
launch by launch in turn share one clock, which hides what a build saves or costs in power
(notes/gemm.md, fifteenth and sixteenth sessions). The W / MHz / capped columns are the
medians of nvidia-smi's samples during the blocks' settled part, and the share of them in
which the software power cap held the clock, with the count of samples (nvidia-smi samples every
50 ms; the power is its instant reading where the driver has one, else `power.draw`, an
average over about a second, which a short block reads mostly from the block before it).
"""

from __future__ import annotations

import argparse

import cupy
import numpy as np
from time_gemm import rows_per_expert  # launch/jobs/time_gemm.py
from time_gemm_fp8 import DenseFp8  # launch/jobs/time_gemm_fp8.py

from epserve.arrays import BF16
from epserve.bench import arithmetic, power, presets
from epserve.bench.wrong import bitwise_wrong
from epserve.check.fp8_reference import scale_ld
from epserve.ffn import fp8, gemm, gemm_fp8
from epserve.runtime import kernels

# The bf16 wgmma GEMM's experimental builds (cuda/gemm/grouped_gemm_wgmma.cu's knobs; the split
# tails measured in the sixteenth session are in commit 9b27bd2's tree)
BF16_KNOBS = {"swap-tails": {"EPSERVE_GEMM_SWAP_TAILS": 1}, "cta-pairs": {"EPSERVE_GEMM_CLUSTER": 2}}


def settled_ms(samples: list) -> float:
    """A block's time: the median of its launches after the first third."""
    return float(np.median(samples[len(samples) // 3:]))


def block_order(names: list, rnd: int) -> list:
    """The builds' order in round `rnd`: forward, then backward (A B, B A, A B, ...)."""
    return list(names) if rnd % 2 == 0 else list(reversed(names))


def run_block(fn, launches: int) -> list:
    """CUDA-event times (ms) of `launches` back-to-back launches of fn."""
    events = [cupy.cuda.Event() for _ in range(launches + 1)]
    for i in range(launches):
        events[i].record()
        fn()
    events[-1].record()
    events[-1].synchronize()
    return [cupy.cuda.get_elapsed_time(events[i], events[i + 1]) for i in range(launches)]


def time_blocks(runs: dict, launches: int, rounds: int, log: power.PowerLog) -> dict:
    """name -> (its block times in ms, one a round, in round order; the settled part of each
    block as (start, stop) on the power log's clock)."""
    names = list(runs)
    for fn in runs.values():
        fn()
    run_block(runs[names[0]], launches)  # the clock settles before the first measured block
    times = {n: [] for n in names}
    spans = {n: [] for n in names}
    for rnd in range(rounds):
        for n in block_order(names, rnd):
            start = log.now()
            times[n].append(settled_ms(run_block(runs[n], launches)))
            stop = log.now()
            spans[n].append((start + (stop - start) / 3, stop))
    return {n: (times[n], spans[n]) for n in names}


def wrong(outs: tuple, refs: tuple) -> int:
    """Elements of a build's outputs that differ from the reference build's in any bit."""
    return sum(bitwise_wrong(o, r) for o, r in zip(outs, refs))


def holding(run, specs, *operands):
    """The launch run(specs), holding `operands`: a GEMM's tensor maps hold only their arrays'
    addresses, so operands dropped when a builder returns go back to CuPy's pool, and the next
    allocation (another build's output, a temporary copy) takes their memory while the launches
    still read it. Until the twenty-fifth session the builders here did drop them (notes/gemm.md)."""
    def launch():
        run(specs)

    launch.operands = operands
    return launch


def fp8_builds(base: str, knobs: list) -> list:
    """(row name, variant) of the shipped build of `base` and of each knob build."""
    return [("FP8, shipped", base)] + [(f"FP8, {k}", gemm_fp8.register_knob(base, k)) for k in knobs]


def bf16_builds(base: str, knobs: list) -> list:
    """(row name, variant) of the bf16 build `base` and of each of BF16_KNOBS given, registered
    in kernels.VARIANTS."""
    builds = [("bf16 wgmma", base)]
    for k in knobs:
        source, defines = kernels.VARIANTS[base]
        kernels.VARIANTS[f"{base}+{k}"] = (source, {**defines, **BF16_KNOBS[k]})
        builds.append((f"bf16 wgmma, {k}", f"{base}+{k}"))
    return builds


def operands(rs, offsets_host, K):
    """offsets on the device, and fresh random A [M, K] rows in bf16 and quantized."""
    A = rs.standard_normal((int(offsets_host[-1]), K), dtype=np.float32).astype(BF16)
    return cupy.asarray(offsets_host), A, fp8.quantize_rows(A)


def gemm1_runs(rs, offsets_host, weights, H, I, knobs, bf16_w13, bf16_knobs):
    """name -> (launch, output, the name of the build it must equal) for GEMM 1's builds;
    outputs poisoned before the first launch."""
    E, M = weights.w13.shape[0], int(offsets_host[-1])
    offsets, A, (a_q, a_s) = operands(rs, offsets_host, H)
    runs = {}
    for name, variant in fp8_builds("gemm1_fp8_swiglu", knobs):
        out = (cupy.full((M, I), 0x7F, np.uint8), cupy.full((I // 128, scale_ld(M)), np.nan, np.float32))
        specs = gemm_fp8._specs(variant, a_q, a_s, weights.w13, weights.w13_scales, E * 2 * I, *out, offsets, E, I,
                                H, gemm_fp8._NO_PEERS, 0)
        runs[name] = (holding(gemm_fp8.run, specs, A, a_q, a_s), (out[0], out[1][:, :M]), "FP8, shipped")
    if bf16_w13 is not None:
        for name, variant in bf16_builds("gemm1_wgmma_swiglu", bf16_knobs):
            act = cupy.full((M, I), np.nan, BF16)
            specs = gemm._wgmma_specs(variant, A, bf16_w13, E * 2 * I, act, offsets, E, I, H, gemm._NO_PEERS, 0)
            runs[name] = (holding(gemm.run, specs, A, bf16_w13), (act,), "bf16 wgmma")
    return runs, arithmetic.gemm1_flops(M, H, I)


def gemm2_runs(rs, offsets_host, weights, H, I, knobs, bf16_w2, bf16_knobs):
    """name -> (launch, output, the name of the build it must equal) for GEMM 2's builds (the
    null sink: C stored); outputs poisoned before the first launch."""
    E, M = weights.w2.shape[0], int(offsets_host[-1])
    offsets, A, (a_q, a_s) = operands(rs, offsets_host, I)
    runs = {}
    for name, variant in fp8_builds("gemm_fp8_null", knobs):
        C = cupy.full((M, H), np.nan, BF16)
        specs = gemm_fp8._specs(variant, a_q, a_s, weights.w2, weights.w2_scales, E * H, C, None, offsets, E, H, I,
                                gemm_fp8._NO_PEERS, 0)
        runs[name] = (holding(gemm_fp8.run, specs, A, a_q, a_s), (C,), "FP8, shipped")
    if bf16_w2 is not None:
        for name, variant in bf16_builds("gemm_wgmma_null", bf16_knobs):
            C = cupy.full((M, H), np.nan, BF16)
            specs = gemm._wgmma_specs(variant, A, bf16_w2, E * H, C, offsets, E, H, I, gemm._NO_PEERS, 0)
            runs[name] = (holding(gemm.run, specs, A, bf16_w2), (C,), "bf16 wgmma")
    return runs, arithmetic.gemm2_flops(M, H, I)


def dense_runs(rs, n: int):
    """name -> (launch, output, reference build) for a dense FP8 GEMM of n^3: ours and, where it
    is reachable, cuBLASLt's on the same operands, which sums in another order (no reference
    build: #wrong "-"); the FLOPs, and why there is no cuBLASLt row (None if there is one)."""
    d = DenseFp8(rs, n)
    runs = {"FP8, shipped": (d.ours, (d.c,), "FP8, shipped")}
    if d.lt is not None:
        runs["cuBLASLt FP8"] = (d.lt, (d.c_lt,), None)
    return runs, 2.0 * n**3, d.why_not


def measure(gemm_name: str, runs: dict, flops: float, args, log: power.PowerLog) -> list:
    """Times the builds; returns their rows as callables that format them once `log` has
    its samples (nvidia-smi's output is read when the log closes)."""
    timed = time_blocks({n: fn for n, (fn, _, _) in runs.items()}, args.launches, args.rounds, log)
    rows = []
    for name, (times, spans) in timed.items():
        _, out, ref = runs[name]
        n_wrong = "-" if ref is None else str(wrong(out, runs[ref][1]))
        ms = float(np.median(times))
        blocks = " ".join(f"{t * 1e3:7.0f}" for t in times)

        def line(name=name, spans=spans, n_wrong=n_wrong, ms=ms, blocks=blocks):
            samples = [s for span in spans for s in log.samples_between(*span)]
            return (f"{gemm_name:<8}{name:<28}{blocks}  {ms * 1e3:8.1f}{flops / ms / 1e9:9.1f}  "
                    f"{power.describe(power.summary(samples)):<38}{n_wrong:>7}")
        rows.append(line)
    return rows


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="dsv3-prefill", choices=sorted(presets.PRESETS))
    p.add_argument("--ranks", type=int, default=2, help="ranks the preset's experts are spread over (default 2)")
    p.add_argument("--routing", nargs="+", default=["balanced"],
                   help="uniform, balanced, skewed or skewed:<exponent> (default: balanced)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--launches", type=int, default=150, help="launches per block (default 150)")
    p.add_argument("--rounds", type=int, default=4, help="blocks per build (default 4)")
    p.add_argument("--knobs", nargs="*", default=[], choices=sorted(gemm_fp8.KNOBS),
                   help="experimental FP8 builds to time beside the shipped one")
    p.add_argument("--bf16", action="store_true", help="also the bf16 wgmma GEMMs on the same rows")
    p.add_argument("--bf16-knobs", nargs="*", default=[], choices=sorted(BF16_KNOBS),
                   help="experimental bf16 builds to time beside the shipped one (implies --bf16)")
    p.add_argument("--dense", type=int, default=0, metavar="N",
                   help="also a dense FP8 GEMM of N^3, ours and cuBLASLt's, in blocks (a multiple of 128)")
    args = p.parse_args()
    if args.launches < 3 or args.rounds < 1:
        p.error("--launches must be at least 3 and --rounds at least 1")
    if args.dense < 0 or args.dense % 128:
        p.error("--dense must be a multiple of 128")
    preset = presets.get_preset(args.preset)
    H, I, E = preset.hidden, preset.intermediate, preset.num_experts // args.ranks
    dev = cupy.cuda.Device()
    gpu = dev.pci_bus_id
    name = cupy.cuda.runtime.getDeviceProperties(dev.id)["name"].decode()
    limit = power.power_limit(gpu)
    print(f"# expert GEMMs in blocks on one GPU ({name}, {gpu}, power limit "
          f"{'unknown' if limit is None else f'{limit:.0f} W'}): {preset.name}, H {H}, I {I}, {E} local experts of "
          f"{preset.num_experts} over {args.ranks} ranks, {preset.tokens_per_rank} tokens/rank, top-{preset.top_k}")
    print(f"# blocks of {args.launches} launches (median of the last two thirds), {args.rounds} rounds A B .. B A; "
          f"#wrong: elements differing in any bit from the shipped build")
    rs = cupy.random.RandomState(5)
    w13 = (rs.standard_normal((E, 2 * I, H), dtype=np.float32) / np.sqrt(H)).astype(BF16)
    w2 = (rs.standard_normal((E, H, I), dtype=np.float32) / np.sqrt(I)).astype(BF16)
    weights = fp8.quantize_weights(w13, w2)
    args.bf16 = args.bf16 or bool(args.bf16_knobs)
    bf16_w13 = cupy.asarray(w13) if args.bf16 else None
    bf16_w2 = cupy.asarray(w2) if args.bf16 else None
    del w13, w2
    lines = []  # text, or callables that need the power samples
    rounds = " ".join(f"{'r' + str(r) + ' us':>7}" for r in range(args.rounds))
    header = (f"{'GEMM':<8}{'build':<28}{rounds}  {'us':>8}{'TFLOP/s':>9}  "
              f"{'power, SM clock, capped (samples)':<38}{'#wrong':>7}")
    with power.PowerLog(gpu) as log:
        if args.dense:
            runs, flops, why_not = dense_runs(rs, args.dense)
            lines += [f"# dense {args.dense}^3, 1 x 128 and 128 x 128 scales"
                      + ("" if why_not is None else f" (no cuBLASLt row: {why_not})"), header]
            lines += measure("dense", runs, flops, args, log)
        for spec in args.routing:
            rows = rows_per_expert(spec, preset, args.ranks, args.seed)
            offsets_host = np.concatenate([[0], np.cumsum(rows)]).astype(np.int32)
            lines.append(f"# {spec}: {rows.sum()} rows, per expert min {rows.min()} mean {rows.mean():.1f} "
                         f"max {rows.max()}")
            lines.append(header)
            g1 = gemm1_runs(rs, offsets_host, weights, H, I, args.knobs, bf16_w13, args.bf16_knobs)
            lines += measure("GEMM 1", *g1, args, log)
            g2 = gemm2_runs(rs, offsets_host, weights, H, I, args.knobs, bf16_w2, args.bf16_knobs)
            lines += measure("GEMM 2", *g2, args, log)
    for line in lines:
        print(line if isinstance(line, str) else line())
    if log.unavailable:
        print(f"# no power samples: {log.unavailable}")


if __name__ == "__main__":
    main()
