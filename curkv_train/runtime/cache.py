"""CurKVCache: a transformers Cache that keeps what the trained estimator values (DESIGN §6).

Per layer the cache holds, per (batch, KV head):

- **sinks**: the first ``n_sink`` tokens, never evicted;
- **hot**: the last ``hot_windows`` windows of ``window`` tokens (only the last window
  with ``hot=False``), never evicted, plus the tokens that arrived since the last compression;
- **warm**: older tokens kept, dense: at each compression the newest ⌊recent_share·k⌋ of
  the k places, the rest by estimator score (top-k), at most
  ⌈ρ·warm_windows·window⌉ of them when the cold tier is on;
- **cold** (opt-in, ``TierConfig(cold=True)``): warm overflow, oldest first, held as CUR factors
  (+ sparse residual) per block of at least ``cold_block`` tokens (:mod:`curkv_train.runtime.cur`).
  Off by default: it holds fewer bytes than the dense tiers at the same keep ratio, but
  costs quality and decode speed (docs/runtime.md has the figures); without it every kept
  token stays dense.

The tier sizes are a :class:`~curkv_train.runtime.cache_config.TierConfig`.

Compression runs each time ``compress_every`` windows of tokens have piled up past the hot
tier (a prefill or chunk at least that long compresses right after it): the tokens that
left the hot tier join the warm ones, are re-scored at the current length, and the top
ones are kept so that the cache holds ⌈ρ·n⌉ tokens for the n seen so far, sinks and hot
tier included, as kvpress counts a compression ratio (capped by ``max_tokens`` /
``max_bytes``, a fixed-memory budget). Cold blocks are formed once and never re-selected.
Different heads keep different tokens but always the same count, so K and V stay dense
(batch, kv_heads, kept, head_dim) tensors. With ``TierConfig(allocation="joint")`` the same totals are shared
out by score across layers and KV heads and each layer holds ragged storage
(:mod:`curkv_train.runtime.ragged_layer`, :mod:`curkv_train.runtime.joint`).

A hybrid model's sliding-window layers (``config.layer_types``) are held as transformers holds them and never
compressed; only its full-attention layers are (:mod:`curkv_train.runtime.hybrid`, docs/runtime.md "Hybrid models").

The model is touched only while the cache is open: the constructor installs the runtime's hooks
(:mod:`curkv_train.runtime.attention`) and :meth:`CurKVCache.close`, the end of a ``with`` block
or the cache's collection removes them and restores the attention implementation.

Attention over the cold tier: with the model's attention switched to the factored
wrapper (for sdpa or eager models, while the cache is open), ``update`` returns only the
dense tokens and the attention reads the cold blocks through their factors (logits
((q·Rᵀ)·Uᵀ)·Cᵀ + residual, one softmax with the dense tokens), so a step never holds a
dense copy of a cold block. Otherwise (another attention implementation, or
``ComputeConfig(factored_attention=False)``) each step reconstructs K_cold ≈ C·U·R
(+ residual) and V_cold likewise as a transient inside ``update``.

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
from typing import TypeVar

import torch
from transformers import PreTrainedModel
from transformers.cache_utils import Cache

from curkv_train.core.errors import CurKVError
from curkv_train.core.observation import QueryStatistics
from curkv_train.core.selection import ADAPTIVE, check_keep_ratio
from curkv_train.core.shapes import kv_shape, text_config
from curkv_train.runtime.allocation import LayerBudget, resolve_layer_budget
from curkv_train.runtime.attention import install_runtime_attention
from curkv_train.runtime.cache_config import ComputeConfig, TierConfig, check_whole, default_scoring_batch_tokens
from curkv_train.runtime.hybrid import SlidingWindowLayer, sliding_layers, sliding_window_of
from curkv_train.runtime.joint import across_layers
from curkv_train.runtime.layer import CurKVLayer
from curkv_train.runtime.observer import ObservationBuffer
from curkv_train.runtime.ragged_layer import RaggedCurKVLayer, keep_jointly
from curkv_train.runtime.scorer import Scorer
from curkv_train.runtime.serialization import check_scorer_fits, load_scorer
from curkv_train.runtime.tiers import TierSettings

log = logging.getLogger(__name__)

Config = TypeVar("Config", TierConfig, ComputeConfig)


def check_full_attention(model: PreTrainedModel) -> int | None:
    """The sliding window the model's masks apply to every compressed layer, or None; a CurKVError for layer types
    other than full and sliding attention (:func:`~curkv_train.runtime.hybrid.sliding_layers`).

    A hybrid model's window applies to its sliding-window layers only, which the cache keeps as transformers does:
    None. A Mistral-style config (a window, no sliding layer types) gets a warning, and
    :func:`~curkv_train.runtime.attention.record_cache_layer` refuses a step whose held and new tokens outgrow it."""
    if sliding_layers(model):
        return None
    window = getattr(text_config(model.config), "sliding_window", None)
    if window:
        log.warning("the model's sliding window (%s tokens) is not applied to compressed tokens: the cache serves "
                    "it while held and new tokens fit in the window, and refuses a step past it", window)
    return window or None


def checked_config(name: str, config: Config | None, kind: type[Config]) -> Config:
    """``config``, or ``kind()`` for None; a one-line CurKVError for anything but a ``kind``."""
    if config is None:
        return kind()
    if not isinstance(config, kind):
        raise CurKVError(f"{name} must be a {kind.__name__} (from curkv_train.runtime import {kind.__name__}), "
                         f"got {type(config).__name__}")
    return config



def resolved_tiers(tiers: TierConfig, scorer: Scorer) -> TierConfig:
    """``tiers`` with the allocation and head floor it leaves None taken from ``scorer`` (how it was trained), and
    the scoring batch it leaves None that allocation's default (:func:`default_scoring_batch_tokens`)."""
    allocation = tiers.allocation or scorer.allocation
    batch = tiers.scoring_batch_tokens
    return dataclasses.replace(tiers, allocation=allocation,
                               head_floor=scorer.head_floor if tiers.head_floor is None else tiers.head_floor,
                               scoring_batch_tokens=(default_scoring_batch_tokens(allocation) if batch is None
                                                     else batch))


