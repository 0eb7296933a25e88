"""kvpress's own presses through the harness (cross-check), and our scores against theirs."""

from __future__ import annotations

import pytest
import torch

kvpress = pytest.importorskip("kvpress")

from curkv_train.eval import kvpress_bridge  # noqa: E402
from curkv_train.eval.harness import EvalSettings, evaluate  # noqa: E402
from curkv_train.eval.methods import (  # noqa: E402
    CurDKVScore,
    ExpectedAttentionScore,
    KNormScore,
    SnapKVScore,
    build_methods,
)
from curkv_train.eval.prefill import prefill  # noqa: E402
from curkv_train.eval.tasks import TaskExample  # noqa: E402
from curkv_train.models.base import TINY_RANDOM, load_base_model  # noqa: E402

CONTEXT, CONTINUATION, N_SINK, WINDOW = 96, 12, 4, 16


@pytest.fixture(scope="module")
def model():
    return load_base_model(TINY_RANDOM)


def examples(count: int) -> list[TaskExample]:
    generator = torch.Generator().manual_seed(11)
    return [TaskExample("ppl_text", torch.randint(0, 500, (1, CONTEXT + CONTINUATION), generator=generator), CONTEXT)
            for _ in range(count)]


def run(model, budget: str) -> dict:
    settings = EvalSettings([0.5], n_sink=N_SINK, window=WINDOW, kvpress=True, kvpress_budget=budget, backend="torch")
    methods = build_methods(["full", "streaming_llm"], None, n_sink=N_SINK, window=WINDOW)
    results = evaluate(model, {"ppl_text": examples(2)}, methods, settings)
    return {row["method"]: row["metrics"] for row in results["rows"]}


def test_every_press_runs_with_our_budget(model):
    rows = run(model, "matched")
    names = kvpress_bridge.available_presses()
    assert {"streaming_llm", "snapkv", "tova", "knorm", "expected_attention", "observed_attention"} <= set(names)
    for name in names:
        metrics = rows[f"kvpress:{name}"]
        assert metrics["kept_tokens"] == rows["streaming_llm"]["kept_tokens"] == 4 + 16 + 38
        assert metrics["kv_bytes"] == rows["streaming_llm"]["kv_bytes"] < rows["full"]["kv_bytes"]
    # kvpress's StreamingLLM keeps the same tokens as ours at the same budget: identical continuations
    assert rows["kvpress:streaming_llm"]["ppl"] == pytest.approx(rows["streaming_llm"]["ppl"], rel=1e-5)
    assert model.config._attn_implementation != "eager"  # ObservedAttention's eager switch was undone


def test_nominal_budget_is_kvpress_own_count(model):
    rows = run(model, "nominal")
    assert rows["kvpress:knorm"]["kept_tokens"] == int(CONTEXT * 0.5)
    assert rows["streaming_llm"]["kept_tokens"] == 4 + 16 + 38


def layer_inputs(model, ids: torch.Tensor, layer: int):
    """(attention module of ``layer``, its input hidden states, its keyword arguments, the Prefill)."""
    captured = {}
    module = model.get_decoder().layers[layer].self_attn

    def hook(module, args, kwargs, output):
        captured.update(kwargs)

    handle = module.register_forward_hook(hook, with_kwargs=True)
    try:
        context = prefill(model, ids)
    finally:
        handle.remove()
    return module, captured["hidden_states"], captured, context


def test_scores_match_kvpress_definitions():
    model = load_base_model(TINY_RANDOM)  # kvpress attaches rotary_emb to the attention modules
    ids = torch.randint(0, 500, (1, CONTEXT), generator=torch.Generator().manual_seed(5))
    for layer in range(model.config.num_hidden_layers):
        module, hidden, kwargs, context = layer_inputs(model, ids, layer)
        module.rotary_emb = model.get_decoder().rotary_emb
        ctx = context.layer_context(layer, model=model, n_sink=N_SINK, window=WINDOW, seed=0)
        keys, values = ctx.keys, ctx.values

        theirs = kvpress.ExpectedAttentionPress(n_sink=N_SINK).score(module, hidden, keys, values, None, kwargs)
        assert torch.allclose(ExpectedAttentionScore(n_sink=N_SINK)(ctx), theirs, rtol=1e-4, atol=1e-6)
        theirs = kvpress.CURPress(num_sinks=N_SINK).score(module, hidden, keys, values, None, kwargs)
        assert torch.allclose(CurDKVScore()(ctx)[..., N_SINK:], theirs[..., N_SINK:], rtol=1e-4, atol=1e-7)
        theirs = kvpress.KnormPress().score(module, hidden, keys, values, None, kwargs)
        assert torch.allclose(KNormScore()(ctx), theirs)


def test_snapkv_keeps_the_tokens_kvpress_snapkv_keeps():
    """Same scores as kvpress's SnapKVPress, so the same top-k at every budget (window = observation window)."""
    model = load_base_model(TINY_RANDOM)
    ids = torch.randint(0, 500, (1, CONTEXT), generator=torch.Generator().manual_seed(6))
    for layer in range(model.config.num_hidden_layers):
        module, hidden, kwargs, context = layer_inputs(model, ids, layer)
        ctx = context.layer_context(layer, model=model, n_sink=N_SINK, window=WINDOW, seed=0)
        theirs = kvpress.SnapKVPress(window_size=WINDOW).score(module, hidden, ctx.keys, ctx.values, None, kwargs)
        ours = SnapKVScore(window_size=WINDOW)(ctx)
        assert torch.allclose(ours, theirs, rtol=1e-4, atol=1e-6)
        for kept in (8, 24, 48):
            assert top_k_overlap(ours, theirs, kept) == 1.0


def top_k_overlap(ours: torch.Tensor, theirs: torch.Tensor, kept: int) -> float:
    """Share of the (batch, KV head, position) top-``kept`` of ``theirs`` that ``ours`` also keeps."""
    def chosen(scores):
        indices = scores.topk(kept, dim=-1).indices
        return {(b, h, int(i)) for b in range(indices.shape[0]) for h in range(indices.shape[1]) for i in indices[b, h]}
    return len(chosen(ours) & chosen(theirs)) / len(chosen(theirs))
