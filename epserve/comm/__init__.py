"""Talking between ranks: MPI at setup and teardown, CUDA IPC peer memory, device signals, NCCL, row moves."""
