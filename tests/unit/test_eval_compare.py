"""curkv-train compare: paired differences between two methods of a run, and its errors."""

import json
import math

import pytest

from curkv_train.core.errors import CurKVError
from curkv_train.eval.compare import compare, compare_methods

EXAMPLES = 40


def passkey_row(method: str, hits: int) -> dict:
    exact = [1.0] * hits + [0.0] * (EXAMPLES - hits)
    return {"method": method, "ratio": 0.5, "task": "passkey", "metrics": {"accuracy": hits / EXAMPLES},
            "example_sums": {"answer_exact": exact, "examples": [1.0] * EXAMPLES}}


def results(hits_a: int, hits_b: int) -> dict:
    return {"rows": [passkey_row("a", hits_a), passkey_row("b", hits_b)], "main_metric": {"passkey": "accuracy"},
            "bootstrap": {"resamples": 500, "confidence": 0.95, "seed": 0}}


def test_a_clear_gap_is_a_win_for_the_first_and_a_loss_reversed():
    entry, = compare_methods(results(36, 8), "a", "b")
    assert entry["difference"] == pytest.approx(0.7) and entry["verdict"] == "wins"
    assert entry["interval"][0] > 0
    assert compare_methods(results(36, 8), "b", "a")[0]["verdict"] == "loses"


def test_equal_methods_tie():
    assert compare_methods(results(20, 20), "a", "b")[0]["verdict"].startswith("ties")


def test_a_method_not_in_the_run_is_named_in_one_error():
    with pytest.raises(CurKVError, match="'c' not in this run; it has: a, b"):
        compare_methods(results(20, 20), "a", "c")


def test_the_command_prints_a_table_and_refuses_a_bad_pair(tmp_path, capsys):
    (tmp_path / "results.json").write_text(json.dumps(results(36, 8)))
    compare(str(tmp_path), ["a..b"])
    assert "| a | b | passkey | 0.5 | accuracy | 0.9 | 0.2 | +0.7" in capsys.readouterr().out
    with pytest.raises(CurKVError, match="METHOD..METHOD"):
        compare(str(tmp_path), ["a-b"])
    with pytest.raises(CurKVError, match="no results.json"):
        compare(str(tmp_path / "missing"), ["a..b"])


def test_prefill_rows_are_resampled_by_the_groups_they_record():
    grouped = results(36, 8)
    for row in grouped["rows"]:  # every hit of "a" over "b" in the first 28 examples, four documents of ten
        row["example_groups"] = [f"doc{index // 10}" for index in range(EXAMPLES)]
    one_by_one, = compare_methods(results(36, 8), "a", "b")
    by_document, = compare_methods(grouped, "a", "b")
    assert by_document["difference"] == one_by_one["difference"]
    width = [entry["interval"][1] - entry["interval"][0] for entry in (one_by_one, by_document)]
    assert width[1] > 1.5 * width[0]


def ppl_row(method: str, nll: list[float], kl: list[float], ratio: float = 0.5) -> dict:
    """A perplexity row of len(nll) examples of 100 tokens each (the metrics shown are not recomputed)."""
    count = len(nll)
    return {"method": method, "ratio": ratio, "task": "ppl_text",
            "metrics": {"ppl_increase_pct": 0.0, "kl": sum(kl) / (100 * count)},
            "example_sums": {"examples": [1.0] * count, "tokens": [100.0] * count, "nll": nll, "kl": kl}}


