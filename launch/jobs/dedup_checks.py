"""check_off_node.py's part for the relay's deduplication (EPSERVE_OFFNODE_DEDUP=1;
epserve/comm/off_node_dedup.py): the packed node blocks the GPU made, read back and held against
the NumPy model of the packing (epserve/comm/dedup_model.py), and the network bytes of the rail
transfers with and without it. The job's bitwise checks against the one-node run say whether
the rows arrived right; this says, when they did not, whether the packing was wrong."""

from __future__ import annotations

import cupy
import numpy as np

from epserve.comm.dedup_model import network_bytes, pack_node, staged_tokens


def device_bytes(ptr: int, nbytes: int) -> np.ndarray:
    """nbytes of device memory at ptr, copied to the host (after the stream's work)."""
    out = np.empty(nbytes, np.uint8)
    if nbytes:
        cupy.cuda.runtime.memcpy(out.ctypes.data, ptr, nbytes, cupy.cuda.runtime.memcpyDeviceToHost)
    return out


def packed_blocks_checks(svc, topk_idx: np.ndarray, num_experts: int) -> list:
    """After a direct dispatch of this rank's routing topk_idx, with no dispatch since: for each
    other node, the staging blocks list the model's tokens, and the packed block's index and
    routing of each node rank are the model's, and each packed row is the staged row it names."""
    off = svc.off_node
    plan, dedup = off.plan, off.relay.dedup
    p = dedup.plan
    cupy.cuda.runtime.deviceSynchronize()
    packed = device_bytes(dedup.staging_ptr, p.blocks_bytes)
    fields = off.dispatch_staging()
    R, T, row, meta_len = plan.R, plan.max_tokens, plan.hidden * 2, plan.meta_len
    staged = staged_tokens(topk_idx, num_experts, plan.world)
    failures = []
    for c in p.relay.other_nodes:
        ci = p.relay.other_index(c, p.relay.node)
        block = packed[ci * p.block_bytes:(ci + 1) * p.block_bytes]
        tokens_of = staged[c * R:(c + 1) * R]
        model = pack_node(tokens_of, T)
        rows_of = []
        for q, tokens in enumerate(tokens_of):
            d, n = c * R + q, len(tokens)
            mine = device_bytes(fields["off_blocks"] + plan.block(d) * fields["off_block_bytes"],
                                fields["off_block_bytes"])
            meta = mine[T * row:T * row + n * meta_len * 4].view(np.int32)
            rows_of.append(mine[:n * row].reshape(n, row))
            where = f"node {c}, rank {d}"
            if not np.array_equal(meta[::meta_len], tokens):
                failures.append(f"{where}: the staging block's tokens {meta[::meta_len]} are not the routing's {tokens}")
            index = block[p.index_offset + q * T * 4:][:n * 4].view(np.int32)
            if not np.array_equal(index, model.index[q]):
                failures.append(f"{where}: packed index {index} is not the model's {model.index[q]}")
            routing = block[p.meta_offset + q * T * meta_len * 4:][:n * meta_len * 4].view(np.int32)
            if not np.array_equal(routing, meta):
                failures.append(f"{where}: the packed routing differs from the staged routing")
        for r, (q, pos) in enumerate(model.sources):
            if not np.array_equal(block[r * row:(r + 1) * row], rows_of[q][pos]):
                failures.append(f"node {c}: packed row {r} is not rank {c * R + q}'s staged row {pos}")
                break
    return failures


def rail_bytes_line(svc, routing: list, num_experts: int) -> str:
    """The rail transfers' bytes of a dispatch of `routing` (every rank's topk_idx), per rank and
    per node (epserve/comm/dedup_model.py NetworkBytes.line)."""
    plan = svc.off_node.plan
    return network_bytes(routing, plan.layout, num_experts, plan.top_k, plan.hidden, plan.max_tokens).line()
