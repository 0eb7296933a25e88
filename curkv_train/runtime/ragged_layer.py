"""A CurKVCache layer under joint allocation: its KV heads hold different counts, in ragged storage.

Until its first compression the layer is a :class:`~curkv_train.runtime.layer.CurKVLayer` (dense: a prefill's
tokens, every head the same). That compression moves it to a :class:`~curkv_train.kernels.RaggedKV` and from then
on each (batch, KV head) segment holds [sinks | its kept tokens | hot tier] in age order, nothing padded or masked
in place of an evicted token. Beside the packed keys and values sit, row for row, the tokens' positions (narrowest
integer dtype) and, for scorers that score on arrival, their logits.

Memory: a compression packs the kept tokens with no spare room; an append that finds a segment full reallocates
every segment with room for up to one window (no more than arrives before the next compression, as the dense
layers' buffers), so between compressions each segment holds at most a window of unused rows.

Attention: while the heads hold the same count, :meth:`update` returns a dense (batch, kv_heads, held + new,
head_dim) view of the storage and the model's own attention runs on it; once they differ it returns the new tokens'
keys and values only and leaves the storage in :attr:`ragged_step`, which the runtime's attention wrapper reads
through :func:`~curkv_train.kernels.ragged_attention` (:mod:`curkv_train.runtime.attention`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from curkv_train.core.errors import CurKVError
from curkv_train.kernels import RaggedKV, append_ragged
from curkv_train.runtime import cur
from curkv_train.runtime.joint import Competition, joint_choice
from curkv_train.runtime.layer import CurKVLayer


def packed_layout(lengths: torch.Tensor, room: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(offsets, capacities) (..., batch, kv_heads) of segments of ``lengths + room`` rows, row-major, as
    :mod:`curkv_train.kernels.ragged` lays them out (each leading index, e.g. a layer, its own buffer)."""
    capacities = lengths + room if room else lengths  # an add is an operator too
    flat = capacities.reshape(*capacities.shape[:-2], -1)  # leading dimensions (several layers) laid out apart
    return (torch.cumsum(flat, -1) - flat).reshape(capacities.shape), capacities


def segment_rows(offsets: torch.Tensor, width: int) -> torch.Tensor:
    """(batch, kv_heads, width) buffer row of each segment's first ``width`` local places."""
    return offsets[..., None] + torch.arange(width, device=offsets.device)