def test_another_metric_than_the_main_one_is_compared_where_rows_carry_it(tmp_path, capsys):
    """Equal perplexity, a's KL half of b's on every example: a tie on the main metric, a win on kl."""
    nll, kl = [200.0 + index for index in range(EXAMPLES)], [1.0 + 0.1 * index for index in range(EXAMPLES)]
    run = {"rows": [ppl_row("full", nll, [0.0] * EXAMPLES, ratio=0.0), ppl_row("a", nll, [value / 2 for value in kl]),
                    ppl_row("b", nll, kl)],
           "main_metric": {"ppl_text": "ppl_increase_pct"}, "bootstrap": {"resamples": 500, "confidence": 0.95, "seed": 0}}
    assert compare_methods(run, "a", "b")[0]["verdict"].startswith("ties")
    entry, = compare_methods(run, "a", "b", metric="kl")
    assert entry["metric"] == "kl" and entry["verdict"] == "wins"
    assert entry["difference"] == pytest.approx(-sum(kl) / (2 * 100 * EXAMPLES))
    (tmp_path / "results.json").write_text(json.dumps(run))
    compare(str(tmp_path), ["a..b"], metric="kl")
    assert "| a | b | ppl_text | 0.5 | kl |" in capsys.readouterr().out
    with pytest.raises(CurKVError, match="no row of 'a' can be compared on 'accuracy'; its rows can on: .*kl, kv_bytes, ppl, ppl_increase_pct$"):
        compare_methods(run, "a", "b", metric="accuracy")


@pytest.mark.parametrize(("content", "message"), [("{not json", "cannot read"), ('{"rows": []}', "needs rows"),
                                                   ("[1, 2]", "needs rows")])
def test_a_results_file_that_is_not_an_evals_is_one_error(tmp_path, content, message):
    (tmp_path / "results.json").write_text(content)
    with pytest.raises(CurKVError, match=message):
        compare(str(tmp_path), ["a..b"])


def stream_row(method: str, nll_per_token: float, setting: str = "0.5") -> dict:
    segments = 12
    nll = [nll_per_token * 100 + 0.5 * (index % 3) for index in range(segments)]
    return {"method": method, "setting": setting, "ratio": 0.5, "task": "stream_text",
            "metrics": {"ppl_increase_pct": 100 * (nll_per_token / 2.0 - 1)},  # the value shown; not recomputed
            "example_sums": {"nll": nll, "tokens": [100.0] * segments}}


def test_streaming_rows_are_compared_per_segment_against_the_full_cache():
    run = {"rows": [], "main_metric": {}, "bootstrap": {"resamples": 500, "confidence": 0.95, "seed": 0},
           "streaming": {"rows": [stream_row("full", 2.0, "full"), stream_row("a", 2.1), stream_row("b", 2.3)],
                         "bootstrap": {"resamples": 500, "confidence": 0.95, "seed": 0}}}
    entry, = compare_methods(run, "a", "b")
    assert entry["setting"] == "0.5" and entry["metric"] == "ppl_increase_pct" and entry["verdict"] == "wins"
    # ΔPPL % = 100·(exp(NLL per token − the full cache's) − 1), recomputed from the segments: 0.1 and 0.3 nats
    assert entry["difference"] == pytest.approx(100 * (math.exp(0.1) - math.exp(0.3)), rel=1e-6)
    assert entry["interval"][1] < 0
    assert compare_methods(run, "b", "a")[0]["verdict"] == "loses"
    with pytest.raises(CurKVError, match="'c' not in this run; it has: a, b, full"):
        compare_methods(run, "a", "c")


def test_the_full_cache_pairs_with_every_setting_of_a_method():
    run = {"rows": [], "main_metric": {}, "bootstrap": {"resamples": 500, "confidence": 0.95, "seed": 0},
           "streaming": {"rows": [stream_row("full", 2.0, "full"), stream_row("a", 2.1), stream_row("a", 2.3, "0.3")],
                         "bootstrap": {"resamples": 500, "confidence": 0.95, "seed": 0}}}
    entries = {entry["setting"]: entry for entry in compare_methods(run, "a", "full")}
    assert sorted(entries) == ["0.3", "0.5"] and all(entry["verdict"] == "loses" for entry in entries.values())
    assert entries["0.5"]["difference"] == pytest.approx(100 * (math.exp(0.1) - 1), rel=1e-6)
    assert [entry["verdict"] for entry in compare_methods(run, "full", "a")] == ["wins", "wins"]


def test_methods_without_a_common_setting_are_one_error():
    run = results(20, 20)
    run["rows"][1]["ratio"] = 0.7
    with pytest.raises(CurKVError, match="share no task and setting in this run \\(a: 0.5; b: 0.7\\)"):
        compare_methods(run, "a", "b")
