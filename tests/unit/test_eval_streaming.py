"""The streaming task on the tiny random Llama: exact against one forward, equal bytes, budgets, long chunks."""

from __future__ import annotations

import functools
import json
import math

import numpy as np
import pytest
import torch
from runtime_helpers import family_scorer, random_scorer

from curkv_train.core.errors import CurKVError
from curkv_train.eval.runtime_caches import RecencyCache, held_bytes, plain_cache
from curkv_train.eval.heldout import (
    PYTHON_TEXT,
    HeldOutDocument,
    StreamDocument,
    python_text_documents,
    stream_documents,
)
from curkv_train.eval.metrics import token_nll
from curkv_train.eval.methods import CURKV_UNIFORM
from curkv_train.eval.stream_rows import (
    CURKV,
    CURKV_COMPENSATED,
    CURKV_SCORE_ONLY,
    FULL,
    RECENCY,
    STREAMING_LLM,
    StreamSettings,
    check_memory,
    memory_settings,
    select_rows,
    stream_methods,
)
from curkv_train.eval.streaming import StreamTrace, evaluate_streaming, segment_sums, stream_document
from curkv_train.runtime import ComputeConfig, CurKVCache, TierConfig

WINDOW, N_SINK, PREFIX = 16, 4, 120

pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.fixture(scope="module")
def scorer():
    return random_scorer(n_sink=N_SINK, window=WINDOW)


def tokens(length: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, 512, (1, length), generator=torch.Generator().manual_seed(seed))


def methods_by_name(model, scorer, settings, scorers=None):
    methods = stream_methods(model, scorers or {CURKV: scorer}, scorer, settings, main=CURKV)
    return {method.name: method for method in methods}


def held_after(settings, seen: int) -> int:
    """Tokens per (layer, KV head) a CurKVCache with ``settings`` (TierSettings) holds right after compressing at
    ``seen``: sinks and hot tier, plus its target share of the rest."""
    protected = settings.n_sink + settings.hot_tokens
    return seen if seen <= protected else protected + settings.target(seen - protected, seen)


@pytest.mark.parametrize("chunk", [1, 16, 50])
def test_full_cache_streaming_equals_one_forward(model, chunk):
    ids = tokens(300)
    trace = stream_document(model, plain_cache(model), ids, PREFIX, chunk)
    with torch.no_grad():
        reference = token_nll(model(ids).logits, ids[:, 1:])[0, PREFIX - 1 :].double().numpy()
    assert trace.nll.shape == reference.shape == (300 - PREFIX,)
    np.testing.assert_allclose(trace.nll, reference, atol=2e-5)
    assert math.isclose(math.exp(trace.nll.mean()), math.exp(reference.mean()), rel_tol=1e-6)
    assert [step[3] for step in trace.steps][:2] == [PREFIX, PREFIX + min(chunk, 300 - PREFIX - 1)]


def test_at_keep_one_every_method_equals_the_full_cache(model, scorer):
    settings = StreamSettings(memory_settings([0.0]), prefix=PREFIX, chunk=WINDOW, backend="torch")
    methods = methods_by_name(model, scorer, settings)
    ids = tokens(260, seed=1)
    full = stream_document(model, methods[FULL].build(settings.memory[0]), ids, PREFIX, WINDOW)
    assert {STREAMING_LLM, CURKV_COMPENSATED, "curkv_cold", CURKV, CURKV_UNIFORM, CURKV_SCORE_ONLY,
            RECENCY} <= set(methods)
    for name, method in methods.items():
        trace = stream_document(model, method.build(settings.memory[0]), ids, PREFIX, WINDOW)
        np.testing.assert_allclose(trace.nll, full.nll, atol=2e-5, err_msg=name)
        assert [step[2] for step in trace.steps] == [step[2] for step in full.steps], name


def test_score_only_row_gives_every_place_to_the_score(model, scorer):
    settings = StreamSettings(memory_settings([0.5]), prefix=PREFIX, chunk=WINDOW, backend="torch")
    methods = methods_by_name(model, scorer, settings)
    shares = {name: methods[name].build(settings.memory[0]).settings.recent_share
              for name in (CURKV, CURKV_SCORE_ONLY, RECENCY)}
    assert shares == {CURKV: 0.5, CURKV_SCORE_ONLY: 0.0, RECENCY: 0.5}


