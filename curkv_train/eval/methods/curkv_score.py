"""``curkv``: the trained value estimator's keep logits."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from curkv_train.eval.context import LayerContext
from curkv_train.runtime.allocation import LayerBudget
from curkv_train.runtime.scorer import Scorer


@dataclass
class CurKVScore:
    """Scores from a trained :class:`~curkv_train.runtime.scorer.Scorer` (its own key view).

    Parameters
    ----------
    scorer : Scorer
        The exported estimator with the settings it was trained under.
    budgeted : bool, default=True
        Split the keep ratio across layers by the scorer's calibrated ``layer_budget`` (if it has
        one), as :class:`~curkv_train.runtime.CurKVCache` does; False keeps one ratio everywhere.
    """

    scorer: Scorer
    budgeted: bool = True

    @property
    def needs_queries(self) -> bool:
        """Whether the prefill must record attention inputs (query-aware and hidden-state families)."""
        return bool(self.scorer.estimator.needs)

    @property
    def budget(self) -> LayerBudget | None:
        """The layer budget this scorer's selection follows (None: one ratio for every layer)."""
        return self.scorer.layer_budget if self.budgeted else None

    def __call__(self, ctx: LayerContext) -> torch.Tensor:
        """(batch, kv_heads, tokens) float32 keep logits."""
        extra = (self.scorer.prefill_inputs(ctx.model, ctx.layer, ctx.hidden) if self.needs_queries
                 else {})
        return self.scorer.score_layer(ctx.model, ctx.layer, ctx.keys, ctx.values, ctx.positions, **extra)
