"""CurKVCache: a transformers Cache that keeps what the trained estimator values (DESIGN §6).

Per layer the cache holds, per (batch, KV head):

- **sinks**: the first ``n_sink`` tokens, never evicted;
- **hot**: the last ``hot_windows`` windows of ``window`` tokens (only the last window
  with ``hot=False``), never evicted, plus the tokens that arrived since the last compression;
- **warm**: older tokens kept, dense: at each compression the newest ⌊recent_share·k⌋ of
  the k places, the rest by estimator score (top-k), at most
  ⌈ρ·warm_windows·window⌉ of them when the cold tier is on;
- **cold** (opt-in, ``cold=True``): warm overflow, oldest first, held as CUR factors
  (+ sparse residual) per block of at least ``cold_block`` tokens (:mod:`curkv_train.runtime.cur`).
  Off by default: it holds fewer bytes than the dense tiers at the same keep ratio, but
  on SmolLM2-135M it costs quality and decode speed (docs/runtime.md has the figures);
  without it every kept token stays dense.

Compression runs each time ``compress_every`` windows of tokens have piled up past the hot
tier (a prefill or chunk at least that long compresses right after it): the tokens that
left the hot tier join the warm ones, are re-scored at the current length, and the top
ones are kept so that the cache holds ⌈ρ·n⌉ tokens for the n seen so far, sinks and hot
tier included, as kvpress counts a compression ratio (capped by ``max_tokens`` /
``max_bytes``, a fixed-memory budget). Cold blocks are formed once and never re-selected.
Different heads keep different tokens but always the same count, so K and V stay dense
(batch, kv_heads, kept, head_dim) tensors.

Attention over the cold tier: with the model's attention switched to the factored
wrapper (:mod:`curkv_train.runtime.attention`, installed by the constructor for sdpa or
eager models), ``update`` returns only the dense tokens and the attention reads the cold
blocks through their factors (logits ((q·Rᵀ)·Uᵀ)·Cᵀ + residual, one softmax with the
dense tokens), so a step never holds a dense copy of a cold block. Otherwise (another
attention implementation, or ``factored_attention=False``) each step reconstructs
K_cold ≈ C·U·R (+ residual) and V_cold likewise as a transient inside ``update``.

Positions: ``get_seq_length`` reports the tokens *seen*, so generate's
``cache_position`` and the RoPE positions of new tokens continue from them, while
``get_mask_sizes`` reports the tokens *held* with an offset (as transformers' own
sliding-window layers do), so attention runs over the held tokens. That is exact
for batch 1 or unpadded batches; a left-padded batch would need its padding mask
re-indexed and is not supported.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
from dataclasses import dataclass
from typing import Any, Callable

import torch
from transformers import PreTrainedModel
from transformers.cache_utils import Cache, CacheLayerMixin

from curkv_train.errors import CurKVError
from curkv_train.core.observation import QueryStatistics
from curkv_train.core.selection import (
    ADAPTIVE,
    check_keep_ratio,
    check_recent_share,
    compress_kv,
    compressible_mask,
    kept_count,
    newest_places,
    share_of_compressible,
    select_kept,
)
from curkv_train.core.shapes import kv_shape, text_config
from curkv_train.kernels import BACKENDS
from curkv_train.runtime import cur
from curkv_train.runtime.allocation import LayerBudget, resolve_layer_budget
from curkv_train.runtime.buffer import buffer_of, buffered
from curkv_train.runtime.observer import ObservationBuffer
from curkv_train.runtime.scorer import Scorer

log = logging.getLogger(__name__)

# (layer, keys, values, positions, end, observation, token_scores) -> (batch, kv_heads, tokens) keep logits
ScoreFn = Callable[..., torch.Tensor]


def adaptive_keep_ratio(tokens: int) -> float:
    """The seed's length-adaptive keep ratio: < 1K tokens 1.0 (no compression), 1K–4K 0.5, > 4K 0.3."""
    if tokens < 1024:
        return 1.0
    return 0.5 if tokens <= 4096 else 0.3


