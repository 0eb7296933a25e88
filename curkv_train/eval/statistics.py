"""Result rows, bootstrap intervals over examples, and the paired verdict of curkv against the best baseline.

One row per (method, ratio, task): ``metrics`` from the sums over all examples, ``m@key=value`` the main
metric by an example tag, ``intervals`` the bootstrap interval of every quality metric, and the per-example
values and sums. Examples are resampled with replacement (seeded, the same resamples for every method of a
task, so differences are paired; examples that are not independent drawn together) and every metric is
recomputed from the resampled sums; intervals are percentiles of those.
"""

from __future__ import annotations

import zlib
from collections.abc import Collection, Sequence
from dataclasses import asdict, dataclass

import numpy as np

from curkv_train.core.errors import CurKVError
from curkv_train.eval.metrics import ExampleSums, finalize, total

BUDGET_METRICS = ("kept_tokens", "context_tokens", "kv_bytes", "prefill_seconds")
LOWER_IS_BETTER = frozenset({"ppl_increase_pct", "ppl", "kl", "nll"})
WINS, LOSES, TIES = "wins", "loses", "ties (within noise)"
# A tie where the uncompressed cache itself does not beat the baseline by the paired interval: no ranking could.
TIES_AT_FULL = "ties (so does the full cache)"


@dataclass(frozen=True)
class Bootstrap:
    """Percentile bootstrap over examples: ``resamples``, the intervals' ``confidence``, and a ``seed`` (each task draws
    its own resamples from (seed, task))."""

    resamples: int = 2000
    confidence: float = 0.95
    seed: int = 0

    def __post_init__(self) -> None:
        if self.resamples < 1 or not 0.0 < self.confidence < 1.0:
            raise CurKVError(f"the bootstrap needs at least 1 resample and a confidence in (0, 1), got "
                             f"{self.resamples} and {self.confidence}")

    def weights(self, examples: int, task: str, groups: Sequence[int] | None = None) -> np.ndarray:
        """(resamples, examples) how often each example is drawn in each resample, the same for every method of ``task``
        (paired differences); with ``groups`` (examples,) whole groups are drawn (their examples are not independent).
        """
        rng = np.random.default_rng([self.seed, zlib.crc32(task.encode())])
        labels = np.arange(examples) if groups is None else np.unique(np.asarray(groups), return_inverse=True)[1]
        if len(labels) != examples:
            raise ValueError(f"{len(labels)} group labels for {examples} examples")
        units = int(labels.max()) + 1 if examples else 0
        drawn = rng.integers(0, units, size=(self.resamples, units))
        counts = np.zeros((self.resamples, units))
        np.add.at(counts, (np.arange(self.resamples)[:, None], drawn), 1.0)
        return counts[:, labels]

    def interval(self, samples: np.ndarray) -> tuple[float, float]:
        """(low, high) percentile interval of ``samples`` (resamples,), NaN resamples ignored."""
        finite = samples[np.isfinite(samples)]
        if not len(finite):
            return float("nan"), float("nan")
        tail = (1.0 - self.confidence) / 2.0
        low, high = np.quantile(finite, [tail, 1.0 - tail])
        return float(low), float(high)

    def record(self) -> dict:
        """The settings, for results.json."""
        return asdict(self)


def metric_samples(kind: str, name: str, sums: dict[str, np.ndarray], full: dict[str, np.ndarray] | None,
                   weights: np.ndarray) -> np.ndarray:
    """(resamples,) metric ``name`` of each resample (``weights`` (resamples, examples)) of the examples' ``sums``
    (key -> (examples,)), against the full cache's ``full``."""
    resampled_full = total(full, weights) if full else None
    return np.asarray(finalize(kind, total(sums, weights), resampled_full)[name], dtype=np.float64)


@dataclass(frozen=True)
class Difference:
    """ours − theirs on the same examples: the point estimate and its paired bootstrap interval."""

    point: float
    low: float
    high: float


def paired_difference(kind: str, name: str, ours: dict[str, np.ndarray], theirs: dict[str, np.ndarray],
                      full: dict[str, np.ndarray] | None, weights: np.ndarray, bootstrap: Bootstrap) -> Difference:
    """Metric ``name`` of ``ours`` minus that of ``theirs``, both over the same resamples of the same examples."""
    point_full = total(full) if full else None
    point = finalize(kind, total(ours), point_full)[name] - finalize(kind, total(theirs), point_full)[name]
    samples = (metric_samples(kind, name, ours, full, weights) - metric_samples(kind, name, theirs, full, weights))
    return Difference(float(point), *bootstrap.interval(samples))


