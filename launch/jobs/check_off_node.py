"""Across nodes (issue 15; docs/design.md, "Across nodes"), run under the launcher with a
forced node size:

    EPSERVE_OFFNODE_CARRIER=ipc python launch/run.py -n 4 --share-gpu -- \
        python -m mpi4py launch/jobs/check_off_node.py --ranks-per-node 2

Per service shape (check_service.py's), several calls with different token counts, first on
one node (EPSERVE_RANKS_PER_NODE unset), then with --ranks-per-node R (the rows for the other
"nodes" staged and moved by the off-node carrier, EPSERVE_OFFNODE_CARRIER): the fused forward
(direct dispatch, peer sink), the unfused one (direct dispatch, null sink, C pushed), every
used recv slot and the direct dispatch's rows, expert_offsets and src_info are bitwise the
one-node run's, also when the calls' dispatches run again back to back with no combine between
them; fused == unfused bitwise; the float64 reference within 1e-2; every output
element written. Where every rank has its own GPU, the NCCL dispatch (with both sinks) gives the
same bits too. Then check_service's bad inputs on the multi-node service: every rank raises,
and the service goes on giving the same bits. Prints `RESULT {json}` lines; exits non-zero if
any check failed on any rank.

With EPSERVE_OFFNODE_OVERLAP=1 (in the environment too) the fused combine's off-node send
runs on a side stream under GEMM 2's overlap build: the same bits are required, every fused
call must have gone that way, GEMM 2's tile order must be the model's
(epserve/ffn/overlap_gemm.py), and capture() must be refused.

With EPSERVE_OFFNODE_ROUTE=relay the job prints the rail transfers' bytes of each shape's first
call, one row per destination rank against one per destination node; with EPSERVE_OFFNODE_DEDUP=1
too (the relay sends each token row once per destination node) the same bits are required, and
the packed node blocks of the latest dispatch must be the NumPy model's (launch/jobs/dedup_checks.py).

With EPSERVE_OFFNODE_SIZES=host (set in the environment, like the carrier) the multi-node
service moves the routed rows only (docs/design.md, "Across nodes"): the same bits are
required, the sizes the host read must be the routing's (token rows to each off-node rank,
rows back from each off-node owner), and capture() must be refused (ConfigError).

More than 8 ranks cannot run as one node (a node holds at most 8): then
--reference-ranks-per-node R0 makes the reference run another forced layout (for example 16
ranks as 4 nodes of 4 against 2 nodes of 8), and both must give the same bits:

    EPSERVE_OFFNODE_CARRIER=ipc python launch/run.py -n 16 --share-gpu -- python -m mpi4py \
        launch/jobs/check_off_node.py --ranks-per-node 8 --reference-ranks-per-node 4 --shapes 1

For a hang (diagnostics, both off by default): EPSERVE_JOB_STACKS_AFTER_S=S dumps every rank's
Python stacks every S seconds, and EPSERVE_OFFNODE_TRACE=DIR logs every carrier group per rank
(epserve/comm/carrier_trace.py); the stacks then go to DIR too.
"""

from __future__ import annotations

import argparse
import os
import sys

import cupy
import numpy as np
from check_service import SHAPES, bad_inputs, experts_for, record, tokens_for  # siblings of this script
from dedup_checks import packed_blocks_checks, rail_bytes_line
from job_report import emit, run_cases

from epserve import EPService, MoEConfig
from epserve.check.reference import reference_layer, rel_error
from epserve.check.testing import BF16, bf16_bits, layer_inputs
from epserve.comm import mpi as ep_comm
from epserve.comm.topology import RANKS_PER_NODE_ENV
from epserve.errors import ConfigError
from epserve.ffn import gemm, overlap_gemm


