"""Joint allocation for :class:`~curkv_train.runtime.cache.CurKVCache` (``TierConfig(allocation="joint")``).

The places a compression fills by score are shared: a prefill's first compression ranks the competing tokens of
every layer and KV head together (:func:`~curkv_train.core.selection.joint_keep_mask`, as training's hard stage),
a later one those of each layer's KV heads (:func:`joint_choice`, for heads that hold different counts). Each head
keeps its own top ``floor`` whatever the others score. The totals are what one count per head would keep, so a
token or byte budget holds; which head holds them is the scores' decision.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from curkv_train.core.errors import CurKVError
from curkv_train.core.selection import joint_keep_mask, prior_floor_counts


@dataclass(frozen=True)
class Competition:
    """What one layer's compression decides, per (batch, KV head) (host tensors, no device sync to read them).

    Attributes:
        candidates: (batch, kv_heads) tokens past the sinks and before the hot tier (warm + aged), oldest first.
        recent: (batch, kv_heads) the newest candidates kept whatever their score (``recent_share`` of ``target``).
        target: compressible tokens one head would keep under ``per_head`` (the same for every head).
        n_sink: sinks held before the candidates in every segment.
    """

    candidates: torch.Tensor
    recent: torch.Tensor
    target: int
    n_sink: int

    @property
    def competing(self) -> torch.Tensor:
        """(batch, kv_heads) candidates that compete by score: the oldest ``candidates − recent``."""
        return self.candidates - self.recent

    def places(self) -> torch.Tensor:
        """(batch,) places filled by score in each sequence: the per-head total, less the recent ones."""
        heads = self.candidates.shape[1]
        total = torch.clamp(self.candidates.sum(dim=1), max=heads * self.target)
        return total - self.recent.sum(dim=1)

    def floor(self, head_floor: float) -> int:
        """Competing tokens each head keeps whatever the joint ranking says: ⌈floor · (target − recent)⌉, no more
        than an equal share of the places (capped per head by what it has, in :func:`joint_choice`)."""
        share = max(0, self.target - int(self.recent.max()))
        heads = self.candidates.shape[1]
        return min(math.ceil(head_floor * share - 1e-9), int(self.places().min()) // heads)

    def competing_mask(self, width: int) -> torch.Tensor:
        """(batch, kv_heads, width) bool: the competing tokens' places in each segment (oldest candidates)."""
        local = torch.arange(width)
        return (local >= self.n_sink) & (local < self.n_sink + self.competing[..., None])


def joint_choice(scores: torch.Tensor, competing: torch.Tensor, places: torch.Tensor, floor: int) -> torch.Tensor:
    """Per sequence, the ``places`` best competing tokens over all its segments, each segment first keeping its
    own top ``floor`` (or all it has, if fewer).

    Args:
        scores: (batch, segments, width) higher = more worth keeping.
        competing: (batch, segments, width) bool, which entries compete (others are never chosen).
        places: (batch,) int tokens to choose per sequence, at most its competing count.
        floor: tokens each segment keeps by its own ranking first.

    Returns:
        (batch, segments, width) bool, ``places[b]`` True per sequence, all of them competing.
    """
    ranked = scores.float().masked_fill(~competing, float("-inf"))
    if floor > 0:
        top = ranked.topk(min(floor, ranked.shape[-1]), dim=-1).indices
        ranked = ranked.scatter(-1, top, float("inf")).masked_fill(~competing, float("-inf"))
    chosen = torch.zeros_like(competing)
    for sequence, count in enumerate(places.tolist()):
        best = ranked[sequence].reshape(-1).topk(count).indices
        chosen[sequence].view(-1)[best] = True
    if bool((chosen & ~competing).any()):
        raise CurKVError("joint selection chose a token that does not compete; report this as a bug")
    return chosen


def across_layers(logits: list[torch.Tensor], competition: Competition, head_floor: float,
                  layer_ratios: Callable[[float], Sequence[float]] | None = None,
                  budget_prior: float = 0.0) -> torch.Tensor:
    """A prefill's first compression over every layer at once: the top ``places`` competing tokens of all layers and
    KV heads with a per-head floor (:func:`~curkv_train.core.selection.joint_keep_mask`).

    Args:
        logits: per layer (batch, kv_heads, tokens) scores of every held token (each layer holds the same tokens).
        competition: the layers' :class:`Competition` (one for all: they saw the same tokens).
        head_floor: TierConfig.head_floor.
        layer_ratios: for a prior on the layers' shares, the calibrated budget's keep ratio of each of these layers
            at a mean keep share (of the competing tokens); None: no prior.
        budget_prior: TierConfig.budget_prior, the prior's weight (:func:`~curkv_train.core.selection.prior_floor_counts`).

    Returns:
        (layers, batch, kv_heads, tokens) bool, the competing tokens chosen.
    """
    competing = int(competition.competing.max())
    if competing == 0 or bool((competition.recent != competition.recent.flatten()[0]).any()):
        raise CurKVError("a prefill's joint compression found no competing tokens; report this as a bug")
    start, keep = competition.n_sink, competition.target - int(competition.recent.max())
    scores = torch.stack(logits)[..., start:start + competing]
    share = keep / competing
    floors = None if layer_ratios is None or not budget_prior else prior_floor_counts(
        competing, share, head_floor, layer_ratios(share), budget_prior)
    mask = joint_keep_mask(scores, share, head_floor, floors).bool()
    tokens = logits[0].shape[-1]
    return torch.nn.functional.pad(mask, (start, tokens - start - competing))
