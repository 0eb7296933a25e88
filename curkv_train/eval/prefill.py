"""One prefill per example: the context's cache plus, per layer, the queries that built it.

Forward hooks on every decoder layer's ``self_attn`` recompute the layer's pre-RoPE
queries from its input hidden states (one extra projection per layer) and keep the
RoPE tables it was given, so attention-based baselines can derive their statistics
later, one layer at a time (:class:`~curkv_train.eval.context.LayerContext`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import DynamicCache, PreTrainedModel

from curkv_train.eval.context import LayerContext


@dataclass
class Prefill:
    """A prefilled context.

    Attributes:
        keys: per layer, (batch, kv_heads, tokens, head_dim) post-RoPE cached keys.
        values: per layer, (batch, kv_heads, tokens, head_dim) cached values.
        queries: per layer, (batch, heads, tokens, head_dim) pre-RoPE queries (empty if not captured).
        rotary: (cos, sin), each (tokens, head_dim), the context's RoPE tables (None without RoPE
            or without captured queries).
        scaling: attention logit scale of the layers.
    """

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    queries: list[torch.Tensor]
    rotary: tuple[torch.Tensor, torch.Tensor] | None
    scaling: float | None

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
            queries=self.queries[layer] if self.queries else None, rotary=self.rotary,
            scaling=self.scaling, model=model, n_sink=n_sink, window=window, seed=seed * 1009 + layer,
        )


def _attention_modules(model: PreTrainedModel) -> list[torch.nn.Module]:
    return [layer.self_attn for layer in model.get_decoder().layers]


def _pre_rope_queries(module: torch.nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """(batch, heads, tokens, head_dim) queries of a Llama-style attention layer before RoPE."""
    batch, tokens, _ = hidden.shape
    queries = module.q_proj(hidden).view(batch, tokens, -1, module.head_dim).transpose(1, 2)
    q_norm = getattr(module, "q_norm", None)  # Qwen3 / Gemma3 normalise queries before RoPE
    return q_norm(queries) if q_norm is not None else queries


@torch.no_grad()
def prefill(model: PreTrainedModel, context_ids: torch.Tensor, capture_queries: bool = True) -> Prefill:
    """Run the frozen model over ``context_ids`` (batch, tokens) once, uncompressed.

    Returns:
        the :class:`Prefill` with every layer's K/V and (with ``capture_queries``) its queries.
    """
    modules = _attention_modules(model)
    queries: dict[int, torch.Tensor] = {}
    rotary: list[tuple[torch.Tensor, torch.Tensor]] = []

    def capture(module, args, kwargs, output):
        hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
        queries[module.layer_idx] = _pre_rope_queries(module, hidden)
        if not rotary and kwargs.get("position_embeddings") is not None:
            cos, sin = kwargs["position_embeddings"]
            rotary.append((cos[0], sin[0]))

    hooks = [m.register_forward_hook(capture, with_kwargs=True) for m in modules] if capture_queries else []
    cache = DynamicCache(config=model.config)
    try:
        model.get_decoder()(input_ids=context_ids, past_key_values=cache, use_cache=True)
    finally:
        for hook in hooks:
            hook.remove()
    keys = [layer.keys for layer in cache.layers]
    values = [layer.values for layer in cache.layers]
    captured = [queries[index] for index in range(len(keys))] if capture_queries else []
    return Prefill(keys, values, captured, rotary[0] if rotary else None, getattr(modules[0], "scaling", None))
