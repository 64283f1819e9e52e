"""NCCL between the ranks (the unfused baseline's transport), and the check that tells
whether it can run at all: NCCL refuses two ranks on one GPU, where the IPC copy serves."""

from __future__ import annotations

import cupy


def gpus_shared(comm) -> bool:
    """True if two ranks of `comm` drive the same GPU."""
    ids = comm.allgather(cupy.cuda.Device().pci_bus_id)
    return len(set(ids)) < len(ids)


def make_nccl(comm):
    from cupy.cuda import nccl

    uid = nccl.get_unique_id() if comm.Get_rank() == 0 else None
    uid = comm.bcast(uid, root=0)
    return nccl.NcclCommunicator(comm.Get_size(), uid, comm.Get_rank())


def exchange_rows(nccl_comm, send, send_counts, send_displs, recv, recv_counts, recv_displs, row_bytes: int) -> None:
    """Grouped send/recv of byte rows: block d of `send` goes to rank d, block s of `recv`
    comes from rank s (counts and displacements in rows), on the current stream."""
    from cupy.cuda import nccl

    stream = cupy.cuda.get_current_stream().ptr
    nccl.groupStart()
    try:
        for peer in range(len(send_counts)):
            if send_counts[peer]:
                nccl_comm.send(send.data.ptr + int(send_displs[peer]) * row_bytes, int(send_counts[peer]) * row_bytes,
                               nccl.NCCL_UINT8, peer, stream)
            if recv_counts[peer]:
                nccl_comm.recv(recv.data.ptr + int(recv_displs[peer]) * row_bytes, int(recv_counts[peer]) * row_bytes,
                               nccl.NCCL_UINT8, peer, stream)
    finally:
        nccl.groupEnd()
