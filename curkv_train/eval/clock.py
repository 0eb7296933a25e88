"""A wall clock that counts queued GPU work: timings of prefills in the evaluation and the benchmarks."""

from __future__ import annotations

import time

import torch


def synchronize() -> None:
    """Wait for queued GPU work, so a wall clock read after it counts that work (no-op without CUDA in use)."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def clock() -> float:
    """``time.perf_counter()`` after the GPU's queue has drained (seconds)."""
    synchronize()
    return time.perf_counter()
