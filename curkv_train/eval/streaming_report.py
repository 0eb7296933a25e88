"""The streaming task in results.md and plots/: tables per document kind, quality against bytes held."""

from __future__ import annotations


from curkv_train.eval.figures import figure_png, finite, signed
from curkv_train.eval.stream_rows import FULL, PRESS_PREFIX

MAIN = "ppl_increase_pct"


def _with_interval(value, interval, digits: str = ".3g") -> str:
    if not finite(value):
        return "–"
    text = f"{value:{digits}}"
    if interval and all(finite(bound) for bound in interval):
        text += f" [{interval[0]:.3g}, {interval[1]:.3g}]"
    return text


def _bytes_cell(metrics: dict) -> str:
    """``mean % (end %); tokens held at the end``."""
    return (f"{metrics['kv_bytes_pct']:.1f} ({metrics['kv_bytes_end_pct']:.1f}); "
            f"{metrics['kept_tokens_end']:.0f}")


def _methods(rows: list[dict]) -> list[str]:
    names = list(dict.fromkeys(row["method"] for row in rows))
    return sorted(names, key=lambda name: (name != FULL, name.startswith(PRESS_PREFIX), names.index(name)))


def _settings(streaming: dict) -> list[str]:
    return [setting["label"] for setting in streaming.get("settings", [])]


def _table(rows: dict, methods: list[str], settings: list[str], task: str, cell) -> list[str]:
    lines = ["| method | " + " | ".join(settings) + " |", "|---|" + "---|" * len(settings)]
    for method in methods:
        cells = [cell(rows.get((method, FULL if method == FULL else setting, task))) for setting in settings]
        if any(text != "–" for text in cells):
            lines.append(f"| {method} | " + " | ".join(cells) + " |")
    return lines + [""]


def _summary(streaming: dict) -> list[str]:
    entries = streaming.get("summary") or []
    if not entries:
        return []
    lines = ["| task | setting | scorer ΔPPL % | baseline | baseline ΔPPL % | scorer − baseline | verdict | "
             "bytes held % (scorer / baseline) |", "|---|---|---|---|---|---|---|---|"]
    for entry in entries:
        low, high = entry["difference_interval"]
        difference = signed(entry["difference"]) + (f" [{signed(low)}, {signed(high)}]"
                                                     if finite(low) and finite(high) else "")
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
    methods, settings = _methods(streaming.get("rows", [])), _settings(streaming)
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
    for method, reason in (streaming.get("skipped") or {}).items():
        lines += [f"`{method}` did not run: {reason}.", ""]
    for task, documents in streaming.get("documents", {}).items():
        lines += [f"### {task}", "", f"{len(documents)} documents: " + "; ".join(
            f"{number + 1}. {', '.join(f'`{source}`' for source in document['sources'])}"
            for number, document in enumerate(documents)) + ".", "",
            "**perplexity increase % vs full** (lower is better)", ""]
        lines += _table(rows, methods, settings, task,
                        lambda row: _with_interval(row["metrics"].get(MAIN), row["intervals"].get(MAIN))
                        if row else "–")
        lines += ["**NLL per token** (nats)", ""]
        lines += _table(rows, methods, settings, task,
                        lambda row: _with_interval(row["metrics"].get("nll"), row["intervals"].get("nll"), ".4f")
                        if row else "–")
        lines += ["**bytes held, % of the full cache** (mean over steps (at the end); tokens held per (layer, KV "
                  "head) at the end)", ""]
        lines += _table(rows, methods, settings, task,
                        lambda row: _bytes_cell(row["metrics"]) if row else "–")
    seconds = streaming.get("seconds_per_document") or {}
    if seconds:
        lines += ["Wall time per document (every method and setting): "
                  + ", ".join(f"{task} {value:.1f} s" for task, value in seconds.items()) + ".", ""]
    return lines


def streaming_pngs(streaming: dict) -> dict[str, bytes]:
    """PNG bytes by file name ``streaming__<task>.png``: perplexity increase against bytes held (mean, % of
    full), a line per method through its settings (error bars: the bootstrap intervals)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pngs = {}
    all_rows = streaming.get("rows", [])
    for task in dict.fromkeys(row["task"] for row in all_rows):
        figure, axes = plt.subplots(figsize=(6.5, 4.5))
        for method in _methods(all_rows):
            points = sorted((row["metrics"]["kv_bytes_pct"], row["metrics"][MAIN], row["intervals"].get(MAIN))
                            for row in all_rows if row["task"] == task and row["method"] == method
                            and finite(row["metrics"].get(MAIN)) and finite(row["metrics"].get("kv_bytes_pct")))
            if not points:
                continue
            errors = [[max(0.0, y - b[0]), max(0.0, b[1] - y)] if b and all(map(finite, b)) else [0.0, 0.0]
                      for _, y, b in points]
            axes.errorbar([x for x, _, _ in points], [y for _, y, _ in points],
                          yerr=[[e[0] for e in errors], [e[1] for e in errors]],
                          fmt=":" if method.startswith(PRESS_PREFIX) else "-", marker="o", capsize=2, label=method)
        pngs[f"streaming__{task}.png"] = figure_png(
            figure, axes, xlabel="bytes held, % of the full cache (mean over steps)",
            ylabel="perplexity increase % vs full", title=f"{task}: quality vs memory")
    return pngs
