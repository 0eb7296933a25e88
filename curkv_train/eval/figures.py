"""What the two report modules share: number checks and formatting, row order, method tables, error-bar plots."""

from __future__ import annotations

import io
import math
from collections.abc import Callable

FULL = "full"
PRESS_PREFIX = "kvpress:"


def finite(value) -> bool:
    """True for an int or float that is neither NaN nor infinite."""
    return isinstance(value, (int, float)) and math.isfinite(value)


def signed(value: float) -> str:
    """``value`` with its sign, 3 significant digits."""
    return f"{value:+.3g}"


def signed_interval(point: float, interval) -> str:
    """``+0.12 [-0.03, +0.25]``: a paired difference and its (low, high) interval; the point alone if a bound is
    missing or not finite."""
    return signed(point) + (f" [{signed(interval[0])}, {signed(interval[1])}]"
                            if all(finite(bound) for bound in interval) else "")


def ordered_methods(rows: list[dict]) -> list[str]:
    """The rows' method names: ``full`` first, kvpress's presses as shipped (``kvpress:...``) last."""
    names = list(dict.fromkeys(row["method"] for row in rows))
    return sorted(names, key=lambda name: (name != FULL, name.startswith(PRESS_PREFIX), names.index(name)))


def method_table(methods: list[str], columns: list[str], cell: Callable[[str, str], str]) -> list[str]:
    """Markdown lines of a method × column table of ``cell(method, column)``; rows of "–" only left out."""
    lines = ["| method | " + " | ".join(columns) + " |", "|---|" + "---|" * len(columns)]
    for method in methods:
        cells = [cell(method, column) for column in columns]
        if any(text != "–" for text in cells):
            lines.append(f"| {method} | " + " | ".join(cells) + " |")
    return lines + [""]


def errorbar_png(series: dict[str, list[tuple[float, float, list | None]]], *, xlabel: str, ylabel: str, title: str,
                 reference: float | None = None) -> bytes:
    """PNG bytes (100 dpi) of a line per method through its (x, y, [low, high] or None) points, with error bars;
    kvpress's presses dotted; ``reference``: a dashed horizontal line labelled ``full``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(6.5, 4.5))
    if finite(reference):
        axes.axhline(reference, color="black", linestyle="--", linewidth=1, label=FULL)
    for method, points in series.items():
        points = sorted((point for point in points if finite(point[1])), key=lambda point: point[0])
        if points:
            bars = [[max(0.0, y - b[0]), max(0.0, b[1] - y)] if b and all(map(finite, b)) else [0.0, 0.0]
                    for _, y, b in points]
            axes.errorbar([x for x, _, _ in points], [y for _, y, _ in points], yerr=list(zip(*bars)),
                          fmt=":" if method.startswith(PRESS_PREFIX) else "-", marker="o", capsize=2, label=method)
    axes.set(xlabel=xlabel, ylabel=ylabel, title=title)
    axes.grid(alpha=0.3)
    axes.legend(fontsize=7, ncol=2)
    figure.tight_layout()
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=100)
    plt.close(figure)
    return buffer.getvalue()
