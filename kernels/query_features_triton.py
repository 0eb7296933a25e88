"""Triton kernels for the attention-sized parts of the query features (forward only, inference).

:func:`curkv_train.core.features.query_features` spends its time on three products as large as
attention: the window rows' logits against every key (R = g·W rows), the expected attention's
quadratic forms k_jᵀΣ'_g k_j (one per query head g), and ‖W_O^(h,g) v_j‖ (vᵀ·Gram·v). In torch
they are about 22 kernels per layer and an (R × n) tensor per KV head; here they are three
launches: two over (token block, batch · KV head) programs that read each key block
from memory twice and hold no (R × n) tile outside registers, and a small one between them:

* ``_token_pass_kernel``: per token block, each window row's maximum and exp-sum over the block
  (partials of the row's log-sum-exp), the expected-attention logits of every query head of
  the group, and the mean over the group of ‖W_O^(h,g) v_j‖;
* ``_row_lse_kernel``: the partials merged into each row's log-sum-exp;
* ``_window_mass_kernel``: per token block again, each row's softmax share of each token,
  summed over the rows.

Semantics are those of the torch path (:func:`~curkv_train.core.features.window_mass`,
:func:`~curkv_train.core.features.expected_logits`, :func:`~curkv_train.core.features.head_output_norms`
averaged over the group), in float32 with IEEE products; a row that sees no key contributes nothing.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from curkv_train.kernels.limits import check_head_dim
from curkv_train.kernels.scored_attention_triton import _dot, _interpreting

BLOCK_TOKENS = {"cuda": 64, "interpret": 16}
BLOCK_ROWS = {"cuda": 64, "interpret": 16}
MAX_BLOCK_CHANNELS = 64  # a quadratic form's matrix is read 64 columns at a time: (head_dim × 64) fp32


@triton.jit
def _window_logits(Q, QPos, k, kpos, n_ok, bh, offs_r, rows, HEAD_DIM: tl.constexpr):
    """[BLOCK_R, BLOCK_N] logits of rows ``offs_r`` (pre-scaled queries) against the key block ``k``,
    -inf where the key comes after the row's query or either is out of range."""
    offs_d = tl.arange(0, HEAD_DIM)
    r_ok = offs_r < rows
    q = tl.load(Q + (bh * rows + offs_r)[:, None] * HEAD_DIM + offs_d[None, :], mask=r_ok[:, None], other=0.0)
    qpos = tl.load(QPos + offs_r, mask=r_ok, other=-1)
    s = _dot(q, tl.trans(k), True, True)
    visible = r_ok[:, None] & n_ok[None, :] & (kpos[None, :] <= qpos[:, None])
    return tl.where(visible, s, float("-inf"))


@triton.jit
def _quadratic_form(x, X, stride_x_n, offs_n, n_ok, M, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_C: tl.constexpr):
    """x_jᵀ·M·x_j for every row j of ``x`` [BLOCK_N, HEAD_DIM] fp32 (``X``: the same rows in memory,
    re-read a column chunk at a time); ``M`` a row-major (HEAD_DIM, HEAD_DIM) fp32 matrix."""
    offs_d = tl.arange(0, HEAD_DIM)
    total = tl.zeros([BLOCK_N], dtype=tl.float32)
    for c0 in tl.static_range(0, HEAD_DIM, BLOCK_C):
        offs_c = c0 + tl.arange(0, BLOCK_C)
        matrix = tl.load(M + offs_d[:, None] * HEAD_DIM + offs_c[None, :])
        chunk = tl.load(X + offs_n[:, None] * stride_x_n + offs_c[None, :], mask=n_ok[:, None], other=0.0)
        total += tl.sum(_dot(x, matrix, True, True) * chunk.to(tl.float32), axis=1)
    return total


