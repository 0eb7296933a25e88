"""Each baseline's kept set on small hand-checked examples, through kvpress's selection (ScorerPress.compress)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

kvpress = pytest.importorskip("kvpress")

from curkv_train.core.errors import CurKVError  # noqa: E402
from curkv_train.core.selection import expected_kept  # noqa: E402
from curkv_train.eval.baseline_presses import H2OPress, ProtectedPress  # noqa: E402
from curkv_train.eval.kvpress_bridge import press_ratio  # noqa: E402
from curkv_train.eval.methods import METHODS, build_methods  # noqa: E402


def kept(press, keys: torch.Tensor, keep_ratio: float, attentions: torch.Tensor | None = None) -> list[int]:
    """Positions (batch 0, KV head 0) kvpress's compress keeps at our count for ``keep_ratio`` of the compressible
    tokens; ``press`` has ``n_sink`` and ``window`` (a ProtectedPress)."""
    tokens = keys.shape[2]
    press.compression_ratio = press_ratio(tokens, 1.0 - keep_ratio, n_sink=press.n_sink, window=press.window,
                                          budget="matched")
    values = torch.arange(tokens, dtype=keys.dtype)[None, None, :, None].expand_as(keys)  # position in every channel
    module = SimpleNamespace(head_dim=keys.shape[-1], layer_idx=0)
    _, held = press.compress(module, None, keys, values.contiguous(), attentions, {})
    assert held.shape[2] == expected_kept(tokens, press.n_sink, press.window, keep_ratio)
    return sorted(int(position) for position in held[0, 0, :, 0])


def keys_with_norms(norms: list[float]) -> torch.Tensor:
    """(1, 1, tokens, 4) keys, key j = norms[j] · e_0."""
    keys = torch.zeros(1, 1, len(norms), 4)
    keys[0, 0, :, 0] = torch.tensor(norms)
    return keys


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


def test_streaming_llm_keeps_exactly_sinks_and_recent():
    press = ProtectedPress(press=kvpress.StreamingLLMPress(n_sink=2), n_sink=2, window=3)
    # compressible 2..8 (7 tokens), ⌈0.5 · 7⌉ = 4 newest of them: 5..8
    assert kept(press, keys_with_norms([1.0] * 12), 0.5) == [0, 1, 5, 6, 7, 8, 9, 10, 11]
    assert kept(press, keys_with_norms([1.0] * 12), 0.01) == [0, 1, 8, 9, 10, 11]


def test_knorm_keeps_the_lowest_norm_keys_and_the_protected_ones():
    keys = keys_with_norms([9, 9, 5, 1, 7, 3, 8, 2, 6, 9, 9, 9])
    # compressible norms 5,1,7,3,8,2,6 at 2..8; the four lowest: 1 (3), 2 (7), 3 (5), 5 (2)
    press = ProtectedPress(press=kvpress.KnormPress(), n_sink=2, window=3)
    assert kept(press, keys, 0.5) == [0, 1, 2, 3, 5, 7, 9, 10, 11]
    # negative control: kvpress's KnormPress alone keeps as many, but not the high-norm sinks and window
    alone = kvpress.KnormPress(compression_ratio=press_ratio(12, 0.5, n_sink=2, window=3, budget="matched"))
    positions = torch.arange(12.0)[None, None, :, None].expand_as(keys).contiguous()
    _, held = alone.compress(SimpleNamespace(head_dim=4, layer_idx=0), None, keys, positions, None, {})
    assert held.shape[2] == 9 and not {0, 1, 9, 10, 11} <= set(held[0, 0, :, 0].tolist())


def test_h2o_sums_attention_over_all_queries_and_averages_the_group():
    probs = torch.tensor([HEAD_0, HEAD_1])[None]  # (1, 2 heads, 6, 6)
    keys = torch.randn(1, 1, 6, 4)
    # column sums head 0 / head 1 on 1..4: (1.4, 1.0, 1.3, 0.2) / (0.9, 1.0, 0.85, 1.15)
    # group means: 1.15, 1.0, 1.075, 0.675 -> keep 1 and 3
    scores = H2OPress().score(None, None, keys, keys, probs, {})
    assert torch.allclose(scores[0, 0, 1:5], torch.tensor([1.15, 1.0, 1.075, 0.675]))
    assert kept(ProtectedPress(press=H2OPress(), n_sink=1, window=1), keys, 0.5, attentions=probs) == [0, 1, 3, 5]
    with pytest.raises(CurKVError, match="eager attention"):
        H2OPress().score(None, None, keys, keys, None, {})


def test_random_draws_other_tokens_per_seed_and_keeps_the_count():
    press = ProtectedPress(press=kvpress.RandomPress(), n_sink=2, window=3)
    keys = keys_with_norms([1.0] * 40)
    torch.manual_seed(0)
    first = kept(press, keys, 0.5)
    torch.manual_seed(0)
    assert kept(press, keys, 0.5) == first
    torch.manual_seed(7)
    assert kept(press, keys, 0.5) != first
    assert len(first) == 2 + 3 + 18 and {0, 1, 37, 38, 39} <= set(first)


def test_unknown_method_lists_the_valid_ones():
    with pytest.raises(CurKVError, match="valid methods: " + ", ".join(METHODS)):
        build_methods(["h2o", "magic"], None)
    with pytest.raises(CurKVError, match="--scorer"):
        build_methods(["curkv"], None)


def layer_counts(press, context_length: int) -> list[int]:
    """Tokens per layer kvpress keeps of ``context_length`` under ``press`` (one ratio, or one per layer)."""
    ratios = getattr(press, "compression_ratios", None) or [press.compression_ratio] * 2
    return [max(1, int(context_length * (1 - ratio))) for ratio in ratios]


def test_a_budgeted_scorer_gets_per_layer_counts_and_a_uniform_row():
    from curkv_train.runtime.allocation import LayerBudget
    from runtime_helpers import random_scorer

    budgeted, plain = random_scorer(), random_scorer()
    budgeted.layer_budget = LayerBudget((0.1, 3.0), 1.0)
    methods = build_methods(["full", "curkv", "h2o"], {"curkv": budgeted, "curkv:plain": plain}, n_sink=4, window=16)
    assert set(methods) == {"full", "curkv", "curkv_uniform", "curkv:plain", "h2o"}

    def counts(name: str, keep: float) -> list[int]:
        return layer_counts(methods[name].press(200, 1.0 - keep, 0, n_sink=4, window=16), 200)

    shares = budgeted.layer_budget.ratios(0.5)
    assert counts("curkv", 0.5) == [expected_kept(200, 4, 16, share) for share in shares]
    assert counts("curkv", 0.5)[0] < expected_kept(200, 4, 16, 0.5) < counts("curkv", 0.5)[1]
    assert counts("curkv_uniform", 0.5) == counts("curkv:plain", 0.5) == counts("h2o", 0.5) == [
        expected_kept(200, 4, 16, 0.5)] * 2
    assert counts("curkv", 1.0) == [200, 200]
    shared = LayerBudget((2.0, 0.5), 1.0)  # --budget_baselines: the baselines follow the shared budget
    h2o = build_methods(["h2o"], None, n_sink=4, window=16, baseline_budget=shared)["h2o"]
    assert layer_counts(h2o.press(200, 0.5, 0, n_sink=4, window=16), 200) == [
        expected_kept(200, 4, 16, share) for share in shared.ratios(0.5)]
