"""Which orderings among a GEMM epilogue's output threads compute-sanitizer's racecheck accepts
around the tile hand-over (cuda/probes/racecheck_handover.cu says what each protocol does):

    python launch/jobs/probe_racecheck_handover.py [--protocols 0 1 2 3 4 5 6 7] [--blocks 24] [--tiles 8]

One GPU. For each protocol, runs this script again (--one) under `compute-sanitizer --tool
racecheck --racecheck-report hazard`, which launches the probe once and checks every byte the
writer warps copied out against the values the protocol must give (#wrong). Prints a table:
the protocol, racecheck's error count and #wrong. Every protocol is ordered by construction
(the kernel's comment says why), so a protocol with errors and #wrong 0 shows racecheck
reporting an ordered hand-over. Exits 1 if any #wrong is not 0. notes/gemm.md (thirty-sixth
session) has what it gave on an H100; it is why the FP8 GEMM 1's split tails order their
exchange by mbarriers."""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys

import numpy as np

SOURCE = "probes/racecheck_handover.cu"
KERNEL = "epserve_probe_racecheck_handover"
PROTOCOLS = {
    0: "both warpgroups write their rows",
    1: "the first warpgroup writes a tail alone",
    2: "1 + a named barrier of the first warpgroup",
    3: "1 + a named barrier of both warpgroups",
    4: "exchange by named barriers (split tails <= s35)",
    5: "4, the second warpgroup arrives only",
    6: "exchange by mbarriers (the shipped split tails)",
    7: "0 + a barrier a warpgroup after (split-K <= s35)",
}
ROW_BYTES, ROWS = 128, 128
OUT_BYTES = ROWS * ROW_BYTES + ROWS * 4
POISON = 0xAB


def expected(protocol: int, blocks: int, tiles: int) -> np.ndarray:
    """The bytes the writer warps must leave in `out`: [blocks * tiles, OUT_BYTES]."""
    rows = 128 if protocol in (0, 7) else 64
    out = np.full((blocks * tiles, OUT_BYTES), POISON, dtype=np.uint8)
    key = np.arange(blocks * tiles, dtype=np.uint64)[:, None, None]
    r = np.arange(rows, dtype=np.uint64)[None, :, None]
    c = np.arange(ROW_BYTES // 2, dtype=np.uint64)[None, None, :]
    words = np.zeros((1, 1, 1), dtype=np.uint64)
    if 4 <= protocol <= 6:
        # the writing thread of (r, c): warp r // 16, lane (r % 8) * 4 + c % 4 of the first warpgroup
        u = (r // 16) * 32 + (r % 8) * 4 + c % 4
        words = (32 * key * 4096 + 32 * u * 32 + 31 * 32 // 2) & 0xFFFFFFFF
    values = ((key * 7 + r * 64 + c + words) & 0xFFFF).astype(np.uint16)
    out[:, : rows * ROW_BYTES] = values.reshape(blocks * tiles, -1).view(np.uint8)
    scales = (key[:, :, 0] * 128 + r[:, :, 0]).astype(np.float32)
    out[:, ROWS * ROW_BYTES : ROWS * ROW_BYTES + rows * 4] = scales.view(np.uint8)
    return out


def run_one(protocol: int, blocks: int, tiles: int) -> int:
    """Launch the probe once; print and return #wrong."""
    import cupy

    from epserve.runtime import build

    fn = build.load_module(SOURCE, {"EPSERVE_PROBE_PROTOCOL": protocol}).get_function(KERNEL)
    out = cupy.full(blocks * tiles * OUT_BYTES, POISON, dtype=cupy.uint8)
    fn((blocks,), (384,), (out, np.int32(tiles)))
    got = out.get().reshape(blocks * tiles, OUT_BYTES)
    wrong = int(np.count_nonzero(got != expected(protocol, blocks, tiles)))
    print(f"#wrong {wrong}")
    return wrong


def racecheck_errors(log: str) -> int | None:
    """The error count of racecheck's summary line, or None without one."""
    m = re.search(r"RACECHECK SUMMARY: \d+ hazards? displayed \((\d+) errors?", log)
    return int(m.group(1)) if m else None


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--protocols", type=int, nargs="+", default=sorted(PROTOCOLS), choices=sorted(PROTOCOLS))
    p.add_argument("--blocks", type=int, default=24)
    p.add_argument("--tiles", type=int, default=8, help="tiles a block hands over")
    p.add_argument("--one", type=int, choices=sorted(PROTOCOLS), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.one is not None:
        return 1 if run_one(args.one, args.blocks, args.tiles) else 0

    sanitizer = shutil.which("compute-sanitizer")
    if sanitizer is None:
        raise SystemExit("probe_racecheck_handover: compute-sanitizer is not on PATH (CUDA toolkit's bin)")
    import cupy

    from epserve.runtime import build

    for protocol in args.protocols:  # built here, so the sanitized runs only load
        build.compile_source(SOURCE, {"EPSERVE_PROBE_PROTOCOL": protocol})
    version = subprocess.run([sanitizer, "--version"], capture_output=True, text=True).stdout.strip().splitlines()
    print(f"# probe_racecheck_handover: {cupy.cuda.runtime.getDeviceProperties(0)['name'].decode()}, "
          f"{version[-1] if version else 'compute-sanitizer'}")
    print(f"# {args.blocks} blocks x {args.tiles} tiles handed over; errors: racecheck's count (--racecheck-report "
          "hazard); every protocol is ordered by construction")
    print(f"# {'protocol':<52} {'errors':>8} {'#wrong':>7}")
    failed = False
    for protocol in args.protocols:
        cmd = [sanitizer, "--tool", "racecheck", "--racecheck-report", "hazard", "--print-limit", "1",
               sys.executable, __file__, "--one", str(protocol), "--blocks", str(args.blocks),
               "--tiles", str(args.tiles)]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        log = done.stdout + done.stderr
        errors = racecheck_errors(log)
        m = re.search(r"#wrong (\d+)", log)
        wrong = m.group(1) if m else "-"
        failed |= wrong != "0"
        name = f"{protocol}  {PROTOCOLS[protocol]}"
        print(f"  {name:<52} {'-' if errors is None else errors:>8} {wrong:>7}")
        if m is None or errors is None:
            print(log[-2000:])
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