@triton.jit
def _load_keys(K, KPos, bh, kv_heads, stride_k_b, stride_k_h, stride_k_n, stride_kpos_bh, offs_n, n,
               HEAD_DIM: tl.constexpr):
    """The key block [BLOCK_N, HEAD_DIM] fp32 of (batch, KV head) ``bh``, its base pointer and positions."""
    offs_d = tl.arange(0, HEAD_DIM)
    n_ok = offs_n < n
    base = K + (bh // kv_heads) * stride_k_b + (bh % kv_heads) * stride_k_h
    k = tl.load(base + offs_n[:, None] * stride_k_n + offs_d[None, :], mask=n_ok[:, None], other=0.0)
    kpos = tl.load(KPos + bh * stride_kpos_bh + offs_n, mask=n_ok, other=0)
    return k.to(tl.float32), base, kpos, n_ok


@triton.jit
def _token_pass_kernel(Q, QPos, K, KPos, V, Mean, Cov, Gram, RowMax, RowSum, Expected, OutNorm,
                       n, rows, kv_heads, n_blocks, scale,
                       stride_k_b, stride_k_h, stride_k_n, stride_v_b, stride_v_h, stride_v_n, stride_kpos_bh,
                       HEAD_DIM: tl.constexpr, GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
                       BLOCK_C: tl.constexpr):
    """Row max / exp-sum partials of the window logits, expected logits and mean ‖W_O v‖ of one token block."""
    block = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)  # offsets past 2**31 elements in a long, large-batch cache
    offs_n = block * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    k, k_base, kpos, n_ok = _load_keys(K, KPos, bh, kv_heads, stride_k_b, stride_k_h, stride_k_n,
                                       stride_kpos_bh, offs_n, n, HEAD_DIM)
    for r0 in range(0, rows, BLOCK_R):
        offs_r = r0 + tl.arange(0, BLOCK_R)
        s = _window_logits(Q, QPos, k, kpos, n_ok, bh, offs_r, rows, HEAD_DIM)
        top = tl.max(s, axis=1)
        shift = tl.where(top == float("-inf"), 0.0, top)  # a row that sees none of the block sums to 0
        partial = (bh * rows + offs_r) * n_blocks + block
        tl.store(RowMax + partial, top, mask=offs_r < rows)
        tl.store(RowSum + partial, tl.sum(tl.exp(s - shift[:, None]), axis=1), mask=offs_r < rows)
    v_base = V + (bh // kv_heads) * stride_v_b + (bh % kv_heads) * stride_v_h
    v = tl.load(v_base + offs_n[:, None] * stride_v_n + offs_d[None, :], mask=n_ok[:, None], other=0.0)
    v = v.to(tl.float32)
    norm = tl.zeros([BLOCK_N], dtype=tl.float32)
    for g in tl.static_range(GROUP):
        head = bh * GROUP + g
        mean = tl.load(Mean + head * HEAD_DIM + offs_d)
        quadratic = _quadratic_form(k, k_base, stride_k_n, offs_n, n_ok, Cov + head * HEAD_DIM * HEAD_DIM,
                                    HEAD_DIM, BLOCK_N, BLOCK_C)
        logits = scale * tl.sum(k * mean[None, :], axis=1) + 0.5 * scale * scale * quadratic
        tl.store(Expected + head * n + offs_n, logits, mask=n_ok)
        gram = Gram + ((bh % kv_heads) * GROUP + g) * HEAD_DIM * HEAD_DIM
        squared = _quadratic_form(v, v_base, stride_v_n, offs_n, n_ok, gram, HEAD_DIM, BLOCK_N, BLOCK_C)
        norm += tl.sqrt(tl.maximum(squared, 0.0))
    tl.store(OutNorm + bh * n + offs_n, norm / GROUP, mask=n_ok)


@triton.jit
def _window_mass_kernel(Q, QPos, K, KPos, RowLse, Mass, n, rows, kv_heads,
                        stride_k_b, stride_k_h, stride_k_n, stride_kpos_bh,
                        HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr):
    """Each token's softmax share of every window row, averaged over the rows, for one token block."""
    block = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)  # offsets past 2**31 elements in a long, large-batch cache
    offs_n = block * BLOCK_N + tl.arange(0, BLOCK_N)
    k, _, kpos, n_ok = _load_keys(K, KPos, bh, kv_heads, stride_k_b, stride_k_h, stride_k_n,
                                  stride_kpos_bh, offs_n, n, HEAD_DIM)
    mass = tl.zeros([BLOCK_N], dtype=tl.float32)
    for r0 in range(0, rows, BLOCK_R):
        offs_r = r0 + tl.arange(0, BLOCK_R)
        s = _window_logits(Q, QPos, k, kpos, n_ok, bh, offs_r, rows, HEAD_DIM)
        lse = tl.load(RowLse + bh * rows + offs_r, mask=offs_r < rows, other=float("inf"))
        mass += tl.sum(tl.exp(s - lse[:, None]), axis=0)
    tl.store(Mass + bh * n + offs_n, mass / rows, mask=n_ok)


