"""One decoder layer of :class:`~curkv_train.runtime.cache.CurKVCache`: appends, compresses and serves attention
(the tiers, their order and the compression schedule are described in :mod:`curkv_train.runtime.cache`)."""

from __future__ import annotations

from typing import Any, Callable

import torch
from transformers.cache_utils import CacheLayerMixin

from curkv_train.core.selection import compress_kv, compressible_mask, kept_count, newest_places, select_kept
from curkv_train.core.errors import CurKVError
from curkv_train.runtime import cur
from curkv_train.runtime.buffer import buffer_of, buffered
from curkv_train.runtime.observer import ObservationBuffer
from curkv_train.runtime.tiers import ColdBlock, TierSettings

# (layer, keys, values, positions, end, observation, token_scores, projected_keys, valid=None) -> (batch, kv_heads,
# tokens) keep logits
ScoreFn = Callable[..., torch.Tensor]


class CurKVLayer(CacheLayerMixin):
    """One decoder layer's compressed cache.

    Dense tensors hold [sinks | warm | hot] in that order: ``keys``/``values``
    (batch, kv_heads, dense, head_dim) and ``positions`` (batch, kv_heads, dense), the
    absolute position of each held token in the narrowest integer dtype. Cold blocks
    sit in ``cold``. The attention of each step sees the cold blocks reconstructed
    from their factors (a transient; the cache keeps only the factors) followed by the
    dense tokens and the new ones.

    A scorer that scores each token once when it arrives (the ``hidden`` family) leaves its
    logits in ``token_scores`` (batch, kv_heads, dense), aligned with the dense tensors; the
    layer's recent attention inputs sit in ``observer`` (query-aware scorers read them).

    Args:
        layer_idx: decoder layer index (for the estimator's per-layer parameters).
        settings: the tier settings shared by all layers.
        score_fn: (layer, keys, values, positions, end, observation, token_scores, projected_keys, valid=None) ->
            (batch, kv_heads, tokens) keep logits of the held dense tokens (projected_keys: their pre-RoPE keys
            when the layer has them, else None; valid: (batch, kv_heads, tokens) False at padding, a ragged layer's
            heads scored together).
        observer: the layer's recorded attention inputs (filled through :meth:`observe`).
    """

    is_sliding = False
    # the ragged storage this step's attention reads instead of what update returned (RaggedCurKVLayer, under
    # joint allocation); never set here
    ragged_step = None
    keys = buffered("keys", -2)
    values = buffered("values", -2)
    positions = buffered("positions", -1)
    token_scores = buffered("token_scores", -1)

    def __init__(self, layer_idx: int, settings: TierSettings, score_fn: ScoreFn, observer: ObservationBuffer) -> None:
        # Decoding appends in place, into room for a window of tokens at a time: a compression interval's
        # room (2 windows) would sit half empty on average, counted as held (one extra copy per interval).
        self.buffer_headroom = settings.window
        super().__init__()
        self.layer_idx, self.settings, self.score_fn, self.observer = layer_idx, settings, score_fn, observer
        self.positions: torch.Tensor | None = None
        self.token_scores: torch.Tensor | None = None
        self.cold: list[ColdBlock] = []
        # Factored cold attention (runtime.attention): the pre-hook sets the flag for the coming
        # update, which leaves the cold blocks it did not reconstruct in factored_cold.
        self.factored_attention = False
        self.factored_cold: tuple[ColdBlock, ...] = ()
        self.seen = self.compressible_seen = 0
        self.n_sink_held = self.n_warm = self.n_hot = 0
        self.projected_keys: torch.Tensor | None = None  # the coming update's pre-RoPE keys (observe_keys)
        # Set by the cache for an update whose first compression it scores together with other layers' (a prefill):
        # the compression then waits, its tokens held, until the cache hands it its scores (compress).
        self.defer_scoring = self.awaiting_scores = False

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Empty dense tensors shaped like the first keys/values."""
        self.dtype, self.device = key_states.dtype, key_states.device
        self.keys = key_states[..., :0, :]
        self.values = value_states[..., :0, :]
        self.positions = torch.zeros(key_states.shape[:2] + (0,), dtype=torch.int16, device=self.device)
        if self.observer.arrival_scores is not None:
            self.token_scores = torch.zeros(key_states.shape[:2] + (0,), device=self.device)
        self.is_initialized = True

    def observe_hidden(self, hidden: torch.Tensor) -> None:
        """Record the attention inputs (batch, new, hidden_size) of the tokens the next update appends."""
        self.observer.observe_hidden(hidden)

    def observe_queries(self, queries: torch.Tensor) -> None:
        """Record the pre-RoPE queries (batch, heads, new, head_dim) of the tokens the next update appends."""
        self.observer.observe_queries(queries, self.seen)

    def observe_keys(self, keys: torch.Tensor) -> None:
        """Record the pre-RoPE keys (batch, kv_heads, new, head_dim) of the tokens the next update appends, until it
        has run (:meth:`held_projected_keys`)."""
        self.projected_keys = keys

    def held_projected_keys(self) -> torch.Tensor | None:
        """The recorded pre-RoPE keys if they are every held dense token's (a first update, as in a prefill), else
        None."""
        keys = self.projected_keys
        if keys is None or keys.shape[-2] != self.seen or self.keys.shape[-2] != self.seen:
            return None
        return keys

    @property
    def cold_tokens(self) -> int:
        """Tokens per (batch, KV head) held in cold blocks."""
        return sum(block.tokens for block in self.cold)

    @property
    def held_tokens(self) -> int:
        """Tokens per (batch, KV head) held in all tiers."""
        return self.cold_tokens + (0 if self.keys is None else self.keys.shape[-2])

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor,
               cache_kwargs: dict[str, Any] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Append new tokens, compress if due, and return what this step attends to.

        Args:
            key_states, value_states: (batch, kv_heads, new, head_dim) post-RoPE keys / values.

        Returns:
            (keys, values) (batch, kv_heads, held_before + new, head_dim): cold blocks
            reconstructed, then the dense tokens held before this step, then the new ones.
            When the pre-hook flagged this step's attention as factored, the dense tokens
            only, and the cold blocks are left in ``factored_cold`` for the attention.
        """
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self._append(key_states, value_states)
        keys, values = self.keys, self.values
        factored, self.factored_attention = self.factored_attention, False
        self.factored_cold = tuple(self.cold) if factored else ()
        if self.cold and not factored:
            keys = torch.cat([cur.reconstruct(block.keys) for block in self.cold] + [keys], dim=-2)
            values = torch.cat([cur.reconstruct(block.values) for block in self.cold] + [values], dim=-2)
        if self._compression_due():
            if self.defer_scoring and self._first_compression_scores():
                self.awaiting_scores = True
            else:
                self.compress()
        if not self.awaiting_scores:
            self.projected_keys = None
        return keys, values

    def _first_compression_scores(self) -> bool:
        """Whether the compression due now is the first (every token seen is held, densely) and evicts, so scores
        tokens: what the cache may score together with other layers' (:meth:`compress` with ``logits``)."""
        settings = self.settings
        aged = self.n_hot - settings.hot_tokens
        if self.cold or self.keys.shape[-2] != self.seen or aged <= 0:
            return False
        return settings.target(self.compressible_seen + aged, self.seen, self.layer_idx) < self.n_warm + aged

    def _append(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Add new tokens to the dense tensors; the first ``n_sink`` ever seen become sinks, the rest hot."""
        new = key_states.shape[-2]
        dtype = cur.narrow_int_dtype(self.seen + new)
        if self.positions.dtype != dtype:
            self.positions = self.positions.to(dtype)
        positions = torch.arange(self.seen, self.seen + new, device=self.device, dtype=dtype)
        room = self._room()
        buffer_of(self, "keys").append(key_states, room)
        buffer_of(self, "values").append(value_states, room)
        buffer_of(self, "positions").append(positions.expand(*key_states.shape[:2], new), room)
        if self.token_scores is not None:
            arrived = self.observer.take_arrival_scores(new, self.layer_idx)
            buffer_of(self, "token_scores").append(arrived.to(self.token_scores.dtype), room)
        self.seen += new
        sinks = min(self.settings.n_sink, self.seen)
        self.n_hot += new - (sinks - self.n_sink_held)
        self.n_sink_held = sinks

    def _room(self) -> int:
        """Tokens of room an append that reallocates makes: a window, but no more than arrive up to the next
        compression (which replaces the tensors), so no room outlasts it and a byte budget holds."""
        settings = self.settings
        return max(1, min(settings.window, settings.hot_tokens + settings.interval - self.n_hot))

    def _compression_due(self) -> bool:
        """Once a compression interval of tokens has piled up past the hot tier, however they arrived
        (one at a time or in chunks: after a first compression, a stream fed in chunks that divide the interval
        compresses when generation would; docs/runtime.md)."""
        return self.n_hot - self.settings.hot_tokens >= self.settings.interval

    @torch.no_grad()
    def compress(self, logits: torch.Tensor | None = None) -> None:
        """Move tokens past the hot tier into warm, keep the top ones by score, spill warm overflow to cold.

        ``logits``: (batch, kv_heads, held) the held dense tokens' scores if the cache computed them (a compression
        that waited for them, :attr:`awaiting_scores`); default: scored here."""
        if logits is not None:  # the wait is over, and the keys it kept for the scores are read
            self.awaiting_scores, self.projected_keys = False, None
        settings = self.settings
        aged = self.n_hot - settings.hot_tokens
        if aged <= 0:
            return
        self.compressible_seen += aged
        self.n_hot = settings.hot_tokens
        candidates = self.n_warm + aged
        target = settings.target(self.compressible_seen, self.seen, self.layer_idx)
        self._drop_cold_beyond(target)
        keep = max(0, target - self.cold_tokens)
        if keep < candidates:
            self._evict(candidates, keep, logits)
        self.n_warm = min(keep, candidates)
        if settings.cold and settings.ratio(self.seen, self.layer_idx) < 1.0:
            self._spill_to_cold()

    def _drop_cold_beyond(self, target: int) -> None:
        """Evict the oldest cold tokens while the cold tier alone holds more than ``target`` compressible tokens
        (the keep ratio fell: the adaptive one past 4K tokens): cold blocks are never re-scored, and left
        in place they would hold more than ρ of the tokens seen and crowd every warm token out."""
        while self.cold and self.cold_tokens > target:
            excess, oldest = self.cold_tokens - target, self.cold[0]
            if oldest.tokens <= excess:
                self.cold.pop(0)
            else:
                self.cold[0] = ColdBlock(cur.drop_leading(oldest.keys, excess), cur.drop_leading(oldest.values, excess))

    def _evict(self, candidates: int, keep: int, logits: torch.Tensor | None = None) -> None:
        """Keep the ``keep`` best of the ``candidates`` warm tokens per head (select_kept + compress_kv):
        the newest ⌊recent_share·keep⌋ of them, and the best-scored of the rest.

        Every held dense token is scored (sinks and hot ones too, so a query-aware score sees
        the whole held cache), and only the candidates compete.
        """
        if logits is None:
            logits = self.score_fn(self.layer_idx, self.keys, self.values, self.positions.long(), self.seen,
                                   self.observer.observation(), self.token_scores, self.held_projected_keys())
        competing = compressible_mask(logits.shape[-1], self.n_sink_held, self.n_hot, device=logits.device)
        logits = logits.masked_fill(newest_places(competing, keep, self.settings.recent_share), float("inf"))
        # select_kept keeps ⌈ρ'·candidates⌉; ρ' = keep / candidates gives exactly ``keep``.
        keep_idx = select_kept(logits, self.n_sink_held, self.n_hot, keep / candidates)
        self.keys, self.values = compress_kv(self.keys, self.values, keep_idx, backend=self.settings.backend)
        self.positions = self.positions.gather(-1, keep_idx)
        if self.token_scores is not None:
            self.token_scores = self.token_scores.gather(-1, keep_idx)

    def _spill_to_cold(self) -> None:
        """Factor the oldest warm tokens beyond the warm capacity into a new cold block."""
        settings = self.settings
        capacity = kept_count(settings.warm_tokens, settings.ratio(self.seen, self.layer_idx))
        overflow = self.n_warm - capacity
        if overflow < settings.cold_block:
            return
        start, stop = self.n_sink_held, self.n_sink_held + overflow
        self.cold.append(ColdBlock(self._factor(self.keys[..., start:stop, :]),
                                   self._factor(self.values[..., start:stop, :])))
        self.keys = torch.cat([self.keys[..., :start, :], self.keys[..., stop:, :]], dim=-2)
        self.values = torch.cat([self.values[..., :start, :], self.values[..., stop:, :]], dim=-2)
        self.positions = torch.cat([self.positions[..., :start], self.positions[..., stop:]], dim=-1)
        if self.token_scores is not None:
            self.token_scores = torch.cat([self.token_scores[..., :start], self.token_scores[..., stop:]], dim=-1)
        self.n_warm -= overflow

    def _factor(self, block: torch.Tensor) -> cur.CurFactors:
        """CUR factors (+ residual when compensation is on) of a (batch, kv_heads, tokens, head_dim) block."""
        settings = self.settings
        factors = cur.cur_decompose(block, settings.cold_rows, settings.cold_channels, core=settings.cold_core)
        if settings.compensation:
            count = cur.residual_count(block.shape[-2], block.shape[-1], settings.compensation_ratio)
            factors = cur.compensate(factors, block, count)
        return factors

    def get_mask_sizes(self, cache_position: torch.Tensor) -> tuple[int, int]:
        """(kv_length, kv_offset): held + new tokens, placed so the new ones sit at their true positions."""
        held = self.held_tokens
        return held + cache_position.shape[0], self.seen - held

    def get_seq_length(self) -> int:
        """Tokens seen so far (not held): new positions continue from here."""
        return self.seen

    def get_max_cache_shape(self) -> int:
        """No fixed maximum length."""
        return -1

    def nbytes(self) -> int:
        """Bytes held: dense K/V, positions and stored token scores (with their headroom), every cold
        factor and the observation window."""
        buffers = [buffer_of(self, name) for name in ("keys", "values", "positions", "token_scores")]
        return (sum(buffer.nbytes() for buffer in buffers if buffer is not None)
                + sum(block.nbytes() for block in self.cold) + self.observer.nbytes())

    def crop(self, max_length: int) -> None:
        """Drop tokens past ``max_length``; only possible before anything was compressed."""
        if max_length < 0:
            max_length = self.seen + max_length
        if max_length >= self.seen:
            return
        if self.compressible_seen or self.cold:
            raise CurKVError("a CurKVCache cannot be cropped after it compressed tokens; "
                             "use a fresh cache (assisted generation and cache rollback are not supported)")
        self.observer.crop(max_length)
        # copies, not views: a view would keep the whole earlier storage alive while nbytes() counted the view
        self.keys, self.values = self.keys[..., :max_length, :].clone(), self.values[..., :max_length, :].clone()
        self.positions = self.positions[..., :max_length].clone()
        if self.token_scores is not None:
            self.token_scores = self.token_scores[..., :max_length].clone()
        self.seen = max_length
        self.n_sink_held = min(self.settings.n_sink, max_length)
        self.n_hot = max_length - self.n_sink_held

    def reset(self) -> None:
        """Forget everything held."""
        self.__init__(self.layer_idx, self.settings, self.score_fn, self.observer.emptied())

    def _map_batch(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Apply a batch-dimension operation to every held tensor."""
        if not self.is_initialized:
            return
        self.keys, self.values, self.positions = fn(self.keys), fn(self.values), fn(self.positions)
        if self.token_scores is not None:
            self.token_scores = fn(self.token_scores)
        self.observer.map_batch(fn)
        self.cold = [ColdBlock(block.keys.map(fn), block.values.map(fn)) for block in self.cold]

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Reorder the batch for beam search."""
        self._map_batch(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        """Repeat every batch entry ``repeats`` times."""
        self._map_batch(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep only the batch entries ``indices``."""
        self._map_batch(lambda t: t[indices])