@dataclass(frozen=True)
class TierSettings:
    """What one cache layer keeps; see :class:`CurKVCache` for the meaning of each field."""

    keep_ratio: float | str
    n_sink: int
    window: int
    hot_tokens: int
    warm_tokens: int
    cold: bool
    cold_block: int
    cold_rows: int
    cold_channels: int
    cold_core: str
    compensation: bool
    compensation_ratio: float
    max_tokens: int | None
    backend: str
    recent_share: float
    interval: int  # tokens that pile up past the hot tier before a compression
    layer_budget: LayerBudget | None = None

    def __post_init__(self) -> None:
        check_keep_ratio(self.keep_ratio, allow_adaptive=True)
        check_recent_share(self.recent_share)
        if (self.window < 1 or self.n_sink < 0 or self.hot_tokens < self.window or self.warm_tokens < 0
                or self.interval < 1):
            raise CurKVError(f"need window >= 1, n_sink >= 0, hot_windows >= 1, warm_windows >= 0 and compress_every "
                             f">= 1; got window {self.window}, n_sink {self.n_sink}, hot {self.hot_tokens}, warm "
                             f"{self.warm_tokens}, compression interval {self.interval} tokens")
        if min(self.cold_block, self.cold_rows, self.cold_channels) < 1:
            raise CurKVError(f"cold_block, cold_rows and cold_channels must be >= 1, got {self.cold_block}, "
                             f"{self.cold_rows}, {self.cold_channels}")
        if not 0.0 <= self.compensation_ratio <= 1.0:
            raise CurKVError(f"compensation_ratio must be in [0, 1], got {self.compensation_ratio}")
        if self.cold_core not in cur.CORES:
            raise CurKVError(f"unknown cold_core {self.cold_core!r}; expected one of {', '.join(cur.CORES)}")
        if self.max_tokens is not None and self.kept_cap < 0:
            raise CurKVError(f"a budget of {self.max_tokens} tokens per (layer, KV head) is smaller than what every "
                             f"layer always holds: {self.fixed_tokens} (n_sink {self.n_sink} + hot tier "
                             f"{self.hot_tokens} + {self.interval - 1} tokens arriving before the next compression); "
                             "raise the budget or lower n_sink / window / hot_windows / compress_every")
        if self.backend not in BACKENDS:
            raise CurKVError(f"unknown backend {self.backend!r}; expected one of {', '.join(BACKENDS)}")

    @property
    def fixed_tokens(self) -> int:
        """Tokens a layer may hold per (batch, KV head) besides the kept ones: sinks, hot tier, pending arrivals."""
        return self.n_sink + self.hot_tokens + self.interval - 1

    @property
    def kept_cap(self) -> int | None:
        """Most compressible tokens (warm + cold) held under ``max_tokens``, or None without a budget."""
        return None if self.max_tokens is None else self.max_tokens - self.fixed_tokens

    def ratio(self, seen: int, layer: int | None = None) -> float:
        """The keep ratio ρ in force after ``seen`` tokens: the mean over layers, or ``layer``'s share of it
        under a layer budget."""
        ratio = adaptive_keep_ratio(seen) if self.keep_ratio == ADAPTIVE else self.keep_ratio
        return ratio if layer is None or self.layer_budget is None else self.layer_budget.ratios(ratio)[layer]

    def target(self, compressible_seen: int, seen: int, layer: int | None = None) -> int:
        """Compressible tokens to hold (warm + cold) after ``compressible_seen`` of the ``seen`` tokens went
        by, in ``layer`` (the mean layer's without it): with the ``seen − compressible_seen`` protected ones,
        ρ of the tokens seen (:func:`~curkv_train.core.selection.share_of_compressible`).

        A token budget caps the mean over layers: under a layer budget the capped mean ratio is split
        across the layers like any other, so the whole cache holds what a uniform one would.
        """
        ratio = share_of_compressible(compressible_seen, seen - compressible_seen, self.ratio(seen))
        if self.max_tokens is not None and compressible_seen:
            ratio = min(ratio, self.kept_cap / compressible_seen)
        if layer is not None and self.layer_budget is not None:
            ratio = self.layer_budget.ratios(ratio)[layer]
        return kept_count(compressible_seen, ratio)


