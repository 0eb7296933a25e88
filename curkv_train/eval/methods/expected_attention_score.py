"""ExpectedAttention: attention future queries are expected to pay (https://github.com/NVIDIA/kvpress).

Queries of the context (pre-RoPE, sinks excluded) are summarised by their mean μ and
covariance Σ, rotated forward by the RoPE rotation R averaged over the next
``n_future_positions`` positions. For a Gaussian query, E[exp(q·k·s)] =
exp(μ'·k·s + ½ s² kᵀΣ'k); these are normalised over the keys, averaged over the KV
head's query heads and weighted by ‖v‖.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from curkv_train.eval.context import LayerContext


@dataclass
class ExpectedAttentionScore:
    """Expected attention of future queries, times the value norm.

    Parameters
    ----------
    n_future_positions : int, default ``512``
        Future positions the RoPE rotation is averaged over.
    n_sink : int, default ``4``
        Leading tokens left out of the query statistics and of the softmax (scored highest).
    use_covariance : bool, default ``True``
        Include the ½ kᵀΣk term.
    use_vnorm : bool, default ``True``
        Rescale by ‖v‖ (after adding ``epsilon``).
    epsilon : float, default ``0.0``
    """

    n_future_positions: int = 512
    n_sink: int = 4
    use_covariance: bool = True
    use_vnorm: bool = True
    epsilon: float = 0.0
    needs_queries = True

    def query_statistics(self, ctx: LayerContext) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Mean (batch, heads, head_dim) and covariance (batch, heads, head_dim, head_dim), rotated forward."""
        queries = ctx.pre_rope_queries()[:, :, self.n_sink :]
        mean = queries.mean(dim=2)
        rotation = ctx.average_rotation(ctx.num_tokens, self.n_future_positions)
        covariance = None
        if self.use_covariance:
            centered = queries - mean[:, :, None]
            covariance = torch.einsum("bhni,bhnj->bhij", centered, centered) / queries.shape[2]
            covariance = rotation @ covariance @ rotation.T
        return mean @ rotation.T, covariance

    def __call__(self, ctx: LayerContext) -> torch.Tensor:
        """(batch, kv_heads, tokens) expected attention × ‖v‖; sinks get the maximum + 1."""
        if ctx.num_tokens <= self.n_sink:
            raise ValueError(f"ExpectedAttention needs more than n_sink={self.n_sink} tokens")
        mean, covariance = self.query_statistics(ctx)
        keys = ctx.keys[:, :, self.n_sink :].float()
        batch, kv_heads, tokens, dim = keys.shape
        scale = ctx.scale
        mean = mean.reshape(batch, kv_heads, -1, dim)
        logits = torch.einsum("bhgd,bhnd->bhgn", mean, keys) * scale
        if covariance is not None:
            covariance = covariance.reshape(batch, kv_heads, -1, dim, dim)
            logits = logits + 0.5 * scale**2 * torch.einsum("bhnd,bhgde,bhne->bhgn", keys, covariance, keys)
        scores = logits.softmax(dim=-1).mean(dim=2)
        if self.use_vnorm:
            scores = (scores + self.epsilon) * ctx.values[:, :, self.n_sink :].float().norm(dim=-1)
        sinks = scores.new_full((batch, kv_heads, self.n_sink), float(scores.max()) + 1)
        return torch.cat([sinks, scores], dim=-1)
