"""The float64 oracle for the whole layer (docs/design.md: "The layer", "Layouts"), on the CPU.

reference_layer follows the real data path (dispatch by the plan of epserve.dispatch.host_plan, per-
expert GEMMs, the recv slots, the fixed-order reduction) and returns every intermediate,
so a GPU test can check each stage on its own. dense_layer computes the same output with no
dispatch layout at all, to cross-check the oracle itself.

Where it rounds: nowhere; everything after the bf16 inputs is float64. The GPU path rounds
to bf16 at four places, which the tolerances of the tests (relative error under 1e-2) cover:
GEMM 1's gate and up values (fp32 accumulators, rounded before SwiGLU as if [M, 2I] were
stored), act, GEMM 2's rows (as they land in recv), and the reduced output.

Inputs are W ranks' arrays given as lists (bf16 from ml_dtypes or any float dtype; they are
converted to float64):

    xs[r]            [T_r, H]
    topk_idxs[r]     [T_r, k]           int, -1 marks an unused slot
    topk_weights[r]  [T_r, k]
    w13s[r]          [E_loc, 2I, H]     rank r's experts, Linear layout (out, in)
    w2s[r]           [E_loc, H, I]
"""

import numpy as np

from epserve.dispatch.host_plan import plan_dispatch, unpack_src_info
from epserve.errors import ConfigError


def reference_layer(xs, topk_idxs, topk_weights, w13s, w2s, num_experts):
    """Per rank r a dict of float64 arrays (M = rows rank r receives):

    expert_offsets, src_info   rank r's dispatch plan (epserve.dispatch.host_plan)
    a     [M, H]     dispatched rows, expert-major
    h     [M, 2I]    a @ w13[e]^T
    act   [M, I]     silu(h[:, :I]) * h[:, I:]
    y     [M, H]     act @ w2[e]^T
    recv  [T_r, k, H]  y of the row that came from (r, t, j); NaN in unused slots
    out   [T_r, H]   sum over ascending j with topk_idx >= 0 of w[t, j] * recv[t, j]
    """
    xs, topk_idxs, topk_weights, w13s, w2s = _checked_inputs(
        xs, topk_idxs, topk_weights, w13s, w2s, num_experts)
    layers = []
    for rank in range(len(xs)):
        plan, a = dispatched_rows(rank, xs, topk_idxs, num_experts)
        offsets = plan.expert_offsets
        per_expert = [_expert_ffn(a[offsets[e]:offsets[e + 1]], w13s[rank][e], w2s[rank][e])
                      for e in range(plan.experts_per_rank)]
        h, act, y = (np.concatenate(stage) for stage in zip(*per_expert))
        layers.append({"expert_offsets": plan.expert_offsets, "src_info": plan.src_info,
                       "a": a, "h": h, "act": act, "y": y})

    return combine_layers(layers, xs, topk_idxs, topk_weights)


def dispatched_rows(rank, xs, topk_idxs, num_experts):
    """Rank `rank`'s dispatch plan and the rows it receives, [M, H] in xs' dtype, expert-major."""
    plan = plan_dispatch(rank, topk_idxs, num_experts, len(xs))
    src_rank, token, _ = unpack_src_info(plan.src_info)
    a = np.empty((plan.num_recv_rows, xs[0].shape[1]), xs[0].dtype)
    for src in range(len(xs)):
        rows = src_rank == src
        a[rows] = xs[src][token[rows]]
    return plan, a


def combine_layers(layers, xs, topk_idxs, topk_weights):
    """The combine of the oracle: each owner's y [M, H] row lands in its home rank's recv
    (token, slot), written once; then the reduction in ascending slot order. layers[r] holds
    rank r's src_info and y; recv and out are added to it. Returns layers."""
    hidden = xs[0].shape[1]
    top_k = topk_idxs[0].shape[1]
    for home, layer in enumerate(layers):
        layer["recv"] = np.full((xs[home].shape[0], top_k, hidden), np.nan)
    for owner in layers:
        src_rank, token, slot = unpack_src_info(owner["src_info"])
        for home, layer in enumerate(layers):
            rows = src_rank == home
            layer["recv"][token[rows], slot[rows]] = owner["y"][rows]

    for layer, idx, weights in zip(layers, topk_idxs, topk_weights):
        out = np.zeros((idx.shape[0], hidden))
        for j in range(top_k):
            used = (idx[:, j] >= 0)[:, None]
            out += np.where(used, weights[:, j, None] * layer["recv"][:, j], 0.0)
        layer["out"] = out
    return layers


