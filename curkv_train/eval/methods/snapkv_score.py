"""SnapKV: attention of an observation window of the last queries (https://arxiv.org/abs/2404.14469)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from curkv_train.eval.context import LayerContext


@dataclass
class SnapKVScore:
    """Mean attention of the last ``window_size`` queries, max-pooled over ``kernel_size`` neighbouring
    keys (clusters, as in the paper's code), averaged over the KV head's query heads.

    Parameters
    ----------
    window_size : int, default ``64``
        Observation window: how many of the last context queries vote.
    kernel_size : int, default ``5``
        Pooling width along the keys (odd).
    """

    window_size: int = 64
    kernel_size: int = 5
    needs_queries = True

    def __post_init__(self) -> None:
        if self.window_size < 1 or self.kernel_size < 1 or self.kernel_size % 2 == 0:
            raise ValueError(f"SnapKV needs window_size >= 1 and an odd kernel_size, got "
                             f"{self.window_size}, {self.kernel_size}")

    def __call__(self, ctx: LayerContext) -> torch.Tensor:
        """(batch, kv_heads, tokens) pooled window attention."""
        votes = ctx.window_attention(self.window_size).mean(dim=2)
        pooled = F.max_pool1d(votes, self.kernel_size, stride=1, padding=self.kernel_size // 2)
        return ctx.group_mean(pooled)
