"""The one selection path every method goes through: scores -> kept token indices -> dense K/V.

Trained scorer and training-free baselines differ only in the scores they give;
which tokens survive, and how they are gathered, is decided here (DESIGN §6).
"""

from __future__ import annotations

import torch

from curkv_train.kernels import compact_kept
from curkv_train.objective import compressible_mask, kept_count


def select_kept(scores: torch.Tensor, n_sink: int, window: int, keep_ratio: float) -> torch.Tensor:
    """Indices kept per (batch, KV head): sinks + recent window + top-⌈ρ·n⌉ compressible by score.

    Args:
        scores: (batch, kv_heads, tokens) higher = more worth keeping.
        n_sink, window: always-kept leading / trailing tokens.
        keep_ratio: ρ, share of the compressible tokens to keep.

    Returns:
        (batch, kv_heads, kept) int64 indices in increasing position order, with
        kept = sinks + window + ⌈ρ·n_compressible⌉ (all tokens when nothing is compressible).
    """
    batch, heads, tokens = scores.shape
    compressible = compressible_mask(tokens, n_sink, window, device=scores.device)
    positions = torch.arange(tokens, device=scores.device)
    protected = positions[~compressible].expand(batch, heads, -1)
    candidates = positions[compressible]
    count = kept_count(candidates.numel(), keep_ratio)
    chosen = scores[..., compressible].float().topk(count, dim=-1).indices
    kept = torch.cat([protected, candidates[chosen]], dim=-1)
    return kept.sort(dim=-1).values


def compress_kv(keys: torch.Tensor, values: torch.Tensor, keep_idx: torch.Tensor, backend: str = "auto"):
    """Dense (keys, values) of the kept tokens: (batch, kv_heads, kept, head_dim) each."""
    return compact_kept(keys, values, keep_idx, backend=backend)
