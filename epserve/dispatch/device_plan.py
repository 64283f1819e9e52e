"""A DispatchPlan's index arrays on the device, in the int32 form the row kernels take."""

from __future__ import annotations

from dataclasses import dataclass

import cupy
import numpy as np

from epserve.dispatch.host_plan import DispatchPlan


@dataclass(frozen=True)
class DevicePlan:
    host: DispatchPlan
    expert_offsets: cupy.ndarray    # [E_loc + 1]
    src_info: cupy.ndarray          # [M]
    send_token: cupy.ndarray        # [S] token of each row this rank sends, in send order
    home_slot: cupy.ndarray         # [S] t * k + j: the recv slot of each sent row when it comes home
    recv_perm: cupy.ndarray         # [M] staging position of dispatched row m
    combine_pack_idx: cupy.ndarray  # [M] row of C at staging position p (rows go home in arrival order)
    recv_src_rank: cupy.ndarray     # [M]
    recv_src_pos: cupy.ndarray      # [M]

    @property
    def num_recv_rows(self) -> int:
        return int(self.host.num_recv_rows)

    @property
    def num_send_rows(self) -> int:
        return int(self.host.send_counts.sum())

    @classmethod
    def upload(cls, plan: DispatchPlan, top_k: int) -> "DevicePlan":
        def dev(a):
            return cupy.asarray(np.ascontiguousarray(a, dtype=np.int32))

        home = plan.send_token.astype(np.int64) * top_k + plan.send_slot
        return cls(plan, dev(plan.expert_offsets), dev(plan.src_info), dev(plan.send_token), dev(home),
                   dev(plan.recv_perm), dev(plan.combine_pack_idx), dev(plan.recv_src_rank), dev(plan.recv_src_pos))
