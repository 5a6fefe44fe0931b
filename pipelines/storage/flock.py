"""A ``flock`` taken within a bound: polled without blocking (a blocking ``flock`` could not be bounded)."""
from __future__ import annotations

import fcntl
import time
from typing import Callable, Optional


def flock_within(fd: int, mode: int, wait_s: float, waiting: Optional[Callable[[], None]] = None) -> bool:
    """``flock(fd, mode | LOCK_NB)``, tried again (pauses from 10 ms doubling to 1 s) until ``wait_s`` has passed:
    True once taken, False when it is still held then; ``waiting()`` is called once, the first time it must wait.
    Any other ``OSError`` (a file system that keeps no such lock: ENOLCK, EOPNOTSUPP) is raised."""
    deadline, pause, told = time.monotonic() + wait_s, 0.01, False
    while True:
        try:
            fcntl.flock(fd, mode | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            pass
        if time.monotonic() >= deadline:
            return False
        if waiting is not None and not told:
            waiting()
        told = True
        time.sleep(max(0.0, min(pause, deadline - time.monotonic())))
        pause = min(2 * pause, 1.0)
