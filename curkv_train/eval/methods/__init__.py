"""Every method of the one-prefill tasks; each compressing one runs a kvpress press (one path for all).

``full`` is the uncompressed reference. Every other row compresses the context inside its prefill under a
kvpress press (:mod:`curkv_train.eval.kvpress_bridge`) keeping, per (layer, KV head), the sinks, the recent
window and the best-scored ⌈ρ·n_compressible⌉ of the rest, so the rows differ in their scores only: the
baselines kvpress's presses (``h2o``: ours, :class:`~curkv_train.eval.baseline_presses.H2OPress`), ``curkv``
the trained scorer's CurKVPress at its calibrated layer budget, ``curkv_uniform`` at one ratio.
``curkv_cache`` is no press: the harness runs the scorer through the runtime CurKVCache."""

from __future__ import annotations

from curkv_train.core.errors import CurKVError
from curkv_train.eval.kvpress_bridge import BASELINE_PRESSES, PressMethod, PressSpec, baseline_method
from curkv_train.runtime.allocation import LayerBudget
from curkv_train.runtime.scorer import Scorer

FULL = "full"
CURKV = "curkv"
CURKV_CACHE = "curkv_cache"
# a budgeted scorer's row again with one keep ratio for every layer (added beside ``curkv``)
CURKV_UNIFORM = "curkv_uniform"
BASELINES = tuple(BASELINE_PRESSES)
METHODS = (FULL, *BASELINES, CURKV, CURKV_CACHE)
# methods that need a trained scorer; with several scorers each gets its rows (``curkv:LABEL``, ...)
SCORER_METHODS = (CURKV, CURKV_CACHE)


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


def scorer_method(scorer: Scorer, budgeted: bool = True) -> PressMethod:
    """The trained ``scorer``'s row: its CurKVPress (protecting the scorer's spans), at the scorer's layer budget
    if ``budgeted`` and it has one, else at one ratio for every layer."""

    def make(compression_ratio: float, seed: int | None):
        from curkv_train.runtime.press import CurKVPress

        return CurKVPress(compression_ratio=compression_ratio, scorer=scorer, layer_budget="uniform")

    return PressMethod(PressSpec("CurKVPress"), make, scorer.layer_budget if budgeted else None)


def build_methods(names: list[str], scorer: Scorer | dict[str, Scorer] | None, *, n_sink: int = 4,
                  window: int = 64, baseline_budget: LayerBudget | None = None) -> dict[str, PressMethod | None]:
    """Each row's press by method name (``full`` -> None; ``curkv_cache`` is left to the harness).

    Args:
        scorer: the trained scorer, or several by method name (``curkv``, ``curkv:LABEL``): ``curkv`` in ``names``
            gives each a row, and each with a calibrated layer budget a ``curkv_uniform[:LABEL]`` row at one ratio.
        n_sink, window: the spans every baseline keeps (the scorers' rows keep their scorer's).
        baseline_budget: a layer budget the baselines' counts follow too (``--budget_baselines``).

    Raises:
        CurKVError: an unknown name, or ``curkv`` without a scorer.
    """
    scorers = scorer if isinstance(scorer, dict) else ({CURKV: scorer} if scorer is not None else {})
    methods: dict[str, PressMethod | None] = {}
    for name in check_methods(names, bool(scorers)):
        if name == FULL:
            methods[name] = None
        elif name == CURKV:
            for method, trained in scorers.items():
                methods[method] = scorer_method(trained)
                if trained.layer_budget is not None:
                    methods[CURKV_UNIFORM + method[len(CURKV):]] = scorer_method(trained, budgeted=False)
        elif name != CURKV_CACHE:
            methods[name] = baseline_method(name, n_sink=n_sink, window=window, layer_budget=baseline_budget)
    return methods


__all__ = ["BASELINES", "CURKV", "CURKV_CACHE", "CURKV_UNIFORM", "FULL", "METHODS", "SCORER_METHODS",
           "build_methods", "check_methods", "scorer_method"]
