"""A run directory: results.json, results.md, one PNG per task metric, TensorBoard scalars.

results.md opens with curkv against the best baseline (paired bootstrap verdicts), then
per task one method × compression-ratio table per quality metric with "value [low, high]"
cells (95 % bootstrap intervals over examples), then the budget tables (kept tokens, bytes
held, prefill time), then the streaming task (:mod:`curkv_train.eval.streaming`): per
document kind, method × memory-setting tables of the perplexity increase and the bytes held,
and a plot of quality against bytes held. Every file is written to a temporary name in the same folder and
renamed into place, so a reader never sees a half-written result (the TensorBoard folder is
swapped whole).
"""

from __future__ import annotations

import inspect
import json
import math
import re
import statistics
from pathlib import Path

from curkv_train.core.atomic import atomic_folder, write_atomic
from curkv_train.eval.aggregate import BUDGET_METRICS
from curkv_train.eval.figures import figure_png, finite, signed
from curkv_train.eval.methods import CURKV, CURKV_CACHE, FULL
from curkv_train.eval.statistics import LOWER_IS_BETTER
from curkv_train.eval.streaming_report import streaming_markdown, streaming_pngs
from curkv_train.runtime.cache import CurKVCache

BUDGET_TABLES = ("kept_tokens", "kv_bytes", "prefill_seconds")
PRESS_PREFIX = "kvpress:"


