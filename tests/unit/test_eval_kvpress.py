"""kvpress's own presses through the harness (cross-check), and our scores against theirs."""

from __future__ import annotations

import pytest
import torch

kvpress = pytest.importorskip("kvpress")

from curkv_train.core.observation import attention_modules  # noqa: E402
from curkv_train.core.selection import expected_kept  # noqa: E402
from curkv_train.core.shapes import kv_shape  # noqa: E402
from curkv_train.core.errors import CurKVError  # noqa: E402
from curkv_train.eval import kvpress_bridge  # noqa: E402
from curkv_train.eval.compressed import cache_from_layers, continuation_logits  # noqa: E402
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
from curkv_train.models.base import TINY_RANDOM, load_base_model, load_tokenizer  # noqa: E402

CONTEXT, CONTINUATION, N_SINK, WINDOW = 96, 12, 4, 16
MATCHED_KEPT = 4 + 16 + 38  # sinks + window + ⌈0.5 · 76⌉ at compression 0.5
NEW_PRESSES = ("compactor", "criticalkv", "keydiff", "lagkv", "adakv", "kvzip")
MASKED = ("adakv", "kvzip")


@pytest.fixture(scope="module")
def model():
    return load_base_model(TINY_RANDOM)


def examples(count: int) -> list[TaskExample]:
    generator = torch.Generator().manual_seed(11)
    return [TaskExample("ppl_text", torch.randint(0, 500, (1, CONTEXT + CONTINUATION), generator=generator), CONTEXT)
            for _ in range(count)]


def run(model, budget: str, presses: bool = True) -> dict:
    settings = EvalSettings([0.5], n_sink=N_SINK, window=WINDOW, kvpress=presses, kvpress_budget=budget,
                            backend="torch")
    methods = build_methods(["full", "streaming_llm"], None, n_sink=N_SINK, window=WINDOW)
    results = evaluate(model, {"ppl_text": examples(2)}, methods, settings, tokenizer=load_tokenizer(TINY_RANDOM))
    return {row["method"]: row["metrics"] for row in results["rows"]}


def test_every_press_runs_with_our_budget(model):
    rows = run(model, "matched")
    names = kvpress_bridge.available_presses()
    assert {"streaming_llm", "snapkv", "tova", "knorm", "expected_attention", "observed_attention",
            *NEW_PRESSES} <= set(names)
    for name in names:
        metrics = rows[f"kvpress:{name}"]
        assert metrics["kept_tokens"] == rows["streaming_llm"]["kept_tokens"] == MATCHED_KEPT
        assert metrics["prefill_seconds"] > 0
        if name in MASKED:  # fake compression: the whole cache is still held
            assert metrics["kv_bytes"] == rows["full"]["kv_bytes"]
        else:
            assert metrics["kv_bytes"] == rows["streaming_llm"]["kv_bytes"] < rows["full"]["kv_bytes"]
    # kvpress's StreamingLLM keeps the same tokens as ours at the same budget: identical continuations
    assert rows["kvpress:streaming_llm"]["ppl"] == pytest.approx(rows["streaming_llm"]["ppl"], rel=1e-5)
    assert model.config._attn_implementation != "eager"  # ObservedAttention's eager switch was undone


def test_masked_presses_leave_no_mask_behind(model):
    """Masks live on the model: after the presses, the full cache and our caches continue as without them."""
    with_presses, without = run(model, "matched"), run(model, "matched", presses=False)
    assert all(getattr(module, "masked_key_indices", None) is None for module in attention_modules(model))
    assert model.config.name_or_path == ""  # KVzip's tokenizer folder was only lent
    for method in ("full", "streaming_llm"):  # example 2 runs after example 1's masked presses
        assert with_presses[method]["ppl"] == pytest.approx(without[method]["ppl"], rel=1e-6)


def pressed(model, name: str, context_ids: torch.Tensor, compression_ratio: float = 0.5):
    """The :class:`~curkv_train.eval.kvpress_bridge.PressedCache` of press ``name`` at our matched budget."""
    shape = kv_shape(model.config)
    spec = kvpress_bridge.PRESSES[name]
    ratio = kvpress_bridge.press_ratio(context_ids.shape[1], compression_ratio, n_sink=N_SINK, window=WINDOW,
                                       budget="matched",
                                       pooled_heads=shape.num_layers * shape.num_kv_heads if spec.global_budget else 1)
    press = kvpress_bridge.make_press(name, ratio, n_sink=N_SINK, window=WINDOW, seed=0)
    return kvpress_bridge.press_cache(model, name, press, context_ids, seed=0, tokenizer=load_tokenizer(TINY_RANDOM))


def full_logits(model, context_ids: torch.Tensor, continuation_ids: torch.Tensor) -> torch.Tensor:
    context = prefill(model, context_ids, capture_queries=False)
    return continuation_logits(model, cache_from_layers(model, context.keys, context.values), continuation_ids,
                               context_ids.shape[1])