def test_layer_budget_rows(model):
    """The scorer's layer budget runs in curkv and recency (equal allocation), not in streaming_llm or
    curkv_uniform."""
    from curkv_train.runtime.allocation import LayerBudget

    scorer = random_scorer(window=WINDOW)
    scorer.layer_budget = LayerBudget((0.5, 2.0))
    settings = StreamSettings(memory_settings([0.5]), prefix=PREFIX, chunk=WINDOW, backend="torch")
    methods = methods_by_name(model, scorer, settings)
    budgets = {name: methods[name].build(settings.memory[0]).settings.layer_budget
               for name in (CURKV, CURKV_UNIFORM, RECENCY, STREAMING_LLM)}
    assert budgets == {CURKV: scorer.layer_budget, CURKV_UNIFORM: None, RECENCY: scorer.layer_budget,
                       STREAMING_LLM: None}


@pytest.mark.parametrize("family", ["seed", "query_aware"])
def test_recency_and_learned_caches_hold_equal_bytes(model, family):
    """The key comparison: at the same settings the two caches differ in the score only, never in bytes."""
    scorer = family_scorer(family, n_sink=N_SINK, window=WINDOW) if family != "seed" else random_scorer(window=WINDOW)
    ids = tokens(400, seed=2)
    for memory in memory_settings([0.5], [120]):
        learned = stream_document(model, CurKVCache(scorer, model=model, compute=ComputeConfig("torch"),
                                                              **memory.cache_options()), ids, PREFIX, WINDOW)
        recent = stream_document(model, RecencyCache(scorer, model=model, compute=ComputeConfig("torch"),
                                                               **memory.cache_options()), ids, PREFIX, WINDOW)
        assert [step[1:] for step in learned.steps] == [step[1:] for step in recent.steps], memory.label
        assert not np.allclose(learned.nll, recent.nll)  # they did keep different tokens
    # StreamingLLM (no tiers, no observation) holds as many tokens as the dense learned cache, fewer bytes
    sink_recent = stream_document(model, RecencyCache(scorer, model=model, keep_ratio=0.5,
                                                                observe=False), ids, PREFIX, WINDOW)
    dense = stream_document(model, CurKVCache(scorer, model=model, keep_ratio=0.5), ids,
                            PREFIX, WINDOW)
    assert [step[2] for step in sink_recent.steps] == [step[2] for step in dense.steps]
    assert all(a[1] <= b[1] for a, b in zip(sink_recent.steps, dense.steps))
    assert (family == "seed") == all(a[1] == b[1] for a, b in zip(sink_recent.steps, dense.steps))


def test_recency_cache_keeps_the_sinks_and_the_newest_tokens(model, scorer):
    cache = RecencyCache(scorer, model=model, keep_ratio=0.5, observe=False)
    with torch.no_grad():
        model(tokens(300), past_key_values=cache)
    held = cache.layers[0].positions[0, 0].long().tolist()
    assert held == list(range(N_SINK)) + list(range(300 - len(held) + N_SINK, 300))


@pytest.mark.parametrize("allocation", ["per_head", "joint"])
def test_recency_cache_without_observation_streams_under_either_allocation(model, allocation):
    """StreamingLLM's row for a query_aware scorer: no observation held, and no scorer call that would need one."""
    scorer = family_scorer("query_aware", n_sink=N_SINK, window=WINDOW)
    cache = RecencyCache(scorer, model=model, keep_ratio=0.5, observe=False, tiers=TierConfig(allocation=allocation))
    stream_document(model, cache, tokens(300, seed=4), PREFIX, WINDOW)
    for layer in cache.compressed_layers:
        held = (layer.positions[0, 0] if allocation == "per_head" else layer.row_positions[:layer.held_tokens])
        held = sorted(held.long().tolist())
        assert held == list(range(N_SINK)) + list(range(299 - len(held) + N_SINK, 299))


def test_chunk_token_by_token_equals_a_window_per_chunk(model, scorer):
    """Fed a window at a time the cache compresses exactly when token-by-token generation would."""
    ids = tokens(330, seed=3)
    compute = ComputeConfig("torch")
    runs = [stream_document(model, CurKVCache(scorer, model=model, keep_ratio=0.5, compute=compute),
                            ids, PREFIX, chunk) for chunk in (1, WINDOW)]
    np.testing.assert_allclose(runs[0].nll, runs[1].nll, atol=1e-4)


