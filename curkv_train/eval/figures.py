"""What the two report modules share: number checks and formatting, and a finished figure as PNG bytes."""

from __future__ import annotations

import io
import math


def finite(value) -> bool:
    """True for an int or float that is neither NaN nor infinite."""
    return isinstance(value, (int, float)) and math.isfinite(value)


def signed(value: float) -> str:
    """``value`` with its sign, 3 significant digits."""
    return f"{value:+.3g}"


def figure_png(figure, axes, *, xlabel: str, ylabel: str, title: str) -> bytes:
    """Label, grid and legend ``axes``, then the PNG bytes of ``figure`` (100 dpi); the figure is closed."""
    import matplotlib.pyplot as plt

    axes.set_xlabel(xlabel)
    axes.set_ylabel(ylabel)
    axes.set_title(title)
    axes.grid(alpha=0.3)
    axes.legend(fontsize=7, ncol=2)
    figure.tight_layout()
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=100)
    plt.close(figure)
    return buffer.getvalue()
