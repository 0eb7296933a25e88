"""Per-example sums, bootstrap intervals and the paired verdict of curkv against the best baseline."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from curkv_train.eval.statistics import result_rows
from curkv_train.eval.metrics import ExampleSums, finalize, total
from curkv_train.eval.report import curkv_summary, results_json, results_markdown
from curkv_train.eval.statistics import (
    LOSES,
    TIES,
    TIES_AT_FULL,
    WINS,
    Bootstrap,
    Difference,
    metric_samples,
    summarize,
    verdict,
)

EXAMPLES = 12
KINDS = {"ppl_text": "ppl", "passkey": "passkey"}
MAIN = {"ppl_text": "ppl_increase_pct", "passkey": "accuracy"}


def ppl_sums(nll_per_token: np.ndarray, tokens: int = 100) -> list[dict[str, float]]:
    """One example's sums per entry of ``nll_per_token`` (mean NLL of that example)."""
    return [{"examples": 1.0, "tokens": float(tokens), "nll": float(tokens * value), "kl": 0.01 * tokens,
             "kept_tokens": 50.0, "context_tokens": 100.0, "kv_bytes": 1000.0} for value in nll_per_token]


def passkey_sums(hits: list[int]) -> list[dict[str, float]]:
    return [{"examples": 1.0, "tokens": 10.0, "kl": 0.5, "answer_tokens": 5.0, "answer_hits": 5.0 * hit,
             "answer_nll": 1.0, "answer_exact": float(hit), "kept_tokens": 50.0, "context_tokens": 100.0,
             "kv_bytes": 1000.0} for hit in hits]


def results_of(cells: dict[tuple[str, float, str], list[dict[str, float]]], bootstrap: Bootstrap | None = None):
    """Rows and summary of synthetic per-example sums, through the harness's own aggregation."""
    bootstrap = bootstrap or Bootstrap(resamples=2000, seed=0)
    log = ExampleSums()
    for (method, ratio, task), examples in cells.items():
        for sums in examples:
            log.add(method, ratio, task, sums)
    tasks = {task for _, _, task in cells}
    main, kinds = {task: MAIN[task] for task in tasks}, {task: KINDS[task] for task in tasks}
    tags = {task: [{} for _ in range(EXAMPLES)] for task in tasks}
    rows = result_rows(log, tags, main, kinds, bootstrap, "full")
    summary = summarize(rows, main, kinds, bootstrap, ours="curkv", reference="full")
    return {"rows": rows, "summary": summary, "main_metric": main, "seconds_per_example": {},
            "bootstrap": bootstrap.record()}


@pytest.fixture(scope="module")
def noisy_nll() -> np.ndarray:
    return np.random.default_rng(0).uniform(1.5, 3.0, EXAMPLES)  # examples differ a lot in difficulty


def by_key(results: dict) -> dict:
    return {(row["method"], row["ratio"], row["task"]): row for row in results["rows"]}


def test_example_sums_keep_every_example_in_order():
    log = ExampleSums()
    log.add("h2o", 0.5, "ppl_text", {"examples": 1.0, "tokens": 3.0, "nll": 6.0})
    log.add("h2o", 0.5, "ppl_text", {"examples": 1.0, "tokens": 5.0, "nll": 5.0, "kl": 0.5})
    sums = log.sums("h2o", 0.5, "ppl_text")
    assert set(sums) == {"examples", "tokens", "nll", "kl"}
    assert sums["nll"].tolist() == [6.0, 5.0] and sums["kl"].tolist() == [0.0, 0.5]
    assert total(sums)["tokens"] == 8.0 and log.sums("h2o", 0.7, "ppl_text") == {}
    with pytest.raises(ValueError, match="unknown sum keys"):
        log.add("h2o", 0.5, "ppl_text", {"nlll": 1.0})


def test_finalize_takes_numbers_or_arrays_alike(noisy_nll):
    sums = {key: np.array([example[key] for example in ppl_sums(noisy_nll)]) for key in ppl_sums(noisy_nll)[0]}
    full = {**sums, "nll": sums["nll"] * 0.9}
    per_example = finalize("ppl", sums, full)
    for index in range(EXAMPLES):
        one = finalize("ppl", {key: float(values[index]) for key, values in sums.items()},
                       {key: float(values[index]) for key, values in full.items()})
        assert per_example["ppl_increase_pct"][index] == pytest.approx(one["ppl_increase_pct"])
        assert isinstance(one["ppl"], float)
    assert math.isnan(finalize("passkey", {"examples": 0.0}, None)["accuracy"])


