"""``curkv-train compare``: paired differences between methods of one evaluation run, with verdicts.

For each pair ``A..B`` (method names as in the run's rows), per task and setting, A's main metric (or
``--metric``) minus B's on the same examples, with the paired 95 % bootstrap interval and the verdict the
run's summary uses, resampled as the rows record in ``example_groups``::

    curkv-train compare --run runs/eval-ablation --pairs "curkv:query_aware_dense..curkv:query_aware"
"""

from __future__ import annotations

import json
from pathlib import Path

from curkv_train.core.errors import CurKVError
from curkv_train.eval.lists import NameList
from curkv_train.eval.metrics import finalize, total
from curkv_train.eval.statistics import Bootstrap, example_sums, paired_difference, verdict
from curkv_train.eval.stream_rows import FULL
from curkv_train.eval.streaming import MAIN_METRIC as STREAM_METRIC
from curkv_train.eval.tasks import TASKS

SEPARATOR = ".."


def _cells(results: dict) -> dict[tuple[str, str, str], tuple]:
    """(method, setting, task) -> (row, kind, metric, full row, bootstrap, groups) of a run's prefill rows
    (setting: the ratio) and streaming rows (setting: the memory setting's label; the metric is the perplexity
    increase); examples are resampled by the row's ``example_groups``, one by one without."""
    cells = {}
    prefill = {(row["method"], row["ratio"], row["task"]): row for row in results["rows"]}
    bootstrap = Bootstrap(**results["bootstrap"])
    for (method, ratio, task), row in prefill.items():
        cells[(method, f"{ratio:g}", task)] = (row, TASKS[task][0], results["main_metric"][task],
                                               prefill.get(("full", 0.0, task)), bootstrap, row.get("example_groups"))
    streaming = results.get("streaming") or {"rows": [], "bootstrap": results["bootstrap"]}
    stream = {(row["method"], row["setting"], row["task"]): row for row in streaming["rows"]}
    bootstrap = Bootstrap(**streaming["bootstrap"])
    for (method, setting, task), row in stream.items():
        cells[(method, setting, task)] = (row, "ppl", STREAM_METRIC, stream.get((FULL, FULL, task)), bootstrap,
                                          row.get("example_groups"))
    return cells


def compare_methods(results: dict, first: str, second: str, metric: str | None = None) -> list[dict]:
    """Per (task, setting) where both methods have rows: ``first`` − ``second`` (method names of ``results``, a run's
    results.json) on the task's main metric, or on ``metric`` where the rows' per-example sums give it; the full
    cache pairs with a method at each of its settings.

    Returns:
        entries with task, setting (a ratio or a streaming memory setting), metric, both values, the difference,
        its interval and the verdict (``wins``: ``first`` is better).

    Raises:
        CurKVError: a method not in the run, two methods that share no (task, setting), or a ``metric`` no row gives.
    """
    cells = _cells(results)
    known = {method for method, _, _ in cells}
    missing = [name for name in (first, second) if name not in known]
    if missing:
        raise CurKVError(f"method(s) {', '.join(map(repr, missing))} not in this run; it has: {', '.join(sorted(known))}")
    anchor = second if first == FULL else first
    entries = []
    comparable = set()  # with ``metric``: the metrics the anchor's rows can be resampled on
    for (method, setting, task), (row, kind, name, full_row, bootstrap, groups) in cells.items():
        if method != anchor:
            continue
        full = example_sums(full_row) if full_row else None
        if metric:  # every row gives its main metric; another only where its kind's sums do
            given = finalize(kind, total(example_sums(row)), total(full) if full else None).keys()
            comparable |= given
            if metric not in given:
                continue
            name = metric
        # the full cache's row (the task's reference) pairs at any setting
        rows = {method: cells[(method, setting, task)][0] if (method, setting, task) in cells
                else full_row if method == FULL else None for method in (first, second)}
        if None in rows.values():
            continue
        ours = example_sums(rows[first])
        weights = bootstrap.weights(len(next(iter(ours.values()))), task, groups)
        difference = paired_difference(kind, name, ours, example_sums(rows[second]), full, weights, bootstrap)
        entries.append({"task": task, "setting": setting, "metric": name, first: rows[first]["metrics"][name],
                        second: rows[second]["metrics"][name], "difference": difference.point,
                        "interval": [difference.low, difference.high], "verdict": verdict(difference, name)})
    if not entries and metric and metric not in comparable:
        raise CurKVError(f"no row of {anchor!r} can be compared on {metric!r}; its rows can on: "
                         f"{', '.join(sorted(comparable))}")
    if not entries:
        settings = {method: sorted({setting for other, setting, _ in cells if other == method}) for method in (first, second)}
        raise CurKVError(f"{first!r} and {second!r} share no task and setting in this run ({first}: "
                         f"{', '.join(settings[first])}; {second}: {', '.join(settings[second])})")
    return entries


def comparison_markdown(run: str, pairs: list[str], metric: str | None = None) -> str:
    """A markdown table of :func:`compare_methods` (on ``metric`` if given) for each ``A..B`` of ``pairs`` over the
    run folder ``run``."""
    results = _read_results(Path(run) / "results.json")
    lines = ["| A | B | task | setting | metric | A | B | A − B [95 %] | verdict for A |",
             "|---|---|---|---|---|---|---|---|---|"]
    for pair in pairs:
        first, separator, second = pair.partition(SEPARATOR)
        if not separator or not first or not second:
            raise CurKVError(f"a pair is METHOD{SEPARATOR}METHOD, got {pair!r}")
        for entry in compare_methods(results, first, second, metric):
            low, high = entry["interval"]
            lines.append(f"| {first} | {second} | {entry['task']} | {entry['setting']} | {entry['metric']} | "
                         f"{entry[first]:.4g} | {entry[second]:.4g} | {entry['difference']:+.3g} [{low:+.3g}, "
                         f"{high:+.3g}] | {entry['verdict']} |")
    return "\n".join(lines)


def _read_results(path: Path) -> dict:
    """A run's results.json, or a one-line CurKVError where it is not one (unreadable, not JSON, no rows)."""
    try:
        results = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise CurKVError(f"cannot read {str(path)!r} as a curkv-train eval's results: {error}") from None
    if not isinstance(results, dict) or not {"rows", "bootstrap", "main_metric"} <= results.keys():
        raise CurKVError(f"{str(path)!r} is not a curkv-train eval's results.json (it needs rows, bootstrap and "
                         "main_metric)")
    return results


def compare(run: str, pairs: NameList, metric: str | None = None) -> None:
    """Print paired differences between methods of one evaluation run (a markdown table).

    Args:
        run: the evaluation's run folder (its results.json).
        pairs: comma-separated METHOD..METHOD pairs, e.g. ``curkv..curkv:untrained``; a verdict
            "wins" means the first is better (its 95 % paired bootstrap interval excludes 0).
        metric: compare this metric (e.g. ``kl``, which every task reports) where the rows' per-example sums give
            it, instead of each task's main metric.
    """
    path = Path(run) / "results.json"
    if not path.is_file():
        raise CurKVError(f"no results.json in {run!r}; pass the run folder of a curkv-train eval")
    print(comparison_markdown(run, list(pairs), metric))
