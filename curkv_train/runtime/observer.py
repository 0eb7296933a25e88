"""What CurKVCache keeps of the layers' attention for query-aware and hidden-state scorers.

A transformers Cache only receives keys and values. The hooks of
:mod:`curkv_train.runtime.attention` hand the cache, before each layer's update, the
attention module's input hidden states (for scorers that score a token on arrival) and the
module's own pre-RoPE queries as it projects them (no extra projection); the layer's
:class:`ObservationBuffer` keeps what its scorer reads: the last ``window`` queries and the
running moments of every query after the first ``statistics_skip`` tokens.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from curkv_train.core.observation import Observation, QueryStatistics
from curkv_train.errors import CurKVError


class ObservationBuffer:
    """One layer's observation (recent queries, query statistics) and arriving tokens' scores.

    Args:
        window: how many of the latest queries to keep (0: keep none, and no statistics).
        arrival_scores: (hidden (batch, new, hidden_size)) -> (batch, kv_heads, new) logits of
            arriving tokens, for scorers that score a token once when it arrives; else None.
        statistics_skip: tokens at positions below it stay out of the statistics.
    """

    def __init__(self, window: int, arrival_scores: Callable[[torch.Tensor], torch.Tensor] | None,
                 statistics_skip: int = 0) -> None:
        self.window, self.arrival_scores, self.statistics_skip = window, arrival_scores, statistics_skip
        self.queries: torch.Tensor | None = None
        self.positions: torch.Tensor | None = None
        self.statistics = QueryStatistics()
        self.pending: torch.Tensor | None = None

    def emptied(self) -> "ObservationBuffer":
        """A new, empty buffer with the same settings."""
        return ObservationBuffer(self.window, self.arrival_scores, self.statistics_skip)

    def observe_hidden(self, hidden: torch.Tensor) -> None:
        """Score arriving tokens from their attention inputs (batch, new, hidden_size), if the scorer does."""
        if self.arrival_scores is not None:
            self.pending = self.arrival_scores(hidden)

    def observe_queries(self, queries: torch.Tensor, start: int) -> None:
        """Record pre-RoPE queries (batch, heads, new, head_dim) of the tokens at positions start, start + 1, ..."""
        if not self.window:
            return
        queries = queries.detach()
        positions = torch.arange(start, start + queries.shape[2], device=queries.device)
        kept = queries if self.queries is None else torch.cat([self.queries, queries], dim=2)
        every = positions if self.positions is None else torch.cat([self.positions, positions])
        self.queries, self.positions = kept[:, :, -self.window:], every[-self.window:]
        counted = queries[:, :, max(0, self.statistics_skip - start):]
        if counted.shape[2]:
            self.statistics.update(counted)

    def take_arrival_scores(self, new: int, layer: int) -> torch.Tensor:
        """The scores of the ``new`` tokens being appended (batch, kv_heads, new); an error if none arrived."""
        pending, self.pending = self.pending, None
        if pending is None or pending.shape[-1] != new:
            raise CurKVError(f"layer {layer} received {new} new tokens but their hidden states were not observed: "
                             "pass the CurKVCache to the model it was built with "
                             "(model(..., past_key_values=cache) or model.generate(..., past_key_values=cache))")
        return pending

    def observation(self) -> Observation | None:
        """The recorded observation, or None if nothing was observed (or no window is kept)."""
        if self.queries is None or not self.statistics.count:
            return None
        return Observation(self.queries, self.positions, self.statistics)

    def nbytes(self) -> int:
        """Bytes held by the recorded window and the query statistics."""
        window = 0 if self.queries is None else self.queries.numel() * self.queries.element_size()
        return window + self.statistics.nbytes()

    def map_batch(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Apply a batch-dimension operation to the recorded queries and statistics."""
        if self.queries is not None:
            self.queries = fn(self.queries)
        self.statistics.map_batch(fn)
