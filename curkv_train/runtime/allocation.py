"""Per-layer keep ratios: spend a cache's memory where losing tokens costs the most perplexity.

Compressing one decoder layer alone costs some layers far more than others (docs/runtime.md,
"Layer budget"; the shipped scorers' cards list their layers' sensitivities). A :class:`LayerBudget` holds each
layer's *sensitivity* s_l, the perplexity loss measured with that layer compressed alone
(``curkv-train calibrate``), and splits a mean keep ratio ρ across layers:

    evicted share e_l = min(1 − floor·ρ, λ / s_l^exponent),  with mean_l e_l = 1 − ρ

(λ by bisection). With a loss that grows like s_l·e_l^(1 + 1/exponent) in a layer's evicted
share, that split is the one of least total loss; exponent 1 is a quadratic loss, larger
exponents concentrate the memory on the most sensitive layers. Every layer keeps at least
floor·ρ, and the mean of the ratios is ρ, so the cache holds the same bytes as with one
ratio for every layer.
"""

from __future__ import annotations

import functools
import math
from dataclasses import asdict, dataclass

from curkv_train.core.errors import CurKVError

# below this a measured sensitivity counts as this (a layer whose loss did not move still gets a share)
LEAST_SENSITIVITY = 1e-4
BISECTION_STEPS = 60


@dataclass(frozen=True)
class LayerBudget:
    """How a mean keep ratio is split across decoder layers.

    Attributes:
        sensitivity: per layer, the perplexity loss (%) with that layer alone compressed (calibrated).
        exponent: how strongly memory follows sensitivity (0: every layer the same ratio).
        floor: least keep ratio of any layer, as a share of the mean ratio.
    """

    sensitivity: tuple[float, ...]
    exponent: float = 1.0
    floor: float = 0.4

    def __post_init__(self) -> None:
        if not self.sensitivity:
            raise CurKVError("a layer budget needs one sensitivity per decoder layer, got none")
        if not all(math.isfinite(value) for value in self.sensitivity):  # negative: a layer whose loss fell, kept
            raise CurKVError("a layer budget's sensitivities must be finite (perplexity losses in %), got "
                             f"{[value for value in self.sensitivity if not math.isfinite(value)]}")
        if not (math.isfinite(self.exponent) and self.exponent >= 0) or not 0.0 <= self.floor <= 1.0:
            raise CurKVError(f"a layer budget needs exponent >= 0 and floor in [0, 1], got exponent "
                             f"{self.exponent}, floor {self.floor}")

    @property
    def num_layers(self) -> int:
        """Decoder layers the budget covers."""
        return len(self.sensitivity)

    def ratios(self, ratio: float) -> tuple[float, ...]:
        """Per-layer keep ratios whose mean is ``ratio`` (each in [floor·ratio, 1]); not rounded: a ratio rounded up
        is a token more than ⌈ρ·n⌉ kept, over a token budget's cap."""
        return layer_keep_ratios(float(ratio), self.sensitivity, self.exponent, self.floor)

    def record(self) -> dict:
        """The budget as plain JSON values (scorer.json's ``layer_budget``)."""
        return {**asdict(self), "sensitivity": list(self.sensitivity)}

    @classmethod
    def from_record(cls, record: dict) -> "LayerBudget":
        """The budget :meth:`record` wrote (extra keys, such as how it was measured, are ignored)."""
        return cls(tuple(float(value) for value in record["sensitivity"]), float(record.get("exponent", 1.0)),
                   float(record.get("floor", 0.4)))


@functools.lru_cache(maxsize=256)
def layer_keep_ratios(ratio: float, sensitivity: tuple[float, ...], exponent: float, floor: float) -> tuple[float, ...]:
    """Keep ratios per layer, mean ``ratio``, evicting in inverse proportion to sensitivity^exponent (module doc)."""
    if ratio >= 1.0 or exponent == 0:
        return (ratio,) * len(sensitivity)
    weights = [1.0 / max(value, LEAST_SENSITIVITY) ** exponent for value in sensitivity]
    cap, evicted = 1.0 - floor * ratio, 1.0 - ratio
    low, high = 0.0, evicted / min(weights) + 1.0
    for _ in range(BISECTION_STEPS):
        scale = (low + high) / 2
        mean = sum(min(cap, scale * weight) for weight in weights) / len(weights)
        low, high = (scale, high) if mean < evicted else (low, scale)
    return tuple(1.0 - min(cap, low * weight) for weight in weights)


def check_layer_budget_choice(choice: object) -> None:
    """A one-line CurKVError unless ``choice`` is ``"scorer"``, ``"uniform"`` or a LayerBudget."""
    if not isinstance(choice, LayerBudget) and choice not in ("scorer", "uniform"):
        raise CurKVError(f"layer_budget must be 'scorer', 'uniform' or a LayerBudget, got {choice!r}")


def resolve_layer_budget(choice: str | LayerBudget, scorer) -> LayerBudget | None:
    """The layer budget ``choice`` names for ``scorer`` (a runtime Scorer): its calibrated one for
    ``"scorer"``, None (one ratio for every layer) for ``"uniform"`` or a scorer without one, or ``choice``
    itself; a one-line CurKVError for a bad choice or a budget of another layer count."""
    check_layer_budget_choice(choice)
    if choice == "uniform":
        return None
    budget = choice if isinstance(choice, LayerBudget) else scorer.layer_budget
    if budget is not None and budget.num_layers != scorer.estimator.num_layers:
        raise CurKVError(f"the layer budget covers {budget.num_layers} layers, the model has "
                         f"{scorer.estimator.num_layers}")
    return budget


@dataclass(frozen=True)
class ProbeBudget(LayerBudget):
    """A layer budget that compresses one layer (``layer``, to ``keep``) and keeps every other whole."""

    layer: int = 0
    keep: float = 0.3

    def ratios(self, ratio: float) -> tuple[float, ...]:
        """1.0 for every layer but ``layer``, whatever the mean ratio asked for."""
        return tuple(self.keep if index == self.layer else 1.0 for index in range(self.num_layers))
