"""The streaming task in results.md and plots/: tables per document kind, quality against bytes held."""

from __future__ import annotations

from curkv_train.eval.figures import errorbar_png, finite, method_table, ordered_methods, signed_interval
from curkv_train.eval.stream_rows import FULL

MAIN = "ppl_increase_pct"


def _with_interval(row: dict | None, name: str, digits: str = ".3g") -> str:
    """``value [low, high]`` of metric ``name`` of ``row``, "–" without one."""
    value, interval = (row["metrics"].get(name), row["intervals"].get(name)) if row else (None, None)
    if not finite(value):
        return "–"
    text = f"{value:{digits}}"
    if interval and all(finite(bound) for bound in interval):
        text += f" [{interval[0]:.3g}, {interval[1]:.3g}]"
    return text


def _bytes_cell(row: dict | None) -> str:
    """``mean % (end %); tokens held at the end``."""
    if not row:
        return "–"
    metrics = row["metrics"]
    return f"{metrics['kv_bytes_pct']:.1f} ({metrics['kv_bytes_end_pct']:.1f}); {metrics['kept_tokens_end']:.0f}"


def _summary(streaming: dict) -> list[str]:
    entries = streaming.get("summary") or []
    if not entries:
        return []
    lines = ["| task | setting | scorer ΔPPL % | baseline | baseline ΔPPL % | scorer − baseline | verdict | "
             "bytes held % (scorer / baseline) |", "|---|---|---|---|---|---|---|---|"]
    for entry in entries:
        difference = signed_interval(entry["difference"], entry["difference_interval"])
        lines.append(f"| {entry['task']} | {entry['setting']} | {entry['method']} {entry['value']:.3g} | "
                     f"{'equal bytes: ' if entry['against'] == 'recency' else 'best: '}{entry['baseline']} | "
                     f"{entry['baseline_value']:.3g} | {difference} | {entry['verdict']} | "
                     f"{entry['bytes_pct']:.1f} / {entry['baseline_bytes_pct']:.1f} |")
    return lines + ["", "`recency` is the scorer's own cache with score = position (same tiers, selection and bytes): "
                        "the learned choice against keeping the newest tokens at equal bytes. The best is the best "
                        "point estimate among the other non-curkv methods. Verdicts read the paired bootstrap "
                        "interval over documents (lower ΔPPL is better).", ""]


def streaming_markdown(streaming: dict) -> list[str]:
    """Markdown lines of the streaming section."""
    rows = {(row["method"], row["setting"], row["task"]): row for row in streaming.get("rows", [])}
    methods, settings = ordered_methods(streaming.get("rows", [])), [s["label"] for s in streaming.get("settings", [])]
    bootstrap = streaming.get("bootstrap", {})
    lines = ["## Streaming", "",
             f"Long held-out documents of {streaming.get('length', '?')} tokens: the first {streaming['prefix']} "
             f"prefilled at once, the rest fed {streaming['chunk']} token(s) at a time through each cache, which "
             "re-compresses as it does at run time; the perplexity is over every token after the prefix. Columns "
             "are memory settings every compressing method runs at: compression ratios (keep ratio 1 − ratio) or "
             "fixed budgets (tokens per (layer, KV head), or bytes for the whole cache). Bytes held: "
             "`CurKVCache.nbytes()` (every tier, positions, observation) or the K/V tensors of a DynamicCache, after "
             "every step, as % of the full cache's (mean over the steps; at the end in parentheses). Intervals: "
             f"{100 * bootstrap.get('confidence', 0.95):g} % bootstrap over held-out files "
             f"({bootstrap.get('resamples', '?')} resamples; each file's {streaming['segment']}-token segments of "
             "scored tokens drawn together, over every document cut from it, since segments of one file are not "
             "independent): with few files the intervals are wide.", ""]
    if any(setting.get("max_tokens") or setting.get("max_bytes") for setting in streaming.get("settings", [])):
        lines += ["Under a fixed budget every cache runs at keep ratio 1.0, and the runtime CurKVCache forms its "
                  "cold tier only while its keep ratio is below 1: in the budget columns `curkv_cold` and "
                  "`curkv_compensated` hold what `curkv` holds.", ""]
    lines += _summary(streaming)
    for task, documents in streaming.get("documents", {}).items():
        def row(method: str, setting: str, task: str = task) -> dict | None:
            return rows.get((method, FULL if method == FULL else setting, task))

        lines += [f"### {task}", "", f"{len(documents)} documents: " + "; ".join(
            f"{number + 1}. {', '.join(f'`{source}`' for source in document['sources'])}"
            for number, document in enumerate(documents)) + ".", "",
            "**perplexity increase % vs full** (lower is better)", ""]
        lines += method_table(methods, settings, lambda method, setting: _with_interval(row(method, setting), MAIN))
        lines += ["**NLL per token** (nats)", ""]
        lines += method_table(methods, settings, lambda method, setting: _with_interval(row(method, setting), "nll",
                                                                                        ".4f"))
        lines += ["**bytes held, % of the full cache** (mean over steps (at the end); tokens held per (layer, KV "
                  "head) at the end)", ""]
        lines += method_table(methods, settings, lambda method, setting: _bytes_cell(row(method, setting)))
    seconds = streaming.get("seconds_per_document") or {}
    if seconds:
        lines += ["Wall time per document (every method and setting): "
                  + ", ".join(f"{task} {value:.1f} s" for task, value in seconds.items()) + ".", ""]
    return lines


def streaming_pngs(streaming: dict) -> dict[str, bytes]:
    """PNG bytes by file name ``streaming__<task>.png``: perplexity increase against bytes held (mean, % of
    full), a line per method through its settings (error bars: the bootstrap intervals)."""
    rows = streaming.get("rows", [])
    return {f"streaming__{task}.png": errorbar_png(
        {method: [(row["metrics"].get("kv_bytes_pct"), row["metrics"].get(MAIN), row["intervals"].get(MAIN))
                  for row in rows if row["task"] == task and row["method"] == method
                  and finite(row["metrics"].get("kv_bytes_pct"))] for method in ordered_methods(rows)},
        xlabel="bytes held, % of the full cache (mean over steps)", ylabel="perplexity increase % vs full",
        title=f"{task}: quality vs memory") for task in dict.fromkeys(row["task"] for row in rows)}
