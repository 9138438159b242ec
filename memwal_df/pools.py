"""Process-wide thread pools, one per purpose, started on first use (starting a pool per call costs
milliseconds on hot paths)."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

_POOLS: dict[str, ThreadPoolExecutor] = {}
_LOCK = threading.Lock()


def shared_pool(name: str, threads: int) -> ThreadPoolExecutor:
    """The pool named `name` (threads `memwal-{name}-N`), created with `threads` workers on first use."""
    with _LOCK:
        pool = _POOLS.get(name)
        if pool is None:
            pool = _POOLS[name] = ThreadPoolExecutor(threads, thread_name_prefix=f"memwal-{name}")
        return pool
