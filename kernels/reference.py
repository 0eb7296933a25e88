"""PyTorch references for the fused compression kernels.

These are the CPU path of the toolkit and the oracle the Triton kernels are
tested against: every kernel in this folder has the same semantics as the
function of the same stem here.
"""

from __future__ import annotations

from typing import Protocol, Sequence

import torch

# float32 exp underflows below about -87.3; denormal results are slow on CPU
EXP_FLOOR = -87.0


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
    queries = q.to(compute).contiguous().reshape(batch, kv_heads, q_heads // kv_heads, num_queries, head_dim)
    logits = torch.einsum("bhgmd,bhnd->bhgmn", queries, k.to(compute)) * scale
    logits = logits + key_bias.to(compute)[:, :, None, None, :]
    if causal:
        visible = causal_key_mask(num_queries, num_keys, q.device)
        logits = logits.masked_fill(~visible, float("-inf"))
    # The shift is detached: softmax does not depend on it, and a detached shift
    # keeps -inf logits from sending NaN gradients through amax.
    row_max = logits.detach().amax(dim=-1, keepdim=True)
    row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
    # Shifted logits below float32's exp range become -inf: their weight would underflow anyway, and
    # CPU exp takes a slow path (about 20x) on inputs that produce denormals.
    shifted = logits - row_max
    weights = torch.exp(shifted.masked_fill(shifted < EXP_FLOOR, float("-inf")))
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


class Factors(Protocol):
    """A matrix M (batch, kv_heads, n, d) held as C·U·R plus a sparse residual S.

    Structurally :class:`curkv_train.runtime.cur.CurFactors` (the kernels do not import
    the runtime).

    Attributes:
        columns: (batch, kv_heads, n, c) C, the selected channels of every token.
        core: (batch, kv_heads, c, r) U.
        rows: (batch, kv_heads, r, d) R, the selected tokens.
        residual_values: (batch, kv_heads, m) the residual entries, or None.
        residual_index: (batch, kv_heads, m) their flat indices into n·d, ascending per
            (batch, KV head) (the Triton kernel relies on the order), or None.
    """

    columns: torch.Tensor
    core: torch.Tensor
    rows: torch.Tensor
    residual_values: torch.Tensor | None
    residual_index: torch.Tensor | None


def grouped_queries(q: torch.Tensor, kv_heads: int, dtype: torch.dtype) -> torch.Tensor:
    """(batch, q_heads, M, d) queries as (batch, kv_heads, group·M, d) rows in ``dtype``.

    Row g·M + m of KV head h is query m of query head h·group + g.
    """
    batch, q_heads, num_queries, head_dim = q.shape
    return q.to(dtype).reshape(batch, kv_heads, q_heads // kv_heads * num_queries, head_dim)


def factored_logits(queries: torch.Tensor, keys: Factors) -> torch.Tensor:
    """Unscaled logits q·(C·U·R + S)ᵀ of query rows against a factored block, no (n × d) transient.

    Args:
        queries: (batch, kv_heads, rows, d) in the compute dtype.
        keys: factors of (batch, kv_heads, n, d) keys.

    Returns:
        (batch, kv_heads, rows, n): ((q·Rᵀ)·Uᵀ)·Cᵀ plus, for each residual entry (j, ch)
        with value s, q[ch]·s added to logit j.
    """
    dtype = queries.dtype
    channels = queries @ keys.rows.to(dtype).transpose(-1, -2) @ keys.core.to(dtype).transpose(-1, -2)
    logits = channels @ keys.columns.to(dtype).transpose(-1, -2)
    if keys.residual_values is not None:
        token, channel = _residual_coordinates(keys.residual_index, queries.shape[-1], queries.shape[-2])
        terms = queries.gather(-1, channel) * keys.residual_values.to(dtype).unsqueeze(-2)
        logits.scatter_add_(-1, token, terms)
    return logits


def factored_values(probs: torch.Tensor, values: Factors) -> torch.Tensor:
    """p·(C·U·R + S) for probability rows over a factored block's tokens, no (n × d) transient.

    Args:
        probs: (batch, kv_heads, rows, n) in the compute dtype.
        values: factors of (batch, kv_heads, n, d) values.

    Returns:
        (batch, kv_heads, rows, d): ((p·C)·U)·R plus, for each residual entry (j, ch) with
        value s, p[j]·s added to output channel ch.
    """
    dtype = probs.dtype
    out = probs @ values.columns.to(dtype) @ values.core.to(dtype) @ values.rows.to(dtype)
    if values.residual_values is not None:
        token, channel = _residual_coordinates(values.residual_index, out.shape[-1], probs.shape[-2])
        terms = probs.gather(-1, token) * values.residual_values.to(dtype).unsqueeze(-2)
        out.scatter_add_(-1, channel, terms)
    return out


def _residual_coordinates(index: torch.Tensor, channels: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(token, channel) of flat residual indices (batch, kv_heads, m), expanded to (batch, kv_heads, rows, m)."""
    index = index.long()
    token = torch.div(index, channels, rounding_mode="floor")
    channel = index - token * channels
    shape = (*index.shape[:-1], rows, index.shape[-1])
    return token.unsqueeze(-2).expand(shape), channel.unsqueeze(-2).expand(shape)


def factored_attention_reference(
    q: torch.Tensor,
    cold_keys: Sequence[Factors],
    cold_values: Sequence[Factors],
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scale: float | None = None,
    causal: bool = True,
) -> torch.Tensor:
    """Attention over [factored cold blocks | dense keys] in one softmax, GQA, fp32 accumulation.

    Same result as :func:`scored_attention_reference` (zero bias) over the keys
    [reconstruct(cold_keys[0]) | ... | k] and values likewise, without materialising any
    cold block: its logits are ((q·Rᵀ)·Uᵀ)·Cᵀ plus the residual's terms and its output
    ((p·C_v)·U_v)·R_v plus p·S_v.

    Args:
        q: (batch, q_heads, M, head_dim) queries; query head h reads KV head h // group.
        cold_keys, cold_values: per cold block, factors of its (batch, kv_heads, n_b, head_dim)
            keys and (batch, kv_heads, n_b, head_dim_v) values (:class:`Factors`). Cold
            tokens precede every query: always visible.
        k: (batch, kv_heads, N, head_dim) dense keys (the last M of them the queries' own
            when causal).
        v: (batch, kv_heads, N, head_dim_v) dense values.
        scale: logit scale, default head_dim ** -0.5.
        causal: bottom-right causal mask over the dense keys (query i sees dense key
            j <= i + N - M).

    Returns:
        (batch, q_heads, M, head_dim_v) in q's dtype; rows that see no key are 0.
    """
    if len(cold_keys) != len(cold_values):
        raise ValueError(f"got {len(cold_keys)} cold key blocks but {len(cold_values)} cold value blocks")
    batch, q_heads, num_queries, head_dim = q.shape
    kv_heads, num_keys = k.shape[1], k.shape[2]
    scale = head_dim**-0.5 if scale is None else scale
    compute = _compute_dtype(q)
    queries = grouped_queries(q, kv_heads, compute)
    dense = queries @ k.to(compute).transpose(-1, -2)
    if causal:
        visible = causal_key_mask(num_queries, num_keys, q.device).repeat(q_heads // kv_heads, 1)
        dense = dense.masked_fill(~visible, float("-inf"))
    logits = torch.cat([factored_logits(queries, block) for block in cold_keys] + [dense], dim=-1)
    probs = torch.softmax(logits * scale, dim=-1)
    if causal and num_queries > num_keys and not cold_keys:
        probs = probs.nan_to_num(0.0)  # the first M - N queries see no key at all: they output 0
    cold_probs = probs.split([block.columns.shape[-2] for block in cold_keys] + [num_keys], dim=-1)
    out = cold_probs[-1] @ v.to(compute)
    for block_probs, block in zip(cold_probs[:-1], cold_values):
        out = out + factored_values(block_probs, block)
    return out.reshape(batch, q_heads, num_queries, v.shape[-1]).to(q.dtype)


def right_aligned_segments(
    keys: torch.Tensor, values: torch.Tensor, offsets: torch.Tensor, lengths: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A temporary padded view of ragged segments, each right-aligned, for computing on them.

    Segment s = (b, h) lands at positions N − lengths[s] ..< N of a width N = max(lengths)
    view, so its newest token is last, as in a dense cache; the padding on the left gets
    key bias -inf and zero keys and values (it reads no row outside the segments). Bottom-right
    causal masking over the view is then exactly per-segment bottom-right causal masking.

    Args:
        keys: (rows, head_dim) packed keys; values: (rows, head_dim_v) packed values.
        offsets: (batch, kv_heads) int first row of each segment.
        lengths: (batch, kv_heads) int tokens per segment.

    Returns:
        (keys (batch, kv_heads, N, head_dim), values (batch, kv_heads, N, head_dim_v),
        key_bias (batch, kv_heads, N) float32: 0 on held tokens, -inf on padding).
    """
    width = int(lengths.max()) if lengths.numel() else 0
    position = torch.arange(width, device=keys.device) - (width - lengths.long())[..., None]
    held = position >= 0
    rows = (offsets.long()[..., None] + position).clamp(0, max(keys.shape[0] - 1, 0))
    key_bias = torch.zeros(held.shape, device=keys.device).masked_fill(~held, float("-inf"))
    if keys.shape[0] == 0:  # nothing held anywhere: width is 0 too
        return keys.new_zeros(*held.shape, keys.shape[-1]), values.new_zeros(*held.shape, values.shape[-1]), key_bias
    # Padding reads a clamped row; zero it so nothing outside the segments (headroom, NaN or not) reaches the logits.
    padding = ~held[..., None]
    return keys[rows].masked_fill(padding, 0.0), values[rows].masked_fill(padding, 0.0), key_bias


def ragged_attention_reference(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    offsets: torch.Tensor,
    lengths: torch.Tensor,
    *,
    scale: float | None = None,
) -> torch.Tensor:
    """Causal attention of the newest queries over ragged KV segments, GQA, fp32 accumulation.

    Segment (b, h) is rows ``offsets[b, h] ..< offsets[b, h] + lengths[b, h]`` of ``keys`` and
    ``values``, oldest token first (:mod:`curkv_train.kernels.ragged`). The M queries are the
    newest M tokens of every segment: query i sees segment tokens t <= lengths − M + i.
    Computed on a temporary right-aligned padded view (:func:`right_aligned_segments`).

    Args:
        q: (batch, q_heads, M, head_dim) queries; query head h reads KV head h // (q_heads / kv_heads).
        keys: (rows, head_dim) packed keys.
        values: (rows, head_dim_v) packed values.
        offsets: (batch, kv_heads) int first row of each segment.
        lengths: (batch, kv_heads) int tokens per segment.
        scale: logit scale, default head_dim ** -0.5.

    Returns:
        (batch, q_heads, M, head_dim_v) in q's dtype; a query that sees no token (lengths − M + i < 0) gives 0.
    """
    check_ragged_shapes(q, keys, values, offsets, lengths)
    check_ragged_bounds(keys, offsets, lengths)
    if not lengths.numel() or int(lengths.max()) == 0:  # no segment holds a token: every query gives 0
        return q.new_zeros(*q.shape[:3], values.shape[-1])
    padded_keys, padded_values, key_bias = right_aligned_segments(keys, values, offsets, lengths)
    return scored_attention_reference(q, padded_keys, padded_values, key_bias, scale=scale, causal=True)


def check_ragged_shapes(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, offsets: torch.Tensor, lengths: torch.Tensor
) -> None:
    """A ValueError unless the ragged attention arguments' shapes agree (no device sync)."""
    if q.dim() != 4 or keys.dim() != 2 or values.dim() != 2:
        raise ValueError(f"q must be (batch, q_heads, M, head_dim) and keys, values (rows, head_dim); got "
                         f"{tuple(q.shape)}, {tuple(keys.shape)}, {tuple(values.shape)}")
    if keys.shape[0] != values.shape[0] or keys.shape[1] != q.shape[-1]:
        raise ValueError(f"keys {tuple(keys.shape)} must be (rows, {q.shape[-1]}) with values' {values.shape[0]} rows")
    if offsets.dim() != 2 or offsets.shape != lengths.shape or offsets.shape[0] != q.shape[0]:
        raise ValueError(f"offsets {tuple(offsets.shape)} and lengths {tuple(lengths.shape)} must both be "
                         f"(batch, kv_heads) with batch = {q.shape[0]}")
    kv_heads = offsets.shape[1]
    if kv_heads == 0 or q.shape[1] % kv_heads:
        raise ValueError(f"q_heads ({q.shape[1]}) must be a multiple of kv_heads ({kv_heads})")
    if offsets.dtype.is_floating_point or lengths.dtype.is_floating_point:
        raise ValueError(f"offsets and lengths must be integer tensors, got {offsets.dtype} and {lengths.dtype}")


def check_ragged_bounds(keys: torch.Tensor, offsets: torch.Tensor, lengths: torch.Tensor) -> None:
    """A ValueError unless every segment lies inside the buffer (one device sync)."""
    if offsets.numel() and bool(((offsets < 0) | (lengths < 0) | (offsets + lengths > keys.shape[0])).any()):
        raise ValueError(f"every segment must satisfy 0 <= offsets, 0 <= lengths, offsets + lengths <= {keys.shape[0]} "
                         "rows of keys")
