"""Ragged KV storage: every (batch, KV head) holds its own number of tokens, nothing padded or masked.

Format (one layer; :class:`RaggedKV`):

* ``keys``, ``values``: (rows, head_dim) buffers. Every (batch, KV head) owns one contiguous
  *segment* of rows; its tokens are in age order, the newest last.
* ``offsets``: (batch, kv_heads) int64, the first row of each segment.
* ``lengths``: (batch, kv_heads) int64, the tokens each segment holds (0 allowed).
* ``capacities``: (batch, kv_heads) int64 >= ``lengths``, the rows each segment owns; rows
  ``offsets + lengths ..< offsets + capacities`` are headroom for appends and are never read.

The helpers here lay segments out in (batch, KV head) row-major order with
``offsets`` = the exclusive cumulative sum of ``capacities``, so ``rows = sum(capacities)``
and the memory held is ``sum(capacities) · head_dim · 2 · itemsize`` bytes — exactly
``sum(lengths) · head_dim · 2 · itemsize`` without headroom. The attention kernels
(:func:`curkv_train.kernels.ragged_attention`) read only ``offsets`` and ``lengths``: any
layout of disjoint segments works for them.

Costs: :func:`pack_ragged` is one gather of the kept rows. :func:`append_ragged` writes the
new tokens in place while every segment has headroom for them; otherwise it reallocates,
copying the packed buffer once (``sum(lengths) · head_dim · 2`` elements) and giving every
segment ``headroom`` spare rows, so with headroom h a decode step (1 token) pays that copy
once every h steps.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch


@dataclass(frozen=True)
class RaggedKV:
    """One layer's keys and values in ragged storage (module docstring for the format).

    Attributes:
        keys: (rows, head_dim) packed keys.
        values: (rows, head_dim) packed values.
        offsets: (batch, kv_heads) int64 first row of each segment.
        lengths: (batch, kv_heads) int64 tokens held per segment.
        capacities: (batch, kv_heads) int64 rows owned per segment (>= lengths).
    """

    keys: torch.Tensor
    values: torch.Tensor
    offsets: torch.Tensor
    lengths: torch.Tensor
    capacities: torch.Tensor

    @property
    def bytes_held(self) -> int:
        """Bytes of the key and value buffers (headroom included)."""
        return self.keys.numel() * self.keys.element_size() + self.values.numel() * self.values.element_size()

    def segment(self, batch: int, kv_head: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(keys, values) views of one segment, each (length, head_dim), oldest token first."""
        start = int(self.offsets[batch, kv_head])
        end = start + int(self.lengths[batch, kv_head])
        return self.keys[start:end], self.values[start:end]


