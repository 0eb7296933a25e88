"""select_kept: sinks + recent window + the top ⌈ρ·n⌉ of the rest, by slices rather than boolean masks."""

from __future__ import annotations

import pytest
import torch

from curkv_train.core.selection import compressible_mask, expected_kept, kept_count, select_kept


def kept_by_mask(scores: torch.Tensor, n_sink: int, window: int, keep_ratio: float) -> torch.Tensor:
    """The definition, with boolean masks: protected tokens, then the top compressible ones, sorted."""
    tokens = scores.shape[-1]
    compressible = compressible_mask(tokens, n_sink, window)
    positions = torch.arange(tokens)
    top = scores[..., compressible].topk(kept_count(int(compressible.sum()), keep_ratio), dim=-1).indices
    protected = positions[~compressible].expand(*scores.shape[:2], -1)
    return torch.cat([protected, positions[compressible][top]], dim=-1).sort(dim=-1).values


@pytest.mark.parametrize("tokens", [0, 3, 4, 7, 12, 13, 40])
@pytest.mark.parametrize("keep_ratio", [0.1, 0.5, 1.0])
def test_select_kept_keeps_the_protected_and_the_top_compressible_tokens(tokens, keep_ratio):
    scores = torch.randn(2, 3, tokens, generator=torch.Generator().manual_seed(tokens))
    kept = select_kept(scores, 4, 8, keep_ratio)
    assert torch.equal(kept, kept_by_mask(scores, 4, 8, keep_ratio))
    assert kept.shape[-1] == expected_kept(tokens, 4, 8, keep_ratio)