@pytest.mark.parametrize("chunk", [5 * WINDOW, 200])
def test_a_chunk_longer_than_the_hot_tier_is_compressed_on_arrival(model, scorer, chunk):
    """The runtime compresses a chunk longer than the hot tier as it arrives: the eval runs it, and after each step
    every compressing cache holds what it would after compressing at that length."""
    settings = StreamSettings(memory_settings([0.5], [150]), prefix=PREFIX, chunk=chunk, backend="torch")
    methods = methods_by_name(model, scorer, settings)
    ids = tokens(600, seed=4)
    for memory in settings.memory:
        for name in (CURKV, RECENCY, STREAMING_LLM):
            run = methods[name].build(memory)
            trace = stream_document(model, run, ids, PREFIX, chunk)
            assert np.isfinite(trace.nll).all() and len(trace.nll) == 600 - PREFIX
            assert [step[2] for step in trace.steps] == [held_after(run.settings, seen)
                                                        for *_, seen in trace.steps], (name, memory.label)


def test_budget_options_reach_every_compressing_cache(model, scorer):
    settings = StreamSettings(memory_settings([], [140], [60_000]), prefix=PREFIX, chunk=WINDOW,
                              backend="torch")
    methods = methods_by_name(model, scorer, settings)
    tokens_budget, bytes_budget = settings.memory
    assert (tokens_budget.max_tokens, tokens_budget.keep_ratio, bytes_budget.max_bytes) == (140, 1.0, 60_000)
    for name, method in methods.items():
        if name == FULL:
            continue
        assert method.build(tokens_budget).settings.max_tokens == 140, name
        assert method.build(bytes_budget).settings.max_tokens is not None, name
    ids = tokens(500, seed=5)
    full = stream_document(model, methods[FULL].build(tokens_budget), ids, PREFIX, WINDOW)
    for name in methods:
        if name == FULL:
            continue
        bounds = ((tokens_budget, lambda step: step[2] <= 140), (bytes_budget, lambda step: step[1] <= 60_000))
        for memory, bound in bounds:
            trace = stream_document(model, methods[name].build(memory), ids, PREFIX, WINDOW)
            assert all(bound(step) for step in trace.steps), (name, memory.label)
            assert trace.steps[-1][1] < full.steps[-1][1]


def test_a_budget_no_cache_can_hold_is_one_line(model, scorer):
    settings = StreamSettings(memory_settings([], [40]), prefix=PREFIX)
    with pytest.raises(CurKVError, match="streaming setting 40 tokens for the recency caches: a budget of 40"):
        check_memory(model, {CURKV: scorer}, scorer, settings)
    with pytest.raises(CurKVError, match="--budget_tokens must be positive"):
        memory_settings([0.5], [0])
    with pytest.raises(CurKVError, match="--stream_length 100 must exceed --stream_prefix 120"):
        settings.check_length(100, None)


def test_documents_are_cut_longest_first_and_name_their_sources():
    held = [HeldOutDocument(name, np.full(size, index), 1, size) for index, (name, size)
            in enumerate([("short", 30), ("long", 250), ("middle", 90)])]
    built = stream_documents("stream_text", held, length=100, count=5)
    assert [document.sources for document in built] == [("long",), ("long",), ("middle", "long")]
    held.append(HeldOutDocument("longer", np.full(310, 3), 1, 310))
    built = stream_documents("stream_text", held, length=100, count=4)
    assert [document.sources for document in built] == [("longer",), ("long",), ("longer",), ("long",)]
    assert built[2].input_ids[0, 0] == 3 and built[3].input_ids.shape == (1, 100)
    assert all(document.input_ids.shape == (1, 100) for document in built)
    with pytest.raises(CurKVError, match="fewer than one streamed document of 700"):
        stream_documents("stream_text", held, length=700, count=1)


