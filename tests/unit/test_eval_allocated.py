"""Rules at the scorer's allocation: the same tokens in every (layer, KV head) as the scorer's ragged cache."""

from __future__ import annotations

import dataclasses

import pytest
import torch

kvpress = pytest.importorskip("kvpress")

from curkv_train.core.errors import CurKVError  # noqa: E402
from curkv_train.eval.allocated import (RAGGED, SAME, AllocatedCache, AllocatedRows, RecordingCache,  # noqa: E402
                                        one_prefill, ragged_lengths, rule_scores)
from curkv_train.eval.harness import EvalSettings, evaluate  # noqa: E402
from curkv_train.eval.methods import build_methods  # noqa: E402
from curkv_train.eval.runtime_caches import continue_in_windows, prefill_budget  # noqa: E402
from curkv_train.eval.tasks import TaskExample  # noqa: E402
from curkv_train.models.base import TINY_RANDOM, load_base_model  # noqa: E402
from runtime_helpers import random_scorer  # noqa: E402

CONTEXT, CONTINUATION, N_SINK, WINDOW = 96, 12, 4, 16
TIERS = one_prefill(N_SINK, WINDOW, CONTINUATION)

pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.fixture(scope="module")
def model():
    return load_base_model(TINY_RANDOM, attn_implementation="sdpa")


@pytest.fixture(scope="module")
def scorer():
    return dataclasses.replace(random_scorer(N_SINK, WINDOW), allocation="joint")


def context(seed: int = 3) -> torch.Tensor:
    return torch.randint(0, 500, (1, CONTEXT + CONTINUATION), generator=torch.Generator().manual_seed(seed))


def held(cache, layer: int) -> list[set[int]]:
    """Per KV head of batch row 0, the positions a ragged layer holds."""
    part = cache.layers[layer]
    return [set(part.row_positions[int(part.store.offsets[0, head]):][:int(part.lengths[0, head])].tolist())
            for head in range(part.lengths.shape[1])]


def test_the_scorers_own_scores_at_its_allocation_keep_its_tokens(model, scorer):
    ids = context()[:, :CONTEXT]
    reference = RecordingCache(scorer, model, 0.4, tiers=TIERS)
    prefill_budget(model, reference, ids)
    lengths = ragged_lengths(reference)
    assert any((each != each.flatten()[0]).any() for each in lengths.values())  # the heads hold different counts
    same = AllocatedCache(scorer, model, 0.4, scores=reference.recorded, lengths=lengths, tiers=TIERS)
    prefill_budget(model, same, ids)
    for layer in lengths:
        assert held(same, layer) == held(reference, layer)
    other = AllocatedCache(scorer, model, 0.4, scores={k: -v for k, v in reference.recorded.items()},
                           lengths=lengths, tiers=TIERS)
    prefill_budget(model, other, ids)
    assert all(torch.equal(other.layers[layer].lengths, lengths[layer]) for layer in lengths)  # same counts
    assert held(other, 0) != held(reference, 0)  # other tokens: the scores decide which


def test_a_rules_scores_cover_every_layer_and_token(model):
    scores = rule_scores(model, "knorm", context()[:, :CONTEXT], n_sink=N_SINK, window=WINDOW, seed=0)
    assert sorted(scores) == [0, 1] and scores[0].shape == (1, 2, CONTEXT)
    with pytest.raises(CurKVError, match="unknown rule 'pyramid'"):
        rule_scores(model, "pyramid", context()[:, :CONTEXT], n_sink=N_SINK, window=WINDOW, seed=0)


def test_no_compression_after_the_prefill(model, scorer):
    ids = context()
    cache = RecordingCache(scorer, model, 0.4, tiers=TIERS)
    prefill_budget(model, cache, ids[:, :CONTEXT])
    before = {layer: each.clone() for layer, each in ragged_lengths(cache).items()}
    continue_in_windows(model, cache, ids[:, CONTEXT:])
    assert all(torch.equal(ragged_lengths(cache)[layer], before[layer] + CONTINUATION) for layer in before)


