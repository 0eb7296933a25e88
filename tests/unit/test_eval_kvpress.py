"""Every compressing row through kvpress's presses: the baselines and the ``kvpress:<name>`` rows, at our budget."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

kvpress = pytest.importorskip("kvpress")

from curkv_train.core.selection import expected_kept  # noqa: E402
from curkv_train.core.errors import CurKVError  # noqa: E402
from curkv_train.core.observation import attention_modules  # noqa: E402
from curkv_train.eval import kvpress_bridge  # noqa: E402
from curkv_train.eval.baseline_presses import H2OPress, ProtectedPress  # noqa: E402
from curkv_train.eval.harness import EvalSettings, evaluate  # noqa: E402
from curkv_train.eval.methods import BASELINES, build_methods  # noqa: E402
from curkv_train.eval.tasks import TaskExample  # noqa: E402
from curkv_train.models.base import TINY_RANDOM, load_base_model  # noqa: E402

CONTEXT, CONTINUATION, N_SINK, WINDOW = 96, 12, 4, 16
MATCHED_KEPT = 4 + 16 + 38  # sinks + window + ⌈0.5 · 76⌉ at compression 0.5
NEW_PRESSES = ("compactor", "criticalkv", "keydiff", "lagkv")


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
    results = evaluate(model, {"ppl_text": examples(2)}, methods, settings)
    return {row["method"]: row["metrics"] for row in results["rows"]}


def test_every_press_runs_with_our_budget(model):
    rows = run(model, "matched")
    names = kvpress_bridge.select_presses(None)
    assert "kvzip" in kvpress_bridge.available_presses() and "kvzip" not in names  # several prefills: when named
    assert {"streaming_llm", "snapkv", "tova", "knorm", "expected_attention", "observed_attention",
            *NEW_PRESSES} <= set(names)
    for name in names:
        metrics = rows[f"kvpress:{name}"]
        assert metrics["prefill_seconds"] > 0
        if name == "pyramidkv":  # each layer its own count, the mean ours to the rounding of kvpress's split
            assert metrics["kept_tokens"] == pytest.approx(MATCHED_KEPT, abs=1)
            continue
        assert metrics["kept_tokens"] == rows["streaming_llm"]["kept_tokens"] == MATCHED_KEPT
        if name == "adakv":  # masks: the whole cache stays
            assert metrics["kv_bytes"] == rows["full"]["kv_bytes"]
            continue
        assert metrics["kv_bytes"] == rows["streaming_llm"]["kv_bytes"] < rows["full"]["kv_bytes"]
    # kvpress's StreamingLLM keeps the same tokens as ours at the same budget: identical continuations
    assert rows["kvpress:streaming_llm"]["ppl"] == pytest.approx(rows["streaming_llm"]["ppl"], rel=1e-5)
    assert model.config._attn_implementation != "eager"  # ObservedAttention's eager switch was undone


def pressed(model, name: str, context_ids: torch.Tensor, compression_ratio: float = 0.5):
    """The cache press ``name`` leaves at our matched budget."""
    ratio = kvpress_bridge.press_ratio(context_ids.shape[1], compression_ratio, n_sink=N_SINK, window=WINDOW,
                                       budget="matched")
    press = kvpress_bridge.make_press(name, ratio, n_sink=N_SINK, window=WINDOW, seed=0)
    return kvpress_bridge.press_cache(model, kvpress_bridge.PRESSES[name], press, context_ids, seed=0)[0]


def prefill(model, context_ids: torch.Tensor):
    """The full cache of ``context_ids`` (a DynamicCache: ``.layers[l].keys``, (1, kv_heads, tokens, head_dim))."""
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=context_ids, past_key_values=cache, use_cache=True)
    return cache


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
    cache = pressed(model, name, ids, compression_ratio=ratio)
    full = prefill(model, ids)
    kept = expected_kept(length, N_SINK, WINDOW, 1 - ratio)
    for layer in range(model.config.num_hidden_layers):
        keys = cache.layers[layer].keys
        assert keys.shape[2] == kept
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


def test_pyramidkv_gives_each_layer_its_own_count(model):
    ids = torch.randint(0, 500, (1, CONTEXT), generator=torch.Generator().manual_seed(8))
    cache = pressed(model, "pyramidkv", ids)
    counts = [layer.keys.shape[2] for layer in cache.layers]
    assert counts[0] > counts[-1]  # a pyramid: more in the lower layers
    assert sum(counts) / len(counts) == pytest.approx(MATCHED_KEPT, abs=1)


def test_adakv_hides_keys_per_head_and_its_masks_do_not_outlive_its_row(model):
    ids = torch.randint(0, 500, (1, CONTEXT + CONTINUATION), generator=torch.Generator().manual_seed(9))
    cache = pressed(model, "adakv", ids[:, :CONTEXT])
    assert all(layer.keys.shape[2] == CONTEXT for layer in cache.layers)  # nothing dropped
    modules = attention_modules(model)
    hidden = [module.masked_key_indices for module in modules]
    per_head = torch.bincount(hidden[0][1], minlength=2)
    assert per_head.sum() == 2 * (CONTEXT - MATCHED_KEPT) and per_head[0] != per_head[1]  # heads share the places
    assert kvpress_bridge.masked_kept(model, cache) == MATCHED_KEPT
    logits = kvpress_bridge.masked_continuation(model, cache, ids[:, CONTEXT:])
    assert logits.shape[:2] == (1, CONTINUATION)
    assert all(module.masked_key_indices is None for module in modules)
    full = prefill(model, ids[:, :CONTEXT])
    plain = kvpress_bridge.masked_continuation(model, full, ids[:, CONTEXT:])
    assert not torch.allclose(logits, plain)  # the masks took effect


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
    cache, _ = kvpress_bridge.press_cache(model, method.spec, press, ids, seed=0)
    assert len(calls) == model.config.num_hidden_layers  # kvpress's score ranked every layer
    full = prefill(model, ids)
    for layer in range(model.config.num_hidden_layers):
        held = cache.layers[layer].keys
        assert held.shape[2] == MATCHED_KEPT
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
    cache, _ = kvpress_bridge.press_cache(model, method.spec, press, examples(1)[0].input_ids[:, :CONTEXT], seed=0)
    held = [layer.keys.shape[2] for layer in cache.layers]
    assert held == [expected_kept(CONTEXT, N_SINK, WINDOW, share) for share in budget.ratios(0.5)]
    assert held[0] < MATCHED_KEPT < held[1]


def test_a_press_subset_runs_only_those_presses(model):
    settings = EvalSettings([0.5], n_sink=N_SINK, window=WINDOW, kvpress=True, backend="torch",
                            kvpress_presses=["tova", "snapkv"])
    assert settings.kvpress_presses == ["snapkv", "tova"]  # kvpress_bridge.PRESSES order
    methods = build_methods(["full"], None, n_sink=N_SINK, window=WINDOW)
    results = evaluate(model, {"ppl_text": examples(1)}, methods, settings)
    assert {row["method"] for row in results["rows"]} == {"full", "kvpress:snapkv", "kvpress:tova"}


def test_an_unknown_press_is_one_clear_error():
    with pytest.raises(CurKVError, match="unknown or unavailable kvpress press.*'snapkvv'"):
        EvalSettings([0.5], kvpress=True, kvpress_presses=["snapkvv"])
