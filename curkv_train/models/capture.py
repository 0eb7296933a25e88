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

KEY_VIEWS = ("pre_rope", "end_relative", "post_rope")


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


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """The RoPE companion of ``x``: halves (a, b) -> (-b, a) on the last dim."""
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


def unrotate(keys: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Invert k' = k·cos + rotate_half(k)·sin (cos, sin may carry an attention scale).

    Args:
        keys: (..., tokens, head_dim) rotated keys; cos, sin broadcastable to it.
    """
    return (keys * cos - rotate_half(keys) * sin) / (cos * cos + sin * sin)


def rotary_tables(model: PreTrainedModel, positions: torch.Tensor, like: torch.Tensor):
    """(cos, sin) of shape (*positions.shape, head_dim) for ``positions``, or None without rotary embeddings.

    ``positions`` is (tokens,) or has leading dims, e.g. (batch, kv_heads, tokens) when
    each head holds a different set of tokens.
    """
    rotary = getattr(model.get_decoder(), "rotary_emb", None)
    if rotary is None:
        return None
    cos, sin = rotary(like, positions.reshape(1, -1))
    shape = (*positions.shape, cos.shape[-1])
    return cos[0].float().reshape(shape), sin[0].float().reshape(shape)


def key_view(model: PreTrainedModel, keys: torch.Tensor, positions: torch.Tensor, view: str) -> torch.Tensor:
    """Keys (..., tokens, head_dim) post-RoPE at ``positions`` -> the estimator's key view.

    ``positions`` is (tokens,) or matches the keys' leading dims, e.g. (batch, kv_heads, tokens).
    """
    if view not in KEY_VIEWS:
        raise ValueError(f"unknown key view {view!r}; expected one of {', '.join(KEY_VIEWS)}")
    if view == "post_rope":
        return keys.float()
    if view == "end_relative":
        last = positions[-1] if positions.dim() == 1 else positions.max()
        positions = torch.full_like(positions, int(last))
    tables = rotary_tables(model, positions, keys)
    if tables is None:
        return keys.float()
    cos, sin = tables
    return unrotate(keys.float(), cos, sin)


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