def test_python_text_is_long_prose_no_training_source_reads():
    from curkv_train.training.data.corpora import stdlib_code

    found = {document["id"] for document in python_text_documents()}
    assert f"{PYTHON_TEXT}/idlelib/NEWS.txt" in found and f"{PYTHON_TEXT}/LICENSE.txt" in found
    trained = {document["id"] for document in stdlib_code()}
    assert not any("idlelib" in name or not name.endswith(".py") for name in trained)


def test_segments_carry_the_bytes_of_their_steps(model, scorer):
    trace = stream_document(model, CurKVCache(scorer, model=model, keep_ratio=0.5), tokens(400), PREFIX,
                            WINDOW)
    sums = segment_sums(trace, 100)
    assert sums["tokens"].tolist() == [100, 100, 80] and math.isclose(sums["nll"].sum(), trace.nll.sum())
    assert sums["kv_bytes"][0] > 0 and sums["context_tokens"][-1] > sums["context_tokens"][0]


def test_evaluation_rows_and_summary(model, scorer):
    settings = StreamSettings(memory_settings([0.5], [140]), prefix=PREFIX, chunk=WINDOW, segment=60,
                              backend="torch", resamples=200)
    other = random_scorer(window=WINDOW, bias=1.0)
    methods = stream_methods(model, {CURKV: scorer, "curkv:b": other}, scorer, settings, main=CURKV)
    documents = {"stream_code": [StreamDocument("stream_code", tokens(300, seed), (f"file{seed % 2}",))
                                 for seed in range(3)]}  # the first and the last cut from one file
    results = evaluate_streaming(model, documents, methods, settings, main=CURKV)
    rows = {(row["method"], row["setting"]): row for row in results["rows"]}
    assert {(CURKV, "0.5"), (RECENCY, "140 tokens"), ("curkv:b", "0.5"), (FULL, FULL)} <= set(rows)
    assert rows[(FULL, FULL)]["metrics"]["ppl_increase_pct"] == 0.0
    assert rows[(CURKV, "0.5")]["metrics"]["kv_bytes_pct"] == rows[(RECENCY, "0.5")]["metrics"]["kv_bytes_pct"] < 100
    against = {(entry["setting"], entry["against"]) for entry in results["summary"]}
    assert ("0.5", "recency") in against and all(entry["method"] == CURKV for entry in results["summary"])
    assert results["documents"]["stream_code"][1]["sources"] == ["file1"]
    groups = rows[(CURKV, "0.5")]["example_groups"]
    per_document = len(groups) // 3
    assert groups == ["file0"] * per_document + ["file1"] * per_document + ["file0"] * per_document  # by file


def test_streaming_through_the_cli(tmp_path, capsys):
    from test_eval_harness import export_scorer

    from curkv_train import cli

    scorer = export_scorer(tmp_path / "scorer")
    run = tmp_path / "run"
    code = cli.main(["eval", "--scorer", str(scorer), "--tasks", "stream_text,stream_code", "--ratios", "0.5",
                     "--budget_tokens", "150", "--stream_length", "400", "--stream_prefix", "150", "--stream_chunk",
                     "32", "--stream_documents", "2", "--stream_segment", "100", "--backend", "torch",
                     "--out", str(run)])
    err = capsys.readouterr().err
    assert code == 0, err
    results = json.loads((run / "results.json").read_text())
    streaming = results["streaming"]
    assert results["rows"] == [] and streaming["length"] == 400 and streaming["chunk"] == 32
    assert [setting["label"] for setting in streaming["settings"]] == ["0.5", "150 tokens"]
    assert streaming["documents"]["stream_text"][0]["sources"][0].startswith(f"{PYTHON_TEXT}/")
    assert streaming["documents"]["stream_code"][0]["sources"][0].startswith("stdlib/")
    assert {row["method"] for row in streaming["rows"]} == {FULL, STREAMING_LLM, CURKV_COMPENSATED, "curkv_cold", CURKV,
                                                           CURKV_UNIFORM, CURKV_SCORE_ONLY, RECENCY}
    markdown = (run / "results.md").read_text()
    assert "## Streaming" in markdown and "### stream_code" in markdown and "| recency |" in markdown
    assert (run / "plots" / "streaming__stream_text.png").read_bytes()[:4] == b"\x89PNG"
    code = cli.main(["eval", "--scorer", str(scorer), "--tasks", "stream_text", "--budget_tokens", "20",
                     "--stream_length", "400", "--stream_prefix", "150", "--out", str(tmp_path / "bad")])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "a budget of 20 tokens" in err
    code = cli.main(["eval", "--scorer", str(scorer), "--tasks", "stream_text", "--stream_rows", "curkv,nope",
                     "--stream_length", "400", "--stream_prefix", "150", "--out", str(tmp_path / "bad_rows")])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "unknown streaming row(s) 'nope'" in err
    assert not (tmp_path / "bad_rows").exists()


