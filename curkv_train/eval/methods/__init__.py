"""Every evaluated method as a score function ``(ctx: LayerContext) -> (batch, kv_heads, tokens)``.

The selection (:func:`curkv_train.core.selection.select_kept`) and compaction are
shared, so methods differ in their scores only. ``full`` is the uncompressed
reference and has no score function. ``curkv_cache`` is not a score function either: the
harness runs the trained scorer through the runtime :class:`~curkv_train.runtime.CurKVCache`
(its tiers, re-compressing during the continuation) and reports it next to the bare selection.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from curkv_train.core.errors import CurKVError
from curkv_train.eval.context import LayerContext
from curkv_train.eval.methods.curdkv_score import CurDKVScore
from curkv_train.eval.methods.curkv_score import CurKVScore
from curkv_train.eval.methods.expected_attention_score import ExpectedAttentionScore
from curkv_train.eval.methods.h2o_score import H2OScore
from curkv_train.eval.methods.knorm_score import KNormScore
from curkv_train.eval.methods.random_score import RandomScore
from curkv_train.eval.methods.snapkv_score import SnapKVScore
from curkv_train.eval.methods.streaming_llm_score import StreamingLLMScore
from curkv_train.eval.methods.tova_score import TOVAScore
from curkv_train.runtime.scorer import Scorer

ScoreFunction = Callable[[LayerContext], torch.Tensor]

# name -> factory(n_sink, window): hyper-parameters that have a counterpart in the selection are aligned with it
_FACTORIES: dict[str, Callable[[int, int], ScoreFunction]] = {
    "random": lambda n_sink, window: RandomScore(),
    "streaming_llm": lambda n_sink, window: StreamingLLMScore(),
    "h2o": lambda n_sink, window: H2OScore(),
    "snapkv": lambda n_sink, window: SnapKVScore(window_size=max(1, window)),
    "tova": lambda n_sink, window: TOVAScore(),
    "knorm": lambda n_sink, window: KNormScore(),
    "curdkv": lambda n_sink, window: CurDKVScore(),
    "expected_attention": lambda n_sink, window: ExpectedAttentionScore(n_sink=n_sink),
}
FULL = "full"
CURKV = "curkv"
CURKV_CACHE = "curkv_cache"
# a budgeted scorer's bare selection again with one keep ratio for every layer (added beside ``curkv``)
CURKV_UNIFORM = "curkv_uniform"
BASELINES = tuple(_FACTORIES)
METHODS = (FULL, *BASELINES, CURKV, CURKV_CACHE)
# methods that need a trained scorer; with several scorers each gets its rows (``curkv:LABEL``, ...)
SCORER_METHODS = (CURKV, CURKV_CACHE)


def baseline(name: str, *, n_sink: int = 4, window: int = 64) -> ScoreFunction:
    """The score function of baseline ``name`` (SnapKV observes the last ``window`` queries,
    ExpectedAttention leaves the ``n_sink`` sinks out of its statistics)."""
    if name not in _FACTORIES:
        raise CurKVError(f"unknown method {name!r}; valid methods: {', '.join(METHODS)}")
    return _FACTORIES[name](n_sink, window)


def check_methods(names: list[str], has_scorer: bool) -> list[str]:
    """``names`` without duplicates, or a CurKVError for an unknown name or a scorer method without a scorer."""
    unknown = [name for name in names if name not in METHODS]
    if unknown:
        raise CurKVError(f"unknown method(s) {', '.join(map(repr, unknown))}; valid methods: {', '.join(METHODS)}")
    needing = [name for name in names if name in SCORER_METHODS]
    if needing and not has_scorer:
        raise CurKVError(f"method {needing[0]!r} needs a trained scorer: pass --scorer PATH "
                         f"(or drop {needing[0]} from --methods to run the baselines only)")
    return list(dict.fromkeys(names))


def build_methods(names: list[str], scorer: Scorer | dict[str, Scorer] | None, *, n_sink: int = 4,
                  window: int = 64) -> dict[str, ScoreFunction | None]:
    """Score functions by method name (``full`` -> None), validated against :data:`METHODS`.

    Args:
        scorer: the trained scorer, or several by method name (``curkv``, ``curkv:LABEL``): ``curkv``
            in ``names`` then gives each of them a row, and each with a calibrated layer budget a
            second row at one ratio for every layer (``curkv_uniform``, ``curkv_uniform:LABEL``).
            ``curkv_cache`` has no score function and is left to the harness.

    Raises:
        CurKVError: an unknown name, or ``curkv`` without a scorer.
    """
    scorers = scorer if isinstance(scorer, dict) else ({CURKV: scorer} if scorer is not None else {})
    methods: dict[str, ScoreFunction | None] = {}
    for name in check_methods(names, bool(scorers)):
        if name == FULL:
            methods[name] = None
        elif name == CURKV:
            for method, trained in scorers.items():
                methods[method] = CurKVScore(trained)
                if trained.layer_budget is not None:
                    methods[CURKV_UNIFORM + method[len(CURKV):]] = CurKVScore(trained, budgeted=False)
        elif name != CURKV_CACHE:
            methods[name] = baseline(name, n_sink=n_sink, window=window)
    return methods


__all__ = ["BASELINES", "CURKV", "CURKV_CACHE", "CURKV_UNIFORM", "FULL", "METHODS", "SCORER_METHODS", "ScoreFunction", "baseline",
           "build_methods", "check_methods",
           "CurDKVScore", "CurKVScore", "ExpectedAttentionScore", "H2OScore", "KNormScore", "RandomScore",
           "SnapKVScore", "StreamingLLMScore", "TOVAScore"]
