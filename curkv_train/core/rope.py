"""Rotary position embeddings as the estimator and the attention statistics need them.

RoPE is a rotation per channel pair, so a cached (post-RoPE) key can be turned back into
the key as projected, or into the key a query at another position would see, exactly.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager, nullcontext

import torch
from transformers import PreTrainedModel

KEY_VIEWS = ("pre_rope", "end_relative", "post_rope")


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """The RoPE companion of ``x``: halves (a, b) -> (-b, a) on the last dim."""
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Apply RoPE: x·cos + rotate_half(x)·sin (``cos``, ``sin`` broadcastable to ``x``)."""
    return x * cos + rotate_half(x) * sin


def unrotate(keys: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Invert k' = k·cos + rotate_half(k)·sin from the tables of one channel pair each (cos, sin may carry an
    attention scale).

    Args:
        keys: (..., tokens, head_dim) rotated keys.
        cos, sin: (..., tokens, head_dim // 2) :func:`pair_rotary_tables`, broadcastable to half the keys.
    """
    first, second = keys.chunk(2, dim=-1)  # k' = (a·c − b·s, b·c + a·s) for k = (a, b)
    norm = cos * cos + sin * sin
    return torch.cat(((first * cos + second * sin) / norm, (second * cos - first * sin) / norm), dim=-1)


def rotary_tables(model: PreTrainedModel, positions: torch.Tensor, like: torch.Tensor):
    """(cos, sin) of shape (*positions.shape, head_dim) float32 for ``positions``, or None without RoPE.

    ``positions`` is (tokens,) or has leading dims, e.g. (batch, kv_heads, tokens) when
    each head holds a different set of tokens.
    """
    rotary = getattr(model.get_decoder(), "rotary_emb", None)
    if rotary is None:
        return None
    with state_kept(rotary) if rescales(rotary) else nullcontext():
        cos, sin = rotary(like, positions.reshape(1, -1).to(like.device))
    shape = (*positions.shape, cos.shape[-1])
    return cos[0].float().reshape(shape), sin[0].float().reshape(shape)


def rescales(rotary: torch.nn.Module) -> bool:
    """Whether ``rotary``'s forward changes its frequencies with the positions it gets (dynamic NTK, longrope)."""
    rope_type = getattr(rotary, "rope_type", "default")
    return "dynamic" in rope_type or rope_type == "longrope"


@contextmanager
def state_kept(rotary: torch.nn.Module) -> Iterator[None]:
    """Restore ``rotary``'s attributes and buffers after the block: a dynamic-NTK or longrope module's forward
    rescales its frequencies for the positions it is given, and a scorer asking for tables (future positions
    included) must leave the model's RoPE as the model's own forwards left it."""
    attributes, buffers = dict(rotary.__dict__), dict(rotary._buffers)
    try:
        yield
    finally:
        rotary.__dict__.clear()
        rotary.__dict__.update(attributes)
        rotary._buffers.clear()
        rotary._buffers.update(buffers)


def pair_rotary_tables(model: PreTrainedModel, positions: torch.Tensor, like: torch.Tensor):
    """(cos, sin) of shape (*positions.shape, head_dim // 2) float32, one per channel pair (the full tables of
    :func:`rotary_tables` repeat them twice), or None without RoPE.

    Where the rotary frequencies are fixed (every rope type but dynamic and longrope, which change them
    with the length in the module's forward), computed from them directly: half the sines and cosines,
    rounded to ``like``'s dtype as the module rounds them.
    """
    rotary = getattr(model.get_decoder(), "rotary_emb", None)
    if rotary is None:
        return None
    if rescales(rotary):
        cos, sin = rotary_tables(model, positions, like)
        return cos[..., : cos.shape[-1] // 2], sin[..., : sin.shape[-1] // 2]
    angles = positions.to(like.device).float()[..., None] * rotary.inv_freq.float()
    scaling = rotary.attention_scaling
    return ((angles.cos() * scaling).to(like.dtype).float(), (angles.sin() * scaling).to(like.dtype).float())


def key_view(model: PreTrainedModel, keys: torch.Tensor, positions: torch.Tensor, view: str,
             end: int | None = None) -> torch.Tensor:
    """Keys (..., tokens, head_dim) post-RoPE at ``positions`` -> the estimator's key view, float32.

    - ``pre_rope``: rotated back by each key's own position (the key as projected);
    - ``end_relative``: rotated back by the last position of the sequence so far (``end - 1``),
      i.e. R(p_j − (end − 1))·k_j, the key as a query standing at the end sees it (distance-aware);
      ``end`` defaults to the largest position + 1;
    - ``post_rope``: the cached key as it is (models without rotary embeddings).

    ``positions`` is (tokens,) or matches the keys' leading dims, e.g. (batch, kv_heads, tokens).
    """
    if view not in KEY_VIEWS:
        raise ValueError(f"unknown key view {view!r}; expected one of {', '.join(KEY_VIEWS)}")
    if view == "post_rope":
        return keys.float()
    if view == "end_relative":
        last = (int(positions.max()) + 1 if end is None else end) - 1
        positions = torch.tensor([last], device=keys.device)
    tables = pair_rotary_tables(model, positions, keys)
    if tables is None:
        return keys.float()
    cos, sin = tables
    if view == "end_relative":
        cos, sin = cos[0], sin[0]
    return unrotate(keys.float(), cos, sin)


def average_rotation(model: PreTrainedModel | None, start: int, count: int, head_dim: int,
                     like: torch.Tensor) -> torch.Tensor:
    """(head_dim, head_dim) RoPE rotation averaged over positions [start, start + count).

    RoPE at position p maps x to cos_p·x + sin_p·rotate_half(x) = (diag(cos_p) + diag(sin_p)·P)·x,
    so the average is diag(mean cos) + diag(mean sin)·P. Identity without rotary embeddings.
    The tables are :func:`pair_rotary_tables` (one per channel pair, repeated for both halves).
    """
    eye = torch.eye(head_dim, device=like.device)
    positions = torch.arange(start, start + count, device=like.device)  # made there: no blocking host copy
    tables = None if model is None else pair_rotary_tables(model, positions, like)
    if tables is None:
        return eye
    cos, sin = (table.mean(dim=0).repeat(2) for table in tables)
    companion = rotate_half(eye).T  # P with P @ x == rotate_half(x)
    return torch.diag(cos) + torch.diag(sin) @ companion