def test_the_interval_contains_the_point_estimate(noisy_nll):
    results = results_of({("full", 0.0, "ppl_text"): ppl_sums(noisy_nll),
                          ("h2o", 0.5, "ppl_text"): ppl_sums(noisy_nll + np.linspace(0.0, 0.2, EXAMPLES))})
    for row in results["rows"]:
        for name, (low, high) in row["intervals"].items():
            assert low <= row["metrics"][name] <= high, (row["method"], name)
    row = by_key(results)[("h2o", 0.5, "ppl_text")]
    low, high = row["intervals"]["ppl_increase_pct"]
    assert 0 < low < high  # the examples vary: a real interval
    assert len(row["example_values"]["ppl_increase_pct"]) == EXAMPLES == len(row["example_sums"]["nll"])
    # perplexity increase is the ratio of summed NLLs, not the mean of per-example increases
    sums, full = row["example_sums"], by_key(results)[("full", 0.0, "ppl_text")]["example_sums"]
    ppl, reference = (math.exp(sum(cell["nll"]) / sum(cell["tokens"])) for cell in (sums, full))
    assert row["metrics"]["ppl_increase_pct"] == pytest.approx(100 * (ppl / reference - 1))


def test_bootstrap_resamples_are_seeded_and_shared_by_a_task():
    bootstrap = Bootstrap(resamples=50, seed=3)
    weights = bootstrap.weights(EXAMPLES, "ppl_text")
    assert weights.shape == (50, EXAMPLES) and (weights.sum(axis=1) == EXAMPLES).all()
    assert (weights == bootstrap.weights(EXAMPLES, "ppl_text")).all()
    assert (weights != bootstrap.weights(EXAMPLES, "passkey")).any()
    assert (weights != Bootstrap(resamples=50, seed=4).weights(EXAMPLES, "ppl_text")).any()
    sums = {"examples": np.ones(EXAMPLES), "answer_exact": np.arange(EXAMPLES) % 2.0}
    samples = metric_samples("passkey", "accuracy", sums, None, weights)
    assert samples.shape == (50,) and ((0 <= samples) & (samples <= 1)).all()


def test_a_method_identical_to_the_best_baseline_ties(noisy_nll):
    worse = noisy_nll + 0.3
    results = results_of({("full", 0.0, "ppl_text"): ppl_sums(noisy_nll),
                          ("snapkv", 0.5, "ppl_text"): ppl_sums(noisy_nll + 0.05),
                          ("h2o", 0.5, "ppl_text"): ppl_sums(worse),
                          ("curkv", 0.5, "ppl_text"): ppl_sums(noisy_nll + 0.05)})
    entry, = results["summary"]
    assert (entry["baseline"], entry["verdict"]) == ("snapkv", TIES)
    assert entry["difference"] == 0.0 and entry["difference_interval"] == [0.0, 0.0]


def test_a_clearly_better_method_wins_and_a_clearly_worse_one_loses(noisy_nll):
    cells = {("full", 0.0, "ppl_text"): ppl_sums(noisy_nll),
             ("snapkv", 0.5, "ppl_text"): ppl_sums(noisy_nll + 0.10 + 0.02 * np.sin(np.arange(EXAMPLES))),
             ("h2o", 0.5, "ppl_text"): ppl_sums(noisy_nll + 0.30),
             ("curkv", 0.5, "ppl_text"): ppl_sums(noisy_nll + 0.04),
             ("curkv", 0.7, "ppl_text"): ppl_sums(noisy_nll + 0.30),
             ("snapkv", 0.7, "ppl_text"): ppl_sums(noisy_nll + 0.15)}
    better, worse = results_of(cells)["summary"]
    assert (better["ratio"], better["baseline"], better["verdict"]) == (0.5, "snapkv", WINS)
    assert better["difference_interval"][1] < 0  # lower is better: the whole interval below 0
    assert (worse["ratio"], worse["verdict"]) == (0.7, LOSES)


