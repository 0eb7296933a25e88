"""SnapKV: attention of an observation window of the last queries (https://arxiv.org/abs/2404.14469)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from curkv_train.eval.context import LayerContext


@dataclass
class SnapKVScore:
    """Mean attention of the last ``window_size`` queries on the keys before them, average-pooled over
    ``kernel_size`` neighbouring keys and averaged over the KV head's query heads, as kvpress's
    SnapKVPress and the SnapKV reference code do; the observation window scores above every other key.

    The pooling sees the keys before the window only (zero-padded at both ends, the padding counted
    in the average), so window attention never leaks into the scores of the keys next to it.

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
        """(batch, kv_heads, tokens) pooled window attention; the last ``window_size`` tokens get max + 1."""
        if ctx.num_tokens <= self.window_size:
            raise ValueError(f"SnapKV needs more than window_size={self.window_size} tokens, got {ctx.num_tokens}")
        votes = ctx.window_attention(self.window_size).mean(dim=2)[..., : -self.window_size]
        pooled = F.avg_pool1d(votes, self.kernel_size, stride=1, padding=self.kernel_size // 2)
        scores = ctx.group_mean(pooled)
        return F.pad(scores, (0, self.window_size), value=float(scores.max()) + 1.0)
