"""A run directory: results.json, results.md (the verdict, then per task a method × ratio table per metric, then
the streaming task), one PNG per task metric; every file written to a temporary name and renamed into place."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

from curkv_train.core.atomic import atomic_folder, write_atomic
from curkv_train.eval.statistics import BUDGET_METRICS
from curkv_train.eval.figures import errorbar_png, finite, method_table, ordered_methods, signed_interval
from curkv_train.eval.methods import CURKV, CURKV_CACHE, FULL
from curkv_train.eval.statistics import LOWER_IS_BETTER
from curkv_train.eval.streaming_report import streaming_markdown, streaming_pngs
from curkv_train.runtime.cache_config import TierConfig

BUDGET_TABLES = ("kept_tokens", "kv_bytes", "prefill_seconds")


SAME_ALLOCATION = "summary_same_allocation"  # results.json: the scorer against the rules at its allocation

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


def _ratios(rows: list[dict]) -> list[float]:
    return sorted({row["ratio"] for row in rows if row["method"] != FULL})


def _lookup(rows: list[dict]) -> dict[tuple[str, float, str], dict]:
    return {(row["method"], row["ratio"], row["task"]): row for row in rows}


def _row(table: dict, method: str, ratio: float, task: str) -> dict:
    """The row of (method, ratio, task); the full cache has one row for every ratio."""
    return table.get((FULL, 0.0, task) if method == FULL else (method, ratio, task), {})


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


def curkv_summary(results: dict, key: str = "summary") -> list[str]:
    """Markdown lines: per task and ratio, the trained scorer against the best other method (``results[key]``:
    ``summary``, system against system; ``summary_same_allocation``, against the rules at its allocation)."""
    entries = results.get(key) or []
    if not entries:
        return []
    ours = entries[0].get("method", CURKV)
    same = key == SAME_ALLOCATION
    title = ("against the rules at its allocation (the same tokens in every layer and KV head)" if same
             else "against the best baseline, system against system")
    candidates = ("The candidates are the `same:<rule>` rows: each rule choosing the tokens within the scorer's "
                  "per-(layer, KV head) counts" if same else
                  "Every compressing row but the scorers' own and the `same:<rule>` rows (which borrow the scorer's "
                  "allocation) is a candidate baseline")
    lines = [f"## Summary: {ours} {title}", "",
             f"| task | metric | ratio | {ours} | best baseline | {ours} − best | full − best | verdict |",
             "|---|---|---|---|---|---|---|---|"]
    for entry in entries:
        name = entry["metric"]
        ceiling = entry.get("full_minus_best")
        lines.append(f"| {entry['task']} | {name}{' (lower is better)' if name in LOWER_IS_BETTER else ''} "
                     f"| {entry['ratio']:g} | {_cell(entry[ours], name, entry.get(f'{ours}_interval'))} "
                     f"| {entry['baseline']} {_cell(entry['baseline_value'], name, entry.get('baseline_interval'))} "
                     f"| {signed_interval(entry['difference'], entry['difference_interval'])} "
                     f"| {signed_interval(ceiling[0], ceiling[1:]) if ceiling else '–'} | {entry['verdict']} |")
    bootstrap = results.get("bootstrap", {})
    return lines + ["", f"{candidates}; the best is the best "
                    f"point estimate. \"wins\" / \"loses\": the paired {100 * bootstrap.get('confidence', 0.95):g} % "
                    "bootstrap interval "
                    f"of {ours} − best (the same examples resampled for both, {bootstrap.get('resamples', '?')} "
                    "resamples) excludes 0 in its favour / against it; otherwise a tie within noise. \"full − best\": "
                    "the uncompressed cache against the same baseline, paired; where it does not win either, no "
                    "choice of tokens could have, and the tie says so.", ""]


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
    """What the tables cannot say: data split, intervals, scorers, the runtime-cache rows."""
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
        defaults = TierConfig()
        lines.append(f"`{CURKV_CACHE}` rows run the scorer through the runtime `CurKVCache` at its defaults: the "
                     "context prefilled into it at the column's keep ratio, the continuation fed a window at a time, "
                     f"the cache compressing as during generation. Its sinks and hot tier ({defaults.hot_windows} "
                     "windows) count inside the ratio (ρ of the tokens seen, where the presses keep ρ of the "
                     f"compressible ones besides sinks and window), the newest tokens wait for up to "
                     f"{defaults.compress_every} windows and its bytes include the observation: it holds other counts "
                     "than the presses at the same ratio; read the budget tables.")
    return [line for text in lines for line in (text, "")]


def _stream_part(stream: dict) -> str:
    """One held-out source of a stream, in words."""
    split = ("every document (no training source reads them)" if stream.get("origin") == "never trained" else
             f"the validation split at val_fraction {stream['val_fraction']:g} ({stream['origin']})")
    return (f"`{stream['kind']}` documents, {split}, {stream['documents']} documents, {stream['removed_tokens']} of "
            f"{stream['validation_tokens']} tokens cut for sharing a {stream['span']}-token span with the recipe's "
            f"training split, {stream['pieces']} pieces left")


def _table(table: dict, methods: list[str], ratios: list[float], task: str, name: str,
           with_intervals: bool) -> list[str]:
    """A method × ratio table of metric ``name`` of ``task``."""
    def cell(method: str, column: str) -> str:
        row = _row(table, method, float(column), task)
        return _cell(row.get("metrics", {}).get(name), name,
                     row.get("intervals", {}).get(name) if with_intervals else None)

    title = f"**{name}**" + (" (lower is better)" if name in LOWER_IS_BETTER else "")
    return [title, ""] + method_table(methods, [f"{ratio:g}" for ratio in ratios], cell)


def results_markdown(results: dict, config: dict) -> str:
    """The summary first; per task, a table per quality metric (method × ratio, "value [low, high]"), then budgets."""
    rows = results["rows"]
    table = _lookup(rows)
    ratios, methods = _ratios(rows), ordered_methods(rows)
    lines = ["# KV-cache compression evaluation", "",
             f"Base `{config.get('base')}`, scorer `{config.get('scorer')}`, context {config.get('context_length')} + "
             f"continuation {config.get('continuation_length')} tokens, {config.get('examples')} examples per task, "
             f"sinks {config.get('n_sink')}, window {config.get('window')}, seed {config.get('seed')}.",
             "Columns are compression ratios (kvpress convention: 0.7 drops 70 % of the compressible tokens); "
             "`full` is the uncompressed cache. Every other row prefills the context under a kvpress press that "
             "keeps sinks + window + ⌈(1 − ratio)·n⌉ compressible tokens per (layer, KV head); `kvpress:*` rows "
             "(kvpress's presses as shipped) keep int(n·(1 − r)) of all tokens with r "
             f"{'matched to that count' if config.get('kvpress_budget') == 'matched' else 'as given'} — "
             "the budget tables give the tokens, bytes and prefill time of each row.", ""]
    if not rows and results.get("streaming"):  # the streaming task alone
        lines = ["# KV-cache compression evaluation", "",
                 f"Base `{config.get('base')}`, scorer `{config.get('scorer')}`, seed {config.get('seed')}.", ""]
    lines += curkv_summary(results) + curkv_summary(results, SAME_ALLOCATION)
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
    (error bars: the bootstrap intervals; the full cache a dashed line)."""
    rows = results["rows"]
    table = _lookup(rows)
    ratios, methods = _ratios(rows), [method for method in ordered_methods(rows) if method != FULL]
    pngs = {}
    for task, main in results["main_metric"].items():
        for name in task_metrics(rows, task, main) + ["kept_tokens", "kv_bytes"]:
            series = {method: [(ratio, _row(table, method, ratio, task).get("metrics", {}).get(name),
                                _row(table, method, ratio, task).get("intervals", {}).get(name)) for ratio in ratios]
                      for method in methods}
            pngs[f"{_slug(task)}__{_slug(name)}.png"] = errorbar_png(
                series, xlabel="compression ratio", ylabel=name, title=f"{task}: {name}",
                reference=_row(table, FULL, 0.0, task).get("metrics", {}).get(name))
    return pngs


def write_run(run_dir: str | Path, results: dict, config: dict) -> Path:
    """Write results.json, results.md and plots/*.png under ``run_dir``; returns it."""
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
    return run_dir
