"""Hybrid models: sliding-window layers interleaved with full-attention ones (Gemma 3, gpt-oss, Qwen3-Next).

A sliding-window layer (``"sliding_attention"`` in ``config.layer_types``) already holds a bounded window of
``config.sliding_window`` tokens: the runtime keeps it exactly as transformers does and never scores or compresses
it; only the full-attention layers are compressed (docs/runtime.md, "Hybrid models").
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import PreTrainedModel
from transformers.cache_utils import DynamicSlidingWindowLayer

from curkv_train.core.errors import CurKVError
from curkv_train.core.shapes import text_config

LAYER_TYPES = ("full_attention", "sliding_attention")


def sliding_layers(model: PreTrainedModel) -> tuple[int, ...]:
    """Indices of ``model``'s sliding-window layers (empty for a model whose ``layer_types`` are all full or unset);
    a one-line CurKVError for other layer types or a model with no full-attention layer to compress."""
    layer_types = list(getattr(text_config(model.config), "layer_types", None) or [])
    unknown = sorted(set(layer_types) - set(LAYER_TYPES))
    if unknown:
        raise CurKVError(f"curkv-train compresses full-attention layers and keeps sliding-window ones, the model has "
                         f"{unknown}: use a model whose layer_types are {' / '.join(LAYER_TYPES)}")
    sliding = tuple(index for index, kind in enumerate(layer_types) if kind == "sliding_attention")
    if sliding and len(sliding) == len(layer_types):
        raise CurKVError("every layer of the model attends over a sliding window: there is no full-attention layer "
                         "to compress; use transformers' DynamicCache")
    return sliding


def sliding_window_of(model: PreTrainedModel) -> int:
    """The window ``model``'s sliding-window layers attend over (``config.sliding_window``)."""
    window = getattr(text_config(model.config), "sliding_window", None)
    if not window:
        raise CurKVError("the model has sliding_attention layers but no config.sliding_window; set it in its config")
    return int(window)


class SlidingWindowLayer(DynamicSlidingWindowLayer):
    """transformers' sliding-window cache layer, holding no more than its window.

    It keeps the last ``sliding_window - 1`` tokens as views of the step's concatenated keys/values; after a prefill
    or chunk longer than the window those views would keep the whole step's storage alive, so they are copied
    out then. What it holds and returns is transformers' own.
    """

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor,
               cache_kwargs: dict[str, Any] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """transformers' update of keys/values (batch, kv_heads, new, head_dim); the held views copied when their
        storage spans more than the window."""
        out = super().update(key_states, value_states, cache_kwargs)
        if storage_tokens(self.keys) > self.sliding_window:
            self.keys, self.values = self.keys.clone(), self.values.clone()
        return out

    def nbytes(self) -> int:
        """Bytes of the storages the held keys and values reference (0 before the first update)."""
        if not self.is_initialized:
            return 0
        return self.keys.untyped_storage().nbytes() + self.values.untyped_storage().nbytes()

    @property
    def held_tokens(self) -> int:
        """Tokens held per (batch, KV head)."""
        return 0 if not self.is_initialized else self.keys.shape[-2]


def storage_tokens(tensor: torch.Tensor) -> int:
    """Tokens a (batch, kv_heads, tokens, head_dim) tensor's whole storage holds."""
    per_token = tensor.shape[0] * tensor.shape[1] * tensor.shape[-1] * tensor.element_size()
    return tensor.untyped_storage().nbytes() // max(1, per_token)
