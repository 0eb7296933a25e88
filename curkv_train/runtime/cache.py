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

import copy
import dataclasses
import functools
import logging
import os

import torch
from transformers import PreTrainedModel
from transformers.cache_utils import Cache

from curkv_train.core.observation import QueryStatistics
from curkv_train.core.selection import ADAPTIVE, check_keep_ratio
from curkv_train.core.shapes import kv_shape, text_config
from curkv_train.core.errors import CurKVError
from curkv_train.runtime.allocation import LayerBudget, resolve_layer_budget
from curkv_train.runtime.layer import CurKVLayer
from curkv_train.runtime.observer import ObservationBuffer
from curkv_train.runtime.scorer import Scorer
from curkv_train.runtime.tiers import TierSettings, check_whole

log = logging.getLogger(__name__)

# A prefill's first compressions are scored a group of layers at a time, as many as hold this many tokens: layer by
# layer, scoring is tens of small operators whose cost hardly depends on the tokens below some thousands
SCORING_BATCH_TOKENS = 4096


def check_full_attention(model: PreTrainedModel) -> int | None:
    """CurKVError unless every layer of ``model`` attends fully; returns the sliding window its masks apply to every
    layer (Mistral-style configs: a warning, and :func:`~curkv_train.runtime.attention.record_cache_layer` refuses a
    step whose held and new tokens outgrow it), or None."""
    config = text_config(model.config)
    layer_types = set(getattr(config, "layer_types", None) or ["full_attention"])
    if layer_types != {"full_attention"}:
        raise CurKVError(f"CurKVCache supports full-attention layers only, the model has {sorted(layer_types)}")
    window = getattr(config, "sliding_window", None)
    if window:
        log.warning("the model's sliding window (%s tokens) is not applied to compressed tokens: the cache serves "
                    "it while held and new tokens fit in the window, and refuses a step past it", window)
    return window or None


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
            tokens seen); ρ still applies while it holds fewer. Under a layer budget it bounds the mean
            over layers, to a token per layer's rounding (a sensitive layer may hold more, another less).
            Must cover n_sink + the hot tier + the ``compress_every`` windows − 1 tokens arriving between
            compressions.
        max_bytes: the budget in bytes for the whole cache of one sequence (what a server sizes by),
            turned into ``max_tokens`` with every token counted as dense (cold tokens cost less, so the
            bytes held stay below it); with both, the smaller budget wins. A batch of B unpadded
            sequences holds up to B times it: the budget is per sequence.
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
        scorer_precision: the scorer's :attr:`Scorer.matmul_precision` for this cache (``highest`` or
            ``medium``: bfloat16 operands in the query features' three attention-sized products); default
            the scorer's own (``highest`` unless set).
        scoring_batch_tokens: a prefill's first compressions are scored several layers at a time, as many as hold
            this many of its tokens (:meth:`Scorer.score_layers`; 4096: four layers at 1K tokens, two at 2K, one
            beyond): the same scores, from fewer, larger operators. Until its group is scored a layer holds the
            whole prompt; 0 or 1 scores each layer as it runs.
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
                 factored_attention: bool = True, compile_scorer: bool = False,
                 scorer_precision: str | None = None, scoring_batch_tokens: int = SCORING_BATCH_TOKENS) -> None:
        from curkv_train.runtime.attention import install_runtime_attention
        from curkv_train.runtime.serialization import check_scorer_fits, load_scorer

        if isinstance(scorer, Scorer):
            check_scorer_fits(scorer, model)
        else:
            scorer = load_scorer(scorer, model=model)
        self.sliding_window = check_full_attention(model)
        scorer = scorer if scorer_precision is None else dataclasses.replace(scorer, matmul_precision=scorer_precision)
        self.scorer, self.model = scorer.compiled() if compile_scorer else scorer, model
        check_whole("scoring_batch_tokens", scoring_batch_tokens)
        if scoring_batch_tokens is None or scoring_batch_tokens < 0:
            raise CurKVError(f"scoring_batch_tokens must be 0 or more, got {scoring_batch_tokens!r}")
        self.scoring_batch_tokens = scoring_batch_tokens
        self.awaiting: list[CurKVLayer] = []  # layers whose first compression waits for its group's scores
        window = scorer.window if window is None else window
        half = max(1, scorer.estimator.head_dim // 2)
        self.settings = TierSettings(
            keep_ratio=check_keep_ratio(keep_ratio, allow_adaptive=True), n_sink=scorer.n_sink if n_sink is None else n_sink,
            window=window, hot_tokens=window * (hot_windows if hot else 1), interval=window * compress_every,
            warm_tokens=window * warm_windows if warm else 0, cold=cold,
            cold_block=4 * window if cold_block is None else cold_block,
            cold_rows=half if cold_rows is None else cold_rows, cold_channels=half if cold_channels is None else cold_channels,
            cold_core=cold_core,
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

    def __deepcopy__(self, memo: dict) -> "CurKVCache":
        """A copy holding its own tokens, sharing the base model and the scorer (``copy.deepcopy(prompt_cache)``
        is how transformers reuses a prompt's cache; copying them would duplicate every weight)."""
        memo[id(self.model)], memo[id(self.scorer)] = self.model, self.scorer
        copied = type(self).__new__(type(self))
        memo[id(self)] = copied  # the layers' score functions are bound to this cache: rebound to the copy
        copied.__dict__.update(copy.deepcopy(self.__dict__, memo))
        return copied

    def _observer(self, layer: int) -> ObservationBuffer:
        """An empty observation buffer sized for the scorer's needs at ``layer``."""
        scorer = self.scorer
        arrival = functools.partial(scorer.token_scores, layer) if scorer.scores_on_arrival else None
        skip = scorer.estimator.statistics_skip if scorer.observation_window else 0
        return ObservationBuffer(scorer.observation_window, arrival, skip)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int,
               cache_kwargs: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Cache.update, and a prefill's first compressions scored a group of layers at a time (:meth:`score_awaiting`):
        a layer's compression waits, its tokens held, until the group is full or the last layer has run."""
        if self.awaiting and layer_idx <= self.awaiting[-1].layer_idx:  # a pass stopped before its last layer
            self.score_awaiting()
        layer = self.layers[layer_idx]
        # only a first compression is scored in a group: a layer that has compressed needs no group (a decoding step
        # then asks the scorer nothing)
        group = 1 if layer.compressible_seen else self.scoring_group(key_states)
        layer.defer_scoring = group > 1
        out = super().update(key_states, value_states, layer_idx, cache_kwargs)
        if layer.awaiting_scores:
            self.awaiting.append(layer)
        if self.awaiting and (len(self.awaiting) >= group or layer_idx == len(self.layers) - 1):
            self.score_awaiting()
        return out

    def scoring_group(self, key_states: torch.Tensor) -> int:
        """How many layers' compressions after an update of ``key_states`` (batch, kv_heads, new, head_dim) are scored
        together: as many as hold ``scoring_batch_tokens`` of the new tokens, if the scorer can
        (:meth:`Scorer.batches_layers`), else 1. A subclass that scores its own way (overrides ``_score``) is
        scored layer by layer, through it."""
        group = self.scoring_batch_tokens // max(1, key_states.shape[-2])
        own_score = type(self)._score is not CurKVCache._score
        return group if group > 1 and not own_score and self.scorer.batches_layers(key_states) else 1

    def score_awaiting(self) -> None:
        """Score the layers whose compressions wait (:attr:`awaiting`) in one pass, and let them compress."""
        layers, self.awaiting = [layer for layer in self.awaiting if layer.awaiting_scores], []
        if layers:
            for layer, logits in zip(layers, self._score_layers(layers)):
                layer.compress(logits)

    def _score_layers(self, layers: list[CurKVLayer]) -> list[torch.Tensor]:
        """Estimator logits (batch, kv_heads, tokens) of each of ``layers``, every one holding the tokens seen."""
        return self.scorer.score_layers(self.model, [layer.layer_idx for layer in layers],
                                        [layer.keys for layer in layers], [layer.values for layer in layers],
                                        [layer.observer.observation() for layer in layers],
                                        [layer.token_scores for layer in layers],
                                        [layer.held_projected_keys() for layer in layers])

    def _score(self, layer: int, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor, end: int,
               observation, token_scores, projected_keys: torch.Tensor | None = None) -> torch.Tensor:
        """Estimator logits (batch, kv_heads, tokens) for held tokens at per-head ``positions`` (``projected_keys``:
        their pre-RoPE keys, if the layer recorded them)."""
        if keys.shape[-2] == end:  # nothing evicted or spilled yet: every head holds 0 .. end - 1
            positions = torch.arange(end, device=keys.device)  # shared: a third of the tables to gather
        return self.scorer.score_layer(self.model, layer, keys, values, positions, end=end, observation=observation,
                                       token_scores=token_scores, projected_keys=projected_keys)

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
        """Bytes the observation takes once filled, whatever the length: per layer the ring of the window's
        pre-RoPE queries (query heads × head_dim wide, which need not be the hidden size) and their moments."""
        shape = kv_shape(self.model.config)
        window = self.scorer.observation_window
        if not window:
            return 0
        element = torch.empty((), dtype=self.model.dtype).element_size()
        ring = window * shape.num_attention_heads * shape.head_dim * element
        return shape.num_layers * (ring + QueryStatistics.nbytes_for(shape.num_attention_heads, shape.head_dim))

    def tokens_within(self, max_bytes: int) -> int:
        """Tokens per (layer, KV head) a budget of ``max_bytes`` for one sequence's cache pays for: all but one of
        the slots it pays for, the one the token that triggers a compression is written into before the
        compression replaces the tensors."""
        check_whole("max_bytes", max_bytes)
        budget = (max_bytes - self.observation_bytes()) // self.bytes_per_token() - 1
        if budget < self.settings.fixed_tokens:
            raise CurKVError(f"max_bytes {max_bytes} pays for {max(budget, 0)} tokens per (layer, KV head), fewer than "
                             f"the {self.settings.fixed_tokens} every layer always holds (n_sink + hot tier + interval - 1)"
                             f"; give at least {(self.settings.fixed_tokens + 1) * self.bytes_per_token() + self.observation_bytes()} "
                             "bytes or lower n_sink / window / hot_windows / compress_every")
        return budget

    def token_bound(self, layer_idx: int = 0) -> int:
        """Most tokens layer ``layer_idx`` may hold per (batch, KV head) at its current length."""
        layer, settings = self.layers[layer_idx], self.settings
        pending = settings.hot_tokens + settings.interval - 1
        last_compression = layer.compressible_seen + layer.n_sink_held + settings.hot_tokens  # tokens seen then
        return settings.n_sink + pending + settings.target(layer.compressible_seen, last_compression, layer_idx)
