"""From every example's sums to the result rows: metrics, bootstrap intervals, breakdowns, per-example values.

One row per (method, ratio, task). ``metrics`` are computed from the sums over all examples
(perplexity from summed NLL over summed tokens, and so on), ``m@key=value`` breaks the
task's main metric down by an example tag (passkey depth and length), ``intervals`` hold
the bootstrap interval of every quality metric, ``example_values`` the main metric of each
example alone and ``example_sums`` the measures every other number is computed from.
"""

from __future__ import annotations

import numpy as np

from curkv_train.eval.metrics import ExampleSums, finalize, total
from curkv_train.eval.statistics import Bootstrap, metric_samples

BUDGET_METRICS = ("kept_tokens", "context_tokens", "kv_bytes", "prefill_seconds")


def _subset(sums: dict[str, np.ndarray], members: np.ndarray) -> dict[str, np.ndarray]:
    return {key: values[members] for key, values in sums.items()}


def breakdowns(kind: str, main: str, sums: dict[str, np.ndarray], full: dict[str, np.ndarray] | None,
               tags: list[dict[str, str]]) -> dict[str, float]:
    """``main@key=value`` -> the main metric over the examples tagged key=value.

    Args:
        sums, full: key -> (examples,) per-example sums of the method and of the full cache.
        tags: per example, its tags (same order).
    """
    labels = sorted({(key, value) for example in tags for key, value in example.items()})
    values = {}
    for key, value in labels:
        members = np.array([example.get(key) == value for example in tags])
        reference = total(_subset(full, members)) if full else None
        metric = finalize(kind, total(_subset(sums, members)), reference).get(main)
        if metric is not None:
            values[f"{main}@{key}={value}"] = metric
    return values


def result_row(method: str, ratio: float, task: str, kind: str, main: str, sums: dict[str, np.ndarray],
               full: dict[str, np.ndarray] | None, tags: list[dict[str, str]], bootstrap: Bootstrap,
               groups: list[int] | None = None) -> dict:
    """The results row of one (method, ratio, task) from its per-example ``sums`` (see the module docstring);
    ``groups``: examples resampled together (:meth:`Bootstrap.weights`), kept in the row as ``example_groups``."""
    metrics = finalize(kind, total(sums), total(full) if full else None)
    weights = bootstrap.weights(len(tags), task, groups)
    intervals = {name: list(bootstrap.interval(metric_samples(kind, name, sums, full, weights)))
                 for name in metrics if name not in BUDGET_METRICS}
    per_example = finalize(kind, sums, full)[main]
    return {"method": method, "ratio": ratio, "task": task,
            "metrics": {**metrics, **breakdowns(kind, main, sums, full, tags)},
            "intervals": intervals,
            "example_values": {main: np.atleast_1d(per_example).tolist()},
            "example_sums": {key: values.tolist() for key, values in sums.items()},
            **({"example_groups": list(groups)} if groups is not None else {})}


def result_rows(log: ExampleSums, tags: dict[str, list[dict[str, str]]], main_metric: dict[str, str],
                kinds: dict[str, str], bootstrap: Bootstrap, reference: str,
                groups: dict[str, list[str] | None] | None = None) -> list[dict]:
    """Every cell of ``log`` as a results row; ``reference`` (the full cache, at ratio 0) is every row's baseline.

    Args:
        tags: task -> per example, its tags (example order).
        main_metric, kinds: task -> its main metric / metric kind.
        groups: task -> per example, its resampling unit (:meth:`Bootstrap.weights`), or None (examples one by one).
    """
    rows = []
    for method, ratio, task in log.cells:
        full = log.sums(reference, 0.0, task) or None
        rows.append(result_row(method, ratio, task, kinds[task], main_metric[task], log.sums(method, ratio, task),
                               full, tags[task], bootstrap, (groups or {}).get(task)))
    return rows
