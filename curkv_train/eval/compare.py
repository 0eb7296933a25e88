"""``curkv-train compare``: paired differences between methods of one evaluation run, with verdicts.

The ablation reading of a run: for each pair ``A..B`` (method names as in the run's rows; ``..``
because names hold ``:``), per task and ratio, A's main metric minus B's on the same examples,
with the paired 95 % bootstrap interval and the verdict the run's summary uses::

    curkv-train compare --run runs/eval-ablation --pairs "curkv:query_aware_dense..curkv:query_aware"
"""

from __future__ import annotations

import json
from pathlib import Path

from curkv_train.errors import CurKVError
from curkv_train.eval.cli import NameList
from curkv_train.eval.statistics import Bootstrap, example_sums, paired_difference, verdict
from curkv_train.eval.tasks import TASKS

SEPARATOR = ".."


def compare_methods(results: dict, first: str, second: str) -> list[dict]:
    """Per (task, ratio) where both methods have rows: ``first`` − ``second`` on the task's main metric.

    Args:
        results: a run's results.json content (rows with per-example sums, main_metric, bootstrap).
        first, second: method names of its rows.

    Returns:
        entries with task, ratio, metric, both values, the difference, its interval and the verdict
        (``wins`` means ``first`` is better).
    """
    table = {(row["method"], row["ratio"], row["task"]): row for row in results["rows"]}
    known = {row["method"] for row in results["rows"]}
    missing = [name for name in (first, second) if name not in known]
    if missing:
        raise CurKVError(f"method(s) {', '.join(map(repr, missing))} not in this run; it has: {', '.join(sorted(known))}")
    bootstrap = Bootstrap(**results["bootstrap"])
    entries = []
    for (method, ratio, task), row in table.items():
        other = table.get((second, ratio, task))
        if method != first or other is None:
            continue
        name, kind = results["main_metric"][task], TASKS[task][0]
        full_row = table.get(("full", 0.0, task))
        ours = example_sums(row)
        weights = bootstrap.weights(len(next(iter(ours.values()))), task)
        difference = paired_difference(kind, name, ours, example_sums(other),
                                       example_sums(full_row) if full_row else None, weights, bootstrap)
        entries.append({"task": task, "ratio": ratio, "metric": name, first: row["metrics"][name],
                        second: other["metrics"][name], "difference": difference.point,
                        "interval": [difference.low, difference.high], "verdict": verdict(difference, name)})
    return entries


def comparison_markdown(run: str, pairs: list[str]) -> str:
    """A markdown table of :func:`compare_methods` for each ``A..B`` of ``pairs`` over the run folder ``run``."""
    results = json.loads((Path(run) / "results.json").read_text())
    lines = ["| A | B | task | ratio | A | B | A − B [95 %] | verdict for A |", "|---|---|---|---|---|---|---|---|"]
    for pair in pairs:
        first, separator, second = pair.partition(SEPARATOR)
        if not separator or not first or not second:
            raise CurKVError(f"a pair is METHOD{SEPARATOR}METHOD, got {pair!r}")
        for entry in compare_methods(results, first, second):
            low, high = entry["interval"]
            lines.append(f"| {first} | {second} | {entry['task']} | {entry['ratio']:g} | {entry[first]:.4g} | "
                         f"{entry[second]:.4g} | {entry['difference']:+.3g} [{low:+.3g}, {high:+.3g}] | "
                         f"{entry['verdict']} |")
    return "\n".join(lines)


def compare(run: str, pairs: NameList) -> None:
    """Print paired differences between methods of one evaluation run (a markdown table).

    Args:
        run: the evaluation's run folder (its results.json).
        pairs: comma-separated METHOD..METHOD pairs, e.g. ``curkv..curkv:untrained``; a verdict
            "wins" means the first is better (its 95 % paired bootstrap interval excludes 0).
    """
    path = Path(run) / "results.json"
    if not path.is_file():
        raise CurKVError(f"no results.json in {run!r}; pass the run folder of a curkv-train eval")
    print(comparison_markdown(run, list(pairs)))
