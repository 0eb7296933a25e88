"""Prefill capture and compressed-cache continuations on the tiny model."""

from __future__ import annotations

import pytest
import torch

from curkv_train.core.rope import rotary_tables, rotate_half
from curkv_train.core.selection import expected_kept
from curkv_train.eval.compressed import (
    batched_continuation_logits,
    cache_bytes,
    cache_from_layers,
    compress_prefill,
    continuation_logits,
    kept_tokens,
)
from curkv_train.eval.methods import ExpectedAttentionScore, StreamingLLMScore
from curkv_train.eval.prefill import prefill
from curkv_train.models.base import TINY_RANDOM, load_base_model

N_SINK, WINDOW, CONTEXT, CONTINUATION = 4, 8, 40, 6


@pytest.fixture(scope="module")
def model():
    return load_base_model(TINY_RANDOM)


@pytest.fixture(scope="module")
def ids():
    generator = torch.Generator().manual_seed(3)
    return torch.randint(0, 500, (1, CONTEXT + CONTINUATION), generator=generator)


def test_keep_all_matches_a_plain_forward(model, ids):
    context = prefill(model, ids[:, :CONTEXT])
    logits = continuation_logits(model, cache_from_layers(model, context.keys, context.values), ids[:, CONTEXT:],
                                 CONTEXT)
    assert torch.allclose(logits, model(ids).logits[:, CONTEXT:], atol=1e-5)


def test_compressed_cache_equals_masking_the_dropped_tokens(model, ids):
    """Continuation over the compacted cache == full cache with the evicted keys masked (same positions)."""
    context = prefill(model, ids[:, :CONTEXT], capture_queries=False)
    scores = [StreamingLLMScore()(context.layer_context(layer, model=model, n_sink=N_SINK, window=WINDOW, seed=0))
              for layer in range(context.num_layers)]
    cache = compress_prefill(model, context, scores, n_sink=N_SINK, window=WINDOW, keep_ratio=0.25, backend="torch")
    held = expected_kept(CONTEXT, N_SINK, WINDOW, 0.25)
    assert held == 4 + 8 + 7 and kept_tokens(cache) == held
    config = model.config
    head_dim = config.hidden_size // config.num_attention_heads
    assert cache_bytes(cache) == 2 * config.num_hidden_layers * config.num_key_value_heads * held * head_dim * 4
    compressed = continuation_logits(model, cache, ids[:, CONTEXT:], CONTEXT)

    keep = list(range(N_SINK)) + list(range(CONTEXT - WINDOW - 7, CONTEXT))
    mask = torch.zeros(1, 1, CONTINUATION, CONTEXT + CONTINUATION, dtype=torch.bool)
    mask[..., keep] = True
    mask[0, 0, :, CONTEXT:] = torch.ones(CONTINUATION, CONTINUATION, dtype=torch.bool).tril()
    full = cache_from_layers(model, context.keys, context.values)
    reference = model(input_ids=ids[:, CONTEXT:], past_key_values=full, attention_mask=mask).logits
    assert torch.allclose(compressed, reference, atol=1e-5)
    assert not torch.allclose(compressed, model(ids).logits[:, CONTEXT:], atol=1e-3)


def test_captured_queries_reproduce_the_model_attention(model, ids):
    """H2O's attention mass from the hooked queries == the eager model's own attention weights, summed over queries."""
    context = prefill(model, ids[:, :CONTEXT])
    eager = load_base_model(TINY_RANDOM, attn_implementation="eager")
    with torch.no_grad():
        attentions = eager(ids[:, :CONTEXT], output_attentions=True).attentions
    for layer in range(context.num_layers):
        ctx = context.layer_context(layer, model=model, n_sink=N_SINK, window=WINDOW, seed=0)
        assert torch.allclose(ctx.attention_mass(), attentions[layer].sum(dim=-2), atol=1e-4)


def test_average_rotation_of_one_position_is_rope(model, ids):
    context = prefill(model, ids[:, :CONTEXT])
    ctx = context.layer_context(0, model=model, n_sink=N_SINK, window=WINDOW, seed=0)
    query = torch.randn(16)
    cos, sin = rotary_tables(model, torch.tensor([57]), ctx.keys)
    assert torch.allclose(ctx.average_rotation(57, 1) @ query, query * cos[0] + rotate_half(query) * sin[0],
                          atol=1e-6)
    scores = ExpectedAttentionScore(n_sink=N_SINK, n_future_positions=16)(ctx)
    assert scores.shape == (1, 2, CONTEXT) and torch.isfinite(scores).all()
    assert (scores[..., :N_SINK] > scores[..., N_SINK:].amax(-1, keepdim=True)).all()


def test_batched_continuations_equal_one_by_one(model, ids):
    context = prefill(model, ids[:, :CONTEXT], capture_queries=False)
    generator = torch.Generator().manual_seed(1)
    caches = []
    for keep_ratio in (0.5, 0.5, 0.25):
        scores = [torch.rand(keys.shape[:3], generator=generator) for keys in context.keys]
        caches.append(compress_prefill(model, context, scores, n_sink=N_SINK, window=WINDOW, keep_ratio=keep_ratio,
                                       backend="torch"))
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
    context = prefill(model, ids[:, :CONTEXT], capture_queries=False)
    generator = torch.Generator().manual_seed(2)
    scores = [torch.rand(keys.shape[:3], generator=generator) for keys in context.keys]
    caches = [compress_prefill(model, context, scores, n_sink=N_SINK, window=WINDOW, keep_ratio=ratios,
                               backend="torch") for ratios in ([0.25, 0.75], [0.25, 0.5])]
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
