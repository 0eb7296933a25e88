"""Each baseline's kept set on small hand-checked examples, through the shared selection path."""

from __future__ import annotations

import pytest
import torch

from curkv_train.core.errors import CurKVError
from curkv_train.eval.context import LayerContext
from curkv_train.eval.methods import (
    METHODS,
    CurDKVScore,
    H2OScore,
    KNormScore,
    RandomScore,
    SnapKVScore,
    StreamingLLMScore,
    TOVAScore,
    build_methods,
)
from curkv_train.core.selection import select_kept


def kept(method, ctx: LayerContext, keep_ratio: float) -> list[int]:
    """Kept positions of batch 0, KV head 0."""
    return select_kept(method(ctx), ctx.n_sink, ctx.window, keep_ratio)[0, 0].tolist()


def context_with_norms(norms: list[float], n_sink: int, window: int) -> LayerContext:
    """One KV head whose key j is norms[j] · e_0 (values alike)."""
    keys = torch.zeros(1, 1, len(norms), 4)
    keys[0, 0, :, 0] = torch.tensor(norms)
    return LayerContext(layer=0, keys=keys, values=keys.clone(), positions=torch.arange(len(norms)),
                        n_sink=n_sink, window=window)


# Two query heads sharing one KV head, six tokens, causal rows summing to 1.
HEAD_0 = [
    [1.0, 0, 0, 0, 0, 0],
    [0.5, 0.5, 0, 0, 0, 0],
    [0.2, 0.1, 0.7, 0, 0, 0],
    [0.1, 0.1, 0.1, 0.7, 0, 0],
    [0.1, 0.6, 0.1, 0.1, 0.1, 0],
    [0.1, 0.1, 0.1, 0.5, 0.1, 0.1],
]
HEAD_1 = HEAD_0[:4] + [
    [0.1, 0.1, 0.1, 0.1, 0.6, 0],
    [0.1, 0.1, 0.1, 0.05, 0.55, 0.1],
]


def hand_made_attention(n_sink: int = 1, window: int = 1) -> LayerContext:
    probs = torch.tensor([HEAD_0, HEAD_1])[None]  # (1, 2 heads, 6, 6)
    keys = torch.randn(1, 1, 6, 4)
    return LayerContext(layer=0, keys=keys, values=keys.clone(), positions=torch.arange(6), probs=probs,
                        n_sink=n_sink, window=window)


def test_streaming_llm_keeps_exactly_sinks_and_recent():
    ctx = context_with_norms([1.0] * 12, n_sink=2, window=3)
    # compressible 2..8 (7 tokens), ⌈0.5 · 7⌉ = 4 newest of them: 5..8
    assert kept(StreamingLLMScore(), ctx, 0.5) == [0, 1, 5, 6, 7, 8, 9, 10, 11]
    assert kept(StreamingLLMScore(), ctx, 0.01) == [0, 1, 8, 9, 10, 11]


def test_knorm_keeps_the_lowest_norm_keys():
    ctx = context_with_norms([9, 9, 5, 1, 7, 3, 8, 2, 6, 9, 9, 9], n_sink=2, window=3)
    # compressible norms 5,1,7,3,8,2,6 at 2..8; the four lowest: 1 (3), 2 (7), 3 (5), 5 (2)
    assert kept(KNormScore(), ctx, 0.5) == [0, 1, 2, 3, 5, 7, 9, 10, 11]


def test_h2o_sums_attention_over_all_queries_and_averages_the_group():
    ctx = hand_made_attention()
    # column sums head 0 / head 1 on 1..4: (1.4, 1.0, 1.3, 0.2) / (0.9, 1.0, 0.85, 1.15)
    # group means: 1.15, 1.0, 1.075, 0.675 -> keep 1 and 3
    scores = H2OScore()(ctx)
    assert torch.allclose(scores[0, 0, 1:5], torch.tensor([1.15, 1.0, 1.075, 0.675]))
    assert kept(H2OScore(), ctx, 0.5) == [0, 1, 3, 5]


def test_tova_uses_the_last_row():
    ctx = hand_made_attention()
    # last rows on 1..4: (0.1, 0.1, 0.5, 0.1) and (0.1, 0.1, 0.05, 0.55): means 0.1, 0.1, 0.275, 0.325
    assert kept(TOVAScore(), ctx, 0.5) == [0, 3, 4, 5]


