"""Triton attention over ragged KV segments (forward only, inference).

Semantics are those of :func:`curkv_train.kernels.reference.ragged_attention_reference`:
segment (b, h) is rows ``offsets[b, h] ..< offsets[b, h] + lengths[b, h]`` of packed
(rows, head_dim) keys and values (format in :mod:`curkv_train.kernels.ragged`); the M
queries are the newest M tokens of every segment, so query i sees segment tokens
t <= length − M + i (bottom-right causal per segment); GQA, fp32 accumulation.

One program per (row block, token split, batch · KV head). Its rows are the KV head's
group of query heads times the M queries, query-major (row r is query r // group of
query head h·group + r % group): the group shares one pass over its segment, and a row
block's last visible token follows from its last query. The program streams its split of
the segment in key blocks of ``BLOCK_N`` rows with an online softmax and writes its
normalised fp32 output and log-sum-exp; splits (flash-decoding, for decode steps that
have few rows and long segments) are merged by log-sum-exp (:func:`merge_partials`).
Nothing is padded: a segment's blocks end at its own length, read through its offset.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from curkv_train.kernels.factored_attention_triton import merge_partials
from curkv_train.kernels.limits import MIN_BLOCK, check_head_dim, check_operands
from curkv_train.kernels.reference import check_ragged_bounds, check_ragged_shapes
from curkv_train.kernels.scored_attention_triton import _dot, _finite_or_zero, _interpreting

INTERPRET_MAX_BLOCK = 64
MAX_SPLITS = 32
TOKENS_PER_SPLIT_MIN = 256  # a split shorter than this costs more in its launch share and merge than it saves


@triton.jit
def _ragged_partial_kernel(
    Q, K, V, Offsets, Lengths, O, LSE, scale,
    stride_qb, stride_qh, stride_qm, stride_k, stride_v,
    B, Hkv, M, GROUP, NUM_SPLITS,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT_F32: tl.constexpr, IEEE: tl.constexpr,
):
    """Partial attention of one row block over one split of its segment.

    Writes O[split, b, head, query, :] (fp32, normalised over the split's visible tokens)
    and LSE[split, b, head, query] (-inf where the split shows the row no token).
    """
    pid_m = tl.program_id(0)
    split = tl.program_id(1)
    bh = tl.program_id(2).to(tl.int64)
    b = bh // Hkv
    hk = bh % Hkv
    offset = tl.load(Offsets + bh).to(tl.int64)
    length = tl.load(Lengths + bh).to(tl.int64)

    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < GROUP * M
    query = rows // GROUP
    head = hk * GROUP + rows % GROUP
    offs_d = tl.arange(0, HEAD_DIM)
    q_ptrs = Q + b * stride_qb + head[:, None] * stride_qh + query[:, None] * stride_qm + offs_d[None, :]
    q = tl.load(q_ptrs, mask=row_ok[:, None], other=0.0)
    last_visible = length - M + query  # per row: tokens t <= last_visible are seen

    # The row block sees tokens < length − M + (its last query) + 1; this split takes its share of the blocks.
    last_query = (tl.minimum(pid_m * BLOCK_M + BLOCK_M, GROUP * M) - 1) // GROUP
    block_end = tl.minimum(length, length - M + last_query + 1)
    blocks_per_split = tl.cdiv(tl.cdiv(length, BLOCK_N), NUM_SPLITS)
    start = split * blocks_per_split * BLOCK_N
    end = tl.minimum(block_end, start + blocks_per_split * BLOCK_N)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    for start_n in range(start, end, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        in_split = offs_n < end
        token_rows = offset + offs_n
        k = tl.load(K + token_rows[:, None] * stride_k + offs_d[None, :], mask=in_split[:, None], other=0.0)
        s = _dot(q, tl.trans(k), DOT_F32, IEEE) * scale
        visible = in_split[None, :] & (offs_n[None, :] <= last_visible[:, None]) & row_ok[:, None]
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = _finite_or_zero(m_new)
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(V + token_rows[:, None] * stride_v + offs_d[None, :], mask=in_split[:, None], other=0.0)
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, DOT_F32, IEEE)
        m_i = m_new

    seen = l_i > 0.0
    out = acc / tl.where(seen, l_i, 1.0)[:, None]
    lse = tl.where(seen, _finite_or_zero(m_i) + tl.log(tl.where(seen, l_i, 1.0)), float("-inf"))
    row_ptrs = ((split * B + b) * Hkv * GROUP + head) * M + query
    tl.store(LSE + row_ptrs, lse, mask=row_ok)
    tl.store(O + row_ptrs[:, None] * HEAD_DIM + offs_d[None, :], out, mask=row_ok[:, None])


def _pad(size: int, cap: int) -> int:
    """Power of two covering ``size`` in [MIN_BLOCK, cap]."""
    return max(MIN_BLOCK, min(cap, triton.next_power_of_2(max(size, 1))))


def _blocks(rows: int, mean_length: int, head_dim: int, block_n: int | None) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps): small fixed blocks under the interpreter; on CUDA, 64-wide tiles
    up to head_dim 128 and 32-wide at 256 (Gemma 3), where fp32 [BLOCK_M, HEAD_DIM] accumulators fill registers."""
    if _interpreting():
        return _pad(rows, INTERPRET_MAX_BLOCK), block_n or _pad(mean_length, INTERPRET_MAX_BLOCK), 4
    wide = head_dim > 128
    return _pad(rows, 32 if wide else 64), block_n or (32 if wide else 64), 8 if wide else 4


def _num_splits(row_blocks: int, segments: int, mean_length: int, device: torch.device, requested: int | None) -> int:
    """Token splits per segment: enough programs to fill the GPU (about 2 per SM), each split at least
    :data:`TOKENS_PER_SPLIT_MIN` tokens of an average segment; 1 under the interpreter unless requested."""
    if requested is not None:
        if requested < 1:
            raise ValueError(f"num_splits must be >= 1, got {requested}")
        return requested
    if _interpreting() or device.type != "cuda":
        return 1
    target = 2 * torch.cuda.get_device_properties(device).multi_processor_count
    by_length = triton.cdiv(max(mean_length, 1), TOKENS_PER_SPLIT_MIN)
    return max(1, min(MAX_SPLITS, by_length, target // max(row_blocks * segments, 1)))


def _validate(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, offsets: torch.Tensor,
              lengths: torch.Tensor, check_bounds: bool) -> None:
    """Shape, dtype and device checks with clear messages; bounds too when ``check_bounds`` (one sync)."""
    check_ragged_shapes(q, keys, values, offsets, lengths)
    check_head_dim(q.shape[-1])
    if values.shape[-1] != q.shape[-1]:
        raise ValueError(f"the kernel needs values' head_dim equal to the keys' ({q.shape[-1]}), "
                         f"got {values.shape[-1]}")
    floats = {"q": q, "keys": keys, "values": values}
    check_operands({**floats, "offsets": offsets, "lengths": lengths}, floats)
    if check_bounds:
        check_ragged_bounds(keys, offsets, lengths)


def ragged_attention_triton(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    offsets: torch.Tensor,
    lengths: torch.Tensor,
    *,
    scale: float | None = None,
    block_n: int | None = None,
    num_splits: int | None = None,
    check_bounds: bool = True,
) -> torch.Tensor:
    """Causal GQA attention of the newest M queries over ragged KV segments (Triton, forward only).

    Args:
        q: (batch, q_heads, M, head_dim) queries, fp16 / bf16 / fp32; head_dim a power of two >= 16.
        keys: (rows, head_dim) packed keys, q's dtype.
        values: (rows, head_dim) packed values, q's dtype.
        offsets: (batch, kv_heads) int first row of each segment.
        lengths: (batch, kv_heads) int tokens per segment (the last M of each the queries' own).
        scale: logit scale, default head_dim ** -0.5.
        block_n: tokens per inner step (power of two >= 16); None picks one.
        num_splits: token splits per segment (merged by log-sum-exp); None picks one.
        check_bounds: check that every segment lies in the buffer (one device sync); a caller
            that built offsets and lengths itself may pass False.

    Returns:
        (batch, q_heads, M, head_dim) in q's dtype; a query that sees no token gives 0.
    """
    _validate(q, keys, values, offsets, lengths, check_bounds)
    if block_n is not None and (block_n < MIN_BLOCK or block_n & (block_n - 1)):
        raise ValueError(f"block_n must be a power of two >= {MIN_BLOCK}, got {block_n}")
    batch, q_heads, num_queries, head_dim = q.shape
    kv_heads = offsets.shape[1]
    group = q_heads // kv_heads
    scale = head_dim**-0.5 if scale is None else float(scale)
    if q.numel() == 0 or keys.shape[0] == 0:
        return q.new_zeros(q.shape)
    q = q if q.stride(-1) == 1 else q.contiguous()
    keys, values = (t if t.stride(-1) == 1 else t.contiguous() for t in (keys, values))
    mean_length = keys.shape[0] // max(batch * kv_heads, 1)  # the buffer's rows: no sync
    block_m, block_n, warps = _blocks(group * num_queries, mean_length, head_dim, block_n)
    row_blocks = triton.cdiv(group * num_queries, block_m)
    splits = _num_splits(row_blocks, batch * kv_heads, mean_length, q.device, num_splits)
    outs = torch.empty((splits, batch, q_heads, num_queries, head_dim), device=q.device, dtype=torch.float32)
    lses = torch.empty((splits, batch, q_heads, num_queries), device=q.device, dtype=torch.float32)
    _ragged_partial_kernel[(row_blocks, splits, batch * kv_heads)](
        q, keys, values, offsets.contiguous(), lengths.contiguous(), outs, lses, scale,
        *q.stride()[:3], keys.stride(0), values.stride(0),
        batch, kv_heads, num_queries, group, splits,
        HEAD_DIM=head_dim, BLOCK_M=block_m, BLOCK_N=block_n,
        DOT_F32=_interpreting(), IEEE=q.dtype == torch.float32, num_warps=warps, num_stages=2,
    )
    out = outs[0] if splits == 1 else merge_partials(outs, lses)
    return out.to(q.dtype)
