"""KNorm: low key norm means high attention (https://arxiv.org/abs/2406.11430)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from curkv_train.eval.context import LayerContext


@dataclass
class KNormScore:
    """Score = −‖k‖₂ (RoPE is a rotation, so the cached key's norm is the key's norm)."""

    needs_queries = False

    def __call__(self, ctx: LayerContext) -> torch.Tensor:
        """(batch, kv_heads, tokens) negative key norms in float32."""
        return -torch.linalg.vector_norm(ctx.keys.float(), dim=-1)
