"""One prefill per example: the context's cache plus, per layer, the attention inputs that built it.

Forward pre-hooks on every decoder layer's attention record its input hidden states
(:class:`~curkv_train.core.observation.HiddenRecorder`); attention-based baselines derive the
layer's pre-RoPE queries from them later, one layer at a time, and trained query-aware or
hidden-state scorers read them as the runtime does (:class:`~curkv_train.eval.context.LayerContext`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import DynamicCache, PreTrainedModel

from curkv_train.core.observation import HiddenRecorder
from curkv_train.eval.context import LayerContext


@dataclass
class Prefill:
    """A prefilled context.

    Attributes:
        keys: per layer, (batch, kv_heads, tokens, head_dim) post-RoPE cached keys.
        values: per layer, (batch, kv_heads, tokens, head_dim) cached values.
        hidden: per layer, (batch, tokens, hidden_size) attention inputs (empty if not recorded).
    """

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    hidden: list[torch.Tensor]

    @property
    def context_length(self) -> int:
        """Context tokens."""
        return self.keys[0].shape[2]

    @property
    def num_layers(self) -> int:
        """Decoder layers."""
        return len(self.keys)

    def layer_context(self, layer: int, *, model: PreTrainedModel | None, n_sink: int, window: int,
                      seed: int) -> LayerContext:
        """The :class:`LayerContext` of ``layer`` (seed = ``seed`` offset by the layer index)."""
        keys = self.keys[layer]
        return LayerContext(
            layer=layer, keys=keys, values=self.values[layer],
            positions=torch.arange(keys.shape[2], device=keys.device),
            hidden=self.hidden[layer] if self.hidden else None, model=model, n_sink=n_sink, window=window,
            seed=seed * 1009 + layer,
        )


@torch.no_grad()
def prefill(model: PreTrainedModel, context_ids: torch.Tensor, capture_queries: bool = True) -> Prefill:
    """Run the frozen model over ``context_ids`` (batch, tokens) once, uncompressed.

    Returns:
        the :class:`Prefill` with every layer's K/V and (with ``capture_queries``) its attention inputs.
    """
    recorder = HiddenRecorder()
    cache = DynamicCache(config=model.config)
    if capture_queries:
        with recorder.recording(model):
            model.get_decoder()(input_ids=context_ids, past_key_values=cache, use_cache=True)
    else:
        model.get_decoder()(input_ids=context_ids, past_key_values=cache, use_cache=True)
    keys = [layer.keys for layer in cache.layers]
    values = [layer.values for layer in cache.layers]
    return Prefill(keys, values, recorder.layers() if capture_queries else [])
