"""Every evaluated method as a score function ``(ctx: LayerContext) -> (batch, kv_heads, tokens)``.

The selection (:func:`curkv_train.core.selection.select_kept`) and compaction are
shared, so methods differ in their scores only. ``full`` is the uncompressed
reference and has no score function.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from curkv_train.errors import CurKVError
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
BASELINES = tuple(_FACTORIES)
METHODS = (FULL, *BASELINES, CURKV)


def baseline(name: str, *, n_sink: int = 4, window: int = 64) -> ScoreFunction:
    """The score function of baseline ``name`` (SnapKV observes the last ``window`` queries,
    ExpectedAttention leaves the ``n_sink`` sinks out of its statistics)."""
    if name not in _FACTORIES:
        raise CurKVError(f"unknown method {name!r}; valid methods: {', '.join(METHODS)}")
    return _FACTORIES[name](n_sink, window)


def build_methods(names: list[str], scorer: Scorer | None, *, n_sink: int = 4,
                  window: int = 64) -> dict[str, ScoreFunction | None]:
    """Score functions by method name (``full`` -> None), validated against :data:`METHODS`.

    Raises:
        CurKVError: an unknown name, or ``curkv`` without a scorer.
    """
    unknown = [name for name in names if name not in METHODS]
    if unknown:
        raise CurKVError(f"unknown method(s) {', '.join(map(repr, unknown))}; valid methods: {', '.join(METHODS)}")
    methods: dict[str, ScoreFunction | None] = {}
    for name in dict.fromkeys(names):
        if name == FULL:
            methods[name] = None
        elif name == CURKV:
            if scorer is None:
                raise CurKVError("method 'curkv' needs a trained scorer: pass --scorer PATH "
                                 "(or drop curkv from --methods to run the baselines only)")
            methods[name] = CurKVScore(scorer)
        else:
            methods[name] = baseline(name, n_sink=n_sink, window=window)
    return methods


__all__ = ["BASELINES", "CURKV", "FULL", "METHODS", "ScoreFunction", "baseline", "build_methods",
           "CurDKVScore", "CurKVScore", "ExpectedAttentionScore", "H2OScore", "KNormScore", "RandomScore",
           "SnapKVScore", "StreamingLLMScore", "TOVAScore"]
