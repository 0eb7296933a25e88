"""Every compressing row through kvpress's presses: the baselines, the ``kvpress:<name>`` rows, masks and budgets."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

kvpress = pytest.importorskip("kvpress")

from curkv_train.core.observation import attention_modules  # noqa: E402
from curkv_train.core.selection import expected_kept  # noqa: E402
from curkv_train.core.shapes import kv_shape  # noqa: E402
from curkv_train.core.errors import CurKVError  # noqa: E402
from curkv_train.eval import kvpress_bridge  # noqa: E402
from curkv_train.eval.baseline_presses import H2OPress, ProtectedPress  # noqa: E402
from curkv_train.eval.compressed import continuation_logits  # noqa: E402
from curkv_train.eval.harness import EvalSettings, evaluate  # noqa: E402
from curkv_train.eval.methods import BASELINES, build_methods  # noqa: E402
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
    return kvpress_bridge.press_cache(model, spec, press, context_ids, seed=0, tokenizer=load_tokenizer(TINY_RANDOM))


def prefill(model, context_ids: torch.Tensor):
    """The full cache of ``context_ids`` (a DynamicCache: ``.layers[l].keys``, (1, kv_heads, tokens, head_dim))."""
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=context_ids, past_key_values=cache, use_cache=True)
    return cache


def full_logits(model, context_ids: torch.Tensor, continuation_ids: torch.Tensor) -> torch.Tensor:
    return continuation_logits(model, prefill(model, context_ids), continuation_ids, context_ids.shape[1])


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
    """Per KV head (batch 0), the context positions whose keys a compressed cache holds (the nearest key: an eager
    prefill rounds other than the full cache's)."""
    return [{int((full_keys[0, head] - key).abs().amax(dim=-1).argmin()) for key in kept_keys[0, head]}
            for head in range(full_keys.shape[1])]


@pytest.mark.parametrize("name", ["compactor", "criticalkv", "keydiff", "lagkv"])
def test_a_press_that_drops_keys_keeps_our_budget_and_its_protected_tokens(model, name):
    length = 300 if name == "lagkv" else CONTEXT  # LagKV compresses from n_sink + 2 · lag_size (128) tokens
    ids = torch.randint(0, 500, (1, length), generator=torch.Generator().manual_seed(8))
    ratio = 0.2 if name == "lagkv" else 0.5
    result = pressed(model, name, ids, compression_ratio=ratio)
    full = prefill(model, ids)
    kept = expected_kept(length, N_SINK, WINDOW, 1 - ratio)
    for layer in range(model.config.num_hidden_layers):
        keys = result.cache.layers[layer].keys
        assert keys.shape[2] == result.kept_tokens == kept and not result.masked
        positions = kept_positions(full.layers[layer].keys, keys)
        protected = {"compactor": set(range(N_SINK)) | set(range(length - 4, length)),  # sink_size_end = 4
                     "criticalkv": set(range(N_SINK)), "keydiff": set(),
                     "lagkv": set(range(N_SINK)) | set(range(4 + 128, length))}[name]  # sinks + the last lags
        assert all(protected <= head for head in positions)
        if name == "keydiff":  # keeps the keys least similar to the mean direction
            full_keys = full.layers[layer].keys
            normal = torch.nn.functional.normalize(full_keys, dim=-1)
            similarity = torch.nn.functional.cosine_similarity(full_keys, normal.mean(2, keepdim=True), dim=-1)
            expected = (-similarity).topk(kept, dim=-1).indices[0]
            assert positions == [set(head.tolist()) for head in expected]


def test_nominal_budget_is_kvpress_own_count(model):
    rows = run(model, "nominal")
    assert rows["kvpress:knorm"]["kept_tokens"] == int(CONTEXT * 0.5)
    assert rows["streaming_llm"]["kept_tokens"] == 4 + 16 + 38


# baseline -> the press whose scores rank its tokens
KVPRESS_CLASSES = {"random": kvpress.RandomPress, "streaming_llm": kvpress.StreamingLLMPress, "h2o": H2OPress,
                   "snapkv": kvpress.SnapKVPress, "tova": kvpress.TOVAPress, "knorm": kvpress.KnormPress,
                   "curdkv": kvpress.CURPress, "expected_attention": kvpress.ExpectedAttentionPress}


@pytest.mark.parametrize("name", BASELINES)
def test_every_baseline_runs_a_kvpress_press_and_keeps_our_count_and_spans(model, name):
    """The baseline's row is kvpress's press under ProtectedPress: our count per (layer, KV head), sinks and
    window held, and the rest kvpress's own top-scored (checked for knorm: the lowest key norms)."""
    ids = examples(1)[0].input_ids[:, :CONTEXT]
    method = build_methods([name], None, n_sink=N_SINK, window=WINDOW)[name]
    press = method.press(CONTEXT, 0.5, 0, n_sink=N_SINK, window=WINDOW)
    assert isinstance(press, ProtectedPress) and type(press.press) is KVPRESS_CLASSES[name]
    calls = []
    score = press.press.score
    press.press.score = lambda *args: calls.append(1) or score(*args)
    result = kvpress_bridge.press_cache(model, method.spec, press, ids, seed=0)
    assert len(calls) == model.config.num_hidden_layers  # kvpress's score ranked every layer
    full = prefill(model, ids)
    for layer in range(model.config.num_hidden_layers):
        held = result.cache.layers[layer].keys
        assert held.shape[2] == result.kept_tokens == MATCHED_KEPT
        positions = kept_positions(full.layers[layer].keys, held)
        protected = set(range(N_SINK)) | set(range(CONTEXT - WINDOW, CONTEXT))
        assert all(protected <= head for head in positions)
        if name == "knorm":
            norms = full.layers[layer].keys[0, :, N_SINK : CONTEXT - WINDOW].norm(dim=-1)
            lowest = norms.topk(MATCHED_KEPT - N_SINK - WINDOW, largest=False).indices + N_SINK
            assert [head - protected for head in positions] == [set(row.tolist()) for row in lowest]


def test_a_layer_budget_gives_each_layer_its_matched_count(model):
    """A baseline under a layer budget (--budget_baselines) runs kvpress's PerLayerCompressionPress at our
    per-layer counts."""
    from curkv_train.runtime.allocation import LayerBudget

    budget = LayerBudget((0.2, 3.0), 1.0)
    method = build_methods(["knorm"], None, n_sink=N_SINK, window=WINDOW, baseline_budget=budget)["knorm"]
    press = method.press(CONTEXT, 0.5, 0, n_sink=N_SINK, window=WINDOW)
    assert isinstance(press, kvpress.PerLayerCompressionPress)
    result = kvpress_bridge.press_cache(model, method.spec, press, examples(1)[0].input_ids[:, :CONTEXT], seed=0)
    held = [layer.keys.shape[2] for layer in result.cache.layers]
    assert held == [expected_kept(CONTEXT, N_SINK, WINDOW, share) for share in budget.ratios(0.5)]
    assert held[0] < MATCHED_KEPT < held[1]


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
