"""Capture: prefill the context once without grad and read its cached K and V.

Keys come out of the cache post-RoPE. RoPE is a rotation per channel pair, so the
estimator's key view is obtained exactly by rotating back (DESIGN §3):

- ``pre_rope``: rotate each key back by its own position (the key as projected);
- ``end_relative``: rotate back by the last context position, i.e. the key as a
  query standing at the end of the context would see it (distance-aware);
- ``post_rope``: the cached key as it is (models without rotary embeddings).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from transformers import DynamicCache, PreTrainedModel

from curkv_train.attention import CompressionState
from curkv_train.core.rope import key_view

@dataclass
class ContextCapture:
    """The prefilled context of a batch.

    Attributes:
        cache: the base model's cache after the context (post-RoPE keys).
        keys: (layers, batch, kv_heads, context, head_dim) keys in the requested view.
        values: (layers, batch, kv_heads, context, head_dim) values.
        positions: (context,) absolute positions of the context tokens.
        attention_mass: per layer, (batch, kv_heads, context) attention the continuation
            paid to each context key (filled by a capturing teacher pass).
    """

    cache: DynamicCache
    keys: torch.Tensor
    values: torch.Tensor
    positions: torch.Tensor
    attention_mass: dict[int, torch.Tensor] = field(default_factory=dict)

    @property
    def context_length(self) -> int:
        """Number of context tokens."""
        return self.positions.numel()


def cache_layer_kv(cache: DynamicCache, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(keys, values) held by ``cache`` for ``layer``, each (batch, kv_heads, tokens, head_dim)."""
    return cache.layers[layer].keys, cache.layers[layer].values


@torch.no_grad()
def prefill_context(model: PreTrainedModel, context_ids: torch.Tensor, view: str = "pre_rope") -> ContextCapture:
    """Run the frozen model over ``context_ids`` (batch, context) once and keep its K/V."""
    cache = DynamicCache(config=model.config)
    model.get_decoder()(input_ids=context_ids, past_key_values=cache, use_cache=True,
                        curkv_state=CompressionState(mode="full"))
    positions = torch.arange(context_ids.shape[1], device=context_ids.device)
    layers = [cache_layer_kv(cache, layer) for layer in range(len(cache.layers))]
    keys = torch.stack([key_view(model, k, positions, view) for k, _ in layers])
    values = torch.stack([v.float() for _, v in layers])
    return ContextCapture(cache=cache, keys=keys, values=values, positions=positions)


def continue_from(
    model: PreTrainedModel, capture: ContextCapture, continuation_ids: torch.Tensor, state: CompressionState
) -> torch.Tensor:
    """Last hidden states (batch, M, hidden) of the continuation over the captured context.

    The cache is cropped back to the context afterwards, so the same capture serves
    the teacher and the student.
    """
    try:
        output = model.get_decoder()(
            input_ids=continuation_ids, past_key_values=capture.cache, use_cache=True, curkv_state=state
        )
    finally:
        capture.cache.crop(capture.context_length)
    return output.last_hidden_state