class RaggedCurKVLayer(CurKVLayer):
    """One decoder layer's cache under ``TierConfig(allocation="joint")`` (module docstring).

    Attributes (ragged, after the first compression):
        store: the layer's :class:`~curkv_train.kernels.RaggedKV`, or None while dense.
        row_positions: (rows,) absolute position of each buffer row's token (rows beyond a length: stale).
        row_scores: (rows,) stored arrival logits, for scorers that score on arrival; else None.
        lengths, capacities, warm: (batch, kv_heads) int64 on the host: tokens held, rows owned, kept tokens
            between the sinks and the hot tier (mirrors of the store's, read without a device sync).
        ragged_step: the storage this step's attention reads, set by :meth:`update` while the heads' counts
            differ and taken by the attention wrapper; None otherwise.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.store: RaggedKV | None = None
        self.row_positions: torch.Tensor | None = None
        self.row_scores: torch.Tensor | None = None
        self.lengths = self.capacities = self.warm = torch.zeros(0, dtype=torch.long)
        self.pending: Competition | None = None  # the compression under way (begin_compression .. finish)

    # --- sizes -----------------------------------------------------------------------------------------------------

    @property
    def held_tokens(self) -> int:
        """Tokens held per (batch, KV head): the largest head's once ragged."""
        return super().held_tokens if self.store is None else int(self.lengths.max())

    def held_lengths(self) -> torch.Tensor:
        """(batch, kv_heads) tokens each head holds (host)."""
        if self.store is None:
            return torch.full(tuple(self.keys.shape[:2]), self.keys.shape[-2], dtype=torch.long)
        return self.lengths.clone()

    def nbytes(self) -> int:
        """Bytes held: the packed keys and values (spare rows included), the rows' positions and stored scores, and
        the observation; the dense layer's count before the first compression."""
        if self.store is None:
            return super().nbytes()
        rows = [self.row_positions] + ([] if self.row_scores is None else [self.row_scores])
        return (self.store.bytes_held + sum(each.numel() * each.element_size() for each in rows)
                + self.observer.nbytes())

    # --- update ----------------------------------------------------------------------------------------------------

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor,
               cache_kwargs: dict[str, Any] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Append new tokens, compress if due, and return what this step attends to.

        Args:
            key_states, value_states: (batch, kv_heads, new, head_dim) post-RoPE keys / values.

        Returns:
            Dense, or while the heads hold the same count: (batch, kv_heads, held_before + new, head_dim) keys and
            values. Ragged with different counts: ``key_states``, ``value_states`` themselves; the attention reads
            :attr:`ragged_step`.
        """
        self.ragged_step = None
        if self.store is None:
            return super().update(key_states, value_states, cache_kwargs)
        self.projected_keys = None
        self._append_rows(key_states, value_states)
        keys, values = self._dense_view()
        if keys is None:
            self.ragged_step, keys, values = self.store, key_states, value_states
        if self._compression_due():
            self.compress()
        return keys, values

    def _dense_view(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(batch, kv_heads, held, head_dim) views of the storage when every segment holds and owns the same
        count, else (None, None)."""
        length, capacity = int(self.lengths.flatten()[0]), int(self.capacities.flatten()[0])
        if bool((self.lengths != length).any() or (self.capacities != capacity).any()):
            return None, None
        shape = (*self.lengths.shape, capacity, -1)
        return (self.store.keys.view(shape)[..., :length, :], self.store.values.view(shape)[..., :length, :])

    def _append_rows(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Append to every segment (:func:`~curkv_train.kernels.append_ragged`) and to the rows' positions and
        scores, reallocating with room for up to a window when a segment is full."""
        new = key_states.shape[-2]
        spare = max(0, self._room() - new)
        grows = bool((self.lengths + new > self.capacities).any())
        old = self.store
        self.store = append_ragged(old, key_states, value_states, headroom=spare)
        dtype = cur.narrow_int_dtype(self.seen + new)
        positions = torch.arange(self.seen, self.seen + new, device=self.device, dtype=dtype)
        self.row_positions = self._append_side(self.row_positions.to(dtype), old, grows,
                                               positions.expand(*key_states.shape[:2], new))
        if self.row_scores is not None:
            arrived = self.observer.take_arrival_scores(new, self.layer_idx).to(self.row_scores.dtype)
            self.row_scores = self._append_side(self.row_scores, old, grows, arrived)
        self.lengths = self.lengths + new
        if grows:
            self.capacities = self.lengths + spare
        self.seen += new
        self.n_hot += new

    def _append_side(self, rows: torch.Tensor, old: RaggedKV, grows: bool, new: torch.Tensor) -> torch.Tensor:
        """``rows`` (old rows,) laid out like the new store, with ``new`` (batch, kv_heads, count) after each
        segment's held tokens."""
        if grows:
            moved = rows.new_zeros(self.store.keys.shape[0])
            width = int(self.lengths.max())
            held = torch.arange(width)[None, None] < self.lengths[..., None]
            moved[segment_rows(self.store.offsets, width)[held.to(rows.device)]] = \
                rows[segment_rows(old.offsets, width)[held.to(rows.device)]]
            rows = moved
        target = segment_rows(self.store.offsets + self.lengths.to(rows.device), new.shape[-1])
        rows[target.reshape(-1)] = new.reshape(-1)
        return rows

    # --- compression -----------------------------------------------------------------------------------------------

    def begin_compression(self, like: Competition | None = None) -> Competition | None:
        """Age the tokens past the hot tier into the candidates and say what competes (None: nothing aged). A dense
        layer (every head the prefill's tokens) stays dense until :meth:`finish` gathers what it keeps into packed
        storage. ``like``: the competition of another dense layer that saw the same tokens (a prefill's joint
        compression, :func:`keep_jointly`), taken as this one's rather than built again."""
        settings = self.settings
        aged = self.n_hot - settings.hot_tokens
        if aged <= 0:
            return None
        self.compressible_seen += aged
        self.n_hot = settings.hot_tokens
        target = settings.target(self.compressible_seen, self.seen, self.layer_idx)
        if like is not None:
            if self.store is not None or like.target != target or like.n_sink != self.n_sink_held:
                raise CurKVError("a joint compression shared a competition between unlike layers; report this as a bug")
            self.pending = like
            return like
        if self.store is None:
            batch, heads, tokens = self.keys.shape[:3]
            self.lengths = torch.full((batch, heads), tokens, dtype=torch.long)
            self.warm = torch.full((batch, heads), self.n_warm, dtype=torch.long)
        candidates = self.warm + aged
        recent = torch.clamp(candidates, max=int(settings.recent_share * target + 1e-9))
        self.pending = Competition(candidates, recent, target, self.n_sink_held)
        return self.pending

    @torch.no_grad()
    def compress(self, logits: torch.Tensor | None = None) -> None:
        """Compress this layer alone: its KV heads share the layer's places (:func:`joint_choice`). ``logits``:
        (batch, kv_heads, held) of a dense layer's tokens, if the cache scored them."""
        if logits is not None:
            self.awaiting_scores, self.projected_keys = False, None
        competition = self.begin_compression()
        if competition is None:
            return
        places = competition.places()
        if bool((places >= competition.competing.sum(dim=1)).all()):  # everything fits: nothing to score
            self.finish(None)
            return
        width = int(self.lengths.max())
        logits = self.score_held(width) if logits is None else logits
        competing = competition.competing_mask(width).to(logits.device)
        self.finish(joint_choice(logits, competing, places, competition.floor(self.settings.head_floor)))

    def finish(self, chosen: torch.Tensor | None) -> None:
        """Keep the sinks, the recent candidates, the hot tier and the ``chosen`` (batch, kv_heads, width) competing
        tokens (None: every candidate) of the compression :meth:`begin_compression` began."""
        competition, self.pending = self.pending, None
        width = int(self.lengths.max())
        local = torch.arange(width)
        held = local < self.lengths[..., None]
        kept = held & ~competition.competing_mask(width)
        if chosen is not None:
            kept = kept | chosen[..., :width].cpu()
        else:
            kept = held
        self._keep(kept)
        self.warm = self.lengths - self.n_sink_held - self.n_hot
        self.n_warm = int(self.warm.max())

    def _keep(self, kept: torch.Tensor) -> None:
        """Repack the store with only the ``kept`` (batch, kv_heads, width) local places, no spare rows; a dense
        layer's kept tokens are gathered straight from its tensors (row-major: each segment's in age order)."""
        mask = kept.to(self.device)
        self.lengths = kept.sum(dim=-1)
        if self.store is not None:
            self._repack(segment_rows(self.store.offsets, kept.shape[-1])[mask])
            return
        offsets, self.capacities = packed_layout(self.lengths, 0)
        device_lengths = self.lengths.to(self.device)
        self._take_dense(mask, offsets.to(self.device), device_lengths, device_lengths.clone())

    def adopt_kept(self, kept: tuple[torch.Tensor, torch.Tensor, torch.Tensor], sizes: "PackedSizes") -> None:
        """Finish a dense layer's begun compression (as :meth:`finish` does) from a choice made for several layers at
        once (:func:`keep_jointly`): ``kept`` the (batch, kv_head, token) index of each kept token, segment after
        segment in age order; ``sizes`` its segments' (:class:`PackedSizes`)."""
        self.pending = None
        self.lengths, self.capacities, self.warm, self.n_warm = sizes.lengths, sizes.lengths, sizes.warm, sizes.n_warm
        self._take_dense(kept, sizes.offsets, sizes.device_lengths, sizes.device_capacities)

    def _take_dense(self, kept: torch.Tensor | tuple[torch.Tensor, ...], offsets: torch.Tensor,
                    lengths: torch.Tensor, capacities: torch.Tensor) -> None:
        """Move a dense layer's ``kept`` tokens (a (batch, kv_heads, tokens) bool mask or its index, row-major) into
        a packed store of segments at ``offsets`` (device tensors, (batch, kv_heads)); positions and stored scores
        follow, and the dense tensors are dropped."""
        self.store = RaggedKV(self.keys[kept], self.values[kept], offsets, lengths, capacities)
        self.row_positions = self.positions[kept]
        self.row_scores = None if self.token_scores is None else self.token_scores[kept]
        self.keys = self.values = self.positions = self.token_scores = None

    def _repack(self, rows: torch.Tensor) -> None:
        """Rebuild the store from its ``rows`` (the held tokens, segment by segment, already counted in
        ``self.lengths``), with no spare rows; positions and stored scores follow."""
        offsets, self.capacities = packed_layout(self.lengths, 0)
        device_lengths = self.lengths.to(self.device)
        self.store = RaggedKV(self.store.keys[rows], self.store.values[rows], offsets.to(self.device),
                              device_lengths, device_lengths.clone())
        self.row_positions = self.row_positions[rows]
        if self.row_scores is not None:
            self.row_scores = self.row_scores[rows]

    def score_held(self, width: int) -> torch.Tensor:
        """(batch, kv_heads, width) logits of each head's held tokens (−inf past its length), in one scoring of a
        dense view: each head's tokens, then its last one repeated up to ``width``, masked (``valid``), so features
        that normalise over a head's tokens see exactly its tokens."""
        index = segment_rows(self.store.offsets, width)
        last = (self.store.lengths - 1).clamp_min(0)[..., None]
        index = torch.minimum(index, self.store.offsets[..., None] + last)  # a shorter head's last row, repeated
        valid = torch.arange(width, device=self.device) < self.store.lengths[..., None]
        scores = None if self.row_scores is None else self.row_scores[index]
        logits = self.score_fn(self.layer_idx, self.store.keys[index], self.store.values[index],
                               self.row_positions[index].long(), self.seen, self.observer.observation(), scores, None,
                               valid=valid)
        return logits.masked_fill(~valid, float("-inf"))

    # --- batch operations and crop ---------------------------------------------------------------------------------

    def _map_batch(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Apply a batch-dimension operation (index_select, repeat_interleave, indexing) to every held tensor."""
        if self.store is None:
            super()._map_batch(fn)
            return
        order = fn(torch.arange(self.lengths.shape[0], device=self.device)).cpu()
        self.lengths, self.warm = self.lengths[order], self.warm[order]
        offsets = self.store.offsets[order.to(self.device)]
        width = int(self.lengths.max())
        held = torch.arange(width)[None, None] < self.lengths[..., None]
        self._repack(segment_rows(offsets, width)[held.to(self.device)])
        self.observer.map_batch(fn)

    def crop(self, max_length: int) -> None:
        """Drop tokens past ``max_length``; only possible before anything was compressed."""
        if self.store is not None and (max_length < 0 or max_length < self.seen):
            raise CurKVError("a CurKVCache cannot be cropped after it compressed tokens; "
                             "use a fresh cache (assisted generation and cache rollback are not supported)")
        super().crop(max_length)


@dataclass(frozen=True)
class PackedSizes:
    """One layer's segment sizes after a joint compression, each (batch, kv_heads): ``lengths`` and ``warm`` (kept
    tokens between the sinks and the hot tier) on the host, ``offsets``, ``device_lengths`` and
    ``device_capacities`` on the layer's device; ``n_warm`` the largest ``warm``."""

    lengths: torch.Tensor
    warm: torch.Tensor
    n_warm: int
    offsets: torch.Tensor
    device_lengths: torch.Tensor
    device_capacities: torch.Tensor


def keep_jointly(layers: list[RaggedCurKVLayer], chosen: torch.Tensor) -> None:
    """Finish a prefill's first compression of ``layers`` together: what :meth:`RaggedCurKVLayer.finish` does for
    each, from operators batched over the layers (a handful per layer, not tens).

    Args:
        layers: dense layers holding the same tokens, each with the same compression begun
            (:meth:`RaggedCurKVLayer.begin_compression`).
        chosen: (layers, batch, kv_heads, tokens) bool, the competing tokens each layer keeps.
    """
    first = layers[0]
    competing = first.pending.competing_mask(chosen.shape[-1]).to(chosen.device)
    kept = chosen | ~competing  # the sinks, the recent candidates and the hot tier, and the chosen
    device_lengths = kept.sum(dim=-1)  # (layers, batch, kv_heads)
    lengths = device_lengths.cpu()
    warm = lengths - (first.n_sink_held + first.n_hot)
    offsets, _ = packed_layout(device_lengths, 0)
    per_layer = [each.unbind() for each in (lengths, warm, offsets, device_lengths, device_lengths.clone())]
    counts = lengths.flatten(1).sum(dim=1).tolist()
    # (batch, head, token) of every kept token, row-major: layer by layer, each segment's tokens in age order
    rows = [index.split(counts) for index in kept.nonzero(as_tuple=True)[1:]]
    for layer, n_warm, *each in zip(layers, warm.flatten(1).amax(dim=1).tolist(), *rows, *per_layer):
        batch, head, token, sizes = each[0], each[1], each[2], each[3:]
        layer.adopt_kept((batch, head, token), PackedSizes(sizes[0], sizes[1], n_warm, *sizes[2:]))