def _json_value(value):
    """``value`` with NaN / inf (also inside lists and dicts) as None."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {key: _json_value(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_value(item) for item in value]
    return value


_NUMBER_LIST = re.compile(r"\[\s*((?:-?[\d.eE+-]+|null)(?:,\s*(?:-?[\d.eE+-]+|null))*)\s*\]")


def results_json(results: dict, config: dict) -> str:
    """The results and the configuration that produced them as JSON (NaN / inf -> null, number lists on one line)."""
    payload = {"config": config, **{key: value for key, value in results.items() if key != "rows"},
               "rows": results["rows"]}
    text = json.dumps(_json_value(payload), indent=2, sort_keys=False)
    return _NUMBER_LIST.sub(lambda match: "[" + ", ".join(match.group(1).split()).replace(",,", ",") + "]",
                            text) + "\n"


def _methods(rows: list[dict]) -> list[str]:
    names = list(dict.fromkeys(row["method"] for row in rows))
    return sorted(names, key=lambda name: (name != FULL, name.startswith(PRESS_PREFIX), names.index(name)))


def _ratios(rows: list[dict]) -> list[float]:
    return sorted({row["ratio"] for row in rows if row["method"] != FULL})


def _lookup(rows: list[dict]) -> dict[tuple[str, float, str], dict]:
    return {(row["method"], row["ratio"], row["task"]): row for row in rows}


def _row(table: dict, method: str, ratio: float, task: str) -> dict:
    """The row of (method, ratio, task); the full cache has one row for every ratio."""
    return table.get((FULL, 0.0, task) if method == FULL else (method, ratio, task), {})


def _metric(table: dict, method: str, ratio: float, task: str, name: str) -> float | None:
    return _row(table, method, ratio, task).get("metrics", {}).get(name)


def task_metrics(rows: list[dict], task: str, main: str) -> list[str]:
    """Quality metrics of ``task`` (main first, then the others, then breakdowns), budget excluded."""
    names = list(dict.fromkeys(name for row in rows if row["task"] == task for name in row["metrics"]))
    quality = [name for name in names if name not in BUDGET_METRICS]
    return sorted(quality, key=lambda name: (name != main, "@" in name, quality.index(name)))


def _number(value: float | None, name: str, digits: int = 4) -> str:
    if not finite(value):
        return "–"
    if name == "kv_bytes":
        return f"{value / 2**20:.2f} MiB"
    if name == "prefill_seconds":
        return f"{value:.3g} s"
    return f"{value:.{digits}g}" if abs(value) < 1e4 else f"{value:.0f}"


def _cell(value: float | None, name: str, interval: list | None = None) -> str:
    """``value [low, high]`` (or the value alone without an interval); bounds to 3 significant digits."""
    text = _number(value, name)
    if interval and finite(value) and all(finite(bound) for bound in interval):
        text += f" [{_number(interval[0], name, 3)}, {_number(interval[1], name, 3)}]"
    return text


def curkv_summary(results: dict) -> list[str]:
    """Markdown lines: per task and ratio, the trained scorer against the best other method (results["summary"])."""
    entries = results.get("summary") or []
    if not entries:
        return []
    ours = entries[0].get("method", CURKV)
    lines = [f"## Summary: {ours} against the best baseline", "",
             f"| task | metric | ratio | {ours} | best baseline | {ours} − best | verdict |",
             "|---|---|---|---|---|---|---|"]
    for entry in entries:
        name = entry["metric"]
        difference = entry["difference_interval"]
        delta = signed(entry["difference"]) + (f" [{signed(difference[0])}, {signed(difference[1])}]"
                                                if all(finite(bound) for bound in difference) else "")
        lines.append(f"| {entry['task']} | {name}{' (lower is better)' if name in LOWER_IS_BETTER else ''} "
                     f"| {entry['ratio']:g} | {_cell(entry[ours], name, entry.get(f'{ours}_interval'))} "
                     f"| {entry['baseline']} {_cell(entry['baseline_value'], name, entry.get('baseline_interval'))} "
                     f"| {delta} | {entry['verdict']} |")
    bootstrap = results.get("bootstrap", {})
    confidence = 100 * bootstrap.get("confidence", 0.95)
    lines += ["", f"Every single-pass compressing method but the scorers' own rows is a candidate baseline "
              f"(kvpress's presses included; KVzip, which reconstructs the context in further passes, is reported "
              f"in the tables but is not a candidate); the best is the best point estimate. \"wins\" / \"loses\": the paired {confidence:g} % "
              f"bootstrap interval of {ours} − best (the same examples resampled for both, "
              f"{bootstrap.get('resamples', '?')} resamples) excludes 0 in curkv's favour / against it; otherwise a "
              "tie within noise.", ""]
    return lines


def _resampling_units(rows: list[dict]) -> str:
    """The sentence naming each task whose examples are drawn by group (its held-out documents), or ""."""
    units = {row["task"]: (len(set(row["example_groups"])), len(row["example_groups"]))
             for row in rows if row.get("example_groups")}
    if not units:
        return ""
    counts = ", ".join(f"{task} {groups} for {examples} examples" for task, (groups, examples) in units.items())
    return (f" Perplexity examples are drawn by held-out document, every example of a document together "
            f"(documents: {counts}).")


def _notes(results: dict, config: dict) -> list[str]:
    """What the tables cannot say: data split, intervals, masked presses, prefill costs."""
    bootstrap = results.get("bootstrap", {})
    lines = [f"Intervals: {100 * bootstrap.get('confidence', 0.95):g} % percentile bootstrap over examples "
             f"({bootstrap.get('resamples', '?')} resamples, seed {bootstrap.get('seed', '?')}); each resample "
             "recomputes the metric from its examples' sums (perplexity: the ratio of summed NLLs over summed "
             "tokens, against the full cache's on the same examples)." + _resampling_units(results["rows"])]
    data = config.get("data") or {}
    for name, stream in (data.get("streams") or {}).items():
        parts = [_stream_part(part) for part in stream.get("parts") or [stream]]
        lines.append(f"Held-out {name}: " + "; then ".join(parts) + "."
                     + (f" Not checked against (unreadable here): {', '.join(stream['unchecked'])}."
                        if stream.get("unchecked") else ""))
    scorers = config.get("scorers") or {}
    if len(scorers) > 1 or any(not entry.get("trained", True) for entry in scorers.values()):
        lines.append("Scorers: " + "; ".join(
            f"`{name}` {entry['source']} ({entry['family']}{'' if entry.get('trained', True) else ', untrained'}, "
            f"sinks {entry['n_sink']}, window {entry['window']})" for name, entry in scorers.items())
            + ". The summary's verdict is about the first; the others' rows are not candidate baselines.")
    if any(row["method"].startswith(CURKV_CACHE) for row in results["rows"]):
        defaults = inspect.signature(CurKVCache).parameters
        lines.append(f"`{CURKV_CACHE}` rows run the scorer through the runtime `CurKVCache` at its defaults: the "
                     "context prefilled into the cache at the column's keep ratio, then the continuation fed a window "
                     "at a time through the same cache, which keeps compressing as during generation. Its sinks and "
                     f"hot tier ({defaults['hot_windows'].default} windows) count inside the ratio (ρ of the tokens "
                     "seen, where the bare selection keeps ρ of the compressible ones besides sinks and window), the "
                     f"newest tokens wait uncompressed for up to {defaults['compress_every'].default} windows, and its "
                     "bytes include the observation (window queries and query moments per layer, a fixed cost that "
                     "does not grow with the context): it holds a different number of tokens than the bare selection "
                     "at the same ratio; read the budget tables.")
    masked = results.get("masked_methods") or []
    if masked:
        lines.append(f"{', '.join(f'`{name}`' for name in masked)} mask evicted keys instead of dropping them "
                     "(kvpress's head-wise \"fake compression\"): kept_tokens counts the keys the continuation can "
                     "attend to, but their memory is not freed (kv_bytes: what they hold, the full cache).")
    lines += _prefill_note(results["rows"])
    return [line for text in lines for line in (text, "")]


def _stream_part(stream: dict) -> str:
    """One held-out source of a stream, in words."""
    split = ("every document (no training source reads them)" if stream.get("origin") == "never trained" else
             f"the validation split at val_fraction {stream['val_fraction']:g} ({stream['origin']})")
    return (f"`{stream['kind']}` documents, {split}, {stream['documents']} documents, {stream['removed_tokens']} of "
            f"{stream['validation_tokens']} tokens cut for sharing a {stream['span']}-token span with the recipe's "
            f"training split, {stream['pieces']} pieces left")


def _prefill_note(rows: list[dict]) -> list[str]:
    """Each kvpress press's prefill time against the plain prefill of the same examples (same run, same machine).

    Medians over examples (and tasks and ratios) of the per-example times and of the per-example
    ratio to the plain prefill, so a stall of the machine during one example does not decide it.
    """
    plain = {row["task"]: row.get("example_sums", {}).get("prefill_seconds") or [] for row in rows
             if row["method"] == FULL}
    seconds: dict[str, list[float]] = {}
    ratios: dict[str, list[float]] = {}
    for row in rows:
        if not row["method"].startswith(PRESS_PREFIX):
            continue
        for index, value in enumerate(row.get("example_sums", {}).get("prefill_seconds") or []):
            reference = plain.get(row["task"], [])
            if finite(value) and index < len(reference) and finite(reference[index]) and reference[index] > 0:
                seconds.setdefault(row["method"], []).append(value)
                ratios.setdefault(row["method"], []).append(value / reference[index])
    everything = [value for values in plain.values() for value in values if finite(value)]
    if not seconds or not everything:
        return []
    listed = ", ".join(f"`{name}` {statistics.median(seconds[name]):.3g} s ({statistics.median(ratios[name]):.1f}×)"
                       for name in sorted(ratios, key=lambda name: -statistics.median(ratios[name])))
    return [f"Prefill time per example (medians over examples, tasks and ratios; this machine): the plain prefill "
            f"{statistics.median(everything):.3g} s; {listed} (× the plain prefill of the same example). KVzip's "
            "includes its context reconstruction (a second pass over the whole context)."]


def _table(table: dict, methods: list[str], ratios: list[float], task: str, name: str,
           with_intervals: bool) -> list[str]:
    """A method × ratio table of metric ``name`` of ``task``."""
    title = f"**{name}**" + (" (lower is better)" if name in LOWER_IS_BETTER else "")
    lines = [title, "", "| method | " + " | ".join(f"{ratio:g}" for ratio in ratios) + " |",
             "|---|" + "---|" * len(ratios)]
    for method in methods:
        cells = []
        for ratio in ratios:
            row = _row(table, method, ratio, task)
            interval = row.get("intervals", {}).get(name) if with_intervals else None
            cells.append(_cell(row.get("metrics", {}).get(name), name, interval))
        if any(cell != "–" for cell in cells):
            lines.append(f"| {method} | " + " | ".join(cells) + " |")
    return lines + [""]


def results_markdown(results: dict, config: dict) -> str:
    """The summary first; per task, a table per quality metric (method × ratio, "value [low, high]"), then budgets."""
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
    if not rows and results.get("streaming"):  # the streaming task alone
        lines = ["# KV-cache compression evaluation", "",
                 f"Base `{config.get('base')}`, scorer `{config.get('scorer')}`, seed {config.get('seed')}.", ""]
    lines += curkv_summary(results)
    lines += _notes(results, config) if rows else []
    for task, main in results["main_metric"].items():
        lines += [f"## {task}", ""]
        for name in task_metrics(rows, task, main):
            lines += _table(table, methods, ratios, task, name, with_intervals="@" not in name)
        for name in BUDGET_TABLES:
            if any(finite(row["metrics"].get(name)) for row in rows if row["task"] == task):
                lines += _table(table, methods, ratios, task, name, with_intervals=False)
    seconds = ", ".join(f"{task} {value:.1f} s" for task, value in results["seconds_per_example"].items())
    if seconds:
        lines += [f"Wall time per example (all methods and ratios): {seconds}.", ""]
    if results.get("streaming"):
        lines += streaming_markdown(results["streaming"])
    return "\n".join(lines)


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.=-]+", "_", text)


def plot_pngs(results: dict) -> dict[str, bytes]:
    """PNG bytes by file name ``<task>__<metric>.png``: metric vs compression ratio, a line per method
    (error bars: the bootstrap intervals)."""
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
                points = [(ratio, _metric(table, method, ratio, task, name),
                           _row(table, method, ratio, task).get("intervals", {}).get(name)) for ratio in ratios]
                points = [(x, y, bounds) for x, y, bounds in points if finite(y)]
                if points:
                    errors = [[y - bounds[0], bounds[1] - y] if bounds and all(map(finite, bounds)) else [0.0, 0.0]
                              for _, y, bounds in points]
                    style = ":" if method.startswith(PRESS_PREFIX) else "-"
                    axes.errorbar([x for x, _, _ in points], [y for _, y, _ in points],
                                  yerr=[[max(0.0, e[0]) for e in errors], [max(0.0, e[1]) for e in errors]],
                                  fmt=style, marker="o", capsize=2, label=method)
            pngs[f"{_slug(task)}__{_slug(name)}.png"] = figure_png(
                figure, axes, xlabel="compression ratio", ylabel=name, title=f"{task}: {name}")
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
    pngs = plot_pngs(results)
    if results.get("streaming"):
        pngs.update(streaming_pngs(results["streaming"]))
    with atomic_folder(run_dir / "plots") as staging:  # swapped in whole: no plot of an earlier run stays
        for name, png in pngs.items():
            (staging / name).write_bytes(png)
    write_tensorboard(run_dir / "tensorboard", results)
    return run_dir