@triton.jit
def _row_lse_kernel(RowMax, RowSum, RowLse, total_rows, n_blocks, BLOCK_R: tl.constexpr, BLOCK_B: tl.constexpr):
    """Each row's log-sum-exp from its per-block maxima and exp-sums; +inf for a row that sees no key."""
    offs_r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    r_ok = offs_r < total_rows
    top = tl.full([BLOCK_R], float("-inf"), dtype=tl.float32)
    for b0 in range(0, n_blocks, BLOCK_B):
        offs_b = b0 + tl.arange(0, BLOCK_B)
        mask = r_ok[:, None] & (offs_b[None, :] < n_blocks)
        block_max = tl.load(RowMax + offs_r[:, None] * n_blocks + offs_b[None, :], mask=mask, other=float("-inf"))
        top = tl.maximum(top, tl.max(block_max, axis=1))
    shift = tl.where(top == float("-inf"), 0.0, top)
    total = tl.zeros([BLOCK_R], dtype=tl.float32)
    for b0 in range(0, n_blocks, BLOCK_B):
        offs_b = b0 + tl.arange(0, BLOCK_B)
        mask = r_ok[:, None] & (offs_b[None, :] < n_blocks)
        offsets = offs_r[:, None] * n_blocks + offs_b[None, :]
        block_max = tl.load(RowMax + offsets, mask=mask, other=float("-inf"))
        block_sum = tl.load(RowSum + offsets, mask=mask, other=0.0)
        total += tl.sum(block_sum * tl.exp(block_max - shift[:, None]), axis=1)
    lse = tl.where(total > 0, shift + tl.log(tl.maximum(total, 1e-30)), float("inf"))  # both sides are evaluated
    tl.store(RowLse + offs_r, lse, mask=r_ok)


def merge_row_partials(row_max: torch.Tensor, row_sum: torch.Tensor) -> torch.Tensor:
    """Log-sum-exp of each row (...) from its per-block maxima and exp-sums (..., blocks), float32, one launch;
    +inf for a row that sees no key (its shares are then 0, as the torch path's)."""
    row_max, row_sum = row_max.float().contiguous(), row_sum.float().contiguous()
    lse = row_max.new_empty(row_max.shape[:-1])
    total_rows, n_blocks = lse.numel(), row_max.shape[-1]
    block_r = 16 if _interpreting() else 64
    _row_lse_kernel[(triton.cdiv(total_rows, block_r),)](row_max, row_sum, lse, total_rows, n_blocks,
                                                         BLOCK_R=block_r, BLOCK_B=16 if _interpreting() else 64)
    return lse


