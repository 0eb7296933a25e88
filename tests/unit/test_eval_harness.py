"""``curkv-train eval`` end to end on the tiny model, and its one-line errors."""

from __future__ import annotations

import json
import math
import sys

import pytest

from curkv_train import cli
from curkv_train.cli import function_parser
from curkv_train.eval import cli as eval_cli
from curkv_train.eval.methods import METHODS
from curkv_train.eval.report import write_run
from curkv_train.eval.tasks import TASKS
from curkv_train.models.base import TINY_RANDOM
from curkv_train.models.seed_estimator import ValueEstimator
from curkv_train.runtime.scorer import Scorer

SMALL = ["--context_length", "128", "--continuation_length", "48", "--examples", "2", "--passkey_lengths", "128",
         "--passkey_depths", "0.2,0.8", "--backend", "torch"]


def export_scorer(folder, num_layers: int = 2):
    """A fresh estimator exported for the tiny model (``num_layers`` other than 2 records another base)."""
    from curkv_train import runtime
    from curkv_train.models.base import load_base_model

    config = load_base_model(TINY_RANDOM).config
    config.num_hidden_layers = num_layers
    scorer = Scorer(ValueEstimator(num_layers, 2, 16, max_positions=2048), n_sink=4, window=16)
    return runtime.save_scorer(scorer, folder, base_model=TINY_RANDOM, fingerprint=runtime.model_fingerprint(config))


def run_cli(args: list[str], capsys) -> tuple[int, str]:
    code = cli.main(["eval", *args])
    return code, capsys.readouterr().err


def test_end_to_end_with_a_fresh_scorer(tmp_path, capsys):
    scorer = export_scorer(tmp_path / "scorer")
    run = tmp_path / "run"
    code, err = run_cli(["--scorer", str(scorer), "--ratios", "0.3,0.7", "--out", str(run), *SMALL],
                        capsys)
    assert code == 0, err
    results = json.loads((run / "results.json").read_text())
    assert results["config"]["base"] == TINY_RANDOM
    assert (results["config"]["n_sink"], results["config"]["window"]) == (4, 16)  # the scorer's spans
    rows = {(row["method"], row["ratio"], row["task"]): row["metrics"] for row in results["rows"]}
    assert {method for method, _, _ in rows} == set(METHODS)
    for task in TASKS:
        main = results["main_metric"][task]
        full = rows[("full", 0.0, task)]
        for ratio in (0.3, 0.7):
            budgets = {rows[(method, ratio, task)]["kept_tokens"] for method in METHODS
                       if method not in ("full", "curkv_cache")}
            assert len(budgets) == 1 and budgets.pop() < full["kept_tokens"]  # one budget for every method
            # the runtime cache counts its budget its own way (ρ of every token seen, plus what arrived since its
            # last compression): not the bare selection's count, and fewer than all
            assert rows[("curkv", ratio, task)]["kept_tokens"] != rows[("curkv_cache", ratio, task)]["kept_tokens"]
            assert rows[("curkv_cache", ratio, task)]["kept_tokens"] < full["kept_tokens"]
            for method in METHODS[1:]:
                metrics = rows[(method, ratio, task)]
                assert metrics[main] is not None and math.isfinite(metrics[main])
                assert metrics["kv_bytes"] < full["kv_bytes"]
    assert rows[("full", 0.0, "ppl_text")]["ppl_increase_pct"] == 0.0
    assert {"accuracy@depth=0.2", "accuracy@depth=0.8", "accuracy@length=128"} <= set(rows[("h2o", 0.3, "passkey")])
    for row in results["rows"]:  # perplexity examples are resampled by their document, synthetic ones alone
        groups = row.get("example_groups")
        if TASKS[row["task"]][0] == "ppl":
            assert all(group in documents for group, documents in zip(groups, results["documents"][row["task"]]))
        else:
            assert groups is None

    markdown = (run / "results.md").read_text()
    assert "| curkv |" in markdown and "## repeated_span" in markdown and "**kv_bytes**" in markdown
    assert "Perplexity examples are drawn by held-out document" in markdown
    for task in TASKS:
        png = run / "plots" / f"{task}__{results['main_metric'][task]}.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not [path for path in run.rglob(".*")]  # no temporary files left behind
    plots = sorted(path.name for path in (run / "plots").iterdir())
    (run / "plots" / "earlier_task__accuracy.png").write_bytes(b"stale")
    write_run(run, results, json.loads((run / "results.json").read_text())["config"])  # a rerun into the same --out
    assert sorted(path.name for path in (run / "plots").iterdir()) == plots


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--tasks", "ppl_text,bogus"], "valid tasks: " + ", ".join([*TASKS, "stream_text", "stream_code"])),
        (["--methods", "full,bogus"], "valid methods: " + ", ".join(METHODS)),
        (["--methods", "curkv"], "needs a trained scorer"),
        (["--context_length", "60"], "must exceed n_sink + window (4 + 64)"),
        (["--ratios", "0.5,1.0"], "must lie in [0, 1)"),
        (["--ratios", "0.3,0.5,0.5"], "compression ratios repeat"),
        (["--examples", "many"], "examples"),
        (["--scorer_precision", "bf16"], "scorer_precision"),
    ],
)
def test_bad_input_is_one_line(args, message, capsys):
    code, err = run_cli(["--scorer", "none", "--base", TINY_RANDOM, *args], capsys)
    assert code == 2
    assert message in err and err.count("\n") == 1


