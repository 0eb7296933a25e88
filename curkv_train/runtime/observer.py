"""What CurKVCache keeps of the layers' attention inputs for query-aware and hidden-state scorers.

A transformers Cache only receives keys and values; the pre-hook of
:mod:`curkv_train.runtime.attention` hands ``CurKVCache.observe`` each attention module's input
hidden states before the module runs (and so before the cache's ``update``), and the layer's
:class:`ObservationBuffer` keeps what its scorer reads.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from curkv_train.core.observation import Observation, QueryStatistics
from curkv_train.errors import CurKVError

class ObservationBuffer:
    """One layer's observation (recent attention inputs, query statistics) and arriving tokens' scores.

    Args:
        window: how many of the latest hidden states to keep (0: keep none, and no statistics).
        arrival_scores: (hidden (batch, new, hidden_size)) -> (batch, kv_heads, new) logits of
            arriving tokens, for scorers that score a token once when it arrives; else None.
        queries: (hidden (batch, new, hidden_size)) -> (batch, heads, new, head_dim) the layer's
            pre-RoPE queries, for the running statistics (needed when ``window`` > 0).
        statistics_skip: tokens at positions below it stay out of the statistics.
    """

    def __init__(self, window: int, arrival_scores: Callable[[torch.Tensor], torch.Tensor] | None,
                 queries: Callable[[torch.Tensor], torch.Tensor] | None = None, statistics_skip: int = 0) -> None:
        self.window, self.arrival_scores = window, arrival_scores
        self.queries, self.statistics_skip = queries, statistics_skip
        self.hidden: torch.Tensor | None = None
        self.positions: torch.Tensor | None = None
        self.statistics = QueryStatistics()
        self.pending: torch.Tensor | None = None

    def emptied(self) -> "ObservationBuffer":
        """A new, empty buffer with the same settings."""
        return ObservationBuffer(self.window, self.arrival_scores, self.queries, self.statistics_skip)

    def observe(self, hidden: torch.Tensor, start: int) -> None:
        """Record attention inputs (batch, new, hidden_size) of tokens at positions start, start + 1, ..."""
        positions = torch.arange(start, start + hidden.shape[1], device=hidden.device)
        if self.window:
            kept = hidden.detach() if self.hidden is None else torch.cat([self.hidden, hidden.detach()], dim=1)
            every = positions if self.positions is None else torch.cat([self.positions, positions])
            self.hidden, self.positions = kept[:, -self.window:], every[-self.window:]
            counted = hidden[:, max(0, self.statistics_skip - start):]
            if counted.shape[1]:
                self.statistics.update(self.queries(counted))
        if self.arrival_scores is not None:
            self.pending = self.arrival_scores(hidden)

    def take_arrival_scores(self, new: int, layer: int) -> torch.Tensor:
        """The scores of the ``new`` tokens being appended (batch, kv_heads, new); an error if none arrived."""
        pending, self.pending = self.pending, None
        if pending is None or pending.shape[-1] != new:
            raise CurKVError(f"layer {layer} received {new} new tokens but their hidden states were not observed: "
                             "pass the CurKVCache to the model it was built with "
                             "(model(..., past_key_values=cache) or model.generate(..., past_key_values=cache))")
        return pending

    def observation(self) -> Observation | None:
        """The recorded window, or None if nothing was observed (or no window is kept)."""
        if self.hidden is None or not self.statistics.count:
            return None
        return Observation(self.hidden, self.positions, self.statistics)

    def nbytes(self) -> int:
        """Bytes held by the recorded window and the query statistics."""
        window = 0 if self.hidden is None else self.hidden.numel() * self.hidden.element_size()
        return window + self.statistics.nbytes()

    def map_batch(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Apply a batch-dimension operation to the recorded hidden states."""
        if self.hidden is not None:
            self.hidden = fn(self.hidden)
        self.statistics.map_batch(fn)
