"""The GPU's power, clock and throttle reasons while a benchmark runs, sampled by nvidia-smi
in a background process. An H200 running the FP8 GEMMs back to back sits at its 700 W limit
with the SM clock pulled down to ~1.4 GHz (notes/gemm.md, sixteenth session), so a GEMM's time
depends on what ran before it and for how long; the numbers here say which state a timing
was taken in. Without nvidia-smi (or on a machine without a GPU) nothing is sampled and
`PowerLog.unavailable` says why.

    with PowerLog(pci_bus_id) as log:
        ... mark = log.now(); run a block; spans.append((mark, log.now())) ...
    summary(log.samples_between(*span))
"""

from __future__ import annotations

import shutil
import signal
import subprocess
import time
from dataclasses import dataclass
from datetime import datetime

# The power reading: the instant one where the driver has it (power.draw averages over about a
# second, longer than a block of launches), else the averaged one.
INSTANT_POWER, AVERAGED_POWER = "power.draw.instant", "power.draw"


def fields(power_field: str = AVERAGED_POWER) -> tuple:
    """nvidia-smi's names of what a sample holds, in parse_line's order; the throttle-reason
    aliases are accepted by both older and newer drivers."""
    return ("timestamp", power_field, "clocks.sm", "temperature.gpu", "clocks_throttle_reasons.sw_power_cap",
            "clocks_throttle_reasons.sw_thermal_slowdown", "clocks_throttle_reasons.hw_thermal_slowdown",
            "clocks_throttle_reasons.hw_slowdown")
TIMESTAMP_FORMAT = "%Y/%m/%d %H:%M:%S.%f"


@dataclass(frozen=True)
class Sample:
    t: float  # seconds since the epoch (nvidia-smi's local time read as local time)
    watts: float | None
    sm_mhz: float | None
    celsius: float | None
    power_capped: bool  # the software power cap is holding the clock down
    thermal: bool  # any thermal or hardware slowdown


def _number(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:  # "[N/A]", "[Not Supported]"
        return None


def parse_line(line: str) -> Sample | None:
    """One line of `nvidia-smi --query-gpu=<fields()> --format=csv,noheader,nounits`, or None
    for a line that is not one (a warning, a truncated last line)."""
    parts = [p.strip() for p in line.split(",")]
    if len(parts) != len(fields()):
        return None
    try:
        t = datetime.strptime(parts[0], TIMESTAMP_FORMAT).timestamp()
    except ValueError:
        return None
    active = [p == "Active" for p in parts[4:]]
    return Sample(t, _number(parts[1]), _number(parts[2]), _number(parts[3]), active[0], any(active[1:]))


class PowerLog:
    """nvidia-smi sampling one GPU every `period_ms` from __enter__ to __exit__."""

    def __init__(self, gpu: str, period_ms: int = 50):
        self.gpu, self.period_ms = gpu, period_ms
        self.samples: list[Sample] = []
        self.unavailable: str | None = None if shutil.which("nvidia-smi") else "nvidia-smi is not on PATH"
        self.power_field: str | None = None  # which power reading the samples hold
        self._proc = None

    def __enter__(self) -> PowerLog:
        if self.unavailable is None:
            instant = _number(_query_once(self.gpu, INSTANT_POWER) or "") is not None
            self.power_field = INSTANT_POWER if instant else AVERAGED_POWER
            self._proc = subprocess.Popen(
                ["nvidia-smi", "-i", self.gpu, f"--query-gpu={','.join(fields(self.power_field))}",
                 "--format=csv,noheader,nounits", f"--loop-ms={self.period_ms}"],
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        return self

    def __exit__(self, *exc) -> None:
        if self._proc is None:
            return
        self._proc.send_signal(signal.SIGINT)  # nvidia-smi's loop ends on ^C with its output flushed
        try:
            out, _ = self._proc.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            out, _ = self._proc.communicate()
        self.samples = [s for s in map(parse_line, out.splitlines()) if s is not None]
        if not self.samples:
            first = out.strip().splitlines()[:1]
            self.unavailable = "nvidia-smi gave no samples" + (f": {first[0]}" if first else "")

    @staticmethod
    def now() -> float:
        """A mark on the samples' clock (take it after synchronizing with the GPU)."""
        return time.time()

    def samples_between(self, start: float, stop: float) -> list[Sample]:
        return [s for s in self.samples if start <= s.t <= stop]


def _query_once(gpu: str, field: str) -> str | None:
    """One field of one GPU as nvidia-smi prints it, or None where it cannot (no nvidia-smi, a
    field this driver does not know)."""
    if not shutil.which("nvidia-smi"):
        return None
    try:
        proc = subprocess.run(["nvidia-smi", "-i", gpu, f"--query-gpu={field}", "--format=csv,noheader,nounits"],
                              capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    lines = proc.stdout.strip().splitlines()
    return lines[0].strip() if proc.returncode == 0 and lines else None


def power_limit(gpu: str) -> float | None:
    """The enforced power limit in watts, or None where nvidia-smi cannot say."""
    return _number(_query_once(gpu, "enforced.power.limit") or "")


def summary(samples: list[Sample]) -> dict:
    """Medians of power and SM clock over `samples`, and the shares of them with the power cap
    or a thermal slowdown active. Empty samples give counts of 0 and None elsewhere."""
    def median(values):
        values = sorted(v for v in values if v is not None)
        return values[len(values) // 2] if values else None

    n = len(samples)
    return {"samples": n, "watts": median(s.watts for s in samples), "sm_mhz": median(s.sm_mhz for s in samples),
            "celsius": median(s.celsius for s in samples),
            "power_capped": sum(s.power_capped for s in samples) / n if n else None,
            "thermal": sum(s.thermal for s in samples) / n if n else None}


def describe(stats: dict) -> str:
    """summary() as one short line: '688 W, 1410 MHz, capped 92% (12)', the count of samples
    last (or 'no samples')."""
    if not stats["samples"]:
        return "no samples"
    parts = []
    if stats["watts"] is not None:
        parts.append(f"{stats['watts']:.0f} W")
    if stats["sm_mhz"] is not None:
        parts.append(f"{stats['sm_mhz']:.0f} MHz")
    parts.append(f"capped {stats['power_capped'] * 100:.0f}%")
    if stats["thermal"]:
        parts.append(f"thermal {stats['thermal'] * 100:.0f}%")
    return ", ".join(parts) + f" ({stats['samples']})"
