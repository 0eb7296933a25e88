"""Estimator families by name: ``seed``, ``query_aware``, ``hidden`` (one interface, see EstimatorInputs)."""

from __future__ import annotations

from torch import nn

from curkv_train.core.shapes import KVShape
from curkv_train.core.errors import CurKVError
from curkv_train.models.seed_estimator import EstimatorInputs, ValueEstimator
from curkv_train.models.hidden_estimator import HiddenStateEstimator
from curkv_train.models.query_aware_estimator import QueryAwareEstimator

ESTIMATORS: dict[str, type[nn.Module]] = {
    "seed": ValueEstimator,
    "query_aware": QueryAwareEstimator,
    "hidden": HiddenStateEstimator,
}
FAMILIES = tuple(ESTIMATORS)
# scorer.json "estimator.class" -> family, for scorers that record a class but no family
CLASS_FAMILIES = {cls.__name__: family for family, cls in ESTIMATORS.items()}


def check_family(family: str) -> str:
    """``family`` if it names an estimator family, else a one-line CurKVError."""
    if family not in ESTIMATORS:
        raise CurKVError(f"unknown estimator family {family!r}; expected one of {', '.join(FAMILIES)}")
    return family


def build_estimator(family: str, shape: KVShape, **options) -> nn.Module:
    """A fresh estimator of ``family`` for a base model of ``shape``.

    Args:
        family: seed, query_aware or hidden.
        shape: the base model's attention shapes.
        options: the family's other constructor arguments (unknown ones are an error).
    """
    cls = ESTIMATORS[check_family(family)]
    sizes = {"num_layers": shape.num_layers, "num_kv_heads": shape.num_kv_heads, "head_dim": shape.head_dim}
    if family == "hidden":
        sizes["hidden_size"] = shape.hidden_size
    else:
        sizes["max_positions"] = shape.max_positions or 8192
    try:
        return cls(**sizes, **options)
    except TypeError as error:
        raise CurKVError(f"estimator family {family!r} does not take these options: {error}") from None


__all__ = ["CLASS_FAMILIES", "ESTIMATORS", "EstimatorInputs", "FAMILIES", "build_estimator", "check_family"]
