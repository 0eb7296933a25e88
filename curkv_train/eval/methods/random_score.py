"""Random keep scores: the floor every method must beat."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from curkv_train.eval.context import LayerContext


@dataclass
class RandomScore:
    """Uniform random scores, reproducible from the context's seed (distinct per example and layer).

    Parameters
    ----------
    seed : int, default ``0``
        Added to the context's seed, to draw a different but still reproducible selection.
    """

    seed: int = 0
    needs_queries = False

    def __call__(self, ctx: LayerContext) -> torch.Tensor:
        """(batch, kv_heads, tokens) scores uniform in [0, 1)."""
        generator = torch.Generator(device="cpu").manual_seed(ctx.seed + self.seed)
        shape = ctx.keys.shape[:3]
        return torch.rand(shape, generator=generator).to(ctx.keys.device)
