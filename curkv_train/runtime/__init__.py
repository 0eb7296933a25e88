"""Runtime: load exported scorers, compress a transformers cache with them, or use them as a kvpress press.

``CurKVPress`` needs the optional ``kvpress`` package and is imported on first use.
"""

from __future__ import annotations

from typing import Any

from curkv_train.core.errors import CurKVError
from curkv_train.runtime.allocation import LayerBudget
from curkv_train.runtime.cache import CurKVCache
from curkv_train.runtime.cache_config import ComputeConfig, TierConfig
from curkv_train.runtime.scorer import Scorer
from curkv_train.runtime.serialization import load_base_for, load_scorer, model_fingerprint, save_scorer

__all__ = ["ComputeConfig", "CurKVCache", "CurKVError", "CurKVPress", "LayerBudget", "Scorer", "TierConfig",
           "load_base_for", "load_scorer", "model_fingerprint", "save_scorer"]


def __getattr__(name: str) -> Any:
    """Import ``CurKVPress`` lazily so this package imports without kvpress."""
    if name == "CurKVPress":
        try:
            from curkv_train.runtime.press import CurKVPress
        except ImportError as error:
            raise ImportError(f"CurKVPress needs kvpress: pip install 'curkv-train[kvpress]' ({error})") from error
        return CurKVPress
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
