"""PyTorch references for the fused compression kernels.

These are the CPU path of the toolkit and the oracle the Triton kernels are
tested against: every kernel in this folder has the same semantics as the
function of the same stem here.
"""

from __future__ import annotations

import torch


def causal_key_mask(num_queries: int, num_keys: int, device: torch.device) -> torch.Tensor:
    """Bottom-right aligned causal mask: query i of M sees keys j <= i + N - M.

    Returns:
        (num_queries, num_keys) bool tensor, True where the key is visible.
    """
    query_pos = torch.arange(num_queries, device=device)[:, None] + (num_keys - num_queries)
    return torch.arange(num_keys, device=device)[None, :] <= query_pos


def _compute_dtype(q: torch.Tensor) -> torch.dtype:
    """float32 accumulation, float64 for float64 inputs (so gradcheck can run)."""
    return torch.float64 if q.dtype == torch.float64 else torch.float32


def scored_attention_probs(
    q: torch.Tensor,
    k: torch.Tensor,
    key_bias: torch.Tensor,
    *,
    scale: float | None = None,
    causal: bool = True,
) -> torch.Tensor:
    """Attention probabilities of :func:`scored_attention_reference`, grouped by KV head.

    Args:
        q: (batch, q_heads, M, head_dim); k: (batch, kv_heads, N, head_dim);
        key_bias: (batch, kv_heads, N), see :func:`scored_attention_reference`.

    Returns:
        (batch, kv_heads, group, M, N) float32 (float64 for float64 q), group =
        q_heads / kv_heads; rows with no visible finite logit are all zero.
    """
    batch, q_heads, num_queries, head_dim = q.shape
    kv_heads, num_keys = k.shape[1], k.shape[2]
    scale = head_dim**-0.5 if scale is None else scale
    compute = _compute_dtype(q)
    queries = q.to(compute).reshape(batch, kv_heads, q_heads // kv_heads, num_queries, head_dim)
    logits = torch.einsum("bhgmd,bhnd->bhgmn", queries, k.to(compute)) * scale
    logits = logits + key_bias.to(compute)[:, :, None, None, :]
    if causal:
        visible = causal_key_mask(num_queries, num_keys, q.device)
        logits = logits.masked_fill(~visible, float("-inf"))
    # The shift is detached: softmax does not depend on it, and a detached shift
    # keeps -inf logits from sending NaN gradients through amax.
    row_max = logits.detach().amax(dim=-1, keepdim=True)
    row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
    weights = torch.exp(logits - row_max)
    # A row with no visible finite logit has weights == 0 and gives 0. Dividing by 1
    # there, not by a tiny clamp, keeps its backward finite: g / tiny can overflow and
    # inf * exp(-inf) = NaN would leak into the q and key_bias gradients.
    denom = weights.sum(dim=-1, keepdim=True)
    return weights / torch.where(denom > 0, denom, torch.ones_like(denom))


def scored_attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    key_bias: torch.Tensor,
    *,
    scale: float | None = None,
    causal: bool = True,
) -> torch.Tensor:
    """Softmax attention with an additive per-key bias, GQA, fp32 accumulation.

    Args:
        q: (batch, q_heads, M, head_dim) queries.
        k: (batch, kv_heads, N, head_dim) keys; q_heads is a multiple of kv_heads and
            query head h reads KV head h // (q_heads / kv_heads).
        v: (batch, kv_heads, N, head_dim) values.
        key_bias: (batch, kv_heads, N) float bias added to every logit of that key
            (log keep-score; 0 keeps, -inf evicts). Rows whose keys are all -inf give 0.
        scale: logit scale, default head_dim ** -0.5.
        causal: bottom-right causal masking (a continuation attending to a cache).

    Returns:
        (batch, q_heads, M, head_dim) in q's dtype. Differentiable in q and key_bias.
    """
    return attend(scored_attention_probs(q, k, key_bias, scale=scale, causal=causal), v, q)


def attend(probs: torch.Tensor, v: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Attention output from grouped probabilities.

    Args:
        probs: (batch, kv_heads, group, M, N) from :func:`scored_attention_probs`.
        v: (batch, kv_heads, N, head_dim_v) values.
        q: (batch, q_heads, M, head_dim) the queries (for the output shape and dtype).

    Returns:
        (batch, q_heads, M, head_dim_v) in q's dtype.
    """
    out = torch.einsum("bhgmn,bhnd->bhgmd", probs, v.to(probs.dtype))
    return out.reshape(q.shape[0], q.shape[1], q.shape[2], v.shape[-1]).to(q.dtype)


def compact_kept_reference(
    k: torch.Tensor, v: torch.Tensor, keep_idx: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gather each (batch, KV head)'s kept tokens into dense contiguous K and V.

    Args:
        k: (batch, kv_heads, N, head_dim) keys.
        v: (batch, kv_heads, N, head_dim_v) values.
        keep_idx: (batch, kv_heads, K) int64 token indices to keep, in the output order.

    Returns:
        (keys, values) of shapes (batch, kv_heads, K, head_dim) and (batch, kv_heads, K, head_dim_v).
    """
    gather_k = keep_idx[..., None].expand(*keep_idx.shape, k.shape[-1])
    gather_v = keep_idx[..., None].expand(*keep_idx.shape, v.shape[-1])
    return torch.gather(k, 2, gather_k).contiguous(), torch.gather(v, 2, gather_v).contiguous()
