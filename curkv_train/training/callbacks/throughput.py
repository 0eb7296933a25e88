"""Token throughput logged through Lightning's own ThroughputMonitor."""

from __future__ import annotations

import warnings

from lightning.pytorch.callbacks import ThroughputMonitor

# TokenThroughput reports tokens and samples per second, not FLOPs (the module defines no
# ``flops_per_batch``), so ThroughputMonitor's reminder to define one is not for our users.
warnings.filterwarnings("ignore", message=r"When using the `ThroughputMonitor`, you need to define a `flops_per_batch`")


def _batch_size(batch: dict) -> int:
    return batch["input_ids"].shape[0]


def _batch_tokens(batch: dict) -> int:
    return batch["input_ids"].numel()


class TokenThroughput(ThroughputMonitor):
    """ThroughputMonitor counting the tokens of ``context | continuation`` batches.

    Logs ``train/device/samples_per_sec``, ``train/device/items_per_sec`` (tokens per second) and
    ``train/device/batches_per_sec`` per process, and with several processes the same without
    ``device/`` for the whole run; no FLOPs. The first reading comes once ``window_size`` batches
    have run (a shorter run logs none).

    Args:
        window_size: batches averaged per reading.
    """

    def __init__(self, window_size: int = 20) -> None:
        super().__init__(batch_size_fn=_batch_size, length_fn=_batch_tokens, window_size=window_size)
