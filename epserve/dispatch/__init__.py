"""Dispatch: token rows to the ranks that own their experts, expert-contiguous there (direct IPC stores, the
NCCL transport planned on the device, and the host-planned baseline)."""
