"""A run directory: results.json, results.md, one PNG per task metric, TensorBoard scalars.

Every file is written to a temporary name in the same folder and renamed into place,
so a reader never sees a half-written result (the TensorBoard folder is swapped whole).
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

from curkv_train.core.atomic import atomic_folder, write_atomic
from curkv_train.eval.methods import CURKV, FULL

BUDGET_METRICS = ("kept_tokens", "context_tokens", "kv_bytes", "prefill_seconds")


def _json_value(value):
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def results_json(results: dict, config: dict) -> str:
    """The results and the configuration that produced them as JSON (NaN / inf -> null)."""
    rows = [{**row, "metrics": {key: _json_value(value) for key, value in row["metrics"].items()}}
            for row in results["rows"]]
    payload = {"config": config, "main_metric": results["main_metric"],
               "seconds_per_example": results["seconds_per_example"], "rows": rows}
    return json.dumps(payload, indent=2, sort_keys=False) + "\n"


def _methods(rows: list[dict]) -> list[str]:
    names = list(dict.fromkeys(row["method"] for row in rows))
    return sorted(names, key=lambda name: (name != FULL, name.startswith("kvpress:"), names.index(name)))


def _ratios(rows: list[dict]) -> list[float]:
    return sorted({row["ratio"] for row in rows if row["method"] != FULL})


def _lookup(rows: list[dict]) -> dict[tuple[str, float, str], dict]:
    return {(row["method"], row["ratio"], row["task"]): row["metrics"] for row in rows}


def _metric(table: dict, method: str, ratio: float, task: str, name: str) -> float | None:
    """``name`` of (method, ratio, task); the full cache has one value for every ratio."""
    key = (FULL, 0.0, task) if method == FULL else (method, ratio, task)
    return table.get(key, {}).get(name)


def task_metrics(rows: list[dict], task: str, main: str) -> list[str]:
    """Quality metrics of ``task`` (main first, then the others, then breakdowns), budget excluded."""
    names = list(dict.fromkeys(name for row in rows if row["task"] == task for name in row["metrics"]))
    quality = [name for name in names if name not in BUDGET_METRICS]
    return sorted(quality, key=lambda name: (name != main, "@" in name, quality.index(name)))


def _cell(value: float | None, name: str) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "–"
    if name == "kv_bytes":
        return f"{value / 2**20:.2f} MiB"
    return f"{value:.4g}" if abs(value) < 1e4 else f"{value:.0f}"


LOWER_IS_BETTER = {"ppl_increase_pct", "ppl", "kl", "nll"}


def curkv_summary(results: dict) -> list[str]:
    """Markdown lines: per task and ratio, the trained scorer's main metric against the best other method.

    Every compressing method other than ``curkv`` counts as a baseline, kvpress's own presses included.
    """
    rows = results["rows"]
    if not any(row["method"] == CURKV for row in rows):
        return []
    table = _lookup(rows)
    baselines = [name for name in _methods(rows) if name not in (FULL, CURKV)]
    lines = ["## Summary: curkv against the best baseline", "",
             "| task | metric | ratio | curkv | best baseline | verdict |", "|---|---|---|---|---|---|"]
    for task, main in results["main_metric"].items():
        better = min if main in LOWER_IS_BETTER else max
        for ratio in _ratios(rows):
            ours = _metric(table, CURKV, ratio, task, main)
            scored = [(value, name) for name in baselines
                      if (value := _metric(table, name, ratio, task, main)) is not None]
            if ours is None or not scored:
                continue
            best_value, best_name = better(scored)
            verdict = "wins" if better(ours, best_value) == ours and ours != best_value else (
                "ties" if ours == best_value else "loses")
            lines.append(f"| {task} | {main} | {ratio:g} | {_cell(ours, main)} | {best_name} {_cell(best_value, main)} "
                         f"| {verdict} |")
    return lines + [""]


def results_markdown(results: dict, config: dict) -> str:
    """Per task, a table per metric (method × compression ratio), then the budget each method had."""
    rows = results["rows"]
    table = _lookup(rows)
    ratios, methods = _ratios(rows), _methods(rows)
    lines = ["# KV-cache compression evaluation", "",
             f"Base `{config.get('base')}`, scorer `{config.get('scorer')}`, context {config.get('context_length')} + "
             f"continuation {config.get('continuation_length')} tokens, {config.get('examples')} examples per task, "
             f"sinks {config.get('n_sink')}, window {config.get('window')}, seed {config.get('seed')}.",
             "Columns are compression ratios (kvpress convention: 0.7 drops 70 % of the compressible tokens); "
             "`full` is the uncompressed cache. Our methods keep sinks + window + ⌈(1 − ratio)·n⌉ compressible "
             "tokens per (layer, KV head); `kvpress:*` rows keep int(n·(1 − r)) of all tokens with r "
             f"{'matched to our budget' if config.get('kvpress_budget') == 'matched' else 'as given'} — "
             "the budget tables give the tokens and bytes each method actually held.", ""]
    lines += curkv_summary(results)
    header = "| method | " + " | ".join(f"{ratio:g}" for ratio in ratios) + " |"
    rule = "|---|" + "---|" * len(ratios)
    for task, main in results["main_metric"].items():
        lines += [f"## {task}", ""]
        for name in task_metrics(rows, task, main) + ["kept_tokens", "kv_bytes"]:
            lines += [f"**{name}**", "", header, rule]
            for method in methods:
                cells = [_cell(_metric(table, method, ratio, task, name), name) for ratio in ratios]
                lines.append(f"| {method} | " + " | ".join(cells) + " |")
            lines.append("")
    seconds = ", ".join(f"{task} {value:.1f} s" for task, value in results["seconds_per_example"].items())
    lines += [f"Wall time per example (all methods and ratios): {seconds}.", ""]
    return "\n".join(lines)


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.=-]+", "_", text)


def plot_pngs(results: dict) -> dict[str, bytes]:
    """PNG bytes by file name ``<task>__<metric>.png``: metric vs compression ratio, a line per method."""
    import io

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = results["rows"]
    table = _lookup(rows)
    ratios, methods = _ratios(rows), _methods(rows)
    pngs = {}
    for task, main in results["main_metric"].items():
        for name in task_metrics(rows, task, main) + ["kept_tokens", "kv_bytes"]:
            figure, axes = plt.subplots(figsize=(6, 4))
            for method in methods:
                if method == FULL:
                    value = _metric(table, FULL, 0.0, task, name)
                    if value is not None and math.isfinite(value):
                        axes.axhline(value, color="black", linestyle="--", linewidth=1, label=FULL)
                    continue
                points = [(ratio, _metric(table, method, ratio, task, name)) for ratio in ratios]
                points = [(x, y) for x, y in points if y is not None and math.isfinite(y)]
                if points:
                    style = ":" if method.startswith("kvpress:") else "-"
                    axes.plot(*zip(*points), style, marker="o", label=method)
            axes.set_xlabel("compression ratio")
            axes.set_ylabel(name)
            axes.set_title(f"{task}: {name}")
            axes.grid(alpha=0.3)
            axes.legend(fontsize=7, ncol=2)
            figure.tight_layout()
            buffer = io.BytesIO()
            figure.savefig(buffer, format="png", dpi=100)
            plt.close(figure)
            pngs[f"{_slug(task)}__{_slug(name)}.png"] = buffer.getvalue()
    return pngs


def write_tensorboard(folder: Path, results: dict) -> None:
    """Scalars ``<task>/<metric>`` at step = round(100 · ratio), one TensorBoard run per method.

    Written to a temporary sibling folder and swapped in whole.
    """
    from torch.utils.tensorboard import SummaryWriter

    ratios = _ratios(results["rows"])
    by_method: dict[str, list[dict]] = {}
    for row in results["rows"]:
        by_method.setdefault(row["method"], []).append(row)
    with atomic_folder(folder) as staging:
        for method, rows in by_method.items():
            writer = SummaryWriter(log_dir=str(staging / _slug(method)))
            for row in rows:
                steps = ratios if method == FULL else [row["ratio"]]
                for name, value in row["metrics"].items():
                    if value is not None and math.isfinite(value):
                        for ratio in steps:
                            writer.add_scalar(f"{row['task']}/{name}", value, global_step=round(100 * ratio))
            writer.close()


def write_run(run_dir: str | Path, results: dict, config: dict) -> Path:
    """Write results.json, results.md, plots/*.png and tensorboard/ under ``run_dir``; returns it."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    write_atomic(run_dir / "results.json", results_json(results, config))
    write_atomic(run_dir / "results.md", results_markdown(results, config))
    for name, png in plot_pngs(results).items():
        write_atomic(run_dir / "plots" / name, png)
    write_tensorboard(run_dir / "tensorboard", results)
    return run_dir