@pytest.mark.parametrize("name", MASKED)
def test_a_masked_press_hides_its_evicted_keys_from_the_continuation(model, name):
    ids = examples(1)[0].input_ids
    context_ids, continuation_ids = ids[:, :CONTEXT], ids[:, CONTEXT:]
    shape = kv_shape(model.config)
    reference = full_logits(model, context_ids, continuation_ids)

    result = pressed(model, name, context_ids)
    masked = kvpress_bridge.masked_key_counts(model)
    assert result.masked and result.cache.get_seq_length() == CONTEXT  # every key still held
    assert sum(masked) == shape.num_layers * shape.num_kv_heads * (CONTEXT - MATCHED_KEPT)
    assert result.kept_tokens == MATCHED_KEPT  # unmasked keys per (layer, KV head), on average
    if name == "adakv":  # per layer, spread unevenly over the KV heads
        assert masked == [shape.num_kv_heads * (CONTEXT - MATCHED_KEPT)] * shape.num_layers
    with kvpress_bridge.masks_cleared(model):
        logits = kvpress_bridge.masked_continuation_logits(model, result.cache, continuation_ids, CONTEXT)
    assert kvpress_bridge.masked_key_counts(model) == [0] * shape.num_layers
    assert (logits - reference).abs().max() > 1e-3  # the masks changed the continuation

    # negative control: the same cache with its masks cleared continues exactly like the full cache
    unmasked = pressed(model, name, context_ids)
    kvpress_bridge.clear_masks(model)
    logits = kvpress_bridge.masked_continuation_logits(model, unmasked.cache, continuation_ids, CONTEXT)
    assert torch.allclose(logits, reference, atol=1e-4)


def test_kvzip_reconstructs_the_context_under_a_global_budget(model):
    calls = []
    handle = model.get_decoder().register_forward_pre_hook(lambda module, args: calls.append(1))
    try:
        result = pressed(model, "kvzip", examples(1)[0].input_ids[:, :CONTEXT])
    finally:
        handle.remove()
        kvpress_bridge.clear_masks(model)
    assert len(calls) == 2  # the prefill, then one "repeat the previous context" pass (one chunk)
    assert result.cache.get_seq_length() == CONTEXT  # the reconstruction's own keys were dropped again
    assert model.config.name_or_path == ""


def kept_positions(full_keys: torch.Tensor, kept_keys: torch.Tensor) -> list[set[int]]:
    """Per KV head (batch 0), the context positions whose keys a compressed cache holds."""
    return [{int((full_keys[0, head] == key).all(dim=-1).nonzero()[0]) for key in kept_keys[0, head]}
            for head in range(full_keys.shape[1])]


@pytest.mark.parametrize("name", ["compactor", "criticalkv", "keydiff", "lagkv"])
def test_a_press_that_drops_keys_keeps_our_budget_and_its_protected_tokens(model, name):
    length = 300 if name == "lagkv" else CONTEXT  # LagKV compresses from n_sink + 2 · lag_size (128) tokens
    ids = torch.randint(0, 500, (1, length), generator=torch.Generator().manual_seed(8))
    ratio = 0.2 if name == "lagkv" else 0.5
    result = pressed(model, name, ids, compression_ratio=ratio)
    full = prefill(model, ids, capture_queries=False)
    kept = expected_kept(length, N_SINK, WINDOW, 1 - ratio)
    for layer in range(model.config.num_hidden_layers):
        keys = result.cache.layers[layer].keys
        assert keys.shape[2] == result.kept_tokens == kept and not result.masked
        positions = kept_positions(full.keys[layer], keys)
        protected = {"compactor": set(range(N_SINK)) | set(range(length - 4, length)),  # sink_size_end = 4
                     "criticalkv": set(range(N_SINK)), "keydiff": set(),
                     "lagkv": set(range(N_SINK)) | set(range(4 + 128, length))}[name]  # sinks + the last lags
        assert all(protected <= head for head in positions)
        if name == "keydiff":  # keeps the keys least similar to the mean direction
            normal = torch.nn.functional.normalize(full.keys[layer], dim=-1)
            similarity = torch.nn.functional.cosine_similarity(full.keys[layer], normal.mean(2, keepdim=True), dim=-1)
            expected = (-similarity).topk(kept, dim=-1).indices[0]
            assert positions == [set(head.tolist()) for head in expected]


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


def test_a_press_subset_runs_only_those_presses(model):
    settings = EvalSettings([0.5], n_sink=N_SINK, window=WINDOW, kvpress=True, backend="torch",
                            kvpress_presses=["tova", "snapkv"])
    assert settings.kvpress_presses == ["snapkv", "tova"]  # kvpress_bridge.PRESSES order
    methods = build_methods(["full"], None, n_sink=N_SINK, window=WINDOW)
    results = evaluate(model, {"ppl_text": examples(1)}, methods, settings, tokenizer=load_tokenizer(TINY_RANDOM))
    assert {row["method"] for row in results["rows"]} == {"full", "kvpress:snapkv", "kvpress:tova"}


def test_an_unknown_press_is_one_clear_error():
    with pytest.raises(CurKVError, match="unknown or unavailable kvpress press.*'snapkvv'"):
        EvalSettings([0.5], kvpress=True, kvpress_presses=["snapkvv"])


def test_kvzip_is_the_multi_pass_press_kept_out_of_the_single_pass_verdict():
    assert kvpress_bridge.multi_pass_methods(["snapkv", "kvzip", "compactor"]) == ["kvpress:kvzip"]
    assert kvpress_bridge.multi_pass_methods(kvpress_bridge.available_presses()) == ["kvpress:kvzip"]


def test_the_verdict_never_takes_kvzip_as_the_best_baseline(model):
    settings = EvalSettings([0.5], n_sink=N_SINK, window=WINDOW, kvpress=True, backend="torch",
                            kvpress_presses=["kvzip"])
    methods = build_methods(["full", "snapkv"], None, n_sink=N_SINK, window=WINDOW)
    results = evaluate(model, {"ppl_text": examples(2)}, methods, settings, tokenizer=load_tokenizer(TINY_RANDOM),
                       ours="snapkv")
    assert any(row["method"] == "kvpress:kvzip" for row in results["rows"])  # reported
    assert results["summary"] == []  # the only other compressing method is no candidate baseline
