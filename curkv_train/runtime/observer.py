"""What CurKVCache keeps of the layers' attention for query-aware and hidden-state scorers.

A transformers Cache only receives keys and values. The hooks of
:mod:`curkv_train.runtime.attention` hand the cache, before each layer's update, the
attention module's input hidden states (for scorers that score a token on arrival) and the
module's own pre-RoPE queries as it projects them (no extra projection); the layer's
:class:`ObservationBuffer` keeps what its scorer reads: the last ``window`` queries and the
running moments of every query after the first ``statistics_skip`` tokens.

Decoding hands the buffer one query per layer and step, while the scorer reads it only when the
cache compresses (every ``window`` tokens). So the window is a ring of ``window`` slots a step
writes one query into, and the moments take the ring's unfolded queries in one batch when
``window`` of them have piled up or the observation is read: a step costs one copy, not a
concatenation and a moment update, and nothing beyond the window is held.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from curkv_train.core.observation import Observation, QueryStatistics, detached
from curkv_train.core.errors import CurKVError
from curkv_train.runtime.buffer import writable


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
        self.ring: torch.Tensor | None = None  # (batch, heads, window, head_dim); position p in slot p % window
        self.seen = 0  # queries observed
        self.unfolded = 0  # the newest queries in the ring not yet in the statistics
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
        """Record pre-RoPE queries (batch, heads, new, head_dim) of the tokens at positions start, start + 1, ...

        Successive calls cover successive positions (``start`` is the count observed before).
        """
        if not self.window:
            return
        queries, new = detached(queries), queries.shape[2]
        if self.ring is None:
            self.ring = queries.new_zeros(*queries.shape[:2], self.window, queries.shape[3])
        self.ring = writable(self.ring)
        if self.unfolded + new > self.window:  # more than the ring can hold unfolded: count them now
            self._fold()
            self._add_to_statistics(queries, start)
        else:
            self.unfolded += new
        kept = min(new, self.window)
        newest = queries[:, :, new - kept:]
        # the slots of positions start + new − kept, ... are one run of the ring or two (wrapping past its end);
        # copied by slices, a decode step's query is one operator, not a slot index built on the device
        first = (start + new - kept) % self.window
        head = min(kept, self.window - first)
        self.ring.narrow(2, first, head).copy_(newest if head == kept else newest[:, :, :head])
        if kept > head:
            self.ring.narrow(2, 0, kept - head).copy_(newest[:, :, head:])
        self.seen = start + new
        if self.unfolded == self.window:
            self._fold()

    def crop(self, length: int) -> None:
        """Forget the queries of positions >= ``length``, or a CurKVError (nothing changed) where that cannot be
        exact: the statistics already count some of them, or the ring has overwritten queries the window needs."""
        dropped = self.seen - length
        if not self.window or dropped <= 0:
            return
        if dropped > self.unfolded or self.seen > self.window:
            raise CurKVError(f"this CurKVCache cannot forget the queries of its last {dropped} tokens (its query "
                             f"statistics count them, or its {self.window}-query window moved past them): crop only "
                             f"within the first {self.window} tokens, or use a fresh cache (assisted generation and "
                             "cache rollback are not supported)")
        self.seen, self.unfolded = length, self.unfolded - dropped

    def _add_to_statistics(self, queries: torch.Tensor, start: int) -> None:
        """Add the queries at positions start, start + 1, ... that are not below ``statistics_skip``."""
        skipped = max(0, self.statistics_skip - start)
        counted = queries[:, :, skipped:] if skipped else queries  # a slice is an operator too
        if counted.shape[2]:
            self.statistics.update(counted)

    def _window_positions(self) -> torch.Tensor:
        """(W,) the positions the ring holds, oldest first."""
        return torch.arange(max(0, self.seen - self.window), self.seen, device=self.ring.device)

    def _fold(self) -> None:
        """Add the ring's unfolded queries to the statistics."""
        if self.unfolded:
            start = self.seen - self.unfolded  # counted on the host: reading it off the device would wait for it
            slots = torch.arange(start, self.seen, device=self.ring.device) % self.window
            self._add_to_statistics(self.ring[:, :, slots], start)
            self.unfolded = 0

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
        self._fold()
        if self.ring is None or not self.statistics.count:
            return None
        positions = self._window_positions()
        oldest = positions.shape[0] and (self.seen - positions.shape[0]) % self.window  # the slot of the oldest
        # oldest first: the ring's first slots as they are (a view) where the oldest sits in slot 0, as after a
        # prefill of a whole number of windows, else its two runs joined
        ring = self.ring.narrow(2, 0, positions.shape[0]) if oldest == 0 else \
            torch.cat([self.ring[:, :, oldest:], self.ring[:, :, :oldest]], dim=2)
        return Observation(ring, positions, self.statistics)

    def nbytes(self) -> int:
        """Bytes held by the recorded window and the query statistics."""
        window = 0 if self.ring is None else self.ring.numel() * self.ring.element_size()
        return window + self.statistics.nbytes()

    def map_batch(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Apply a batch-dimension operation to the recorded queries and statistics."""
        self._fold()
        if self.ring is not None:
            self.ring = fn(self.ring)
        self.statistics.map_batch(fn)
