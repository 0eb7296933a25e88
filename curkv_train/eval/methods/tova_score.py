"""TOVA: keep what the last token attends to (https://arxiv.org/abs/2401.06104)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from curkv_train.eval.context import LayerContext


@dataclass
class TOVAScore:
    """Attention of the last context query, averaged over the KV head's query heads.

    (TOVA and kvpress's TOVAPress average over all heads of the layer; here the
    average is per KV head, as every method's selection is per KV head.)
    """

    needs_queries = True

    def __call__(self, ctx: LayerContext) -> torch.Tensor:
        """(batch, kv_heads, tokens) last-query attention."""
        return ctx.group_mean(ctx.window_attention(1)[:, :, 0])
