"""Wall-time accumulators the benchmarks wrap library methods with (the library carries no instrumentation)."""

from __future__ import annotations

import functools
import time
from collections import defaultdict
from typing import Callable

import torch

TIMERS: dict[str, float] = defaultdict(float)


def synchronize() -> None:
    """Wait for queued GPU work, so a wall clock read after it counts that work (no-op without CUDA in use)."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def clock() -> float:
    """perf_counter after the GPU's queue has drained."""
    synchronize()
    return time.perf_counter()


def timed(name: str, method: Callable) -> Callable:
    """``method`` adding its wall time (GPU work included) to TIMERS[name]."""

    @functools.wraps(method)
    def wrapper(*args, **kwargs):
        start = clock()
        try:
            return method(*args, **kwargs)
        finally:
            TIMERS[name] += clock() - start

    return wrapper