def test_selected_rows_keep_the_full_cache_and_refuse_unknown_names(model, scorer):
    settings = StreamSettings(memory_settings([0.5]), prefix=PREFIX, chunk=WINDOW, backend="torch")
    methods = stream_methods(model, {CURKV: scorer, "curkv:b": scorer}, scorer, settings, main=CURKV)
    assert [method.name for method in select_rows(methods, ["recency", "curkv:b"])] == [FULL, RECENCY, "curkv:b"]
    assert select_rows(methods, None) == methods
    with pytest.raises(CurKVError, match="unknown streaming row.*'curkv:c'.*this run has: full, streaming_llm"):
        select_rows(methods, ["curkv", "curkv:c"])


def test_held_bytes_of_a_plain_cache_are_its_key_value_tensors(model):
    cache = plain_cache(model)
    with torch.no_grad():
        model(tokens(50), past_key_values=cache)
    assert held_bytes(cache) == sum(t.numel() * t.element_size() for layer in cache.layers
                                    for t in (layer.keys, layer.values))


@pytest.mark.parametrize("budgets", [{"ratios": [0.5, 0.5]}, {"ratios": [], "budget_bytes": [1_000_000, 1_000_001]}])
def test_repeated_memory_settings_are_refused(budgets):
    """Two settings with one label would share a results cell and drop its rows."""
    with pytest.raises(CurKVError, match="memory settings repeat"):
        memory_settings(**budgets)


def test_a_segment_no_step_starts_in_takes_the_step_that_scored_it():
    """Chunks of 64 over segments of 16: every segment of a chunk reads that chunk's step, not the last one."""
    steps = [(0, 100, 10.0, 64), (64, 200, 20.0, 128), (128, 300, 30.0, 192)]
    sums = segment_sums(StreamTrace(np.ones(192), steps, 1.0), 16)
    assert sums["kv_bytes"].tolist() == [100.0] * 4 + [200.0] * 4 + [300.0] * 4
    assert sums["context_tokens"].tolist() == [64.0] * 4 + [128.0] * 4 + [192.0] * 4


def test_given_spans_reach_every_runtime_cache(tmp_path, capsys, monkeypatch):
    """--n_sink / --window reach the curkv_cache rows and every streaming cache, not only the selections."""
    from test_eval_harness import export_scorer

    from curkv_train import cli
    from curkv_train.runtime.cache import CurKVCache

    spans = []
    original = CurKVCache.__init__

    @functools.wraps(original)  # the report reads the cache's defaults from its signature
    def recording(self, *args, **kwargs):
        original(self, *args, **kwargs)
        spans.append((type(self).__name__, self.settings.n_sink, self.settings.window))

    monkeypatch.setattr(CurKVCache, "__init__", recording)
    scorer = export_scorer(tmp_path / "scorer")  # n_sink 4, window 16
    code = cli.main(["eval", "--scorer", str(scorer), "--tasks", "ppl_text,stream_text", "--methods", "full,curkv_cache",
                     "--ratios", "0.5", "--n_sink", "2", "--window", "8", "--context_length", "128",
                     "--continuation_length", "48", "--examples", "1", "--stream_length", "300", "--stream_prefix",
                     "120", "--stream_chunk", "32", "--stream_documents", "1", "--stream_segment", "60",
                     "--backend", "torch", "--out", str(tmp_path / "run")])
    assert code == 0, capsys.readouterr().err
    assert {name for name, _, _ in spans} == {"CurKVCache", "RecencyCache"}
    assert {(n_sink, window) for _, n_sink, window in spans} == {(2, 8)}
    results = json.loads((tmp_path / "run" / "results.json").read_text())
    assert results["config"]["scorers"]["curkv"]["n_sink"] == 2 and results["config"]["window"] == 8
