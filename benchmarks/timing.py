"""Wall-time accumulators the benchmarks wrap library methods with (the library carries no instrumentation)."""

from __future__ import annotations

import functools
import time
from collections import defaultdict
from typing import Callable

TIMERS: dict[str, float] = defaultdict(float)


def timed(name: str, method: Callable) -> Callable:
    """``method`` adding its wall time to TIMERS[name]."""

    @functools.wraps(method)
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return method(*args, **kwargs)
        finally:
            TIMERS[name] += time.perf_counter() - start

    return wrapper
