"""A trained estimator packaged for inference: scores cached tokens layer by layer."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from transformers import PreTrainedModel

from curkv_train.core.rope import key_view
from curkv_train.models.estimator import ValueEstimator


@dataclass
class Scorer:
    """A value estimator with the settings it was trained under.

    Attributes:
        estimator: the trained network.
        key_view: pre_rope, end_relative or post_rope (how keys are presented to it).
        n_sink, window: the always-kept spans it was trained with.
        metadata: everything else recorded at export (fingerprint, recipe, metrics).
        keep_ratio: the keep ratio ρ it was trained for.
        temperature: the score temperature T it was trained with (s = σ(z / T)).
    """

    estimator: ValueEstimator
    key_view: str = "pre_rope"
    n_sink: int = 4
    window: int = 64
    metadata: dict = field(default_factory=dict)
    keep_ratio: float = 0.5
    temperature: float = 1.0

    @torch.no_grad()
    def score_layer(self, model: PreTrainedModel, layer: int, keys: torch.Tensor, values: torch.Tensor,
                    positions: torch.Tensor | None = None, end: int | None = None) -> torch.Tensor:
        """Keep logits of one layer's cached tokens.

        Args:
            model: the base model (for its rotary tables).
            layer: decoder layer index.
            keys: (batch, kv_heads, tokens, head_dim) cached keys, post-RoPE as transformers caches them.
            values: (batch, kv_heads, tokens, head_dim) cached values.
            positions: (tokens,) absolute positions of the cached tokens, default 0..tokens-1; or
                (batch, kv_heads, tokens) when each head holds its own tokens (a compressed cache).
            end: tokens seen so far (distance features are measured to it); default last position + 1.

        Returns:
            (batch, kv_heads, tokens) float32 logits, higher = keep.
        """
        if positions is None:
            positions = torch.arange(keys.shape[2], device=keys.device)
        viewed = key_view(model, keys, positions, self.key_view)
        self.estimator.to(keys.device)
        if end is None:
            end = int(positions[-1] if positions.dim() == 1 else positions.max()) + 1
        return self.estimator.score_layer(layer, viewed, values, positions, end)