def _check(queries, query_positions, keys, positions, values, mean, covariance, gram) -> None:
    """Shapes and devices the kernels rely on, with clear messages."""
    batch, kv_heads, tokens, dim = keys.shape
    group = mean.shape[2]
    expected = {"queries": (batch, kv_heads, queries.shape[2], dim), "values": (batch, kv_heads, tokens, dim),
                "mean": (batch, kv_heads, group, dim), "covariance": (batch, kv_heads, group, dim, dim),
                "gram": (kv_heads, group, dim, dim), "query_positions": (queries.shape[2] // group,)}
    given = {"queries": queries, "values": values, "mean": mean, "covariance": covariance, "gram": gram,
             "query_positions": query_positions}
    for name, shape in expected.items():
        if tuple(given[name].shape) != shape:
            raise ValueError(f"{name} must be {shape}, got {tuple(given[name].shape)}")
    if positions.shape not in ((tokens,), (batch, kv_heads, tokens)):
        raise ValueError(f"positions must be ({tokens},) or {(batch, kv_heads, tokens)}, got {tuple(positions.shape)}")
    check_head_dim(dim)
    if not keys.is_cuda and not _interpreting():
        raise RuntimeError("the Triton kernels need CUDA tensors, or TRITON_INTERPRET=1 for CPU tensors")


def query_feature_parts_triton(queries: torch.Tensor, query_positions: torch.Tensor, keys: torch.Tensor,
                               positions: torch.Tensor, values: torch.Tensor, mean: torch.Tensor,
                               covariance: torch.Tensor, gram: torch.Tensor,
                               scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The attention-sized parts of the query features of one layer.

    Args:
        queries: (batch, kv_heads, R, head_dim) window rows, rotated and scaled
            (:func:`~curkv_train.core.features.window_queries`).
        query_positions: (W,) the window's query positions; R = g·W rows, row g·W + w is query w.
        keys: (batch, kv_heads, tokens, head_dim) post-RoPE keys (any float dtype; unit stride along head_dim).
        positions: (tokens,) or (batch, kv_heads, tokens) the keys' positions.
        values: (batch, kv_heads, tokens, head_dim).
        mean, covariance: (batch, kv_heads, g, head_dim) and (..., head_dim, head_dim) the rotated query
            moments (:func:`~curkv_train.core.features.future_moments`).
        gram: (kv_heads, g, head_dim, head_dim) :func:`~curkv_train.core.features.output_gram`.
        scale: the attention's logit scale.

    Returns:
        window mass (batch, kv_heads, tokens), expected logits (batch, kv_heads, g, tokens) and the mean
        over g of ‖W_O^(h,g) v_j‖ (batch, kv_heads, tokens), all float32.
    """
    _check(queries, query_positions, keys, positions, values, mean, covariance, gram)
    batch, kv_heads, tokens, dim = keys.shape
    rows, group = queries.shape[2], mean.shape[2]
    keys = keys if keys.stride(-1) == 1 else keys.contiguous()
    values = values if values.stride(-1) == 1 else values.contiguous()
    positions = positions.contiguous()
    queries, mean, covariance, gram = (t.float().contiguous() for t in (queries, mean, covariance, gram))
    query_positions = query_positions.to(positions.dtype).repeat(rows // query_positions.shape[0])  # (R,)
    kind = "interpret" if _interpreting() else "cuda"
    block_n, block_r = BLOCK_TOKENS[kind], BLOCK_ROWS[kind]
    n_blocks = triton.cdiv(tokens, block_n)
    grid = (n_blocks, batch * kv_heads)
    row_max = keys.new_empty(batch * kv_heads, rows, n_blocks, dtype=torch.float32)
    row_sum = torch.empty_like(row_max)
    expected = keys.new_empty(batch, kv_heads, group, tokens, dtype=torch.float32)
    output = keys.new_empty(batch, kv_heads, tokens, dtype=torch.float32)
    stride_positions = 0 if positions.dim() == 1 else tokens
    key_strides = (keys.stride(0), keys.stride(1), keys.stride(2))
    _token_pass_kernel[grid](queries, query_positions, keys, positions, values, mean, covariance, gram,
                             row_max, row_sum, expected, output, tokens, rows, kv_heads, n_blocks, scale,
                             *key_strides, values.stride(0), values.stride(1), values.stride(2), stride_positions,
                             HEAD_DIM=dim, GROUP=group, BLOCK_N=block_n, BLOCK_R=block_r,
                             BLOCK_C=min(dim, MAX_BLOCK_CHANNELS), num_warps=4)
    lse = merge_row_partials(row_max, row_sum)
    mass = keys.new_empty(batch, kv_heads, tokens, dtype=torch.float32)
    _window_mass_kernel[grid](queries, query_positions, keys, positions, lse, mass, tokens, rows, kv_heads,
                              *key_strides, stride_positions, HEAD_DIM=dim, BLOCK_N=block_n, BLOCK_R=block_r,
                              num_warps=4)
    return mass, expected, output
