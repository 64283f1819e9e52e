"""The layer shapes the benchmark measures, and the routings it feeds them.

Presets are real models' MoE layers at a token count typical of their use (prefill or decode
batch per rank); `scaled` shrinks them for quick runs and sweeps. Routings are `balanced`
(every expert equally likely, the router's ideal) and `skewed` (a Zipf law over the experts,
so low-numbered experts, and hence low ranks, get the most rows, as hot experts do)."""

from __future__ import annotations

import dataclasses
import math
import numbers

import numpy as np

from epserve.check.testing import routing as draw_routing
from epserve.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class Preset:
    name: str
    hidden: int
    intermediate: int
    num_experts: int
    top_k: int
    tokens_per_rank: int
    expert_dtype: str = "bf16"  # "fp8": e4m3 experts (MoEConfig.expert_dtype), rated against an FP8 dense GEMM

    def __post_init__(self):
        for field in ("hidden", "intermediate", "num_experts", "top_k", "tokens_per_rank"):
            value = getattr(self, field)
            if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"Preset {self.name!r}: {field} = {value!r} must be an integer > 0")
        if self.expert_dtype not in ("bf16", "fp8"):
            raise ConfigError(f"Preset {self.name!r}: expert_dtype = {self.expert_dtype!r} must be 'bf16' or 'fp8'")
        if self.top_k > self.num_experts:
            raise ConfigError(f"Preset {self.name!r}: top_k = {self.top_k} exceeds "
                              f"num_experts = {self.num_experts}")


PRESETS = {p.name: p for p in (
    Preset("dsv3-prefill", hidden=7168, intermediate=2048, num_experts=256, top_k=8, tokens_per_rank=4096),
    Preset("dsv3-decode", hidden=7168, intermediate=2048, num_experts=256, top_k=8, tokens_per_rank=128),
    Preset("dsv3-prefill-fp8", hidden=7168, intermediate=2048, num_experts=256, top_k=8, tokens_per_rank=4096,
           expert_dtype="fp8"),
    Preset("dsv3-decode-fp8", hidden=7168, intermediate=2048, num_experts=256, top_k=8, tokens_per_rank=128,
           expert_dtype="fp8"),
    Preset("qwen3-moe", hidden=2048, intermediate=768, num_experts=128, top_k=8, tokens_per_rank=8192),
    Preset("mixtral", hidden=4096, intermediate=14336, num_experts=8, top_k=2, tokens_per_rank=4096),
)}

# Marks a preset whose layer shape was changed, so a table or JSON file never shows a small
# test layer under a real model's name.
SCALED_SUFFIX = "/scaled"


def get_preset(name: str) -> Preset:
    try:
        return PRESETS[name]
    except KeyError:
        raise ConfigError(f"no preset named {name!r}; the presets are: {', '.join(PRESETS)}") from None


def scaled(preset: Preset, tokens_per_rank: int | None = None, hidden: int | None = None,
           intermediate: int | None = None, num_experts: int | None = None,
           top_k: int | None = None) -> Preset:
    """`preset` with the given fields replaced. Changing only tokens_per_rank keeps the name
    (a sweep point of the same layer); changing the layer's shape appends SCALED_SUFFIX."""
    shape = {"hidden": hidden, "intermediate": intermediate, "num_experts": num_experts, "top_k": top_k}
    shape = {field: value for field, value in shape.items() if value is not None}
    changes = dict(shape)
    if tokens_per_rank is not None:
        changes["tokens_per_rank"] = tokens_per_rank
    if any(getattr(preset, field) != value for field, value in shape.items()) \
            and not preset.name.endswith(SCALED_SUFFIX):
        changes["name"] = preset.name + SCALED_SUFFIX
    return dataclasses.replace(preset, **changes)


def balanced_point(name: str, tokens: int | None, world: int, seed: int, wait_timeout_s: float = 60.0):
    """A timing job's point, as the bench draws it: the preset at `tokens` per rank (default
    its own), its MoEConfig for `world` ranks (FP8 experts for the -fp8 presets), and every
    rank's balanced routing (seed + T)."""
    from epserve.config import MoEConfig

    pre = get_preset(name)
    at = scaled(pre, tokens_per_rank=tokens or pre.tokens_per_rank)
    cfg = MoEConfig(at.num_experts, at.top_k, at.hidden, at.intermediate, at.tokens_per_rank, world_size=world,
                    wait_timeout_s=wait_timeout_s, expert_dtype=pre.expert_dtype)
    return at, cfg, balanced().draw(at, world, seed + at.tokens_per_rank)


DEFAULT_ZIPF = 1.2


@dataclasses.dataclass(frozen=True)
class Routing:
    """How tokens pick their top-k experts: zipf = 0 is uniform (`balanced`), zipf > 0 draws
    expert e with weight (e + 1) ** -zipf (`skewed`)."""

    kind: str
    zipf: float = 0.0

    @property
    def label(self) -> str:
        return self.kind if self.kind == "balanced" else f"{self.kind}({self.zipf:g})"

    def draw(self, preset: Preset, world_size: int, seed: int) -> list[np.ndarray]:
        """Every rank's topk_idx [tokens_per_rank, top_k] int32 from one seed, so all ranks
        draw the same routings without exchanging them."""
        rng = np.random.default_rng(seed)
        return [draw_routing(rng, preset.tokens_per_rank, preset.num_experts, preset.top_k, zipf=self.zipf)
                for _ in range(world_size)]


def balanced() -> Routing:
    return Routing("balanced")


def skewed(exponent: float = DEFAULT_ZIPF) -> Routing:
    if not (isinstance(exponent, numbers.Real) and math.isfinite(exponent) and exponent > 0):
        raise ConfigError(f"a skewed routing needs a finite Zipf exponent > 0, not {exponent!r}")
    return Routing("skewed", float(exponent))


def get_routing(spec: str) -> Routing:
    """`balanced`, `skewed` (exponent DEFAULT_ZIPF) or `skewed:<exponent>`, as on a command line."""
    kind, _, exponent = spec.partition(":")
    if kind == "balanced" and not exponent:
        return balanced()
    if kind == "skewed":
        if not exponent:
            return skewed()
        try:
            value = float(exponent)
        except ValueError:
            value = None
        if value is not None:
            return skewed(value)
    raise ConfigError(f"no routing {spec!r}; use balanced, skewed or skewed:<Zipf exponent>, "
                      f"e.g. skewed:{DEFAULT_ZIPF}")
