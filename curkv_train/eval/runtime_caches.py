"""Caches text is fed through as generation would: a recency-scored CurKVCache, chunked feeding, what a cache holds.

:class:`RecencyCache` is :class:`~curkv_train.runtime.CurKVCache` with the score replaced by the token's
position: the same selection, tiers and bookkeeping as the learned score, the score alone differs.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from transformers import DynamicCache, PreTrainedModel
from transformers.cache_utils import Cache

from curkv_train.core.shapes import kv_shape
from curkv_train.runtime.cache import CurKVCache
from curkv_train.runtime.observer import ObservationBuffer
from curkv_train.runtime.ragged_layer import RaggedCurKVLayer


class RecencyCache(CurKVCache):
    """A CurKVCache whose score is the position: it keeps the sinks, the hot tier and the newest kept tokens.

    Every argument but ``observe`` is :class:`CurKVCache`'s (the scorer only supplies spans and shapes; without the
    cold tier this is StreamingLLM's sink + recent window). ``observe``: hold the observation the scorer would read,
    as the learned cache does, so both hold the same bytes; False holds none (a plain sink + recent cache).
    """

    def __init__(self, *args, observe: bool = True, **kwargs) -> None:
        self.observe = observe
        super().__init__(*args, **kwargs)

    def _observer(self, layer: int) -> ObservationBuffer:
        """The scorer's observation buffer, or an empty one that records nothing (``observe=False``)."""
        return super()._observer(layer) if self.observe else ObservationBuffer(0, None, 0)

    def _score(self, layer: int, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor, end: int,
               observation, token_scores, projected_keys=None, valid=None) -> torch.Tensor:
        """(batch, kv_heads, tokens) float32 positions of the held tokens: newer = higher."""
        return positions.float()

    def _score_layers(self, layers: list) -> list[torch.Tensor]:
        """Per layer (batch, kv_heads, tokens) float32 positions: a group's scores, and a joint allocation's first
        compression, which score every held token of dense layers together."""
        return [layer.positions.float().expand(*layer.keys.shape[:3]) for layer in layers]

    def bytes_per_token(self) -> int:
        """Bytes one dense token costs (no stored per-token score without ``observe``)."""
        if self.observe or not self.scorer.scores_on_arrival:
            return super().bytes_per_token()
        shape = kv_shape(self.model.config)
        return super().bytes_per_token() - 4 * len(self.compressed_layers) * shape.num_kv_heads

    def observation_bytes(self) -> int:
        """Bytes of the observation: none without ``observe``."""
        return super().observation_bytes() if self.observe else 0


def held_bytes(cache: Cache) -> int:
    """Bytes a cache holds: :meth:`CurKVCache.nbytes` (every tier, positions, observation), else its K/V tensors."""
    if isinstance(cache, CurKVCache):
        return cache.nbytes()
    return sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values)
               if t is not None)


def held_tokens(cache: Cache) -> float:
    """Mean tokens held per (layer, KV head), all tiers counted (a ragged layer's heads averaged)."""
    if isinstance(cache, CurKVCache):
        ragged = {layer.layer_idx: float(layer.held_lengths().float().mean()) for layer in cache.compressed_layers
                  if isinstance(layer, RaggedCurKVLayer)}
        return sum(ragged.get(layer, cache.held_tokens(layer)) for layer in range(len(cache.layers))) / len(cache.layers)
    return sum(layer.keys.shape[2] for layer in cache.layers if layer.keys is not None) / len(cache.layers)


@torch.no_grad()
def prefill_cache(model: PreTrainedModel, cache: Cache, input_ids: torch.Tensor) -> torch.Tensor:
    """Run ``input_ids`` (1, tokens) into an empty ``cache`` at once (a prefill; the cache compresses as it
    does at run time); returns the last token's logits (1, 1, vocab) float32."""
    output = model(input_ids=input_ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
    return output.logits.float()


@torch.no_grad()
def feed_chunks(model: PreTrainedModel, cache: Cache, input_ids: torch.Tensor, seen: int, chunk: int,
                on_step: Callable[[int, int, torch.Tensor], None]) -> None:
    """Feed ``input_ids`` (1, tokens) after ``seen`` tokens, ``chunk`` at a time, at their true RoPE positions (the
    causal mask follows the cache); ``on_step(start, stop, logits)`` gets each chunk's range in ``input_ids`` and its
    (1, stop − start, vocab) float32 logits."""
    device = input_ids.device
    for start in range(0, input_ids.shape[1], chunk):
        part = input_ids[:, start : start + chunk]
        positions = torch.arange(seen + start, seen + start + part.shape[1], device=device)[None]
        output = model(input_ids=part, past_key_values=cache, use_cache=True, position_ids=positions)
        on_step(start, start + part.shape[1], output.logits.float())


def cache_budget(cache: Cache, context_length: int) -> dict[str, float]:
    """What ``cache`` holds of a context of ``context_length`` tokens: tokens per (layer, KV head), bytes."""
    return {"kept_tokens": held_tokens(cache), "context_tokens": float(context_length),
            "kv_bytes": float(held_bytes(cache))}


def prefill_budget(model: PreTrainedModel, cache: Cache, context_ids: torch.Tensor) -> dict[str, float]:
    """Prefill ``context_ids`` (1, tokens) into an empty ``cache``; what it then holds (:func:`cache_budget`)."""
    prefill_cache(model, cache, context_ids)
    return cache_budget(cache, context_ids.shape[1])


def continue_in_windows(model: PreTrainedModel, cache: CurKVCache, continuation_ids: torch.Tensor) -> torch.Tensor:
    """Continuation logits (1, M, vocab) float32: ``continuation_ids`` fed into a prefilled runtime ``cache`` a window
    at a time, as during generation (the cache compresses as it does then)."""
    parts: list[torch.Tensor] = []
    feed_chunks(model, cache, continuation_ids, cache.get_seq_length(), cache.settings.window,
                lambda start, stop, logits: parts.append(logits))
    return torch.cat(parts, dim=1)


def plain_cache(model: PreTrainedModel) -> DynamicCache:
    """An empty full cache for ``model``."""
    return DynamicCache(config=model.config)