def test_noise_on_few_examples_is_a_tie_and_equal_at_the_full_cache_says_so():
    hits_full = [1] * EXAMPLES
    noisy = {("full", 0.0, "passkey"): passkey_sums(hits_full),
             ("h2o", 0.5, "passkey"): passkey_sums([1, 0] * (EXAMPLES // 2)),
             ("curkv", 0.5, "passkey"): passkey_sums([0, 1] * (EXAMPLES // 2 - 1) + [1, 1]),
             ("h2o", 0.7, "passkey"): passkey_sums(hits_full),
             ("curkv", 0.7, "passkey"): passkey_sums(hits_full)}
    at_half, at_seven = results_of(noisy)["summary"]
    assert at_half["difference"] > 0 and at_half["verdict"] == TIES  # one more hit out of 12: noise
    assert at_seven["verdict"] == TIES_AT_FULL
    assert verdict(Difference(0.0, 0.0, 0.0), "accuracy") == TIES
    assert verdict(Difference(0.2, 0.1, 0.3), "accuracy") == WINS
    assert verdict(Difference(0.2, 0.1, 0.3), "kl") == LOSES


def test_a_tie_with_a_baseline_the_full_cache_does_not_beat_either_says_so(noisy_nll):
    jitter = 0.05 * np.where(np.arange(EXAMPLES) % 2, 1.0, -1.0)  # the baseline: the full cache give or take noise
    cells = {("full", 0.0, "ppl_text"): ppl_sums(noisy_nll),
             ("snapkv", 0.5, "ppl_text"): ppl_sums(noisy_nll + jitter),
             ("curkv", 0.5, "ppl_text"): ppl_sums(noisy_nll - jitter),
             ("snapkv", 0.7, "ppl_text"): ppl_sums(noisy_nll + 0.10 + jitter),  # clearly above the full cache
             ("curkv", 0.7, "ppl_text"): ppl_sums(noisy_nll + 0.10 - jitter)}
    no_room, room = results_of(cells)["summary"]
    low, high = no_room["full_minus_best"][1:]
    assert low < 0 < high and no_room["verdict"] == TIES_AT_FULL
    assert room["full_minus_best"][2] < 0 and room["verdict"] == TIES  # the full cache wins there: a plain tie
    lines = curkv_summary(results_of(cells))
    assert lines[2].endswith("| curkv − best | full − best | verdict |")
    assert lines[4].endswith(f"| {no_room['full_minus_best'][0]:+.3g} [{low:+.3g}, {high:+.3g}] | {TIES_AT_FULL} |")
    # a clear loss stays a loss whatever the full cache does
    assert verdict(Difference(0.2, 0.1, 0.3), "kl", full_minus_theirs=Difference(0.0, -0.1, 0.1)) == LOSES


def test_report_shows_intervals_and_the_summary_first(noisy_nll):
    results = results_of({("full", 0.0, "ppl_text"): ppl_sums(noisy_nll),
                          ("snapkv", 0.5, "ppl_text"): ppl_sums(noisy_nll + 0.10),
                          ("curkv", 0.5, "ppl_text"): ppl_sums(noisy_nll + 0.04)})
    summary = curkv_summary(results)
    assert summary[0] == "## Summary: curkv against the best baseline, system against system"
    assert "| ppl_text | ppl_increase_pct (lower is better) | 0.5 |" in summary[4] and summary[4].endswith("| wins |")
    markdown = results_markdown(results, {"kvpress_budget": "matched"})
    assert markdown.index("## Summary") < markdown.index("## ppl_text") < markdown.index("**kept_tokens**")
    row = by_key(results)[("curkv", 0.5, "ppl_text")]
    low, high = row["intervals"]["ppl_increase_pct"]
    assert f"| curkv | {row['metrics']['ppl_increase_pct']:.4g} [{low:.3g}, {high:.3g}] |" in markdown
    payload = json.loads(results_json(results, {"base": "x"}))
    assert payload["summary"][0]["verdict"] == WINS and payload["bootstrap"]["resamples"] == 2000
    assert payload["rows"][0]["example_sums"]["nll"] == pytest.approx(
        results["rows"][0]["example_sums"]["nll"])
    nan_row = {**results["rows"][0], "metrics": {"ppl": float("nan")}}
    assert json.loads(results_json({**results, "rows": [nan_row]}, {}))["rows"][0]["metrics"]["ppl"] is None


def test_report_gives_each_rows_prefill_time(noisy_nll):
    def timed(sums: list[dict[str, float]], seconds: list[float]) -> list[dict[str, float]]:
        return [{**example, "prefill_seconds": value} for example, value in zip(sums, seconds)]

    results = results_of({("full", 0.0, "ppl_text"): timed(ppl_sums(noisy_nll), [1.0] * EXAMPLES),
                          ("kvpress:compactor", 0.5, "ppl_text"): timed(ppl_sums(noisy_nll + 0.1), [3.0] * EXAMPLES),
                          ("knorm", 0.5, "ppl_text"): timed(ppl_sums(noisy_nll + 0.2), [1.5] * EXAMPLES)})
    markdown = results_markdown(results, {"kvpress_budget": "matched"})
    table = markdown[markdown.index("**prefill_seconds**"):]
    assert "| full | 1 s |" in table and "| knorm | 1.5 s |" in table and "| kvpress:compactor | 3 s |" in table


def test_grouped_weights_resample_whole_groups_and_ungrouped_ones_are_unchanged():
    bootstrap = Bootstrap(resamples=300, seed=3)
    groups = [0] * 4 + [1] * 4 + [2] * 4
    weights = bootstrap.weights(12, "stream_text", groups)
    assert weights.shape == (300, 12) and np.all(weights.sum(axis=1) == 12)
    for block in range(3):  # a document's segments are drawn together, as often as the document
        assert np.all(weights[:, 4 * block : 4 * block + 4] == weights[:, [4 * block]])
    assert np.array_equal(bootstrap.weights(12, "stream_text", list(range(12))), bootstrap.weights(12, "stream_text"))


def test_document_resampling_widens_a_difference_that_one_document_carries():
    """Six documents of ten segments: one document far better, the others equal. Segment by segment the gain
    looks certain; document by document it is one document of six, and the interval says so."""
    from curkv_train.eval.statistics import paired_difference

    segments, groups = 60, [index // 10 for index in range(60)]
    tokens = np.full(segments, 100.0)
    full = {"nll": tokens * 2.0, "tokens": tokens}
    theirs = {"nll": tokens * 2.02, "tokens": tokens}
    ours = {"nll": np.where(np.asarray(groups) == 0, 1.90, 2.02) * tokens, "tokens": tokens}
    bootstrap = Bootstrap(resamples=2000)
    by_segment = paired_difference("ppl", "ppl_increase_pct", ours, theirs, full,
                                   bootstrap.weights(segments, "t"), bootstrap)
    by_document = paired_difference("ppl", "ppl_increase_pct", ours, theirs, full,
                                    bootstrap.weights(segments, "t", groups), bootstrap)
    assert by_document.high - by_document.low > 1.5 * (by_segment.high - by_segment.low)


def test_the_verdict_resamples_the_groups_its_rows_record():
    """The summary's paired interval of ours − best follows the rows' example_groups: the same rows with one
    document carrying the whole gain tie by document where they win example by example."""
    from curkv_train.eval.statistics import summarize

    examples, groups = 60, [f"doc{index // 10}" for index in range(60)]
    tokens = np.full(examples, 100.0)
    nll = {"full": tokens * 2.0, "theirs": tokens * 2.02,
           "ours": np.where(np.arange(examples) < 10, 1.90, 2.02) * tokens}

    def row(method: str, ratio: float, grouped: bool) -> dict:
        return {"method": method, "ratio": ratio, "task": "ppl_text", "metrics": {"ppl_increase_pct": 0.0},
                "example_sums": {"nll": nll[method].tolist(), "tokens": tokens.tolist()},
                **({"example_groups": groups} if grouped else {})}

    def entry(grouped: bool) -> dict:
        rows = [row("full", 0.0, grouped), row("ours", 0.5, grouped), row("theirs", 0.5, grouped)]
        rows[1]["metrics"]["ppl_increase_pct"], rows[2]["metrics"]["ppl_increase_pct"] = -1.0, 1.0
        return summarize(rows, {"ppl_text": "ppl_increase_pct"}, {"ppl_text": "ppl"}, Bootstrap(resamples=2000),
                         ours="ours", reference="full")[0]

    one_by_one, by_document = entry(False), entry(True)
    assert one_by_one["verdict"] == "wins" and by_document["verdict"].startswith("ties")
    assert one_by_one["difference"] == pytest.approx(by_document["difference"])
