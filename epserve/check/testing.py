"""Random layer inputs for tests, jobs and benchmarks: fresh random values (never zeros),
routings that are uniform or skewed, with masked slots and experts that get nothing.
Every rank can draw every rank's inputs from one seed, so all ranks know all routings."""

from __future__ import annotations

from dataclasses import dataclass

import ml_dtypes
import numpy as np

BF16 = ml_dtypes.bfloat16


def bf16_bits(a) -> np.ndarray:
    """A bf16 GPU array's bits on the host, for bitwise comparison."""
    import cupy

    return cupy.asnumpy(a).view(np.uint16)


def poison(*buffers) -> None:
    """Every bit of each GPU array to one (NaN for floats, -1 for ints): a call that must
    write every element is then checked on all of them, since no leftover matches by chance."""
    for buf in buffers:
        buf.view(f"u{buf.dtype.itemsize}").fill((1 << 8 * buf.dtype.itemsize) - 1)


def routing(rng, tokens: int, num_experts: int, top_k: int, *, zipf: float = 0.0, unused: float = 0.0,
            experts=None) -> np.ndarray:
    """int32 [tokens, top_k]: distinct experts per token (from `experts`, default all),
    drawn uniformly or by a Zipf law of exponent `zipf` (Gumbel top-k), with a fraction
    `unused` of the slots set to -1."""
    pool = np.arange(num_experts) if experts is None else np.asarray(experts)
    if top_k > pool.size:
        raise ValueError(f"top_k {top_k} exceeds the {pool.size} experts to choose from")
    if zipf:
        pool = rng.permutation(pool)  # the popular experts land on random ranks, not all on rank 0
    logits = -zipf * np.log(np.arange(1, pool.size + 1)) if zipf else np.zeros(pool.size)
    keys = logits + rng.gumbel(size=(tokens, pool.size))
    choice = np.argsort(-keys, axis=1)[:, :top_k]
    idx = pool[choice].astype(np.int32)
    if unused:
        idx[rng.random(idx.shape) < unused] = -1
    return idx


@dataclass
class LayerInputs:
    """One rank's inputs, on the host."""

    x: np.ndarray             # [T, H] bf16
    topk_idx: np.ndarray      # [T, k] int32
    topk_weights: np.ndarray  # [T, k] float32
    w13: np.ndarray           # [E_loc, 2I, H] bf16
    w2: np.ndarray            # [E_loc, H, I] bf16

    def on_device(self) -> tuple:
        """(x, topk_idx, topk_weights, w13, w2) as CuPy arrays on the current device."""
        import cupy

        return tuple(cupy.asarray(a) for a in (self.x, self.topk_idx, self.topk_weights, self.w13, self.w2))


def layer_inputs(seed: int, tokens_per_rank, num_experts: int, top_k: int, hidden: int, intermediate: int, *,
                 zipf: float = 0.0, unused: float = 0.0, experts=None, with_weights: bool = True) -> list[LayerInputs]:
    """Every rank's inputs from one seed (so every rank can build all of them)."""
    world = len(tokens_per_rank)
    e_loc = num_experts // world
    rng = np.random.default_rng(seed)
    out = []
    for T in tokens_per_rank:
        x = rng.standard_normal((T, hidden), np.float32).astype(BF16)
        idx = routing(rng, T, num_experts, top_k, zipf=zipf, unused=unused, experts=experts)
        w = rng.random((T, top_k), np.float32) + 0.05
        w /= w.sum(axis=1, keepdims=True)
        w13 = w2 = None
        if with_weights:
            w13 = (rng.standard_normal((e_loc, 2 * intermediate, hidden), np.float32) / np.sqrt(hidden)).astype(BF16)
            w2 = (rng.standard_normal((e_loc, hidden, intermediate), np.float32) / np.sqrt(intermediate)).astype(BF16)
        out.append(LayerInputs(x, idx, w, w13, w2))
    return out
