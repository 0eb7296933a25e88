"""Rotary position embeddings as the estimator and the attention statistics need them.

RoPE is a rotation per channel pair, so a cached (post-RoPE) key can be turned back into
the key as projected, or into the key a query at another position would see, exactly.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext

import torch
from transformers import PreTrainedModel

from curkv_train.core.observation import decoder_of

KEY_VIEWS = ("pre_rope", "end_relative", "post_rope")


# the layer type a per-layer-type rotary module (Gemma 3) is read for: a hybrid model's sliding layers are never scored
FULL_ATTENTION = "full_attention"


def rotary_module(model: PreTrainedModel) -> torch.nn.Module | None:
    """The decoder's rotary embedding module (``rotary_emb``), or None for a model without RoPE."""
    return getattr(decoder_of(model), "rotary_emb", None)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """The RoPE companion of ``x``: halves (a, b) -> (-b, a) on the last dim."""
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Apply RoPE: x·cos + rotate_half(x)·sin (``cos``, ``sin`` broadcastable to ``x``)."""
    return x * cos + rotate_half(x) * sin


def unrotate(keys: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Invert k' = k·cos + rotate_half(k)·sin, given the inverse's tables (:func:`inverse_pair_tables`).

    Args:
        keys: (..., tokens, head_dim) rotated keys.
        cos, sin: (..., tokens, head_dim // 2) cos/(cos² + sin²) and sin/(cos² + sin²) of each channel pair
            (the norm is 1 unless the tables carry an attention scale), broadcastable to half the keys.
    """
    first, second = keys.chunk(2, dim=-1)  # k' = (a·c − b·s, b·c + a·s) for k = (a, b)
    return torch.cat((torch.addcmul(first * cos, second, sin), torch.addcmul(second * cos, first, sin, value=-1)),
                     dim=-1)


def rotary_tables(model: PreTrainedModel, positions: torch.Tensor, like: torch.Tensor):
    """(cos, sin) of shape (*positions.shape, head_dim) float32 for ``positions``, or None without RoPE.

    ``positions`` is (tokens,) or has leading dims, e.g. (batch, kv_heads, tokens) when
    each head holds a different set of tokens. A module with one set of frequencies per layer type (Gemma 3) gives
    the full-attention layers' (only those are scored).
    """
    rotary = rotary_module(model)
    if rotary is None:
        return None
    layer_type = {} if "inv_freq" in rotary._buffers else {"layer_type": FULL_ATTENTION}
    with state_kept(rotary) if rescales(rotary) else nullcontext():
        cos, sin = rotary(like, positions.reshape(1, -1).to(like.device), **layer_type)
    shape = (*positions.shape, cos.shape[-1])
    return cos[0].float().reshape(shape), sin[0].float().reshape(shape)


def fixed_frequencies(rotary: torch.nn.Module) -> tuple[torch.Tensor, float]:
    """``rotary``'s (head_dim // 2,) inverse frequencies and attention scaling; for a module holding one set per
    layer type (Gemma 3's sliding and full attention), the full-attention layers' set: only those are scored."""
    if "inv_freq" in rotary._buffers:
        return rotary.inv_freq, rotary.attention_scaling
    return getattr(rotary, f"{FULL_ATTENTION}_inv_freq"), getattr(rotary, f"{FULL_ATTENTION}_attention_scaling")