def dense_layer(xs, topk_idxs, topk_weights, w13s, w2s, num_experts):
    """Per rank r the output [T_r, H] in float64, sending each token through its experts
    directly (no dispatch plan), summed in ascending slot order like the real reduction."""
    xs, topk_idxs, topk_weights, w13s, w2s = _checked_inputs(
        xs, topk_idxs, topk_weights, w13s, w2s, num_experts)
    experts_per_rank = num_experts // len(xs)
    outs = []
    for x, idx, weights in zip(xs, topk_idxs, topk_weights):
        out = np.zeros_like(x)
        for j in range(idx.shape[1]):
            for expert in np.unique(idx[:, j]):
                if expert < 0:
                    continue
                owner, local = divmod(int(expert), experts_per_rank)
                tokens = np.flatnonzero(idx[:, j] == expert)
                _, _, y = _expert_ffn(x[tokens], w13s[owner][local], w2s[owner][local])
                out[tokens] += weights[tokens, j, None] * y
        outs.append(out)
    return outs


def rel_error(a, b):
    """||a - b|| / ||b|| in float64: 0 when both norms are 0, inf when either holds NaN."""
    a = np.asarray(a).astype(np.float64)
    b = np.asarray(b).astype(np.float64)
    if a.shape != b.shape:
        raise ValueError(f"rel_error needs arrays of one shape; got {a.shape} and {b.shape}")
    if np.isnan(a).any() or np.isnan(b).any():
        return float("inf")
    diff = np.linalg.norm(a - b)
    norm = np.linalg.norm(b)
    if norm == 0:
        return 0.0 if diff == 0 else float("inf")
    return float(diff / norm)


def silu(x):
    # x * sigmoid(x), with sigmoid written through tanh so no exp overflows at large |x|.
    return x * 0.5 * (1.0 + np.tanh(0.5 * x))


def _expert_ffn(a, w13, w2):
    """One expert on its rows: (h, act, y)."""
    intermediate = w13.shape[0] // 2
    h = a @ w13.T
    act = silu(h[:, :intermediate]) * h[:, intermediate:]
    return h, act, act @ w2.T


def _checked_inputs(xs, topk_idxs, topk_weights, w13s, w2s, num_experts):
    """The inputs as float64 (routing as int64), after checking their shapes agree."""
    world_size = len(xs)
    lists = {"topk_idxs": topk_idxs, "topk_weights": topk_weights, "w13s": w13s, "w2s": w2s}
    for name, values in lists.items():
        if len(values) != world_size:
            raise ConfigError(f"{name} holds {len(values)} ranks' arrays but xs holds "
                              f"{world_size}; give one per rank")
    if world_size == 0 or num_experts % world_size:
        raise ConfigError(f"num_experts = {num_experts} must be a multiple of the number of "
                          f"ranks, {world_size}")
    experts_per_rank = num_experts // world_size
    xs = [np.asarray(x).astype(np.float64) for x in xs]
    topk_idxs = [np.asarray(idx).astype(np.int64) for idx in topk_idxs]
    topk_weights = [np.asarray(w).astype(np.float64) for w in topk_weights]
    w13s = [np.asarray(w).astype(np.float64) for w in w13s]
    w2s = [np.asarray(w).astype(np.float64) for w in w2s]
    hidden = xs[0].shape[-1]
    intermediate = w2s[0].shape[-1]
    for rank in range(world_size):
        num_tokens = xs[rank].shape[0]
        expected = {
            "xs": (xs[rank], (num_tokens, hidden)),
            "topk_idxs": (topk_idxs[rank], (num_tokens, topk_idxs[0].shape[-1])),
            "topk_weights": (topk_weights[rank], topk_idxs[rank].shape),
            "w13s": (w13s[rank], (experts_per_rank, 2 * intermediate, hidden)),
            "w2s": (w2s[rank], (experts_per_rank, hidden, intermediate)),
        }
        for name, (array, shape) in expected.items():
            if array.shape != shape:
                raise ConfigError(f"{name}[{rank}] has shape {array.shape}; expected {shape}")
        idx = topk_idxs[rank]
        if ((idx < -1) | (idx >= num_experts)).any():
            raise ConfigError(f"topk_idxs[{rank}] holds an id outside -1..{num_experts - 1}")
    return xs, topk_idxs, topk_weights, w13s, w2s