def layer_budgets(tiers: TierConfig, choice: str | LayerBudget, scorer: Scorer) -> tuple[LayerBudget | None,
                                                                                        LayerBudget | None]:
    """(the per-head allocation's layer split, the joint allocation's prior budget) that the cache's
    ``layer_budget`` argument ``choice`` gives under ``tiers`` (resolved); one-line CurKVErrors for a budget the
    allocation cannot take."""
    if tiers.allocation != "joint":
        if tiers.budget_prior:
            raise CurKVError("budget_prior weighs a layer budget into the joint allocation; this cache's allocation "
                             "is per_head, which takes the budget itself (layer_budget)")
        return resolve_layer_budget(choice, scorer), None
    if not tiers.budget_prior:
        if isinstance(choice, LayerBudget):
            raise CurKVError("allocation='joint' decides each layer's share from the scores: a layer budget enters "
                             "only as a prior (TierConfig(budget_prior=...)), or pass TierConfig(allocation='per_head')")
        resolve_layer_budget(choice, scorer)
        return None, None
    prior = resolve_layer_budget(choice, scorer)
    if prior is None:
        raise CurKVError("budget_prior needs a layer budget: calibrate the scorer (curkv-train calibrate) or pass "
                         "layer_budget=LayerBudget(...), not 'uniform'")
    return None, prior