@dataclass
class ColdBlock:
    """Keys and values of a block of cold tokens as CUR factors, (batch, kv_heads, tokens, head_dim) each."""

    keys: cur.CurFactors
    values: cur.CurFactors

    @property
    def tokens(self) -> int:
        """Tokens per (batch, KV head) in the block."""
        return self.keys.shape[-2]

    def nbytes(self) -> int:
        """Bytes held by both factorizations."""
        return cur.nbytes(self.keys) + cur.nbytes(self.values)


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
        score_fn: (layer, keys, values, positions, end, observation, token_scores) ->
            (batch, kv_heads, tokens) keep logits of the held dense tokens.
        observer: the layer's recorded attention inputs (filled through :meth:`observe`).
    """

    is_sliding = False
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
            self.compress()
        return keys, values

    def _append(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Add new tokens to the dense tensors; the first ``n_sink`` ever seen become sinks, the rest hot."""
        new = key_states.shape[-2]
        dtype = cur.narrow_int_dtype(self.seen + new)
        if self.positions.dtype != dtype:
            self.positions = self.positions.to(dtype)
        positions = torch.arange(self.seen, self.seen + new, device=self.device, dtype=dtype)
        buffer_of(self, "keys").append(key_states)
        buffer_of(self, "values").append(value_states)
        buffer_of(self, "positions").append(positions.expand(*key_states.shape[:2], new))
        if self.token_scores is not None:
            arrived = self.observer.take_arrival_scores(new, self.layer_idx)
            buffer_of(self, "token_scores").append(arrived.to(self.token_scores.dtype))
        self.seen += new
        sinks = min(self.settings.n_sink, self.seen)
        self.n_hot += new - (sinks - self.n_sink_held)
        self.n_sink_held = sinks

    def _compression_due(self) -> bool:
        """Once a compression interval of tokens has piled up past the hot tier, however they arrived
        (one at a time or in chunks: a stream fed in chunks compresses when generation would)."""
        return self.n_hot - self.settings.hot_tokens >= self.settings.interval

    @torch.no_grad()
    def compress(self) -> None:
        """Move tokens past the hot tier into warm, keep the top ones by score, spill warm overflow to cold."""
        settings = self.settings
        aged = self.n_hot - settings.hot_tokens
        if aged <= 0:
            return
        self.compressible_seen += aged
        self.n_hot = settings.hot_tokens
        candidates = self.n_warm + aged
        keep = max(0, settings.target(self.compressible_seen, self.seen, self.layer_idx) - self.cold_tokens)
        if keep < candidates:
            self._evict(candidates, keep)
        self.n_warm = min(keep, candidates)
        if settings.cold and settings.ratio(self.seen, self.layer_idx) < 1.0:
            self._spill_to_cold()

    def _evict(self, candidates: int, keep: int) -> None:
        """Keep the ``keep`` best of the ``candidates`` warm tokens per head (select_kept + compress_kv):
        the newest ⌊recent_share·keep⌋ of them, and the best-scored of the rest.

        Every held dense token is scored (sinks and hot ones too, so a query-aware score sees
        the whole held cache), and only the candidates compete.
        """
        logits = self.score_fn(self.layer_idx, self.keys, self.values, self.positions.long(), self.seen,
                               self.observer.observation(), self.token_scores)
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
        self.keys, self.values = self.keys[..., :max_length, :], self.values[..., :max_length, :]
        self.positions = self.positions[..., :max_length]
        if self.token_scores is not None:
            self.token_scores = self.token_scores[..., :max_length]
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


def check_full_attention(model: PreTrainedModel) -> None:
    """CurKVError unless every layer of ``model`` attends fully (a warning for a configured sliding window)."""
    config = text_config(model.config)
    layer_types = set(getattr(config, "layer_types", None) or ["full_attention"])
    if layer_types != {"full_attention"}:
        raise CurKVError(f"CurKVCache supports full-attention layers only, the model has {sorted(layer_types)}")
    if getattr(config, "sliding_window", None):
        log.warning("the model's sliding window (%s tokens) is not applied to compressed tokens: generation "
                    "matches the model only while the sequence fits in the window", config.sliding_window)