def test_without_kvpress_the_press_rows_are_one_line(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "kvpress", None)  # import kvpress raises ImportError
    monkeypatch.delitem(sys.modules, "curkv_train.eval.baseline_presses", raising=False)  # imports kvpress
    code, err = run_cli(["--scorer", "none", "--base", TINY_RANDOM, "--tasks", "ppl_text", "--methods", "full,knorm",
                         "--ratios", "0.5", "--out", str(tmp_path / "run"), *SMALL], capsys)
    assert code == 2 and "pip install 'curkv-train[kvpress]'" in err and err.count("\n") == 1


def test_scorer_for_another_base_is_rejected(tmp_path, capsys):
    scorer = export_scorer(tmp_path / "scorer", num_layers=3)
    code, err = run_cli(["--scorer", str(scorer), "--out", str(tmp_path / "run"), *SMALL], capsys)
    assert code == 2 and err.count("\n") == 1
    assert "num_hidden_layers: scorer 3 vs model 2" in err


def test_missing_scorer_path(tmp_path, capsys):
    code, err = run_cli(["--scorer", str(tmp_path / "nope"), "--base", TINY_RANDOM], capsys)
    assert code == 2 and "nope" in err and err.count("\n") == 1


def test_exported_scorer_through_the_runtime_loader(tmp_path, capsys):
    """A scorer written by the runtime's exporter loads by path; a fingerprint of another base is refused."""
    from curkv_train import runtime
    from curkv_train.models.base import load_base_model

    good = export_scorer(tmp_path / "good")
    code, err = run_cli(["--scorer", str(good), "--tasks", "ppl_text", "--methods", "full,streaming_llm,curkv",
                         "--ratios", "0.5", "--out", str(tmp_path / "run"), *SMALL], capsys)
    assert code == 0, err
    rows = json.loads((tmp_path / "run" / "results.json").read_text())["rows"]
    assert {row["method"] for row in rows} == {"full", "streaming_llm", "curkv"}

    config = load_base_model(TINY_RANDOM).config
    other = config.to_dict() | {"vocab_size": config.vocab_size * 2}
    scorer = Scorer(ValueEstimator(2, 2, 16, max_positions=2048), n_sink=4, window=16)
    bad = runtime.save_scorer(scorer, tmp_path / "bad", base_model=TINY_RANDOM,
                              fingerprint=runtime.model_fingerprint(type(config).from_dict(other)))
    code, err = run_cli(["--scorer", str(bad), "--out", str(tmp_path / "run2"), *SMALL], capsys)
    assert code == 2 and err.count("\n") == 1


def test_scorer_of_an_unreachable_hub_model_uses_its_training_fallback(tmp_path, capsys):
    """A scorer trained on a hub id with a fallback evaluates offline on that fallback."""
    from curkv_train import runtime
    from curkv_train.models.base import load_base_model

    config = load_base_model(TINY_RANDOM).config
    scorer = Scorer(ValueEstimator(2, 2, 16, max_positions=2048), n_sink=4, window=16)
    path = runtime.save_scorer(scorer, tmp_path / "hub", base_model="no-such-org/no-such-model",
                               fingerprint=runtime.model_fingerprint(config),
                               extra={"training": {"hyper_parameters": {"base_fallback": TINY_RANDOM}}})
    code, err = run_cli(["--scorer", str(path), "--tasks", "ppl_text", "--methods", "full,curkv",
                         "--ratios", "0.5", "--out", str(tmp_path / "run"), *SMALL], capsys)
    assert code == 0, err