def compute_scorer(scorer: Scorer, compute: ComputeConfig) -> Scorer:
    """``scorer`` as ``compute`` runs it: through CUDA graphs (:meth:`Scorer.graphed`), compiled, or eager. A scorer
    compiled already is taken as it is: pass one made by :meth:`Scorer.graphed` or :meth:`Scorer.compiled` to every
    cache and they share one compilation (each copy compiles its own)."""
    if scorer.is_compiled:
        return scorer
    if compute.scoring_graphs:
        return scorer.graphed()
    return scorer.compiled() if compute.compile_scorer else scorer


class CurKVCache(Cache):
    """A transformers Cache compressed by a trained value estimator, with hot / warm / cold tiers.

    Use it as ``with CurKVCache(scorer, model, keep_ratio=0.5) as cache: model.generate(ids,
    past_key_values=cache)``. While it is open the model carries the runtime's hooks; :meth:`close`
    (the end of the ``with`` block, or the cache's collection) removes them, and a closed cache
    refuses further use.

    Args:
        scorer: a :class:`Scorer`, the path of an exported scorer folder or a shipped scorer's name.
        model: the base model (for its rotary tables and shapes).
        keep_ratio: ρ, the share of the tokens seen the cache holds after each compression, sinks and
            hot tier included (kvpress's convention: keep 0.5 holds half), in (0, 1]; or ``"adaptive"``:
            1.0 below 1K tokens seen, 0.5 up to 4K, 0.3 beyond.
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
            calibrate``), else one ratio for every layer, and under the joint allocation none (the scores
            decide each layer's share, unless ``TierConfig.budget_prior`` weighs it in); ``"uniform"`` one ratio
            for every layer; or a LayerBudget (under joint only as the prior's). The mean of the layers' ratios is
            ρ, so the bytes held are the same.
        tiers: the tiers' sizes and schedule (:class:`~curkv_train.runtime.cache_config.TierConfig`); default
            ``TierConfig()``.
        compute: kernels, factored attention, compilation and precision of the scoring
            (:class:`~curkv_train.runtime.cache_config.ComputeConfig`); default ``ComputeConfig()``.
    """

    def __init__(self, scorer: Scorer | str | os.PathLike, model: PreTrainedModel,
                 keep_ratio: float | str = ADAPTIVE, *, max_tokens: int | None = None, max_bytes: int | None = None,
                 layer_budget: str | LayerBudget = "scorer", tiers: TierConfig | None = None,
                 compute: ComputeConfig | None = None) -> None:
        self.tiers = checked_config("tiers", tiers, TierConfig)
        self.compute = checked_config("compute", compute, ComputeConfig)
        if isinstance(scorer, Scorer):
            check_scorer_fits(scorer, model)
        else:
            scorer = load_scorer(scorer, model=model)
        self.sliding_window = check_full_attention(model)
        if self.compute.scorer_precision is not None:
            scorer = dataclasses.replace(scorer, matmul_precision=self.compute.scorer_precision)
        self.scorer, self.model = compute_scorer(scorer, self.compute), model
        self.tiers = resolved_tiers(self.tiers, scorer)
        self.scoring_batch_tokens = self.tiers.scoring_batch_tokens
        self.awaiting: list[CurKVLayer] = []  # layers whose first compression waits for its group's scores
        self.joint_chunk = 1  # under joint allocation: layers scored together while the first compression waits
        split, prior = layer_budgets(self.tiers, layer_budget, scorer)
        self.settings = TierSettings.resolve(
            self.tiers, self.compute, keep_ratio=check_keep_ratio(keep_ratio, allow_adaptive=True),
            max_tokens=max_tokens, n_sink=scorer.n_sink, window=scorer.window, head_dim=scorer.estimator.head_dim,
            layer_budget=split, prior_budget=prior)
        self.joint = self.settings.allocation == "joint"
        self.sliding = frozenset(sliding_layers(model))
        if self.sliding and (split or prior) is not None:
            raise CurKVError("a layer budget on a hybrid model (sliding-window layers) is not supported yet; "
                             "pass layer_budget='uniform'")
        super().__init__(layers=self._build_layers(scorer.estimator.num_layers))
        self.last_compressed = self.compressed_layers[-1].layer_idx  # a pass's last scored layer
        if max_bytes is not None:
            budget = self.tokens_within(max_bytes)
            self.settings = dataclasses.replace(self.settings, max_tokens=min(budget, max_tokens or budget))
            for layer in self.compressed_layers:
                layer.settings = self.settings
        self._hold_model()

    def _build_layers(self, num_layers: int) -> list[CurKVLayer | SlidingWindowLayer]:
        """One cache layer per decoder layer: a compressed one (ragged under joint allocation), or transformers'
        sliding-window layer for a hybrid model's sliding layers (docs/runtime.md, "Hybrid models")."""
        layer_type = RaggedCurKVLayer if self.joint else CurKVLayer
        window = sliding_window_of(self.model) if self.sliding else 0
        return [SlidingWindowLayer(window) if index in self.sliding
                else layer_type(index, self.settings, self._score, self._observer(index))
                for index in range(num_layers)]

    @property
    def compressed_layers(self) -> list[CurKVLayer]:
        """The layers the cache compresses: every layer but a hybrid model's sliding-window ones."""
        return [layer for layer in self.layers if isinstance(layer, CurKVLayer)]

    def _hold_model(self) -> None:
        """Install the runtime's hooks (and attention wrapper) on the model until this cache is closed or collected
        (a finalizer that holds the hold, not the cache)."""
        hold = install_runtime_attention(self.model, factored=self.settings.cold and self.compute.factored_attention,
                                         per_layer=self.settings.layer_budget is not None, cache=self,
                                         ragged=self.joint)
        self.factored_attention = hold.factored
        self._finalizer = hold.release_with(self)

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` ran: the model no longer carries this cache's hooks."""
        return not self._finalizer.alive

    def close(self) -> None:
        """Remove the hooks this cache installed on the model and restore the attention implementation it replaced
        (another open cache on the same model keeps its own); idempotent. The tokens held stay readable."""
        self._finalizer()

    def __enter__(self) -> "CurKVCache":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def check_open(self) -> None:
        """A one-line CurKVError if the cache was closed."""
        if self.closed:
            raise CurKVError("this CurKVCache was closed (close() or the end of its `with` block); "
                             "build a new CurKVCache to generate again")

    def __deepcopy__(self, memo: dict) -> "CurKVCache":
        """An open copy holding its own tokens (and its own hold on the model), sharing the base model and the scorer
        (``copy.deepcopy(prompt_cache)`` is how transformers reuses a prompt's cache; copying them would duplicate
        every weight)."""
        self.check_open()
        memo[id(self.model)], memo[id(self.scorer)] = self.model, self.scorer
        copied = type(self).__new__(type(self))
        memo[id(self)] = copied  # the layers' score functions are bound to this cache: rebound to the copy
        state = {name: value for name, value in self.__dict__.items() if name != "_finalizer"}
        copied.__dict__.update(copy.deepcopy(state, memo))
        copied._hold_model()
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
        self.check_open()
        if self.awaiting and layer_idx <= self.awaiting[-1].layer_idx:  # a pass stopped before its last layer
            self.score_awaiting()
        layer = self.layers[layer_idx]
        if not isinstance(layer, CurKVLayer):  # a hybrid model's sliding-window layer, held as transformers does
            return super().update(key_states, value_states, layer_idx, cache_kwargs)
        # only a first compression is scored in a group: a layer that has compressed needs no group (a decoding step
        # then asks the scorer nothing)
        group = 1 if layer.compressible_seen else self.scoring_group(key_states)
        if self.joint and not layer.compressible_seen:  # a first compression waits for every layer's scores
            self.joint_chunk, group = group, len(self.compressed_layers)
        layer.defer_scoring = group > 1
        out = super().update(key_states, value_states, layer_idx, cache_kwargs)
        if layer.awaiting_scores:
            self.awaiting.append(layer)
        if self.awaiting and (len(self.awaiting) >= group or layer_idx == self.last_compressed):
            self.score_awaiting()
        return out

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Tokens seen by layer ``layer_idx`` (what generate continues the positions from); a one-line CurKVError
        once the cache is closed (generate asks this first)."""
        self.check_open()
        return super().get_seq_length(layer_idx)

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
        if layers and self.joint:
            self.compress_jointly(layers)
        elif layers:
            for layer, logits in zip(layers, self._score_layers(layers)):
                layer.compress(logits)

    def compress_jointly(self, layers: list[RaggedCurKVLayer]) -> None:
        """A prefill's first compression of ``layers`` together: scored :attr:`joint_chunk` layers at a time, then the
        top competing tokens over all their KV heads kept (:func:`~curkv_train.runtime.joint.across_layers`)."""
        chunk = max(1, self.joint_chunk)
        logits = [each for start in range(0, len(layers), chunk)
                  for each in self._score_layers(layers[start:start + chunk])]
        competition = None
        for layer in layers:  # every layer saw the same tokens: one competition for all
            layer.awaiting_scores, layer.projected_keys = False, None
            competition = layer.begin_compression(like=competition)
        prior = self.settings.prior_budget
        layer_ratios = None if prior is None else (
            lambda share: [prior.ratios(share)[layer.layer_idx] for layer in layers])
        keep_jointly(layers, across_layers(logits, competition, self.settings.head_floor, layer_ratios,
                                           self.settings.budget_prior))

    def _score_layers(self, layers: list[CurKVLayer]) -> list[torch.Tensor]:
        """Estimator logits (batch, kv_heads, tokens) of each of ``layers``, every one holding the tokens seen."""
        return self.scorer.score_layers(self.model, [layer.layer_idx for layer in layers],
                                        [layer.keys for layer in layers], [layer.values for layer in layers],
                                        [layer.observer.observation() for layer in layers],
                                        [layer.token_scores for layer in layers],
                                        [layer.held_projected_keys() for layer in layers])

    def _score(self, layer: int, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor, end: int,
               observation, token_scores, projected_keys: torch.Tensor | None = None,
               valid: torch.Tensor | None = None) -> torch.Tensor:
        """Estimator logits (batch, kv_heads, tokens) for held tokens at per-head ``positions`` (``projected_keys``:
        their pre-RoPE keys, if the layer recorded them; ``valid``: False where a head's tokens are padding, as
        :meth:`Scorer.score_layer` takes it)."""
        if keys.shape[-2] == end and valid is None:  # nothing evicted or spilled yet: every head holds 0 .. end - 1
            positions = torch.arange(end, device=keys.device)  # shared: a third of the tables to gather
        return self.scorer.score_layer(self.model, layer, keys, values, positions, end=end, observation=observation,
                                       token_scores=token_scores, projected_keys=projected_keys, valid=valid)

    def nbytes(self) -> int:
        """Bytes actually held by the cache, every layer counted: K/V, CUR factors, residuals and position
        bookkeeping of the compressed layers, and a hybrid model's sliding-window layers as they hold them."""
        return sum(layer.nbytes() for layer in self.layers)

    def held_tokens(self, layer_idx: int = 0) -> int:
        """Tokens held per (batch, KV head) in layer ``layer_idx`` (all tiers; a sliding-window layer's window)."""
        return self.layers[layer_idx].held_tokens

    def compressed_layer(self, layer_idx: int) -> CurKVLayer:
        """Layer ``layer_idx`` if the cache compresses it, else a one-line CurKVError (a sliding-window layer)."""
        layer = self.layers[layer_idx]
        if not isinstance(layer, CurKVLayer):
            raise CurKVError(f"layer {layer_idx} is a sliding-window layer, held as transformers holds it, without "
                             f"tiers; ask a full-attention layer ({sorted(set(range(len(self.layers))) - self.sliding)})")
        return layer

    def tier_sizes(self, layer_idx: int = 0) -> dict[str, int]:
        """Tokens per (batch, KV head) in each tier of layer ``layer_idx`` (a compressed one), and the tokens seen."""
        layer = self.compressed_layer(layer_idx)
        return {"seen": layer.seen, "sink": layer.n_sink_held, "hot": layer.n_hot, "warm": layer.n_warm,
                "cold": layer.cold_tokens}

    def bytes_per_token(self) -> int:
        """Bytes one dense token costs the compressed layers: K and V of every such layer and KV head, its position
        (int32 counted) and, for scorers that score on arrival, its stored score."""
        shape = kv_shape(self.model.config)
        element = torch.empty((), dtype=self.model.dtype).element_size()
        per_head = 2 * shape.head_dim * element + 4 + (4 if self.scorer.scores_on_arrival else 0)
        return len(self.compressed_layers) * shape.num_kv_heads * per_head

    def sliding_bytes(self) -> int:
        """Most bytes a hybrid model's sliding-window layers hold for one sequence: K and V of their window of
        tokens (0 without such layers)."""
        if not self.sliding:
            return 0
        shape = kv_shape(self.model.config)
        element = torch.empty((), dtype=self.model.dtype).element_size()
        return len(self.sliding) * shape.num_kv_heads * sliding_window_of(self.model) * 2 * shape.head_dim * element

    def observation_bytes(self) -> int:
        """Bytes the observation takes once filled, whatever the length: per compressed layer the ring of the
        window's pre-RoPE queries (query heads × head_dim wide, which need not be the hidden size) and their
        moments."""
        shape = kv_shape(self.model.config)
        window = self.scorer.observation_window
        if not window:
            return 0
        element = torch.empty((), dtype=self.model.dtype).element_size()
        ring = window * shape.num_attention_heads * shape.head_dim * element
        return len(self.compressed_layers) * (ring + QueryStatistics.nbytes_for(shape.num_attention_heads,
                                                                                shape.head_dim))

    def tokens_within(self, max_bytes: int) -> int:
        """Tokens per (compressed layer, KV head) a budget of ``max_bytes`` for one sequence's cache pays for, once
        the sliding-window layers' windows and the observation are paid: all but one of the slots it pays for, the
        one the token that triggers a compression is written into before the compression replaces the tensors."""
        check_whole("max_bytes", max_bytes)
        fixed = self.sliding_bytes() + self.observation_bytes()
        if self.sliding and max_bytes <= fixed:
            raise CurKVError(f"max_bytes {max_bytes} does not cover the {self.sliding_bytes()} bytes the model's "
                             f"sliding-window layers hold (and the scorer's observation); give more than {fixed} bytes")
        budget = (max_bytes - fixed) // self.bytes_per_token() - 1
        if budget < self.settings.fixed_tokens:
            raise CurKVError(f"max_bytes {max_bytes} pays for {max(budget, 0)} tokens per (layer, KV head), fewer than "
                             f"the {self.settings.fixed_tokens} every layer always holds (n_sink + hot tier + interval - 1)"
                             f"; give at least {(self.settings.fixed_tokens + 1) * self.bytes_per_token() + fixed} "
                             "bytes or lower n_sink / window / hot_windows / compress_every")
        return budget

    def token_bound(self, layer_idx: int = 0) -> int:
        """Most tokens layer ``layer_idx`` (a compressed one) may hold per (batch, KV head) at its current length."""
        layer, settings = self.compressed_layer(layer_idx), self.settings
        pending = settings.hot_tokens + settings.interval - 1
        last_compression = layer.compressible_seen + layer.n_sink_held + settings.hot_tokens  # tokens seen then
        return settings.n_sink + pending + settings.target(layer.compressible_seen, last_compression, layer_idx)