def segment_rows(offsets: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """Buffer rows of every held token, segment after segment in (batch, KV head) order.

    Args:
        offsets, lengths: (batch, kv_heads) int64.

    Returns:
        (sum(lengths),) int64: row offsets[s] + t for t < lengths[s], s in row-major order.
    """
    flat_lengths = lengths.reshape(-1)
    segment = torch.repeat_interleave(torch.arange(flat_lengths.numel(), device=lengths.device), flat_lengths)
    starts = torch.cumsum(flat_lengths, 0) - flat_lengths
    position = torch.arange(segment.numel(), device=lengths.device) - starts[segment]
    return offsets.reshape(-1)[segment] + position


def _layout(lengths: torch.Tensor, headroom: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(offsets, capacities) of segments of ``lengths + headroom`` rows laid out row-major."""
    if headroom < 0:
        raise ValueError(f"headroom must be >= 0 tokens per segment, got {headroom}")
    capacities = lengths + headroom
    offsets = torch.cumsum(capacities.reshape(-1), 0) - capacities.reshape(-1)
    return offsets.reshape(capacities.shape), capacities


def pack_ragged(
    keys: torch.Tensor,
    values: torch.Tensor,
    keep_idx: Sequence[Sequence[torch.Tensor]],
    *,
    headroom: int = 0,
) -> RaggedKV:
    """Gather each (batch, KV head)'s kept tokens of a dense cache into ragged storage.

    Args:
        keys: (batch, kv_heads, tokens, head_dim) dense keys.
        values: (batch, kv_heads, tokens, head_dim) dense values.
        keep_idx: ``keep_idx[b][h]`` a 1-D int tensor of token indices kept for batch b, KV
            head h, in segment order (ascending keeps age order, the newest last).
        headroom: spare rows per segment for later appends.

    Returns:
        The :class:`RaggedKV`; its buffers hold sum(len(keep_idx[b][h]) + headroom) rows.
    """
    if keys.dim() != 4 or keys.shape != values.shape:
        raise ValueError(f"keys {tuple(keys.shape)} and values {tuple(values.shape)} must both be "
                         "(batch, kv_heads, tokens, head_dim)")
    batch, kv_heads, tokens, head_dim = keys.shape
    if len(keep_idx) != batch or any(len(heads) != kv_heads for heads in keep_idx):
        raise ValueError(f"keep_idx must hold {batch} lists of {kv_heads} index tensors (one per KV head)")
    kept = [index.to(keys.device, torch.long).reshape(-1) for heads in keep_idx for index in heads]
    indices = torch.cat(kept)
    if indices.numel() and bool(((indices < 0) | (indices >= tokens)).any()):  # one check, one sync
        raise ValueError(f"keep_idx holds an index outside [0, {tokens})")
    lengths = torch.tensor([index.numel() for index in kept], device=keys.device).reshape(batch, kv_heads)
    offsets, capacities = _layout(lengths, headroom)
    segment_starts = torch.arange(len(kept), device=keys.device) * tokens
    source = indices + torch.repeat_interleave(segment_starts, lengths.reshape(-1))
    rows = int(capacities.sum())
    packed = []
    for dense in (keys, values):
        buffer = dense.new_zeros(rows, head_dim)
        buffer[segment_rows(offsets, lengths)] = dense.reshape(-1, head_dim)[source]
        packed.append(buffer)
    return RaggedKV(packed[0], packed[1], offsets, lengths, capacities)


def append_ragged(cache: RaggedKV, new_keys: torch.Tensor, new_values: torch.Tensor, *, headroom: int = 0) -> RaggedKV:
    """Append the same number of new tokens to every segment (a decode step or a prefill chunk).

    In place when every segment has room (the returned cache shares ``cache``'s buffers);
    otherwise the buffers are reallocated with ``headroom`` spare rows per segment after the
    new tokens, at the cost of one copy of the held tokens.

    Args:
        cache: the layer's ragged storage.
        new_keys: (batch, kv_heads, new, head_dim) keys of the newest tokens, oldest first.
        new_values: (batch, kv_heads, new, head_dim) their values.
        headroom: spare rows per segment if the buffers are reallocated.

    Returns:
        The cache with ``lengths + new`` tokens per segment, the new ones last.
    """
    expected = (*cache.lengths.shape, new_keys.shape[2] if new_keys.dim() == 4 else -1, cache.keys.shape[-1])
    if new_keys.dim() != 4 or tuple(new_keys.shape) != expected or new_values.shape != new_keys.shape:
        raise ValueError(f"new_keys {tuple(new_keys.shape)} and new_values {tuple(new_values.shape)} must both be "
                         f"(batch, kv_heads, new, head_dim) = {expected}")
    new = new_keys.shape[2]
    lengths = cache.lengths + new
    if bool((lengths <= cache.capacities).all()):
        keys, values, offsets, capacities = cache.keys, cache.values, cache.offsets, cache.capacities
    else:
        offsets, capacities = _layout(lengths, headroom)
        rows = int(capacities.sum())
        keys = cache.keys.new_zeros(rows, cache.keys.shape[-1])
        values = cache.values.new_zeros(rows, cache.values.shape[-1])
        source = segment_rows(cache.offsets, cache.lengths)
        target = segment_rows(offsets, cache.lengths)
        keys[target] = cache.keys[source]
        values[target] = cache.values[source]
    target = ((offsets + cache.lengths)[..., None] + torch.arange(new, device=offsets.device)).reshape(-1)
    keys[target] = new_keys.reshape(-1, keys.shape[-1]).to(keys.dtype)
    values[target] = new_values.reshape(-1, values.shape[-1]).to(values.dtype)
    return RaggedKV(keys, values, offsets, lengths, capacities)
