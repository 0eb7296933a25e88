"""Compressed caches and their continuation: RoPE positions continue from the true context length, cache
positions (what the causal mask is built from) from the kept length."""

from __future__ import annotations

import copy
from contextlib import nullcontext

import torch
from transformers import DynamicCache, PreTrainedModel

from curkv_train.core.shapes import text_config
from curkv_train.runtime.hybrid import sliding_layers


def cache_from_layers(model: PreTrainedModel, keys: list[torch.Tensor], values: list[torch.Tensor]) -> DynamicCache:
    """A DynamicCache whose layer l holds ``keys[l]``, ``values[l]`` (batch, kv_heads, kept, head_dim)."""
    cache = DynamicCache(config=model.config)
    for layer, (layer_keys, layer_values) in enumerate(zip(keys, values)):
        cache.update(layer_keys, layer_values, layer)
    return cache


@torch.no_grad()
def continuation_logits(model: PreTrainedModel, cache: DynamicCache, continuation_ids: torch.Tensor,
                        context_length: int) -> torch.Tensor:
    """Logits (batch, M, vocab) float32 of ``continuation_ids`` (batch, M) after a (compressed) context; ``cache`` is
    extended in place by the continuation (build a fresh one per run)."""
    if _full_layers_pressed(model, cache, context_length):
        return _per_type_masks(model, cache, continuation_ids, context_length)
    held = cache.get_seq_length()
    count = continuation_ids.shape[1]
    device = continuation_ids.device
    output = model(
        input_ids=continuation_ids,
        past_key_values=cache,
        use_cache=True,
        position_ids=torch.arange(context_length, context_length + count, device=device)[None],
        cache_position=torch.arange(held, held + count, device=device),
    )
    return output.logits.float()


def _full_layers_pressed(model: PreTrainedModel, cache: DynamicCache, context_length: int) -> bool:
    """Whether ``model`` is hybrid and a full-attention layer of ``cache`` holds fewer than the context's tokens."""
    sliding = set(sliding_layers(model))
    return bool(sliding) and any(layer.keys.shape[-2] < context_length for index, layer in enumerate(cache.layers)
                                 if index not in sliding)


def _per_type_masks(model: PreTrainedModel, cache: DynamicCache, continuation_ids: torch.Tensor,
                    context_length: int) -> torch.Tensor:
    """:func:`continuation_logits` on a hybrid model whose full-attention layers were pressed, in one forward: its
    sliding-window layers have seen the whole context and its full layers hold fewer tokens, so the model's one
    cache position cannot build both masks (the full layers' would let a query see the tokens after it). Each layer
    type gets its own: the full layers' causal over their held tokens (built for the first, fitted to the others by
    the runtime's attention wrapper where they hold different counts), the sliding layers' at the true positions."""
    from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

    from curkv_train.runtime.attention import install_runtime_attention

    sliding = set(sliding_layers(model))
    full_held = [layer.keys.shape[-2] for index, layer in enumerate(cache.layers) if index not in sliding]
    count, device = continuation_ids.shape[1], continuation_ids.device
    positions = torch.arange(context_length, context_length + count, device=device)
    embeds = model.get_input_embeddings()(continuation_ids)
    arguments = {"config": text_config(model.config), "inputs_embeds": embeds, "attention_mask": None,
                 "past_key_values": cache, "position_ids": positions[None]}
    masks = {"full_attention": create_causal_mask(cache_position=positions - context_length + full_held[0],
                                                  **arguments),
             "sliding_attention": create_sliding_window_causal_mask(cache_position=positions, **arguments)}
    fitted = len(set(full_held)) > 1
    with install_runtime_attention(model, factored=False, per_layer=True) if fitted else nullcontext():
        output = model(inputs_embeds=embeds, attention_mask=masks, past_key_values=cache, use_cache=True,
                       position_ids=positions[None], cache_position=positions)
    return output.logits.float()


@torch.no_grad()
def batched_continuation_logits(model: PreTrainedModel, caches: list[DynamicCache], continuation_ids: torch.Tensor,
                                context_length: int, max_batch: int = 8) -> list[torch.Tensor]:
    """Per cache of ``caches`` (batch 1, left unmodified), the (1, M, vocab) float32 logits of ``continuation_ids``
    (1, M) after it; caches of equal lengths in every layer run as one batch of at most ``max_batch``."""
    if sliding_layers(model):  # a rebuilt cache would lose what its sliding layers have seen: each on its own
        return [continuation_logits(model, copy.deepcopy(cache), continuation_ids, context_length) for cache in caches]
    logits: list[torch.Tensor | None] = [None] * len(caches)
    groups: dict[tuple[int, ...], list[int]] = {}
    for index, cache in enumerate(caches):
        groups.setdefault(tuple(layer.keys.shape[2] for layer in cache.layers), []).append(index)
    for members in groups.values():
        for start in range(0, len(members), max_batch):
            chunk = members[start : start + max_batch]
            layers = range(len(caches[chunk[0]].layers))
            stacked = cache_from_layers(
                model,
                [torch.cat([caches[i].layers[layer].keys for i in chunk]) for layer in layers],
                [torch.cat([caches[i].layers[layer].values for i in chunk]) for layer in layers],
            )
            batch_logits = continuation_logits(model, stacked, continuation_ids.expand(len(chunk), -1),
                                               context_length)
            for row, index in enumerate(chunk):
                logits[index] = batch_logits[row : row + 1]
    return logits
