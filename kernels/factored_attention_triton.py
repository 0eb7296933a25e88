"""Triton attention over CUR-factored cold blocks plus dense keys (forward only, inference).

Semantics are those of :func:`curkv_train.kernels.reference.factored_attention_reference`:
one softmax over [cold blocks | dense keys], GQA, cold tokens always visible, dense keys
bottom-right causal. The work is split flash-decoding style:

* each cold block (C (n × c), U (c × r), R (r × d), sparse residual S) is streamed by
  ``_cold_partial_kernel``: one program per (query-row block, token split, batch * KV
  head). A program first projects its query rows once, q̃ = (q·Rᵀ)·Uᵀ (rows × c),
  then loops over its split's tokens in blocks of ``BLOCK_N``: logits q̃·C_jᵀ plus the
  residual entries of those tokens, an online softmax, and the accumulation of p·C_v
  (rows × c_v) and p·S_v (rows × d). At the end it projects (p·C_v)·U_v·R_v and writes
  the normalised partial output and its fp32 log-sum-exp. No (n × d) tile of the block
  is ever formed; the query rows of a program are the group's query heads times the
  queries (GQA: they share their KV head's factors).
* the dense keys go through the score-biased attention kernel with a zero bias
  (:func:`attention_partial_triton`), which also returns its log-sum-exp;
* the partial outputs are merged by log-sum-exp (:func:`merge_partials`).

Residual entries are found per token block through their flat indices, which must be
ascending per (batch, KV head) (as :func:`curkv_train.runtime.cur.residual_topk` stores
them): the host turns them into per-token-block ranges with ``searchsorted``. Inside a
block, an entry (token j, channel ch, value s) adds q[ch]·s to logit j and p[j]·s to
output channel ch; both gathers/scatters are one-hot products, so they run on tensor
cores like the rest.
"""

from __future__ import annotations

from typing import Sequence

import torch
import triton
import triton.language as tl

from curkv_train.kernels.limits import MIN_BLOCK, SUPPORTED_DTYPES, check_head_dim
from curkv_train.kernels.reference import Factors
from curkv_train.kernels.scored_attention_triton import (
    _dot,
    _finite_or_zero,
    _interpreting,
    attention_partial_triton,
)

BLOCK_TOKENS_CUDA = 64
BLOCK_TOKENS_INTERPRET_MAX = 64
BLOCK_RESIDUAL = 32
MAX_ROW_BLOCK = 64


