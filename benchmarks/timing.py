"""Wall-time and page-fault accumulators the benchmarks wrap library methods with (the library carries no
instrumentation)."""

from __future__ import annotations

import functools
import resource
from collections import defaultdict
from typing import Callable

import torch

from curkv_train.eval.clock import clock

TIMERS: dict[str, float] = defaultdict(float)
FAULTS: dict[str, int] = defaultdict(int)  # minor page faults inside each timed method


def timed(name: str, method: Callable) -> Callable:
    """``method`` adding its wall time (GPU work included) to TIMERS[name] and its minor page faults to FAULTS[name]."""

    @functools.wraps(method)
    def wrapper(*args, **kwargs):
        start, faults = clock(), minor_faults()
        try:
            return method(*args, **kwargs)
        finally:
            TIMERS[name] += clock() - start
            FAULTS[name] += minor_faults() - faults

    return wrapper


def minor_faults() -> int:
    """Minor page faults of this process so far: each is a page touched for the first time since the OS handed it
    over (a buffer in memory the allocator had just returned to the OS and taken back)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def product_ms(device: str = "cpu", repeats: int = 50) -> float:
    """Fastest of ``repeats`` runs of one fixed fp32 product (a 1K-token layer's expected-attention quadratic form,
    (3, 3, 1024, 64) @ (3, 3, 64, 64)), in ms: printed at a benchmark's start and end so a reader can tell a run
    made while a shared host ran slow (docs/runtime.md, "Costs")."""
    generator = torch.Generator(device=device).manual_seed(0)
    keys = torch.randn(1, 3, 1, 1024, 64, device=device, generator=generator)
    covariance = torch.randn(1, 3, 3, 64, 64, device=device, generator=generator)
    best = float("inf")
    for _ in range(repeats):
        start = clock()
        keys @ covariance
        best = min(best, clock() - start)
    return best * 1e3
