"""Scoring with padding: heads of different lengths in one pass, and widths padded to buckets (what a CUDA-graphed
scorer replays), give each real token the logit of scoring its head alone."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from curkv_train.runtime import CurKVCache, TierConfig
from curkv_train.runtime.scorer import bucket_width
from runtime_helpers import TORCH, family_scorer, greedy, prompt

FAMILIES = [("seed", "pre_rope"), ("query_aware", "pre_rope"), ("query_aware", "end_relative"),
            ("hidden", "pre_rope")]


def test_bucket_widths_cover_the_tokens_with_four_widths_per_doubling():
    widths = [bucket_width(tokens) for tokens in range(1, 20_000)]
    assert all(width >= tokens for tokens, width in enumerate(widths, start=1))
    assert all(width <= max(64, 1.25 * tokens) for tokens, width in enumerate(widths, start=1))
    assert sorted({bucket_width(tokens) for tokens in range(1025, 2049)}) == [1280, 1536, 1792, 2048]
    assert widths[:64] == [64] * 64


def layer_inputs(scorer, model, tokens: int, end: int, seed: int) -> dict:
    """A compressed layer's held tokens: random keys and values, and per head its own increasing positions below
    ``end``; the observation and arrival scores the scorer's family reads."""
    generator = torch.Generator().manual_seed(seed)
    keys, values = (torch.randn(1, 2, tokens, 16, generator=generator) for _ in range(2))
    positions = torch.stack([torch.randperm(end - 1, generator=generator)[:tokens].sort().values for _ in range(2)])
    positions[:, -1] = end - 1
    hidden = torch.randn(1, end, model.config.hidden_size, generator=generator)
    extra = scorer.prefill_inputs(model, 0, hidden)
    if "token_scores" in extra:
        extra["token_scores"] = extra["token_scores"].gather(-1, positions[None])
    return {"keys": keys, "values": values, "positions": positions[None], "end": end, **extra}


@pytest.mark.parametrize("family, view", FAMILIES)
def test_masked_heads_score_as_each_head_alone(model, family, view):
    """Head 1 holds 30 tokens, then 20 padding places (its last token repeated, as a ragged layer pads): its real
    tokens' logits are those of scoring its 30 tokens alone; head 0's, of its 50."""
    scorer = family_scorer(family, view)
    inputs = layer_inputs(scorer, model, 50, end=120, seed=0)
    per_token = [name for name in ("keys", "values", "positions", "token_scores") if name in inputs]
    alone = scorer.score_layer(model, 0, **{**inputs, **{name: inputs[name][:, :, :30] for name in per_token}})
    index = torch.arange(50).clamp_max(29)  # head 1: its first 30 tokens, then its 30th repeated
    both = {**inputs, **{name: torch.cat([inputs[name][:, :1], inputs[name][:, 1:].index_select(2, index)], dim=1)
                         for name in per_token}}
    valid = torch.ones(1, 2, 50, dtype=torch.bool)
    valid[:, 1, 30:] = False
    logits = scorer.score_layer(model, 0, **both, valid=valid)
    torch.testing.assert_close(logits[:, :1], scorer.score_layer(model, 0, **inputs)[:, :1], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(logits[:, 1:, :30], alone[:, 1:], atol=1e-4, rtol=1e-4)
    if family == "query_aware":  # without the mask the padding would change the real tokens' features
        unmasked = scorer.score_layer(model, 0, **both)
        assert not torch.allclose(unmasked[:, 1:, :30], alone[:, 1:], atol=1e-3)


@pytest.mark.parametrize("family, view", FAMILIES)
def test_a_bucketed_scorer_gives_the_unpadded_logits(model, family, view):
    scorer = family_scorer(family, view)
    inputs = layer_inputs(scorer, model, 100, end=150, seed=1)
    bucketed = dataclasses.replace(scorer, bucketed=True)
    widths = []
    original = bucketed.layer_logits

    def spy(model, module, layers, keys, *rest):
        widths.append(keys.shape[2])
        return original(model, module, layers, keys, *rest)

    bucketed.layer_logits = spy
    torch.testing.assert_close(bucketed.score_layer(model, 0, **inputs), scorer.score_layer(model, 0, **inputs),
                               atol=1e-4, rtol=1e-4)
    assert widths == [112]


def test_a_joint_layer_scores_its_heads_in_one_call_per_compression(model):
    """After the prefill the heads of a joint cache hold different counts; each decode compression scores a layer
    once (its heads padded to the longest), where it scored once per distinct length."""
    scorer = family_scorer("query_aware")
    cache = CurKVCache(scorer, model, keep_ratio=0.3, tiers=TierConfig(allocation="joint"), compute=TORCH)
    calls, original = [], cache._score

    def spy(layer, keys, values, positions, end, *rest, valid=None, **kwargs):
        calls.append((layer, end, valid is not None and bool((~valid).any())))
        return original(layer, keys, values, positions, end, *rest, valid=valid, **kwargs)

    for layer in cache.compressed_layers:
        layer.score_fn = spy
    greedy(model, prompt(300), cache, new=128)
    compressions = [(layer, end) for layer, end, _ in calls]
    assert len(compressions) >= 4 and len(set(compressions)) == len(compressions)  # one call per layer and round
    assert any(padded for *_, padded in calls)  # some head was shorter than the layer's longest


def test_a_bucketed_cache_generates_what_the_exact_one_does_through_fewer_widths(model):
    scorer = family_scorer("query_aware")
    outputs, widths = [], {False: [], True: []}
    for bucketed in (False, True):
        cache = CurKVCache(scorer, model, keep_ratio=0.5, tiers=TierConfig(allocation="joint"), compute=TORCH)
        cache.scorer = dataclasses.replace(scorer, bucketed=bucketed)
        original = cache.scorer.layer_logits

        def spy(model, module, layers, keys, *rest, _original=original, _widths=widths[bucketed]):
            _widths.append(keys.shape[2])
            return _original(model, module, layers, keys, *rest)

        cache.scorer.layer_logits = spy
        outputs.append(greedy(model, prompt(300), cache, new=160))
    assert torch.equal(outputs[1], outputs[0])
    assert len(widths[True]) == len(widths[False]) >= 7
    assert all(width == bucket_width(exact) for width, exact in zip(widths[True], widths[False]))
    assert len(set(widths[True])) < len(set(widths[False]))  # fewer graphs to record than compressions


def test_a_graphed_scorer_pads_and_a_cache_takes_a_compiled_scorer_as_it_is():
    from curkv_train.runtime import ComputeConfig
    from curkv_train.runtime.cache import compute_scorer

    scorer = family_scorer("query_aware")
    graphed = compute_scorer(scorer, ComputeConfig(scoring_graphs=True))  # compiles lazily: nothing runs here
    assert graphed.bucketed and graphed.is_compiled and not scorer.bucketed and not scorer.is_compiled
    assert compute_scorer(graphed, ComputeConfig(scoring_graphs=True)) is graphed  # one compilation, shared
    assert compute_scorer(graphed, ComputeConfig()) is graphed
    assert compute_scorer(scorer, ComputeConfig()) is scorer
