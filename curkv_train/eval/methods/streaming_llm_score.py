"""StreamingLLM: attention sinks plus the most recent tokens (https://arxiv.org/abs/2309.17453)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from curkv_train.eval.context import LayerContext


@dataclass
class StreamingLLMScore:
    """Score = position: the selection path keeps the sinks, the window and then the newest tokens.

    Without key re-rotation (as in kvpress's StreamingLLMPress without KeyRerotationPress).
    """

    needs_queries = False

    def __call__(self, ctx: LayerContext) -> torch.Tensor:
        """(batch, kv_heads, tokens) float positions, higher = more recent."""
        batch, kv_heads, tokens = ctx.keys.shape[:3]
        return ctx.positions.float().to(ctx.keys.device).expand(batch, kv_heads, tokens)