@triton.jit
def _load_tile(base, offs_rows, offs_cols, n_rows, n_cols, row_stride):
    """[rows, cols] fp32 tile of a row-major matrix, zero outside (n_rows, n_cols)."""
    mask = (offs_rows[:, None] < n_rows) & (offs_cols[None, :] < n_cols)
    return tl.load(base + offs_rows[:, None] * row_stride + offs_cols[None, :], mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _residual_logits(s, q_rows, row_ok, Index, Values, Bounds, bh, m_res, n_token_blocks, block_idx, start_n,
                     scale, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
                     DOT_F32: tl.constexpr, IEEE: tl.constexpr):
    """s plus scale·q[ch]·value at column (token − start_n) for every residual entry of this token block."""
    bounds = Bounds + bh * (n_token_blocks + 1) + block_idx
    lo = tl.load(bounds).to(tl.int32)
    hi = tl.load(bounds + 1).to(tl.int32)
    offs_cols = tl.arange(0, BLOCK_N)
    for r0 in range(lo, hi, BLOCK_R):
        offs_r = r0 + tl.arange(0, BLOCK_R)
        r_ok = offs_r < hi
        idx = tl.load(Index + bh * m_res + offs_r, mask=r_ok, other=0).to(tl.int32)
        val = tl.load(Values + bh * m_res + offs_r, mask=r_ok, other=0.0).to(tl.float32)
        token = idx // HEAD_DIM - start_n
        channel = idx % HEAD_DIM
        gathered = tl.load(q_rows[:, None] + channel[None, :], mask=row_ok[:, None] & r_ok[None, :],
                           other=0.0).to(tl.float32)
        onehot = ((token[:, None] == offs_cols[None, :]) & r_ok[:, None]).to(tl.float32)
        s += _dot(gathered * (val * scale)[None, :], onehot, DOT_F32, IEEE)
    return s


@triton.jit
def _residual_values(acc, p, Index, Values, Bounds, bh, m_res, n_token_blocks, block_idx, start_n,
                     HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
                     DOT_F32: tl.constexpr, IEEE: tl.constexpr):
    """acc [rows, HEAD_DIM] plus p[token]·value at channel ch for every residual entry of this token block."""
    bounds = Bounds + bh * (n_token_blocks + 1) + block_idx
    lo = tl.load(bounds).to(tl.int32)
    hi = tl.load(bounds + 1).to(tl.int32)
    offs_cols = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    for r0 in range(lo, hi, BLOCK_R):
        offs_r = r0 + tl.arange(0, BLOCK_R)
        r_ok = offs_r < hi
        idx = tl.load(Index + bh * m_res + offs_r, mask=r_ok, other=0).to(tl.int32)
        val = tl.load(Values + bh * m_res + offs_r, mask=r_ok, other=0.0).to(tl.float32)
        token = idx // HEAD_DIM - start_n
        channel = idx % HEAD_DIM
        token_onehot = ((offs_cols[:, None] == token[None, :]) & r_ok[None, :]).to(tl.float32)
        p_at_entry = _dot(p, token_onehot, DOT_F32, IEEE)
        channel_onehot = ((channel[:, None] == offs_d[None, :]) & r_ok[:, None]).to(tl.float32)
        acc += _dot(p_at_entry * val[None, :], channel_onehot, DOT_F32, IEEE)
    return acc


@triton.jit
def _cold_partial_kernel(
    Q, KC, KU, KR, KResIdx, KResVal, KBounds,
    VC, VU, VR, VResIdx, VResVal, VBounds,
    O, LSE, scale,
    stride_qb, stride_qh, stride_qm,
    B, Hkv, M, GROUP, N, TOKENS_PER_SPLIT, N_TOKEN_BLOCKS,
    KC_RANK, KR_RANK, VC_RANK, VR_RANK, K_RES, V_RES,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_KC: tl.constexpr, BLOCK_KR: tl.constexpr, BLOCK_VC: tl.constexpr, BLOCK_VR: tl.constexpr,
    HAS_K_RES: tl.constexpr, HAS_V_RES: tl.constexpr, DOT_F32: tl.constexpr, IEEE: tl.constexpr,
):
    """Partial attention of GROUP·M query rows over one split of a factored cold block.

    One program per (row block, split, batch * KV head). Factors are contiguous
    (B·Hkv, ...) tensors. Writes O[split, b, head, m, :] (fp32, normalised over the
    split's tokens) and LSE[split, b, head, m] (-inf for a split with no tokens).
    """
    pid_m = tl.program_id(0)
    pid_split = tl.program_id(1)
    bh = tl.program_id(2).to(tl.int64)
    b = bh // Hkv
    hk = bh % Hkv
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < GROUP * M
    head = hk * GROUP + rows // M
    query = rows % M
    q_rows = Q + b * stride_qb + head * stride_qh + query * stride_qm
    offs_d = tl.arange(0, HEAD_DIM)
    q = tl.load(q_rows[:, None] + offs_d[None, :], mask=row_ok[:, None], other=0.0).to(tl.float32)

    # q̃ = (q·Rᵀ)·Uᵀ · scale: the query rows in the block's channel space.
    offs_kr = tl.arange(0, BLOCK_KR)
    offs_kc = tl.arange(0, BLOCK_KC)
    k_rows = _load_tile(KR + bh * KR_RANK * HEAD_DIM, offs_kr, offs_d, KR_RANK, HEAD_DIM, HEAD_DIM)
    k_core = _load_tile(KU + bh * KC_RANK * KR_RANK, offs_kc, offs_kr, KC_RANK, KR_RANK, KR_RANK)
    q_tilde = _dot(_dot(q, tl.trans(k_rows), DOT_F32, True), tl.trans(k_core), DOT_F32, True) * scale

    offs_vc = tl.arange(0, BLOCK_VC)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_VC], dtype=tl.float32)
    acc_res = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    start = pid_split * TOKENS_PER_SPLIT
    end = tl.minimum(N, start + TOKENS_PER_SPLIT)
    for start_n in range(start, end, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        columns = _load_tile(KC + bh * N * KC_RANK, offs_n, offs_kc, end, KC_RANK, KC_RANK)
        s = _dot(q_tilde, tl.trans(columns), DOT_F32, IEEE)
        if HAS_K_RES:
            s = _residual_logits(s, q_rows, row_ok, KResIdx, KResVal, KBounds, bh, K_RES, N_TOKEN_BLOCKS,
                                 start_n // BLOCK_N, start_n, scale, HEAD_DIM, BLOCK_N, BLOCK_R, DOT_F32, IEEE)
        s = tl.where((offs_n[None, :] < end) & row_ok[:, None], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = _finite_or_zero(m_new)
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        value_columns = _load_tile(VC + bh * N * VC_RANK, offs_n, offs_vc, end, VC_RANK, VC_RANK)
        acc = acc * alpha[:, None] + _dot(p, value_columns, DOT_F32, IEEE)
        if HAS_V_RES:
            acc_res = _residual_values(acc_res * alpha[:, None], p, VResIdx, VResVal, VBounds, bh, V_RES,
                                       N_TOKEN_BLOCKS, start_n // BLOCK_N, start_n, HEAD_DIM, BLOCK_N, BLOCK_R,
                                       DOT_F32, IEEE)
        m_i = m_new

    seen = l_i > 0.0
    inv_l = 1.0 / tl.where(seen, l_i, 1.0)
    offs_vr = tl.arange(0, BLOCK_VR)
    v_core = _load_tile(VU + bh * VC_RANK * VR_RANK, offs_vc, offs_vr, VC_RANK, VR_RANK, VR_RANK)
    v_rows = _load_tile(VR + bh * VR_RANK * HEAD_DIM, offs_vr, offs_d, VR_RANK, HEAD_DIM, HEAD_DIM)
    out = _dot(_dot(acc * inv_l[:, None], v_core, DOT_F32, True), v_rows, DOT_F32, True)
    if HAS_V_RES:
        out += acc_res * inv_l[:, None]
    lse = tl.where(seen, _finite_or_zero(m_i) + tl.log(tl.where(seen, l_i, 1.0)), float("-inf"))
    row_ptrs = ((pid_split * B + b) * Hkv * GROUP + head) * M + query
    tl.store(LSE + row_ptrs, lse, mask=row_ok)
    tl.store(O + row_ptrs[:, None] * HEAD_DIM + offs_d[None, :], out, mask=row_ok[:, None])


def _pad(size: int) -> int:
    """Power of two covering ``size``, at least tl.dot's minimum."""
    return max(MIN_BLOCK, triton.next_power_of_2(max(size, 1)))


def _residual_bounds(index: torch.Tensor, token_blocks: int, block_tokens: int, head_dim: int) -> torch.Tensor:
    """(B·Hkv, token_blocks + 1) int32: entry range of each token block in the ascending flat indices."""
    flat = index.reshape(-1, index.shape[-1]).long().contiguous()
    edges = torch.arange(token_blocks + 1, device=index.device, dtype=torch.long) * (block_tokens * head_dim)
    return torch.searchsorted(flat, edges.expand(flat.shape[0], -1).contiguous()).to(torch.int32)


def _flat(t: torch.Tensor) -> torch.Tensor:
    """A contiguous copy-if-needed view; factors are small, so this costs little."""
    return t.contiguous()


def _num_splits(token_blocks: int, programs: int, device: torch.device, requested: int | None) -> int:
    """Token splits per block: enough programs to fill the GPU (about 2 per SM), at most one per token block."""
    if requested is not None:
        return max(1, min(requested, token_blocks))
    if _interpreting() or device.type != "cuda":
        return min(2, token_blocks)
    target = 2 * torch.cuda.get_device_properties(device).multi_processor_count
    return max(1, min(token_blocks, target // max(programs, 1)))


def cold_partial_triton(
    q: torch.Tensor,
    keys: Factors,
    values: Factors,
    *,
    scale: float,
    block_n: int | None = None,
    num_splits: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Partial attention of every query over one factored cold block (all its tokens visible).

    Args:
        q: (batch, q_heads, M, head_dim) queries; head_dim a power of two >= 16.
        keys, values: factors of the block's (batch, kv_heads, n, head_dim) keys and values.
        scale: logit scale.
        block_n: tokens per inner step (power of two >= 16); None picks one.
        num_splits: token splits (programs per row block and KV head); None picks one.

    Returns:
        (outs (splits, batch, q_heads, M, head_dim) fp32, lses (splits, batch, q_heads, M)
        fp32): each split's softmax-normalised output and log-sum-exp, for
        :func:`merge_partials`.
    """
    batch, q_heads, num_queries, head_dim = q.shape
    kv_heads, tokens = keys.columns.shape[1], keys.columns.shape[2]
    group = q_heads // kv_heads
    rows = group * num_queries
    block_m = min(_pad(rows), MAX_ROW_BLOCK)
    if block_n is None:
        block_n = BLOCK_TOKENS_CUDA if not _interpreting() else min(BLOCK_TOKENS_INTERPRET_MAX, _pad(tokens))
    token_blocks = triton.cdiv(tokens, block_n)
    row_blocks = triton.cdiv(rows, block_m)
    splits = _num_splits(token_blocks, row_blocks * batch * kv_heads, q.device, num_splits)
    tokens_per_split = triton.cdiv(token_blocks, splits) * block_n
    outs = torch.zeros((splits, batch, q_heads, num_queries, head_dim), device=q.device, dtype=torch.float32)
    lses = torch.full((splits, batch, q_heads, num_queries), float("-inf"), device=q.device, dtype=torch.float32)
    if outs.numel() == 0 or tokens == 0:
        return outs, lses

    def residual(factors: Factors) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
        if factors.residual_values is None:
            empty = torch.zeros(1, device=q.device, dtype=torch.int32)
            return empty, empty.float(), empty, 0
        bounds = _residual_bounds(factors.residual_index, token_blocks, block_n, head_dim)
        return _flat(factors.residual_index), _flat(factors.residual_values), bounds, factors.residual_index.shape[-1]

    k_idx, k_val, k_bounds, k_res = residual(keys)
    v_idx, v_val, v_bounds, v_res = residual(values)
    k_c, k_r, v_c, v_r = (keys.core.shape[-2], keys.core.shape[-1], values.core.shape[-2], values.core.shape[-1])
    grid = (row_blocks, splits, batch * kv_heads)
    _cold_partial_kernel[grid](
        q, _flat(keys.columns), _flat(keys.core), _flat(keys.rows), k_idx, k_val, k_bounds,
        _flat(values.columns), _flat(values.core), _flat(values.rows), v_idx, v_val, v_bounds,
        outs, lses, scale, *q.stride()[:3],
        batch, kv_heads, num_queries, group, tokens, tokens_per_split, token_blocks,
        k_c, k_r, v_c, v_r, k_res, v_res,
        HEAD_DIM=head_dim, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_R=BLOCK_RESIDUAL,
        BLOCK_KC=_pad(k_c), BLOCK_KR=_pad(k_r), BLOCK_VC=_pad(v_c), BLOCK_VR=_pad(v_r),
        HAS_K_RES=k_res > 0, HAS_V_RES=v_res > 0, DOT_F32=_interpreting(), IEEE=q.dtype == torch.float32,
        num_warps=4, num_stages=2,
    )
    return outs, lses


def merge_partials(outs: torch.Tensor, lses: torch.Tensor) -> torch.Tensor:
    """Combine partial attentions over disjoint key sets into the attention over their union.

    Args:
        outs: (parts, ..., head_dim) each part's softmax-normalised output.
        lses: (parts, ...) each part's log-sum-exp of logits (-inf: the part saw no key).

    Returns:
        (..., head_dim) Σ_p exp(lse_p − lse) · out_p with lse = logsumexp_p lse_p; 0 where no part saw a key.
    """
    total = torch.logsumexp(lses, dim=0)
    weights = torch.exp(lses - torch.where(torch.isfinite(total), total, torch.zeros_like(total)))
    return (weights.unsqueeze(-1) * outs).sum(dim=0)


def _validate(q: torch.Tensor, cold_keys: Sequence[Factors], cold_values: Sequence[Factors],
              k: torch.Tensor, v: torch.Tensor) -> None:
    """Shape, dtype and device checks with clear messages."""
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError("q, k, v must be 4-D: (batch, heads, seq, head_dim)")
    batch, q_heads, _, head_dim = q.shape
    kv_heads = k.shape[1]
    if k.shape != v.shape or k.shape[0] != batch or k.shape[3] != head_dim:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must be (batch, kv_heads, N, {head_dim})")
    if kv_heads == 0 or q_heads % kv_heads:
        raise ValueError(f"q_heads ({q_heads}) must be a multiple of kv_heads ({kv_heads})")
    check_head_dim(head_dim)
    if q.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"unsupported dtype {q.dtype}; expected float16, bfloat16 or float32")
    if len(cold_keys) != len(cold_values):
        raise ValueError(f"got {len(cold_keys)} cold key blocks but {len(cold_values)} cold value blocks")
    for block, factors in enumerate(list(cold_keys) + list(cold_values)):
        columns, rows = factors.columns, factors.rows
        if columns.shape[:2] != (batch, kv_heads) or rows.shape[-1] != head_dim:
            raise ValueError(f"cold factors {block}: columns {tuple(columns.shape)} and rows {tuple(rows.shape)} "
                             f"must be (batch={batch}, kv_heads={kv_heads}, ...) with {head_dim} channels")
        if columns.device != q.device:
            raise ValueError("the cold factors must be on the queries' device")
    if not q.is_cuda and not _interpreting():
        raise RuntimeError("the Triton kernels need CUDA tensors, or TRITON_INTERPRET=1 for CPU tensors")


def factored_attention_triton(
    q: torch.Tensor,
    cold_keys: Sequence[Factors],
    cold_values: Sequence[Factors],
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scale: float | None = None,
    causal: bool = True,
    block_n: int | None = None,
    num_splits: int | None = None,
) -> torch.Tensor:
    """Attention over [factored cold blocks | dense keys] in one softmax (Triton, forward only).

    Args:
        q: (batch, q_heads, M, head_dim) queries, fp16 / bf16 / fp32; head_dim a power of two >= 16.
        cold_keys, cold_values: per cold block, factors of (batch, kv_heads, n_b, head_dim)
            keys and values; residual indices ascending per (batch, KV head).
        k, v: (batch, kv_heads, N, head_dim) dense keys and values in q's dtype.
        scale: logit scale, default head_dim ** -0.5.
        causal: bottom-right causal mask over the dense keys (cold tokens always visible).
        block_n, num_splits: cold-kernel tokens per step and token splits; None picks them.

    Returns:
        (batch, q_heads, M, head_dim) in q's dtype; not differentiable.
    """
    _validate(q, cold_keys, cold_values, k, v)
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    if q.stride(-1) != 1:
        q = q.contiguous()
    dense_out, dense_lse = attention_partial_triton(q, k, v, scale=scale, causal=causal)
    outs, lses = [dense_out[None]], [dense_lse[None]]
    for keys, values in zip(cold_keys, cold_values):
        block_outs, block_lses = cold_partial_triton(q, keys, values, scale=scale, block_n=block_n,
                                                     num_splits=num_splits)
        outs.append(block_outs)
        lses.append(block_lses)
    return merge_partials(torch.cat(outs), torch.cat(lses)).to(q.dtype)