def verdict(difference: Difference, name: str, *, full_minus_theirs: Difference | None = None) -> str:
    """``wins`` / ``loses`` where the interval of ours − theirs excludes 0 (in our favour / against us), else a
    tie; ``TIES_AT_FULL`` where ``full_minus_theirs`` (paired) shows that the uncompressed cache does not
    beat them either, so that no choice of tokens could have won there on these examples."""
    sign = -1.0 if name in LOWER_IS_BETTER else 1.0
    low, high = sorted((sign * difference.low, sign * difference.high))
    if low > 0.0:
        return WINS
    if high < 0.0:
        return LOSES
    if full_minus_theirs is not None and verdict(full_minus_theirs, name) != WINS:
        return TIES_AT_FULL
    return TIES


def example_sums(row: dict) -> dict[str, np.ndarray]:
    """A results row's per-example sums as arrays (key -> (examples,))."""
    return {key: np.asarray(values, dtype=np.float64) for key, values in row.get("example_sums", {}).items()}


def _finite(value) -> bool:
    return value is not None and bool(np.isfinite(value))


def summarize(rows: list[dict], main_metric: dict[str, str], kinds: dict[str, str], bootstrap: Bootstrap, *,
              ours: str, reference: str, exclude: Collection[str] = ()) -> list[dict]:
    """Per task and ratio: ``ours`` against the best other compressing method on the task's main metric.

    The best is the best point estimate among the ``rows`` (with per-example sums) of every method but ``ours``,
    the ``reference`` (the full cache) and ``exclude`` (rows that are not baselines), the first in method order
    among equals; the verdict reads the paired bootstrap interval of ours − best on the same examples
    (:func:`verdict`). ``main_metric``, ``kinds``: task -> metric, kind. Returns one entry per (task, ratio):
    ``ours``'s value and interval, the best baseline's, the paired difference, ``full_minus_best`` (the full cache
    against the best baseline, paired: [point, low, high]; None without a full-cache row) and the verdict.
    """
    table = {(row["method"], row["ratio"], row["task"]): row for row in rows}
    methods = list(dict.fromkeys(row["method"] for row in rows))
    entries = []
    for task, name in main_metric.items():
        full_row = table.get((reference, 0.0, task))
        full = example_sums(full_row) if full_row else None
        for ratio in sorted({row["ratio"] for row in rows if row["task"] == task and row["method"] != reference}):
            mine = table.get((ours, ratio, task))
            scored = [(row["metrics"][name], method) for method in methods
                      if method not in (ours, reference) and method not in exclude
                      and (row := table.get((method, ratio, task))) and _finite(row["metrics"].get(name))]
            if mine is None or not _finite(mine["metrics"].get(name)) or not scored:
                continue
            # the best point estimate; among equals the first in method order (the baselines before kvpress:*)
            best_value, best = (min if name in LOWER_IS_BETTER else max)(scored, key=lambda scored: scored[0])
            theirs = table[(best, ratio, task)]
            sums, their_sums = example_sums(mine), example_sums(theirs)
            weights = bootstrap.weights(len(next(iter(sums.values()))), task, mine.get("example_groups"))
            difference = paired_difference(kinds[task], name, sums, their_sums, full, weights, bootstrap)
            ceiling = paired_difference(kinds[task], name, full, their_sums, full, weights,
                                        bootstrap) if full else None  # the full cache against the best baseline
            entries.append({"task": task, "metric": name, "ratio": ratio, "method": ours,
                            ours: mine["metrics"][name], f"{ours}_interval": mine.get("intervals", {}).get(name),
                            "baseline": best, "baseline_value": best_value,
                            "baseline_interval": theirs.get("intervals", {}).get(name),
                            "difference": difference.point, "difference_interval": [difference.low, difference.high],
                            "full_minus_best": ceiling and [ceiling.point, ceiling.low, ceiling.high],
                            "verdict": verdict(difference, name, full_minus_theirs=ceiling)})
    return entries


def _subset(sums: dict[str, np.ndarray], members: np.ndarray) -> dict[str, np.ndarray]:
    return {key: values[members] for key, values in sums.items()}


def breakdowns(kind: str, main: str, sums: dict[str, np.ndarray], full: dict[str, np.ndarray] | None,
               tags: list[dict[str, str]]) -> dict[str, float]:
    """``main@key=value`` -> the main metric over the examples tagged key=value (``tags``: per example), from the
    method's and the full cache's per-example ``sums`` and ``full`` (key -> (examples,))."""
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
    """Every cell of ``log`` as a results row, against ``reference`` (the full cache, at ratio 0); ``tags``, ``groups``
    (resampling units, None: one by one): task -> per example; ``main_metric``, ``kinds``: task -> metric, kind."""
    rows = []
    for method, ratio, task in log.cells:
        full = log.sums(reference, 0.0, task) or None
        rows.append(result_row(method, ratio, task, kinds[task], main_metric[task], log.sums(method, ratio, task),
                               full, tags[task], bootstrap, (groups or {}).get(task)))
    return rows