def run_calls(svc, comm, calls, E, k, H, I, opts, seed):
    """Every call's results as host arrays, and the inputs of the first call."""
    rank, world = comm.Get_rank(), comm.Get_size()
    results, first = [], None
    for n, call in enumerate(calls):
        inputs = layer_inputs(seed + n, tokens_for(call, world), E, k, H, I, **opts)
        me = inputs[rank]
        x, idx, w, w13, w2 = me.on_device()
        T = x.shape[0]
        used = cupy.asnumpy(idx) >= 0
        out = cupy.full((T, H), np.nan, BF16)  # poisoned: every element must be overwritten
        r = {"inputs": inputs}
        r["fused"] = bf16_bits(svc.forward(x, idx, w, w13, w2, sink="peer", dispatch="direct", out=out))
        if svc.off_node is not None and svc.off_node.overlap is not None:  # the tile order GEMM 2 just used
            order = gemm.last_tile_order()
            r["tile_order"] = None if order is None else cupy.asnumpy(order)
        r["recv_fused"] = bf16_bits(svc.combiner.recv)[:T][used]
        r["unfused"] = bf16_bits(svc.forward(x, idx, w, w13, w2, sink="null", dispatch="direct"))
        r["recv_unfused"] = bf16_bits(svc.combiner.recv)[:T][used]
        d = svc.dispatch(x, idx, w, transport="direct")
        r["dispatch"] = {f: cupy.asnumpy(getattr(d, f)).view(np.uint8) for f in ("rows", "expert_offsets", "src_info")}
        if svc.off_node is not None and svc.off_node.host_sizes:  # what the host read for this dispatch
            r["sizes"] = svc.off_node.last_sizes
        if not svc.shared_gpu:  # the NCCL dispatch (pure NCCL, crosses nodes itself), both sinks
            r["nccl_unfused"] = bf16_bits(svc.forward(x, idx, w, w13, w2, sink="null", dispatch="nccl"))
            r["nccl_fused"] = bf16_bits(svc.forward(x, idx, w, w13, w2, sink="peer", dispatch="nccl"))
        svc.check()
        results.append(r)
        if n == 0:
            first = (x, idx, w, w13, w2)
    dispatch_burst(svc, results, rank)
    return results, first


def dispatch_burst(svc, results, rank):
    """The calls' direct dispatches again, back to back with no combine between them (as the
    bench's dispatch loop makes them): each one's rows, expert_offsets and src_info, copied on
    the stream before the next dispatch rewrites them, into results[n]["burst"]. A rank that
    writes the next call's count rows or token rows while a node peer still reads the previous
    call's shows here."""
    copies = []
    for r in results:
        x, idx, w, _, _ = r["inputs"][rank].on_device()
        d = svc.dispatch(x, idx, w, transport="direct")
        copies.append({f: getattr(d, f).copy() for f in ("rows", "expert_offsets", "src_info")})
    svc.check()
    for r, c in zip(results, copies):
        r["burst"] = {f: cupy.asnumpy(a).view(np.uint8) for f, a in c.items()}