def test_the_evaluation_runs_rules_at_the_scorers_allocation(model, scorer):
    settings = EvalSettings([0.5], n_sink=N_SINK, window=WINDOW, backend="torch")
    examples = [TaskExample("ppl_text", context(seed), CONTEXT) for seed in (1, 2)]
    allocated = AllocatedRows(scorer, ("knorm", "snapkv"), TIERS, "torch")
    results = evaluate(model, {"ppl_text": examples}, build_methods(["full", "knorm"], None, n_sink=N_SINK,
                                                                   window=WINDOW),
                       settings, allocated=allocated, ours=RAGGED)
    rows = {row["method"]: row["metrics"] for row in results["rows"]}
    assert {RAGGED, SAME + "knorm", SAME + "snapkv"} <= set(rows)
    assert rows[RAGGED]["kept_tokens"] == rows["knorm"]["kept_tokens"]  # a press row's count, spread by the scores
    for rule in ("knorm", "snapkv"):
        assert rows[SAME + rule]["kept_tokens"] == rows[RAGGED]["kept_tokens"] < CONTEXT
        assert rows[SAME + rule]["kv_bytes"] == rows[RAGGED]["kv_bytes"]
    assert rows[SAME + "knorm"]["ppl"] != rows[RAGGED]["ppl"]
    same = results["summary_same_allocation"]
    assert same and all(entry["method"] == RAGGED and entry["baseline"].startswith(SAME) for entry in same)
    system = results["summary"]  # system against system: a rule at the scorer's allocation is not a system
    assert system and all(entry["method"] == RAGGED and entry["baseline"] == "knorm" for entry in system)


def test_the_budget_prior_row_holds_the_same_tokens_and_is_not_a_baseline(model, scorer):
    from curkv_train.eval.allocated import PRIOR
    from curkv_train.runtime import LayerBudget

    budgeted = dataclasses.replace(scorer, layer_budget=LayerBudget((1.0, 30.0)))
    settings = EvalSettings([0.5], n_sink=N_SINK, window=WINDOW, backend="torch")
    examples = [TaskExample("ppl_text", context(seed), CONTEXT) for seed in (1, 2)]
    allocated = AllocatedRows(budgeted, ("knorm",), TIERS, "torch", budget_prior=1.0)
    assert allocated.own_rows() == [RAGGED, RAGGED + PRIOR]
    results = evaluate(model, {"ppl_text": examples}, build_methods(["full", "knorm"], None, n_sink=N_SINK,
                                                                   window=WINDOW),
                       settings, allocated=allocated, ours=RAGGED, not_baselines=(RAGGED + PRIOR,))
    rows = {row["method"]: row["metrics"] for row in results["rows"]}
    assert rows[RAGGED + PRIOR]["kept_tokens"] == rows[RAGGED]["kept_tokens"]
    assert rows[RAGGED + PRIOR]["ppl"] != rows[RAGGED]["ppl"]  # the budget moved the memory, and the outcome
    assert all(entry["baseline"] != RAGGED + PRIOR for entry in results["summary"])


def test_a_budget_prior_without_rows_at_the_scorers_allocation_is_refused(scorer):
    from curkv_train.eval.cli import EvalConfig, _allocated_rows

    with pytest.raises(CurKVError, match="--budget_prior adds a row beside the rules"):
        _allocated_rows(EvalConfig(scorer="x", tasks=["ppl_text"], same_allocation=["none"], budget_prior=0.5),
                        scorer, (N_SINK, WINDOW))
    with pytest.raises(CurKVError, match="budget_prior must be in"):
        _allocated_rows(EvalConfig(scorer="x", tasks=["ppl_text"], budget_prior=2.0), scorer, (N_SINK, WINDOW))
    rows = _allocated_rows(EvalConfig(scorer="x", tasks=["ppl_text"], budget_prior=0.5), scorer, (N_SINK, WINDOW))
    assert rows.budget_prior == 0.5 and rows.own_rows()[-1] == RAGGED + "@prior"