def test_options_come_from_the_config_dataclass():
    parser = function_parser(eval_cli.EvalConfig)
    namespace = parser.parse_args(["--scorer", "none", "--context_length", "64", "--kvpress", "true", "--ratios=0.5"])
    assert namespace.context_length == 64 and namespace.kvpress is True and namespace.ratios == [0.5]
    assert parser.parse_args(["--scorer", "x"]).kvpress is False


def test_several_scorers_each_get_rows_and_the_first_gets_the_verdict(tmp_path, capsys):
    """``--scorer main=PATH,fresh=init:query_aware``: rows curkv:main, curkv:fresh and their runtime-cache rows;
    the summary is about curkv:main, and no scorer row is its baseline."""
    scorer = export_scorer(tmp_path / "scorer")
    code, err = run_cli(["--scorer", f"main={scorer},fresh=init:query_aware", "--tasks", "ppl_text",
                         "--methods", "full,streaming_llm,knorm,curkv,curkv_cache", "--ratios", "0.0,0.5",
                         "--out", str(tmp_path / "run"), *SMALL], capsys)
    assert code == 0, err
    results = json.loads((tmp_path / "run" / "results.json").read_text())
    rows = {(row["method"], row["ratio"]): row["metrics"] for row in results["rows"]}
    assert {method for method, _ in rows} == {"full", "streaming_llm", "knorm", "curkv:main", "curkv:fresh",
                                              "curkv_cache:main", "curkv_cache:fresh"}
    # every row protects the main scorer's spans (4, 16), the fresh one's cache too (its own default window is 64)
    assert results["config"]["scorers"]["curkv:fresh"] == {"source": "init:query_aware", "family": "query_aware",
                                                           "n_sink": 4, "window": 16, "trained": False}
    for entry in results["summary"]:
        assert entry["method"] == "curkv:main" and not entry["baseline"].startswith("curkv")
    for name in ("curkv_cache:main", "curkv_cache:fresh"):
        assert rows[(name, 0.5)]["kv_bytes"] > 0 and rows[(name, 0.5)]["kept_tokens"] > 0
        assert abs(rows[(name, 0.0)]["ppl_increase_pct"]) < 1e-3  # keep 1.0 through the runtime cache: the full cache
    report = (tmp_path / "run" / "results.md").read_text()
    assert "Summary: curkv:main against the best baseline" in report
    assert "hot tier (2 windows) count inside the ratio" in report  # the cache's defaults, not a stale constant
    assert all(documents for documents in results["documents"]["ppl_text"])


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("init:nonsense", "unknown estimator family 'nonsense'"),
        ("a=init:seed,a=init:hidden", "same name: labels ['curkv:a']"),
        ("init:seed,init:hidden", "bare paths"),
        ("none,init:seed", "cannot be combined"),
        ("=init:seed", "is empty"),
        ("a b=init:seed", "may hold only letters"),
    ],
)
def test_bad_scorer_entries_are_one_line(spec, message, capsys):
    code, err = run_cli(["--scorer", spec, "--base", TINY_RANDOM], capsys)
    assert code == 2 and message in err and err.count("\n") == 1


def test_scorers_of_different_bases_are_refused(tmp_path, capsys):
    good = export_scorer(tmp_path / "good")
    other = export_scorer(tmp_path / "other", num_layers=3)
    code, err = run_cli(["--scorer", f"{good},b={other}", "--out", str(tmp_path / "run"), *SMALL], capsys)
    assert code == 2 and err.count("\n") == 1 and "were trained for different base models" in err
    code, err = run_cli(["--scorer", f"{good},b={tmp_path / 'missing'}", "--out", str(tmp_path / "run"), *SMALL],
                        capsys)
    assert code == 2 and err.count("\n") == 1 and "missing" in err


