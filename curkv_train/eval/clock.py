"""A wall clock that counts queued GPU work: timings of prefills in the evaluation and the benchmarks."""

from __future__ import annotations

import time

import torch


def clock() -> float:
    """``time.perf_counter()`` (seconds) after queued GPU work has drained, so a time read after it counts that work."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
    return time.perf_counter()