def run_shape(comm, name, H, I, E, k, calls, opts, seed, ranks_per_node, reference_ranks_per_node=None):
    world = comm.Get_size()
    E = experts_for(E, world)
    max_tokens = max(max(tokens_for(c, world)) for c in calls)
    cfg = MoEConfig(E, k, H, I, max_tokens, world_size=world, wait_timeout_s=20.0)
    failures, info = [], {"calls": len(calls)}
    os.environ.pop(RANKS_PER_NODE_ENV, None)
    if reference_ranks_per_node:  # more ranks than a node holds: another forced layout is the reference
        os.environ[RANKS_PER_NODE_ENV] = str(reference_ranks_per_node)
    with EPService(cfg, comm) as svc:  # one node (or reference_ranks_per_node): the reference run
        if svc.off_node is not None and not reference_ranks_per_node:
            return [f"the one-node service has an off-node part ({svc.nodes})"], info
        info["reference_nodes"] = svc.nodes.nodes
        one, _ = run_calls(svc, comm, calls, E, k, H, I, opts, seed)
    os.environ[RANKS_PER_NODE_ENV] = str(ranks_per_node)
    with EPService(cfg, comm) as svc:
        info.update(nodes=svc.nodes.nodes, carrier=svc.off_node and svc.off_node.carrier.name,
                    transport=svc.transport, sizes=svc.off_node and svc.off_node.sizes,
                    overlap=bool(svc.off_node and svc.off_node.overlap),
                    route=svc.off_node and svc.off_node.route, dedup=bool(svc.off_node and svc.off_node.dedup))
        if svc.off_node is None:
            return [f"EPSERVE_RANKS_PER_NODE={ranks_per_node} gave one node"], info
        many, first = run_calls(svc, comm, calls, E, k, H, I, opts, seed)
        if svc.off_node.dedup:  # the packed blocks of the latest dispatch (the burst's last call)
            failures += packed_blocks_checks(svc, many[-1]["inputs"][comm.Get_rank()].topk_idx, E)
        if svc.off_node.relay is not None:  # what deduplication saves on the rails (or would)
            info["rail_bytes"] = rail_bytes_line(svc, [i.topk_idx for i in many[0]["inputs"]], E)
            if comm.Get_rank() == 0:
                emit(f"# {name}, call 0, the rail transfers: {info['rail_bytes']}")
        for n, (a, b) in enumerate(zip(one, many)):
            for field in ("fused", "unfused", "recv_fused", "recv_unfused"):
                if not np.array_equal(a[field], b[field]):
                    failures.append(f"call {n}: {field} differs from the one-node run "
                                    f"({int((a[field] != b[field]).sum())} elements)")
            for field, bits in a["dispatch"].items():
                if not np.array_equal(bits, b["dispatch"][field]):
                    failures.append(f"call {n}: the direct dispatch's {field} differs from the one-node run")
                if not np.array_equal(bits, b["burst"][field]):
                    failures.append(f"call {n}: in back-to-back dispatches, {field} differs from the one-node run")
            if not np.array_equal(b["fused"], b["unfused"]):
                failures.append(f"call {n}: fused != unfused across nodes")
            for field in ("nccl_unfused", "nccl_fused"):
                if field in b and not np.array_equal(b[field], b["fused"]):
                    failures.append(f"call {n}: {field} != fused across nodes")
            if np.isnan(b["fused"].view(BF16).astype(np.float32)).any():
                failures.append(f"call {n}: the fused output has unwritten (poisoned) elements")
            inputs, rank = b["inputs"], comm.Get_rank()
            if inputs[rank].x.shape[0]:
                ref = reference_layer([i.x for i in inputs], [i.topk_idx for i in inputs],
                                      [i.topk_weights for i in inputs], [i.w13 for i in inputs],
                                      [i.w2 for i in inputs], E)[rank]
                err = rel_error(b["fused"].view(BF16).astype(np.float64), ref["out"])
                info[f"rel_err_call{n}"] = err
                if not err < 1e-2:
                    failures.append(f"call {n}: relative error {err:.3g} vs the float64 reference")
        failures += sized_checks(svc, many, E, first)
        failures += overlap_checks(svc, many, H, ranks_per_node, first)
        failures += bad_inputs(comm, svc, cfg, first, many[0]["fused"])
    os.environ.pop(RANKS_PER_NODE_ENV, None)
    return failures, info