def test_a_budgeted_scorer_and_budget_baselines(tmp_path, capsys):
    """A scorer with a layer budget gets a curkv_uniform row; --budget_baselines gives a baseline the same
    per-layer counts as curkv; without a budget the option is a one-line error."""
    from curkv_train import runtime
    from curkv_train.models.base import load_base_model
    from curkv_train.runtime.allocation import LayerBudget

    plain = export_scorer(tmp_path / "plain")
    scorer = runtime.load_scorer(plain)
    scorer.layer_budget = LayerBudget((0.1, 4.0), 1.0)
    budgeted = runtime.save_scorer(scorer, tmp_path / "budgeted", base_model=TINY_RANDOM,
                                   fingerprint=runtime.model_fingerprint(load_base_model(TINY_RANDOM).config))
    args = ["--tasks", "ppl_text", "--methods", "full,h2o,curkv", "--ratios", "0.5", *SMALL]
    code, err = run_cli(["--scorer", str(budgeted), "--budget_baselines", "true", "--out", str(tmp_path / "run"),
                         *args], capsys)
    assert code == 0, err
    results = json.loads((tmp_path / "run" / "results.json").read_text())
    bytes_held = {row["method"]: row["metrics"]["kv_bytes"] for row in results["rows"]}
    assert set(bytes_held) == {"full", "h2o", "curkv", "curkv_uniform"}
    assert bytes_held["h2o"] == bytes_held["curkv"] != bytes_held["curkv_uniform"]
    assert results["summary"][0]["baseline"] == "h2o"  # curkv_uniform is not a baseline
    code, err = run_cli(["--scorer", str(plain), "--budget_baselines", "true", "--out", str(tmp_path / "run2"),
                         *args], capsys)
    assert code == 2 and "--budget_baselines needs a main scorer" in err and err.count("\n") == 1


def test_a_budgeted_evaluation_leaves_the_model_as_it_found_it(tmp_path, capsys, monkeypatch):
    """The mask-fitting wrapper a layer budget needs is held for the evaluation only."""
    from curkv_train import runtime
    from curkv_train.eval import cli
    from curkv_train.models.base import load_base_model
    from curkv_train.runtime.allocation import LayerBudget

    scorer = runtime.load_scorer(export_scorer(tmp_path / "plain"))
    scorer.layer_budget = LayerBudget((0.1, 4.0), 1.0)
    models = []
    monkeypatch.setattr(cli, "load_base_model", lambda *a, **k: models.append(load_base_model(*a, **k)) or models[-1])
    budgeted = runtime.save_scorer(scorer, tmp_path / "budgeted", base_model=TINY_RANDOM,
                                   fingerprint=runtime.model_fingerprint(load_base_model(TINY_RANDOM).config))
    code, err = run_cli(["--scorer", str(budgeted), "--tasks", "ppl_text", "--methods", "full,curkv", "--ratios", "0.5",
                         "--out", str(tmp_path / "run"), *SMALL], capsys)
    assert code == 0, err
    (model,) = models
    assert model.config._attn_implementation == "sdpa"
    assert not [name for name, module in model.named_modules()
                if module._forward_hooks or module._forward_pre_hooks]


def test_every_scorer_of_a_run_scores_with_the_precision_asked():
    from curkv_train.eval.scorer_entries import build_scorers, parse_scorers
    from curkv_train.models.base import load_base_model

    entries = parse_scorers("a=init:query_aware,b=init:seed")
    scorers = build_scorers(entries, {}, load_base_model(TINY_RANDOM), TINY_RANDOM, spans=(4, 16),
                            matmul_precision="medium")
    assert [(scorer.matmul_precision, scorer.window) for scorer in scorers.values()] == [("medium", 16)] * 2


def test_a_rule_runs_at_its_own_calibrated_budget(tmp_path, capsys):
    """``--rule_budgets knorm=FILE`` adds ``knorm@own``, knorm's press at that split (other per-layer counts, the
    same mean); a file of another rule is a one-line error before anything runs."""
    from curkv_train.runtime.allocation import LayerBudget

    scorer = export_scorer(tmp_path / "scorer")
    budget = tmp_path / "knorm.json"
    budget.write_text(json.dumps({**LayerBudget((0.1, 4.0), 1.0).record(), "method": "knorm"}))
    args = ["--scorer", str(scorer), "--tasks", "ppl_text", "--methods", "full,knorm", "--ratios", "0.5", *SMALL]
    code, err = run_cli([*args, "--rule_budgets", f"knorm={budget}", "--out", str(tmp_path / "run")], capsys)
    assert code == 0, err
    rows = {row["method"]: row["metrics"] for row in json.loads((tmp_path / "run" / "results.json").read_text())["rows"]}
    assert {"knorm", "knorm@own"} <= set(rows)
    assert rows["knorm@own"]["kept_tokens"] == pytest.approx(rows["knorm"]["kept_tokens"], abs=1)
    assert rows["knorm@own"]["ppl"] != rows["knorm"]["ppl"]
    code, err = run_cli([*args, "--rule_budgets", f"snapkv={budget}", "--out", str(tmp_path / "run2")], capsys)
    assert code == 2 and "not 'snapkv'" in err and err.count("\n") == 1