def rescales(rotary: torch.nn.Module) -> bool:
    """Whether ``rotary``'s forward changes its frequencies with the positions it gets (dynamic NTK, longrope)."""
    rope_type = getattr(rotary, "rope_type", "default")
    if isinstance(rope_type, dict):  # one per layer type (Gemma 3)
        rope_type = rope_type.get(FULL_ATTENTION, "default")
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
    rotary = rotary_module(model)
    if rotary is None:
        return None
    if rescales(rotary):
        cos, sin = rotary_tables(model, positions, like)
        return cos[..., : cos.shape[-1] // 2], sin[..., : sin.shape[-1] // 2]
    frequencies, scaling = fixed_frequencies(rotary)
    angles = positions.to(like.device).float()[..., None] * frequencies.float()
    return ((angles.cos() * scaling).to(like.dtype).float(), (angles.sin() * scaling).to(like.dtype).float())


def key_view(model: PreTrainedModel, keys: torch.Tensor, positions: torch.Tensor, view: str,
             end: int | None = None) -> torch.Tensor:
    """Keys (..., tokens, head_dim) post-RoPE at ``positions`` -> the estimator's key view, float32.

    - ``pre_rope``: rotated back by each key's own position (the key as projected);
    - ``end_relative``: rotated back by the last position of the sequence so far (``end - 1``),
      i.e. R(p_j − (end − 1))·k_j, the key as a query standing at the end sees it (distance-aware);
      ``end`` defaults to the largest position + 1;
    - ``post_rope``: the cached key as it is (models without rotary embeddings).

    ``positions`` is (tokens,) or matches the keys' leading dims, e.g. (batch, kv_heads, tokens); every
    one is below ``end`` when it is given.
    """
    if view not in KEY_VIEWS:
        raise ValueError(f"unknown key view {view!r}; expected one of {', '.join(KEY_VIEWS)}")
    if view == "post_rope":
        return keys.float()
    if view == "end_relative":
        if isinstance(end, torch.Tensor):  # a CUDA graph's input (Scorer.graphed): no host copy
            positions = (end - 1).reshape(1).to(keys.device)
        else:
            positions = torch.tensor([(int(positions.max()) + 1 if end is None else end) - 1], device=keys.device)
    tables = inverse_pair_tables(model, positions, keys, end)
    if tables is None:
        return keys.float()
    cos, sin = tables
    if view == "end_relative":
        cos, sin = cos[0], sin[0]
    return unrotate(keys.float(), cos, sin)


def inverse_pair_tables(model: PreTrainedModel, positions: torch.Tensor, like: torch.Tensor,
                        end: int | None = None):
    """The tables :func:`unrotate` takes for keys at ``positions``: (cos, sin) / (cos² + sin²) of
    :func:`pair_rotary_tables`, each (*positions.shape, head_dim // 2) float32, or None without RoPE.

    Where the frequencies are fixed (and outside ``torch.compile``), rows of a table over positions 0, 1, ...
    kept on the rotary module (:func:`position_table`): one gather per layer instead of the sines and cosines of
    every key. ``end``: a bound on the positions if the caller has one (tokens seen so far), else their largest + 1.
    """
    rotary = rotary_module(model)
    if rotary is None:
        return None
    if rescales(rotary) or torch.compiler.is_compiling():  # compiled: fused in its graph, which a lookup breaks
        return inverted(*pair_rotary_tables(model, positions, like))
    end = int(positions.max()) + 1 if end is None else end
    table = position_table(model, end, like)
    rows = table.index_select(0, positions.reshape(-1).to(table.device)).view(*positions.shape, table.shape[-1])
    return rows.chunk(2, dim=-1)


def inverted(cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse rotation's tables from :func:`pair_rotary_tables`' (any shape): (cos, sin) / (cos² + sin²)."""
    norm = cos * cos + sin * sin
    return cos / norm, sin / norm


# rotary module -> (key, table) of position_table: beside the model, not on it (a user's model is left as it was)
_position_tables: weakref.WeakKeyDictionary[torch.nn.Module, tuple] = weakref.WeakKeyDictionary()


@torch.compiler.disable  # a cache lookup, like features.future_rotation: traced, its key would be a guard
def position_table(model: PreTrainedModel, end: int, like: torch.Tensor) -> torch.Tensor:
    """(P, head_dim) float32 with P >= ``end`` (a power of two): row p is [cos_p | sin_p] / (cos_p² + sin_p²) of
    :func:`pair_rotary_tables` at position p, for a rotary module whose frequencies are fixed. Kept per module (while
    it lives), grown when a longer sequence asks, remade if ``inv_freq`` changes."""
    rotary = rotary_module(model)
    frequencies, scaling = fixed_frequencies(rotary)
    key = (like.device, like.dtype, frequencies.data_ptr(), frequencies._version, scaling)
    cached = _position_tables.get(rotary)
    if cached is None or cached[0] != key or cached[1].shape[0] < end:
        size = 1 << max(int(end) - 1, 255).bit_length()
        tables = pair_rotary_tables(model, torch.arange(size, device=like.device), like)
        cached = (key, torch.cat(inverted(*tables), dim=-1))
        _position_tables[rotary] = cached
    return cached[1]


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