def sized_checks(svc, results, E, first) -> list:
    """EPSERVE_OFFNODE_SIZES=host: the sizes the host read are this rank's routing's, and
    capture is refused (on every rank alike, before anything is queued)."""
    off = svc.off_node
    if not off.host_sizes:
        return []
    failures = []
    rank, e_loc = svc.rank, E // svc.world
    for n, r in enumerate(results):
        idx = r["inputs"][rank].topk_idx
        owner = np.where(idx >= 0, idx // e_loc, -1)
        want_tokens = {d: int((owner == d).any(axis=1).sum()) for d in off.plan.peers}
        want_back = {o: int((owner == o).sum()) for o in off.plan.peers}
        got = r.get("sizes")
        if got is None or got.tokens_to != want_tokens or got.returns_from != want_back:
            failures.append(f"call {n}: the host's sizes {got} are not the routing's (token rows {want_tokens}, "
                            f"rows back {want_back})")
    return failures + capture_refused(svc, first, "EPSERVE_OFFNODE_SIZES=host")


def overlap_checks(svc, results, H, R, first) -> list:
    """EPSERVE_OFFNODE_OVERLAP=1: every fused combine went under GEMM 2 (the side stream), the
    tile order its overlap build used is epserve/ffn/overlap_gemm.py's model of it (a
    permutation, the m-tiles with rows bound off-node first), and capture is refused."""
    off = svc.off_node
    if off.overlap is None:
        return []
    failures = []
    if off.overlap.sends < len(results):
        failures.append(f"{off.overlap.sends} combines went under GEMM 2, of {len(results)} fused calls")
    rank = svc.rank
    for n, r in enumerate(results):
        offsets = r["dispatch"]["expert_offsets"].view(np.int32)
        src = r["dispatch"]["src_info"].view(np.int32)[:offsets[-1]]
        home = (src >> 24) & 0x7F
        want = overlap_gemm.tile_order_model(offsets, H, home // R != rank // R)
        got = r.get("tile_order")
        if want.size == 0:
            continue
        if got is None or got.size < want.size or not np.array_equal(got[:want.size], want):
            failures.append(f"call {n}: GEMM 2's tile order {None if got is None else got[:want.size]} is not the "
                            f"model's {want}")
    return failures + capture_refused(svc, first, "EPSERVE_OFFNODE_OVERLAP=1")


def capture_refused(svc, first, setting: str) -> list:
    """[] when capture() is refused (ConfigError, on every rank alike), else the failure."""
    x, idx, w, w13, w2 = first
    try:
        svc.capture(x.shape[0], w13, w2)
    except ConfigError:
        return []
    return [f"capture() was not refused with {setting}"]


STACKS_ENV = "EPSERVE_JOB_STACKS_AFTER_S"  # a diagnostic, off when unset


def dump_stacks_if_asked(rank: int) -> None:
    """EPSERVE_JOB_STACKS_AFTER_S=S: every S seconds, each rank's Python stacks (faulthandler),
    into EPSERVE_OFFNODE_TRACE's directory as stacks.rank<r>.txt when that is set, else stderr:
    where each rank sits when the job hangs."""
    after = os.environ.get(STACKS_ENV, "").strip()
    if not after:
        return
    import faulthandler

    directory = os.environ.get("EPSERVE_OFFNODE_TRACE", "").strip()
    if directory:
        os.makedirs(directory, exist_ok=True)
    out = open(os.path.join(directory, f"stacks.rank{rank}.txt"), "w") if directory else sys.stderr
    dump_stacks_if_asked.file = out  # kept open for the dumps
    faulthandler.dump_traceback_later(float(after), repeat=True, file=out)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--ranks-per-node", type=int, required=True)
    p.add_argument("--reference-ranks-per-node", type=int, default=None,
                   help="the reference run's forced node size (default: one node)")
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--shapes", type=int, default=len(SHAPES), help="the first N of check_service's shapes")
    args = p.parse_args()
    comm = ep_comm.world()
    dump_stacks_if_asked(comm.Get_rank())
    return run_cases(comm, "check_off_node", list(enumerate(SHAPES[: args.shapes])), lambda case: record(
        comm, case[1][0], *run_shape(comm, *case[1], args.seed + 10 * case[0], args.ranks_per_node,
                                     args.reference_ranks_per_node)))


if __name__ == "__main__":
    sys.exit(main())