def test_snapkv_average_pools_the_keys_before_the_observation_window():
    ctx = hand_made_attention()
    head_0 = LayerContext(layer=0, keys=ctx.keys, values=ctx.values, positions=ctx.positions, probs=ctx.probs[:, :1])
    # head 0's last two rows average to (0.1, 0.35, 0.1, 0.3 | 0.1, 0.05); the window (4, 5) is cut off,
    # then a zero-padded mean over 3 neighbours: (0 + .1 + .35) / 3, (.1 + .35 + .1) / 3, ...
    pooled_0 = torch.tensor([0.45, 0.55, 0.75, 0.4]) / 3
    assert torch.allclose(SnapKVScore(window_size=2, kernel_size=3)(head_0)[0, 0],
                          torch.cat([pooled_0, torch.full((2,), 0.75 / 3 + 1)]))
    per_head = [torch.tensor(head[4:]).mean(0)[:4] for head in (HEAD_0, HEAD_1)]
    padded = [torch.cat([torch.zeros(1), h, torch.zeros(1)]) for h in per_head]
    pooled = [torch.stack([p[i : i + 3].mean() for i in range(4)]) for p in padded]
    scores = SnapKVScore(window_size=2, kernel_size=3)(ctx)[0, 0]
    assert torch.allclose(scores[:4], (pooled[0] + pooled[1]) / 2)  # pooled per head, then averaged
    assert (scores[4:] > scores[:4].max()).all()  # the observation window is never evicted
    with pytest.raises(ValueError):
        SnapKVScore(kernel_size=4)
    with pytest.raises(ValueError):
        SnapKVScore(window_size=6)(ctx)


def test_random_is_seeded_per_context():
    ctx = context_with_norms([1.0] * 40, n_sink=2, window=3)
    first = kept(RandomScore(), ctx, 0.5)
    assert first == kept(RandomScore(), ctx, 0.5)
    ctx.seed = 7
    assert first != kept(RandomScore(), ctx, 0.5)
    assert len(first) == 2 + 3 + 18


def test_curdkv_local_leverage_product():
    keys = torch.zeros(1, 1, 4, 2)
    values = torch.zeros(1, 1, 4, 2)
    keys[0, 0, :, 0] = torch.tensor([1.0, 3.0, 2.0, 2.0]).sqrt()  # squared norms 1, 3, 2, 2
    values[0, 0, :, 1] = torch.tensor([1.0, 1.0, 4.0, 0.0]).sqrt()  # squared norms 1, 1, 4, 0
    ctx = LayerContext(layer=0, keys=keys, values=values, positions=torch.arange(4), n_sink=0, window=0)
    # blocks of 2: keys (0.25, 0.75 | 0.5, 0.5), values (0.5, 0.5 | 1, 0); product sums to 1
    scores = CurDKVScore(local_window_size=2)(ctx)
    assert torch.allclose(scores[0, 0], torch.tensor([0.125, 0.375, 0.5, 0.0]))
    assert kept(CurDKVScore(local_window_size=2), ctx, 0.5) == [1, 2]


def test_attention_from_queries_is_causal_softmax():
    torch.manual_seed(0)
    queries = torch.randn(1, 4, 7, 8)
    keys = torch.randn(1, 2, 7, 8)
    ctx = LayerContext(layer=0, keys=keys, values=keys, positions=torch.arange(7), queries=queries, scaling=0.5)
    expanded = keys.repeat_interleave(2, dim=1)
    logits = queries @ expanded.transpose(-1, -2) * 0.5
    logits = logits.masked_fill(torch.ones(7, 7, dtype=torch.bool).triu(1), float("-inf"))
    probs = logits.softmax(-1)
    assert torch.allclose(ctx.attention(0, 7), probs, atol=1e-6)
    assert torch.allclose(ctx.attention_mass(), probs.sum(2), atol=1e-5)
    assert torch.allclose(ctx.window_attention(1)[:, :, 0], probs[:, :, -1], atol=1e-6)


def test_unknown_method_lists_the_valid_ones():
    with pytest.raises(CurKVError, match="valid methods: " + ", ".join(METHODS)):
        build_methods(["h2o", "magic"], None)
    with pytest.raises(CurKVError, match="--scorer"):
        build_methods(["curkv"], None)


def test_a_budgeted_scorer_gets_per_layer_ratios_and_a_uniform_row():
    from curkv_train.eval.harness import keep_ratios
    from curkv_train.runtime.allocation import LayerBudget
    from runtime_helpers import random_scorer

    budgeted, plain = random_scorer(), random_scorer()
    budgeted.layer_budget = LayerBudget((0.1, 3.0), 1.0)
    methods = build_methods(["full", "curkv", "h2o"], {"curkv": budgeted, "curkv:plain": plain})
    assert set(methods) == {"full", "curkv", "curkv_uniform", "curkv:plain", "h2o"}
    ratios = keep_ratios(methods["curkv"], 0.5)
    assert list(ratios) == list(budgeted.layer_budget.ratios(0.5)) and ratios[0] < 0.5 < ratios[1]
    assert keep_ratios(methods["curkv_uniform"], 0.5) == 0.5
    assert keep_ratios(methods["curkv:plain"], 0.5) == 0.5 and keep_ratios(methods["h2o"], 0.5) == 0.5
    assert keep_ratios(methods["curkv"], 1.0) == 1.0
    shared = LayerBudget((2.0, 0.5), 1.0)  # --budget_baselines: every other method follows the shared budget
    assert keep_ratios(methods["h2o"], 0.5, shared) == shared.ratios(0.5)
    assert keep_ratios(methods["curkv"], 0.5, shared) == ratios and keep_ratios(methods["h2o"], 1.0, shared) == 1.0
