"""H2O: heavy hitters by accumulated attention (https://arxiv.org/abs/2306.14048)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from curkv_train.eval.context import LayerContext


@dataclass
class H2OScore:
    """Attention each key received, summed over every context query, averaged over the KV head's query heads.

    The plain accumulated sum of the paper (early keys are seen by more queries);
    kvpress's ObservedAttentionPress divides by the number of queries instead.
    """

    needs_queries = True

    def __call__(self, ctx: LayerContext) -> torch.Tensor:
        """(batch, kv_heads, tokens) accumulated attention."""
        return ctx.group_mean(ctx.attention_mass())
