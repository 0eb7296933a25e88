"""Compressed caches and their continuations on the tiny model."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from curkv_train.core.selection import compress_kv, expected_kept, select_kept
from curkv_train.eval.compressed import batched_continuation_logits, cache_from_layers, continuation_logits
from curkv_train.eval.runtime_caches import held_bytes, held_tokens
from curkv_train.models.base import TINY_RANDOM, load_base_model

N_SINK, WINDOW, CONTEXT, CONTINUATION = 4, 8, 40, 6


@pytest.fixture(scope="module")
def model():
    return load_base_model(TINY_RANDOM)


@pytest.fixture(scope="module")
def ids():
    generator = torch.Generator().manual_seed(3)
    return torch.randint(0, 500, (1, CONTEXT + CONTINUATION), generator=generator)


@torch.no_grad()
def prefill(model, context_ids: torch.Tensor) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per layer, the full cache's keys and values (1, kv_heads, tokens, head_dim) of ``context_ids``."""
    cache = DynamicCache(config=model.config)
    model(input_ids=context_ids, past_key_values=cache, use_cache=True)
    return [layer.keys for layer in cache.layers], [layer.values for layer in cache.layers]


def compressed(model, keys: list[torch.Tensor], values: list[torch.Tensor], keep_ratios: list[float],
               generator: torch.Generator) -> DynamicCache:
    """A cache of random-scored kept tokens, ``keep_ratios[l]`` of layer l's compressible ones."""
    kept = [compress_kv(k, v, select_kept(torch.rand(k.shape[:3], generator=generator), N_SINK, WINDOW, ratio),
                        backend="torch") for k, v, ratio in zip(keys, values, keep_ratios)]
    return cache_from_layers(model, [k for k, _ in kept], [v for _, v in kept])


def test_keep_all_matches_a_plain_forward(model, ids):
    keys, values = prefill(model, ids[:, :CONTEXT])
    logits = continuation_logits(model, cache_from_layers(model, keys, values), ids[:, CONTEXT:], CONTEXT)
    assert torch.allclose(logits, model(ids).logits[:, CONTEXT:], atol=1e-5)


def test_compressed_cache_equals_masking_the_dropped_tokens(model, ids):
    """Continuation over the streaming_llm baseline's cache (kvpress's press) == the full cache with the evicted
    keys masked (same positions)."""
    from curkv_train.eval.kvpress_bridge import press_cache
    from curkv_train.eval.methods import build_methods

    pytest.importorskip("kvpress")
    method = build_methods(["streaming_llm"], None, n_sink=N_SINK, window=WINDOW)["streaming_llm"]
    press = method.press(CONTEXT, 0.75, 0, n_sink=N_SINK, window=WINDOW)
    cache, _ = press_cache(model, method.spec, press, ids[:, :CONTEXT], seed=0)
    held = expected_kept(CONTEXT, N_SINK, WINDOW, 0.25)
    assert held == 4 + 8 + 7 and held_tokens(cache) == held
    config = model.config
    head_dim = config.hidden_size // config.num_attention_heads
    assert held_bytes(cache) == 2 * config.num_hidden_layers * config.num_key_value_heads * held * head_dim * 4
    compressed_logits = continuation_logits(model, cache, ids[:, CONTEXT:], CONTEXT)

    keep = list(range(N_SINK)) + list(range(CONTEXT - WINDOW - 7, CONTEXT))
    mask = torch.zeros(1, 1, CONTINUATION, CONTEXT + CONTINUATION, dtype=torch.bool)
    mask[..., keep] = True
    mask[0, 0, :, CONTEXT:] = torch.ones(CONTINUATION, CONTINUATION, dtype=torch.bool).tril()
    full = cache_from_layers(model, *prefill(model, ids[:, :CONTEXT]))
    reference = model(input_ids=ids[:, CONTEXT:], past_key_values=full, attention_mask=mask).logits
    assert torch.allclose(compressed_logits, reference, atol=1e-5)
    assert not torch.allclose(compressed_logits, model(ids).logits[:, CONTEXT:], atol=1e-3)


def test_batched_continuations_equal_one_by_one(model, ids):
    keys, values = prefill(model, ids[:, :CONTEXT])
    generator = torch.Generator().manual_seed(1)
    caches = [compressed(model, keys, values, [keep_ratio] * len(keys), generator) for keep_ratio in (0.5, 0.5, 0.25)]
    held = [cache.get_seq_length() for cache in caches]
    batched = batched_continuation_logits(model, caches, ids[:, CONTEXT:], CONTEXT, max_batch=8)
    assert [cache.get_seq_length() for cache in caches] == held  # the caches were not extended
    for cache, logits in zip(caches, batched):
        assert torch.allclose(logits, continuation_logits(model, cache, ids[:, CONTEXT:], CONTEXT), atol=1e-5)
    assert not torch.allclose(batched[0], batched[1], atol=1e-4)


@torch.no_grad()
def test_per_layer_ratios_hold_their_shares_and_continue_as_single_tokens(ids):
    """A layer budget's cache: layers hold their own counts, a continuation chunk (the model's mask built
    for layer 0, fitted per layer by the runtime's attention wrapper) gives the logits of feeding the same
    tokens one at a time, and caches that differ only past layer 0 are not batched together."""
    from curkv_train.runtime.attention import install_runtime_attention

    model = load_base_model(TINY_RANDOM)
    install_runtime_attention(model, factored=False, per_layer=True)
    keys, values = prefill(model, ids[:, :CONTEXT])
    caches = [compressed(model, keys, values, ratios, torch.Generator().manual_seed(2))
              for ratios in ([0.25, 0.75], [0.25, 0.5])]
    lengths = [[layer.keys.shape[2] for layer in cache.layers] for cache in caches]
    compressible = CONTEXT - N_SINK - WINDOW
    assert lengths[0] == [expected_kept(CONTEXT, N_SINK, WINDOW, 0.25), expected_kept(CONTEXT, N_SINK, WINDOW, 0.75)]
    assert lengths[0][0] == lengths[1][0] < lengths[1][1] < lengths[0][1] < N_SINK + WINDOW + compressible
    batched = batched_continuation_logits(model, caches, ids[:, CONTEXT:], CONTEXT, max_batch=8)
    for cache, logits in zip(caches, batched):
        stepped = cache_from_layers(model, [layer.keys for layer in cache.layers],
                                    [layer.values for layer in cache.layers])
        single = torch.cat([continuation_logits(model, stepped, ids[:, CONTEXT + index : CONTEXT + index + 1],
                                                CONTEXT + index) for index in range(CONTINUATION)], dim=1)
        torch.testing.assert_close(logits, single, atol=1e-4, rtol=1e-4)
