"""One prefill through the runtime cache and through the press: per-layer digests of what each keeps."""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch
from transformers import DynamicCache


def digest(tensor: torch.Tensor) -> str:
    """sha256 (16 hex digits) of a tensor's values."""
    return hashlib.sha256(tensor.detach().cpu().contiguous().numpy().tobytes()).hexdigest()[:16]


def held_positions(layer) -> torch.Tensor:
    """The positions a cache layer holds: (batch, kv_heads, held) sorted per head, or for a ragged layer (a joint
    allocation's) each head's count followed by its sorted positions, heads one after another."""
    if getattr(layer, "store", None) is None:
        return layer.positions.long().sort(dim=-1).values
    parts = []
    for row, length in zip(layer.store.offsets.flatten().tolist(), layer.lengths.flatten().tolist()):
        parts += [torch.tensor([length]), layer.row_positions[row:row + length].long().sort().values.cpu()]
    return torch.cat(parts)


@torch.no_grad()
def selections(model, scorer_dir: Path, ids: torch.Tensor, keep_ratio: float) -> dict[str, list[str]]:
    """``cache``: per layer, the digest of the token positions CurKVCache holds after prefilling ``ids``
    (1, tokens); ``press``: per layer, the digest of the keys CurKVPress leaves in a DynamicCache."""
    from curkv_train.runtime import CurKVCache, load_scorer
    from curkv_train.runtime.press import CurKVPress

    scorer = load_scorer(scorer_dir, model=model)
    cache = CurKVCache(scorer, model=model, keep_ratio=keep_ratio)
    model(ids, past_key_values=cache, use_cache=True)
    held = [digest(held_positions(layer)) for layer in cache.layers]
    if hasattr(cache, "close"):
        cache.close()
    del cache
    press = CurKVPress(scorer=scorer, compression_ratio=1.0 - keep_ratio)
    plain = DynamicCache()
    with press(model):
        model(ids, past_key_values=plain, use_cache=True)
    pressed = [digest(layer.keys) for layer in plain.layers]
    return {"cache": held, "press": pressed}