class CurKVCache(Cache):
    """A transformers Cache compressed by a trained value estimator, with hot / warm / cold tiers.

    Use it as ``model.generate(ids, past_key_values=CurKVCache(scorer, model=model))``.

    Args:
        scorer: a :class:`Scorer` or the path of an exported scorer folder.
        model: the base model (for its rotary tables and shapes).
        keep_ratio: ρ, the share of the tokens seen the cache holds after each compression, sinks and
            hot tier included (kvpress's convention: keep 0.5 holds half), in (0, 1]; or ``"adaptive"``:
            1.0 below 1K tokens seen, 0.5 up to 4K, 0.3 beyond.
        recent_share: share of the places compressible tokens compete for at each compression given
            to the newest of them; the estimator fills the rest from the older ones (H2O's
            recent + heavy-hitter split). 0: every place by score; 1: a recent window. The
            default 0.5 streamed 6K-token text at keep 0.5 with 3.9 % more perplexity than the
            full cache, against 6.3 % at 0 and 4.4 % for a recent window, but kept fewer passkeys
            after a prompt (docs/runtime.md); 0 suits prompts that hide a needle.
        n_sink, window: always-kept leading tokens and the window unit; default the scorer's.
        hot: protect the last ``hot_windows`` windows; off = only the last window.
        hot_windows: size of the hot tier in windows.
        compress_every: compress once this many windows of tokens have piled up past the hot tier.
            Each compression scores every held token, so 2 (the default) halves that work against 1;
            with a hot tier of 2 windows, the most tokens held and the bytes allocated are those of the
            earlier defaults (3 hot windows, a compression every window; docs/runtime.md).
        warm: hold up to ⌈ρ·warm_windows·window⌉ kept tokens densely before they go cold;
            off = kept tokens go straight to the cold tier. Matters only with ``cold`` on:
            without a cold tier every kept token stays dense.
        warm_windows: size of the warm tier's span in windows.
        cold: factor warm overflow into CUR blocks (not while ρ = 1); off by default (see above).
        cold_block: least tokens per cold block (default 4 windows).
        cold_rows, cold_channels: CUR ranks r (tokens) and c (channels); default head_dim // 2.
        cold_core: ``optimal`` or ``intersection`` (see :mod:`curkv_train.runtime.cur`).
        compensation: keep the largest entries of each cold block's CUR residual.
        compensation_ratio: share of a block's entries kept as residual.
        max_tokens: a fixed-memory budget: at most this many tokens held per (layer, KV head),
            all tiers counted, however long generation runs (without it the cache holds ρ of the
            tokens seen); ρ still applies while it holds fewer. Must cover n_sink + the hot tier
            + window − 1 tokens arriving between compressions.
        max_bytes: the budget in bytes for the whole cache (what a server sizes by), turned into
            ``max_tokens`` with every token counted as dense (cold tokens cost less, so the
            bytes held stay below it); with both, the smaller budget wins.
        layer_budget: how ρ is split across layers: ``"scorer"`` (default) the scorer's calibrated
            :class:`~curkv_train.runtime.allocation.LayerBudget` when it has one (``curkv-train
            calibrate``), else one ratio for every layer; ``"uniform"`` one ratio for every layer; or
            a LayerBudget. The mean of the layers' ratios is ρ, so the bytes held are the same.
        backend: compaction and factored-attention kernel backend (auto, torch, triton).
        factored_attention: attend to cold blocks through their factors (the model's sdpa or
            eager attention is wrapped, see :mod:`curkv_train.runtime.attention`); False
            rebuilds them densely at each step.
        compile_scorer: score through ``torch.compile`` (:meth:`Scorer.compiled`): the first
            compression pays the compilation (tens of seconds), later ones run fused kernels
            (scoring 1.3–1.7× faster on an H200, where it is bound by operator launches;
            docs/runtime.md).
    """

    def __init__(self, scorer: Scorer | str | os.PathLike, model: PreTrainedModel,
                 keep_ratio: float | str = ADAPTIVE, *, recent_share: float = 0.5, n_sink: int | None = None,
                 window: int | None = None,
                 hot: bool = True, hot_windows: int = 2, compress_every: int = 2, warm: bool = True,
                 warm_windows: int = 10,
                 cold: bool = False, cold_block: int | None = None, cold_rows: int | None = None,
                 cold_channels: int | None = None, cold_core: str = "optimal", compensation: bool = True,
                 compensation_ratio: float = 0.05, max_tokens: int | None = None, max_bytes: int | None = None,
                 layer_budget: str | LayerBudget = "scorer", backend: str = "auto",
                 factored_attention: bool = True, compile_scorer: bool = False) -> None:
        from curkv_train.runtime.attention import install_runtime_attention
        from curkv_train.runtime.serialization import check_scorer_fits, load_scorer

        if isinstance(scorer, Scorer):
            check_scorer_fits(scorer, model)
        else:
            scorer = load_scorer(scorer, model=model)
        check_full_attention(model)
        self.scorer, self.model = scorer.compiled() if compile_scorer else scorer, model
        window = scorer.window if window is None else window
        half = max(1, scorer.estimator.head_dim // 2)
        self.settings = TierSettings(
            keep_ratio=check_keep_ratio(keep_ratio, allow_adaptive=True), n_sink=scorer.n_sink if n_sink is None else n_sink,
            window=window, hot_tokens=window * (hot_windows if hot else 1), interval=window * compress_every,
            warm_tokens=window * warm_windows if warm else 0, cold=cold, cold_block=cold_block or 4 * window,
            cold_rows=cold_rows or half, cold_channels=cold_channels or half, cold_core=cold_core,
            compensation=compensation, compensation_ratio=compensation_ratio, max_tokens=max_tokens,
            backend=backend, recent_share=recent_share, layer_budget=resolve_layer_budget(layer_budget, scorer))
        layers = [CurKVLayer(index, self.settings, self._score, self._observer(index))
                  for index in range(scorer.estimator.num_layers)]
        super().__init__(layers=layers)
        if max_bytes is not None:
            budget = self.tokens_within(max_bytes)
            self.settings = dataclasses.replace(self.settings, max_tokens=min(budget, max_tokens or budget))
            for layer in self.layers:
                layer.settings = self.settings
        self.factored_attention = install_runtime_attention(
            model, factored=cold and factored_attention, per_layer=self.settings.layer_budget is not None)

    def _observer(self, layer: int) -> ObservationBuffer:
        """An empty observation buffer sized for the scorer's needs at ``layer``."""
        scorer = self.scorer
        arrival = functools.partial(scorer.token_scores, layer) if scorer.scores_on_arrival else None
        skip = scorer.estimator.statistics_skip if scorer.observation_window else 0
        return ObservationBuffer(scorer.observation_window, arrival, skip)


    def _score(self, layer: int, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor, end: int,
               observation, token_scores) -> torch.Tensor:
        """Estimator logits (batch, kv_heads, tokens) for held tokens at per-head ``positions``."""
        return self.scorer.score_layer(self.model, layer, keys, values, positions, end=end, observation=observation,
                                       token_scores=token_scores)

    def nbytes(self) -> int:
        """Bytes actually held by the cache: K/V, CUR factors, residuals and position bookkeeping."""
        return sum(layer.nbytes() for layer in self.layers)

    def held_tokens(self, layer_idx: int = 0) -> int:
        """Tokens held per (batch, KV head) in layer ``layer_idx`` (all tiers)."""
        return self.layers[layer_idx].held_tokens

    def tier_sizes(self, layer_idx: int = 0) -> dict[str, int]:
        """Tokens per (batch, KV head) in each tier of layer ``layer_idx``, and the tokens seen."""
        layer = self.layers[layer_idx]
        return {"seen": layer.seen, "sink": layer.n_sink_held, "hot": layer.n_hot, "warm": layer.n_warm,
                "cold": layer.cold_tokens}

    def bytes_per_token(self) -> int:
        """Bytes one dense token costs the whole cache: K and V of every layer and KV head, its position
        (int32 counted) and, for scorers that score on arrival, its stored score."""
        shape = kv_shape(self.model.config)
        element = torch.empty((), dtype=self.model.dtype).element_size()
        per_head = 2 * shape.head_dim * element + 4 + (4 if self.scorer.scores_on_arrival else 0)
        return shape.num_layers * shape.num_kv_heads * per_head

    def observation_bytes(self) -> int:
        """Bytes the observation takes whatever the length (window of hidden states and query moments)."""
        shape = kv_shape(self.model.config)
        window = self.scorer.observation_window
        if not window:
            return 0
        element = torch.empty((), dtype=self.model.dtype).element_size()
        moments = QueryStatistics.nbytes_for(shape.num_attention_heads, shape.head_dim)
        return shape.num_layers * (window * shape.hidden_size * element + moments)

    def tokens_within(self, max_bytes: int) -> int:
        """Tokens per (layer, KV head) a budget of ``max_bytes`` for the whole cache pays for (batch 1)."""
        budget = (max_bytes - self.observation_bytes()) // self.bytes_per_token()
        if budget < self.settings.fixed_tokens:
            raise CurKVError(f"max_bytes {max_bytes} pays for {max(budget, 0)} tokens per (layer, KV head), fewer than "
                             f"the {self.settings.fixed_tokens} every layer always holds (n_sink + hot tier + interval - 1)"
                             f"; give at least {self.settings.fixed_tokens * self.bytes_per_token() + self.observation_bytes()} "
                             "bytes or lower n_sink / window / hot_windows / compress_every")
        return budget

    def token_bound(self, layer_idx: int = 0) -> int:
        """Most tokens layer ``layer_idx`` may hold per (batch, KV head) at its current length."""
        layer, settings = self.layers[layer_idx], self.settings
        pending = settings.hot_tokens + settings.interval - 1
        last_compression = layer.compressible_seen + layer.n_sink_held + settings.hot_tokens  # tokens seen then
        return settings.n_sink + pending + settings.target(layer.compressible_seen, last_compression, layer_idx)
