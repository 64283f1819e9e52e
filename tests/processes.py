"""Helpers for tests that watch the processes a job started."""


def alive(pid: int) -> bool:
    """True while `pid` runs (a zombie or a dead process is not alive); needs /proc."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")
