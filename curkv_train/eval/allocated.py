"""Rules at the scorer's allocation: every (layer, KV head) of a rule's cache holds what the scorer's holds.

A joint scorer decides, per example, how many tokens each (layer, KV head) keeps (:mod:`curkv_train.runtime.joint`).
To ask whether its *scores* beat a rule's, the rule must get that same allocation. The ``curkv_ragged`` row prefills
the context into the runtime :class:`~curkv_train.runtime.CurKVCache` under the one-prefill tiers (:func:`one_prefill`:
its sinks and last window protected, the rest chosen once, ragged storage), holding as many tokens in all as a press
row. A ``same:<rule>`` row prefills the context
under :class:`RecordingPress`, which holds kvpress's press ``<rule>`` scoring every layer and evicts nothing. It then
feeds the context through :class:`AllocatedCache`: the same cache, whose compression keeps in each (layer, KV head)
the scorer's count, chosen by the rule's scores. Same tiers, counts, storage and attention: only the scores differ.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch
from kvpress.presses.scorer_press import ScorerPress
from torch import nn
from transformers import PreTrainedModel

from curkv_train.core.errors import CurKVError
from curkv_train.core.selection import expected_kept
from curkv_train.eval import kvpress_bridge
from curkv_train.eval.runtime_caches import continue_in_windows, prefill_budget
from curkv_train.runtime.cache import CurKVCache
from curkv_train.runtime.cache_config import ComputeConfig, TierConfig
from curkv_train.runtime.ragged_layer import RaggedCurKVLayer
from curkv_train.runtime.scorer import Scorer

RAGGED = "curkv_ragged"
PRIOR = "@prior"
SAME = "same:"
# kvpress presses whose scores a rule row reads (their score() depends on no compression ratio); h2o is ours
ALLOCATED_RULES = ("snapkv", "expected_attention", "tova", "knorm", "cur", "compactor", "keydiff", "lagkv", "h2o")


def one_prefill(n_sink: int, window: int, continuation_length: int) -> TierConfig:
    """Tiers that compress a prefill once, jointly, protecting ``n_sink`` sinks and the last ``window`` tokens (the
    presses' spans), and not again while ``continuation_length`` more tokens arrive."""
    return TierConfig(recent_share=0.0, n_sink=n_sink, window=window, hot_windows=1,
                      compress_every=continuation_length // window + 1, allocation="joint")


@dataclass
class RecordingPress(ScorerPress):
    """kvpress's ``press`` scoring every layer of a prefill into :attr:`scores` (layer -> (batch, kv_heads, tokens)
    float32), the cache left whole."""

    press: ScorerPress | None = None
    scores: dict[int, torch.Tensor] = field(default_factory=dict)

    def post_init_from_model(self, model: PreTrainedModel) -> None:
        """The wrapped press's model-dependent setup."""
        self.press.post_init_from_model(model)

    def compress(self, module: nn.Module, hidden_states: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                 attentions: torch.Tensor | None, kwargs: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """Record the wrapped press's scores of ``keys`` (batch, kv_heads, tokens, head_dim); return both unchanged."""
        scores = self.press.score(module, hidden_states, keys, values, attentions, kwargs)
        self.scores[module.layer_idx] = scores.float()
        return keys, values


def rule_scores(model: PreTrainedModel, rule: str, context_ids: torch.Tensor, *, n_sink: int, window: int,
                seed: int) -> dict[int, torch.Tensor]:
    """Per layer, kvpress's press ``rule`` (of :data:`ALLOCATED_RULES`) scoring the prefill of ``context_ids``."""
    if rule not in ALLOCATED_RULES:
        raise CurKVError(f"unknown rule {rule!r} for the scorer's allocation; expected one of "
                         f"{', '.join(ALLOCATED_RULES)}")
    inner = kvpress_bridge.make_press(rule, 0.5, n_sink=n_sink, window=window, seed=seed)
    recording = RecordingPress(compression_ratio=0.5, press=inner)
    spec = kvpress_bridge.PRESSES.get(rule) or kvpress_bridge.OWN_PRESSES[rule]
    kvpress_bridge.press_cache(model, spec, recording, context_ids, seed)
    return recording.scores


class AllocatedCache(CurKVCache):
    """A joint :class:`CurKVCache` whose one compression keeps, in each (layer, KV head), the count ``lengths``
    gives (what another cache of the same tiers held after the same prefill), chosen by ``scores``.

    Args:
        scores: layer -> (batch, kv_heads, tokens) scores of every prefilled token, higher = kept first.
        lengths: layer -> (batch, kv_heads) tokens held after the compression, sinks and hot tier included.
        Others: :class:`CurKVCache`'s.
    """

    def __init__(self, scorer: Scorer, model: PreTrainedModel, keep_ratio: float, *,
                 scores: dict[int, torch.Tensor], lengths: dict[int, torch.Tensor], tiers: TierConfig,
                 compute: ComputeConfig | None = None) -> None:
        self.rule_scores, self.reference_lengths = scores, lengths
        super().__init__(scorer, model, keep_ratio, layer_budget="uniform", tiers=tiers, compute=compute)

    def compress_jointly(self, layers: list[RaggedCurKVLayer]) -> None:
        """Each layer keeps its reference count per head: the protected tokens, then the best-scored competitors."""
        for layer in layers:
            layer.awaiting_scores, layer.projected_keys = False, None
            competition = layer.begin_compression()  # into ragged storage: every head holds the prefill
            held = layer.lengths.clone()
            width = int(held.max())
            competing = competition.competing_mask(width)
            count = self.reference_lengths[layer.layer_idx].cpu() - (held - competition.competing)
            scores = self.rule_scores[layer.layer_idx][..., :width].cpu()
            order = scores.masked_fill(~competing, float("-inf")).argsort(dim=-1, descending=True)
            take = torch.arange(width) < count[..., None]
            layer.finish(torch.zeros_like(competing).scatter(-1, order, take))

    def _score(self, *args, **kwargs) -> torch.Tensor:
        raise CurKVError("a cache at the scorer's allocation compresses once, after the prefill; a later compression "
                         "has no reference counts (lengthen compress_every)")


class RecordingCache(CurKVCache):
    """A joint :class:`CurKVCache` that keeps, in :attr:`recorded` (layer -> (batch, kv_heads, tokens)), the logits
    its scorer gave every prefilled token for its first compression."""

    recorded: dict[int, torch.Tensor]

    def _score_layers(self, layers: list) -> list[torch.Tensor]:
        logits = super()._score_layers(layers)
        self.recorded = {**getattr(self, "recorded", {}),
                         **{layer.layer_idx: each for layer, each in zip(layers, logits)}}
        return logits


def ragged_lengths(cache: CurKVCache) -> dict[int, torch.Tensor]:
    """layer -> (batch, kv_heads) tokens each compressed layer of a joint cache holds."""
    return {layer.layer_idx: layer.held_lengths() for layer in cache.compressed_layers}


@dataclass(frozen=True)
class AllocatedRows:
    """The ``curkv_ragged`` row (``scorer`` through the runtime cache under ``tiers``, :func:`one_prefill`) and one
    ``same:<rule>`` row per rule, at its allocation (:class:`AllocatedCache`)."""

    scorer: Scorer
    rules: tuple[str, ...]
    tiers: TierConfig
    backend: str = "auto"
    budget_prior: float = 0.0  # > 0: also the row curkv_ragged@prior, its layer budget weighed in (TierConfig)

    def own_rows(self) -> list[str]:
        """The scorer's rows: ``curkv_ragged``, and ``curkv_ragged@prior`` with a budget prior."""
        return [RAGGED, *([RAGGED + PRIOR] if self.budget_prior else [])]

    def scores(self, model: PreTrainedModel, context_ids: torch.Tensor, seed: int) -> dict[str, dict]:
        """rule -> its :func:`rule_scores` of the context (one prefill each, whatever the ratios)."""
        return {rule: rule_scores(model, rule, context_ids, n_sink=self.tiers.n_sink, window=self.tiers.window,
                                  seed=seed) for rule in self.rules}

    def rows(self, model: PreTrainedModel, context_ids: torch.Tensor, continuation_ids: torch.Tensor,
             keep_ratio: float, scores: dict[str, dict]) -> list[tuple[str, torch.Tensor, dict[str, float]]]:
        """(row, continuation logits (1, M, vocab), budget after the prefill) of the scorer and of every rule, each
        holding what a press row holds at ``keep_ratio`` (sinks + window + ⌈ρ·n_compressible⌉ per head on average)."""
        tokens = context_ids.shape[1]
        keep_ratio = expected_kept(tokens, self.tiers.n_sink, self.tiers.window, keep_ratio) / tokens
        compute = ComputeConfig(backend=self.backend)
        reference = CurKVCache(self.scorer, model, keep_ratio, layer_budget="uniform", tiers=self.tiers,
                               compute=compute)
        budget = prefill_budget(model, reference, context_ids)
        lengths = ragged_lengths(reference)
        out = [(RAGGED, continue_in_windows(model, reference, continuation_ids), budget)]
        if self.budget_prior:
            tiers = dataclasses.replace(self.tiers, budget_prior=self.budget_prior)
            prior = CurKVCache(self.scorer, model, keep_ratio, tiers=tiers, compute=compute)
            budget = prefill_budget(model, prior, context_ids)
            out.append((RAGGED + PRIOR, continue_in_windows(model, prior, continuation_ids), budget))
        for rule in self.rules:
            cache = AllocatedCache(self.scorer, model, keep_ratio, scores=scores[rule], lengths=lengths,
                                   tiers=self.tiers, compute=compute)
            budget = prefill_budget(model, cache, context_ids)
            out.append((SAME + rule, continue_in_windows(model, cache, continuation_ids), budget))
        return out
