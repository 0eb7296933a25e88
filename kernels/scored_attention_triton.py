"""Triton kernels for score-biased attention (FlashAttention-style, fp32 accumulation).

Semantics are those of :func:`curkv_train.kernels.reference.scored_attention_reference`:
softmax attention with GQA, bottom-right causal masking and an additive per-key bias
``key_bias[b, kv_head, j]`` (0 keeps a key, -inf evicts it). The forward pass streams
key blocks with an online softmax and saves the fp32 log-sum-exp of every query row.
The backward pass differentiates w.r.t. ``q``, ``k``, ``v`` and ``key_bias`` with two
deterministic kernels, each launched only when one of its gradients is needed:

* ``_dq_kernel``: one program per (batch, query head, query block), looping over keys.
* ``_dkv_kernel``: one program per (batch, KV head, key block), looping over the group's
  query heads and query blocks. It accumulates in fp32 registers (no atomics) the
  key-bias gradient, the column sum of the logit gradient ``dS = P * (dP - D)``, and
  with ``NEED_DKV`` also ``dV_j = sum_i P_ij dO_i`` and ``dK_j = scale * sum_i dS_ij q_i``
  (summed over the group's query heads). Without ``NEED_DKV`` (a frozen cache, the
  common case) the kernel skips both matmuls and their [BLOCK_N, HEAD_DIM] accumulators.

In a multi-layer student the keys and values are [frozen context cache | the
continuation's own K/V], and the latter depend on earlier layers' outputs, hence on
the key bias: that is why dK and dV are supported.

Every -inf case is NaN-free: the running max is replaced by 0 while it is -inf, a row
that sees no finite logit outputs 0 and gets ``lse = -inf``, and the backward treats
such a row's probabilities as 0.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl
from torch.autograd.function import once_differentiable

from curkv_train.kernels.limits import MIN_BLOCK, check_head_dim, check_operands

# Block sizes under the interpreter (CPU), capped by the problem size; on CUDA the
# kernels are autotuned over the configs below unless the caller fixes the blocks.
INTERPRET_MAX_BLOCK = 64

_FWD_CONFIGS = [
    (128, 64, 8, 3),
    (128, 64, 4, 3),
    (64, 64, 4, 3),
    (64, 32, 4, 4),
]
_DQ_CONFIGS = [
    (128, 64, 8, 3),
    (64, 64, 4, 3),
    (64, 32, 4, 3),
]
_DBIAS_CONFIGS = [
    (64, 128, 8, 3),
    (64, 64, 4, 3),
    (32, 64, 4, 3),
]
# dK / dV add two fp32 [BLOCK_N, HEAD_DIM] accumulators per program: smaller query blocks.
_DKV_CONFIGS = [
    (32, 128, 8, 3),
    (32, 64, 4, 3),
    (64, 64, 4, 3),
    (16, 64, 4, 3),
]
_TUNE_KEY = ["HEAD_DIM", "CAUSAL", "GROUP"]


# --------------------------------------------------------------------------- device code


@triton.jit
def _dot(a, b, DOT_F32: tl.constexpr, IEEE: tl.constexpr):
    """a @ b with an fp32 result; fp32 operands when DOT_F32 (interpreter bf16 fix)."""
    if DOT_F32:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    if IEEE:
        out = tl.dot(a, b, input_precision="ieee")
    else:
        out = tl.dot(a, b)
    return out


@triton.jit
def _biased_logits(q, k, bias, offs_m, offs_n, M, N, scale,
                   CAUSAL: tl.constexpr, DOT_F32: tl.constexpr, IEEE: tl.constexpr):
    """[BLOCK_M, BLOCK_N] logits q k^T * scale + bias, -inf where masked or out of range."""
    s = _dot(q, tl.trans(k), DOT_F32, IEEE) * scale + bias[None, :]
    visible = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    if CAUSAL:
        visible = visible & (offs_n[None, :] <= offs_m[:, None] + (N - M))
    return tl.where(visible, s, float("-inf"))


@triton.jit
def _key_end(start_m, M, N, BLOCK_M: tl.constexpr, CAUSAL: tl.constexpr):
    """Exclusive end of the keys any query of the block starting at start_m can see."""
    end = N
    if CAUSAL:
        end = tl.minimum(N, start_m + BLOCK_M + N - M)
    return end


@triton.jit
def _query_start(start_n, M, N, BLOCK_M: tl.constexpr, CAUSAL: tl.constexpr):
    """First query-block start that can see the key block starting at start_n."""
    start = 0
    if CAUSAL:
        start = (tl.maximum(start_n - (N - M), 0) // BLOCK_M) * BLOCK_M
    return start


@triton.jit
def _finite_or_zero(x):
    """Replace -inf (a row max or lse with no visible key) by 0 so exp() never sees inf - inf."""
    return tl.where(x == float("-inf"), 0.0, x)


@triton.jit
def _load_rows(base, offs_rows, stride_row, offs_d, n_rows):
    """Load a [rows, HEAD_DIM] tile with row stride `stride_row`, zero past n_rows."""
    ptrs = base + offs_rows[:, None] * stride_row + offs_d[None, :]
    return tl.load(ptrs, mask=offs_rows[:, None] < n_rows, other=0.0)


@triton.jit
def _fwd_kernel(Q, K, V, Bias, O, O32, LSE, scale,
                stride_qb, stride_qh, stride_qm,
                stride_kb, stride_kh, stride_kn,
                stride_vb, stride_vh, stride_vn,
                Hq, Hkv, M, N, GROUP,
                HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                CAUSAL: tl.constexpr, DOT_F32: tl.constexpr, IEEE: tl.constexpr,
                STORE_F32: tl.constexpr):
    """Forward: one program per (query block, batch * query head); online softmax over keys.

    Writes O in its dtype, the fp32 row log-sum-exp, and with STORE_F32 an fp32 copy of O.
    """
    start_m = tl.program_id(0) * BLOCK_M
    pid_bh = tl.program_id(1)
    b = (pid_bh // Hq).to(tl.int64)
    h = pid_bh % Hq
    hk = h // GROUP
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    q = _load_rows(Q + b * stride_qb + h * stride_qh, offs_m, stride_qm, offs_d, M)
    k_base = K + b * stride_kb + hk * stride_kh
    v_base = V + b * stride_vb + hk * stride_vh
    bias_base = Bias + (b * Hkv + hk) * N

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    for start_n in range(0, _key_end(start_m, M, N, BLOCK_M, CAUSAL), BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        k = _load_rows(k_base, offs_n, stride_kn, offs_d, N)
        bias = tl.load(bias_base + offs_n, mask=offs_n < N, other=float("-inf"))
        s = _biased_logits(q, k, bias, offs_m, offs_n, M, N, scale, CAUSAL, DOT_F32, IEEE)
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = _finite_or_zero(m_new)
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = _load_rows(v_base, offs_n, stride_vn, offs_d, N)
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, DOT_F32, IEEE)
        m_i = m_new

    seen = l_i > 0.0
    out = acc / tl.where(seen, l_i, 1.0)[:, None]
    lse = tl.where(seen, _finite_or_zero(m_i) + tl.log(tl.where(seen, l_i, 1.0)), float("-inf"))
    row_ptrs = (b * Hq + h) * M + offs_m
    tl.store(LSE + row_ptrs, lse, mask=offs_m < M)
    o_offs = row_ptrs[:, None] * HEAD_DIM + offs_d[None, :]
    tl.store(O + o_offs, out.to(O.dtype.element_ty), mask=offs_m[:, None] < M)
    if STORE_F32:
        tl.store(O32 + o_offs, out, mask=offs_m[:, None] < M)


@triton.jit
def _row_dot_kernel(O, DO, Delta, rows, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr):
    """Backward preprocess: Delta[r] = sum_d dO[r, d] * O[r, d] in fp32 (contiguous rows)."""
    offs_r = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    o = _load_rows(O, offs_r, HEAD_DIM, offs_d, rows).to(tl.float32)
    do = _load_rows(DO, offs_r, HEAD_DIM, offs_d, rows).to(tl.float32)
    tl.store(Delta + offs_r, tl.sum(o * do, 1), mask=offs_r < rows)


@triton.jit
def _dq_kernel(Q, K, V, Bias, DO, LSE, Delta, DQ, scale,
               stride_qb, stride_qh, stride_qm,
               stride_kb, stride_kh, stride_kn,
               stride_vb, stride_vh, stride_vn,
               Hq, Hkv, M, N, GROUP,
               HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               CAUSAL: tl.constexpr, DOT_F32: tl.constexpr, IEEE: tl.constexpr):
    """dQ = scale * sum_j dS_ij k_j; one program per (query block, batch * query head)."""
    start_m = tl.program_id(0) * BLOCK_M
    pid_bh = tl.program_id(1)
    b = (pid_bh // Hq).to(tl.int64)
    h = pid_bh % Hq
    hk = h // GROUP
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    row_ptrs = (b * Hq + h) * M + offs_m
    q = _load_rows(Q + b * stride_qb + h * stride_qh, offs_m, stride_qm, offs_d, M)
    do = _load_rows(DO + (b * Hq + h) * M * HEAD_DIM, offs_m, HEAD_DIM, offs_d, M)
    lse = _finite_or_zero(tl.load(LSE + row_ptrs, mask=offs_m < M, other=0.0))
    delta = tl.load(Delta + row_ptrs, mask=offs_m < M, other=0.0)
    k_base = K + b * stride_kb + hk * stride_kh
    v_base = V + b * stride_vb + hk * stride_vh
    bias_base = Bias + (b * Hkv + hk) * N

    dq = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    for start_n in range(0, _key_end(start_m, M, N, BLOCK_M, CAUSAL), BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        k = _load_rows(k_base, offs_n, stride_kn, offs_d, N)
        v = _load_rows(v_base, offs_n, stride_vn, offs_d, N)
        bias = tl.load(bias_base + offs_n, mask=offs_n < N, other=float("-inf"))
        s = _biased_logits(q, k, bias, offs_m, offs_n, M, N, scale, CAUSAL, DOT_F32, IEEE)
        p = tl.exp(s - lse[:, None])
        dp = _dot(do, tl.trans(v), DOT_F32, IEEE)
        ds = p * (dp - delta[:, None])
        dq += _dot(ds.to(k.dtype), k, DOT_F32, IEEE)
    dq_ptrs = DQ + row_ptrs[:, None] * HEAD_DIM + offs_d[None, :]
    tl.store(dq_ptrs, (dq * scale).to(DQ.dtype.element_ty), mask=offs_m[:, None] < M)


@triton.jit
def _dkv_kernel(Q, K, V, Bias, DO, LSE, Delta, DBias, DK, DV, scale,
                stride_qb, stride_qh, stride_qm,
                stride_kb, stride_kh, stride_kn,
                stride_vb, stride_vh, stride_vn,
                Hq, Hkv, M, N, GROUP,
                HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                CAUSAL: tl.constexpr, DOT_F32: tl.constexpr, IEEE: tl.constexpr,
                NEED_DKV: tl.constexpr):
    """Key-side gradients; one program per (key block, batch * KV head), looping over the
    group's query heads and query blocks with fp32 register accumulation (no atomics).

    dBias_j = sum_{h in group, i} dS_ij always; with NEED_DKV also
    dV_j = sum_{h, i} P_ij dO_i and dK_j = scale * sum_{h, i} dS_ij q_i, stored
    contiguous [B, Hkv, N, HEAD_DIM] in DK / DV's dtype.
    """
    start_n = tl.program_id(0) * BLOCK_N
    pid_bk = tl.program_id(1)
    b = (pid_bk // Hkv).to(tl.int64)
    hk = pid_bk % Hkv
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    k = _load_rows(K + b * stride_kb + hk * stride_kh, offs_n, stride_kn, offs_d, N)
    v = _load_rows(V + b * stride_vb + hk * stride_vh, offs_n, stride_vn, offs_d, N)
    bias_ptrs = (b * Hkv + hk) * N + offs_n
    bias = tl.load(Bias + bias_ptrs, mask=offs_n < N, other=float("-inf"))
    v_t = tl.trans(v)

    dbias = tl.zeros([BLOCK_N], dtype=tl.float32)
    dk = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    for g in range(0, GROUP):
        h = hk * GROUP + g
        q_base = Q + b * stride_qb + h * stride_qh
        do_base = DO + (b * Hq + h) * M * HEAD_DIM
        for start_m in range(_query_start(start_n, M, N, BLOCK_M, CAUSAL), M, BLOCK_M):
            offs_m = start_m + tl.arange(0, BLOCK_M)
            row_ptrs = (b * Hq + h) * M + offs_m
            q = _load_rows(q_base, offs_m, stride_qm, offs_d, M)
            do = _load_rows(do_base, offs_m, HEAD_DIM, offs_d, M)
            lse = _finite_or_zero(tl.load(LSE + row_ptrs, mask=offs_m < M, other=0.0))
            delta = tl.load(Delta + row_ptrs, mask=offs_m < M, other=0.0)
            s = _biased_logits(q, k, bias, offs_m, offs_n, M, N, scale, CAUSAL, DOT_F32, IEEE)
            p = tl.exp(s - lse[:, None])
            dp = _dot(do, v_t, DOT_F32, IEEE)
            ds = p * (dp - delta[:, None])
            dbias += tl.sum(ds, 0)
            if NEED_DKV:
                dv += _dot(tl.trans(p.to(do.dtype)), do, DOT_F32, IEEE)
                dk += _dot(tl.trans(ds.to(q.dtype)), q, DOT_F32, IEEE)
    tl.store(DBias + bias_ptrs, dbias, mask=offs_n < N)
    if NEED_DKV:
        kv_offs = bias_ptrs[:, None] * HEAD_DIM + offs_d[None, :]
        tl.store(DK + kv_offs, (dk * scale).to(DK.dtype.element_ty), mask=offs_n[:, None] < N)
        tl.store(DV + kv_offs, dv.to(DV.dtype.element_ty), mask=offs_n[:, None] < N)


# --------------------------------------------------------------------------- host code


def _interpreting() -> bool:
    """Whether Triton runs kernels through its CPU interpreter."""
    return os.environ.get("TRITON_INTERPRET") == "1"


@functools.cache
def _tuned(kernel_name: str):
    """Autotuned wrapper of a kernel for CUDA (built lazily: autotune needs a driver)."""
    kernel, configs = {
        "fwd": (_fwd_kernel, _FWD_CONFIGS),
        "dq": (_dq_kernel, _DQ_CONFIGS),
        "dbias": (_dkv_kernel, _DBIAS_CONFIGS),
        "dkv": (_dkv_kernel, _DKV_CONFIGS),
    }[kernel_name]
    return triton.autotune(
        configs=[
            triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=warps, num_stages=stages)
            for bm, bn, warps, stages in configs
        ],
        key=_TUNE_KEY,
    )(kernel)


def _fixed_block(size: int) -> int:
    """Fixed-block default: power of two covering `size` in [MIN_BLOCK, INTERPRET_MAX_BLOCK]."""
    return max(MIN_BLOCK, min(INTERPRET_MAX_BLOCK, triton.next_power_of_2(max(size, 1))))


def _launch(kernel_name: str, grid_rows: int, grid_heads: int, row_meta: str, args: tuple,
            meta: dict, blocks: tuple[int | None, int | None], sizes: tuple[int, int]) -> None:
    """Launch a kernel over (cdiv(grid_rows, meta[row_meta]), grid_heads) programs.

    Fixed blocks (caller's, or the interpreter's defaults) launch the plain kernel;
    otherwise the CUDA autotuned wrapper picks BLOCK_M / BLOCK_N.
    """
    kernels = {"fwd": _fwd_kernel, "dq": _dq_kernel, "dbias": _dkv_kernel, "dkv": _dkv_kernel}
    kernel = kernels[kernel_name]
    block_m, block_n = blocks
    if _interpreting() or block_m is not None or block_n is not None:
        block_m = block_m or _fixed_block(sizes[0])
        block_n = block_n or _fixed_block(sizes[1])
        fixed = {"BLOCK_M": block_m, "BLOCK_N": block_n}
        grid = (triton.cdiv(grid_rows, fixed[row_meta]), grid_heads)
        kernel[grid](*args, **meta, **fixed, num_warps=4, num_stages=2)
        return

    def grid(config):
        return (triton.cdiv(grid_rows, config[row_meta]), grid_heads)

    _tuned(kernel_name)[grid](*args, **meta)


def _check_block(name: str, block: int | None) -> None:
    """Blocks must be powers of two of at least MIN_BLOCK (tl.dot's minimum)."""
    if block is not None and (block < MIN_BLOCK or block & (block - 1)):
        raise ValueError(f"{name} must be a power of two >= {MIN_BLOCK}, got {block}")


def _validate(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_bias: torch.Tensor) -> None:
    """Shape, device and dtype checks with clear messages."""
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError("q, k, v must be 4-D: (batch, heads, seq, head_dim)")
    batch, q_heads, _, head_dim = q.shape
    kv_heads, num_keys = k.shape[1], k.shape[2]
    if k.shape != v.shape or k.shape[0] != batch or k.shape[3] != head_dim:
        raise ValueError(
            f"k {tuple(k.shape)} and v {tuple(v.shape)} must be (batch, kv_heads, N, {head_dim})"
        )
    if kv_heads == 0 or q_heads % kv_heads:
        raise ValueError(f"q_heads ({q_heads}) must be a multiple of kv_heads ({kv_heads})")
    if tuple(key_bias.shape) != (batch, kv_heads, num_keys):
        raise ValueError(
            f"key_bias must be (batch, kv_heads, N) = {(batch, kv_heads, num_keys)}, "
            f"got {tuple(key_bias.shape)}"
        )
    check_head_dim(head_dim)
    floats = {"q": q, "k": k, "v": v}
    check_operands({**floats, "key_bias": key_bias}, floats)


def _last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    """The kernels index rows by stride but need unit stride along head_dim."""
    return x if x.stride(-1) == 1 else x.contiguous()


def _strides(*tensors: torch.Tensor) -> tuple[int, ...]:
    """(batch, head, seq) strides of each 4-D tensor, flattened."""
    return tuple(s for t in tensors for s in t.stride()[:3])


def _meta(q: torch.Tensor, causal: bool) -> dict:
    """Compile-time flags shared by all kernels."""
    return {
        "HEAD_DIM": q.shape[-1],
        "CAUSAL": causal,
        "DOT_F32": _interpreting(),
        "IEEE": q.dtype == torch.float32,
    }


def _forward(q, k, v, key_bias, scale, causal, blocks, keep_f32):
    """Run the forward kernel.

    Returns:
        out [B,Hq,M,d] in q.dtype, lse [B,Hq,M] fp32, and out32: the fp32 output when
        keep_f32 (the same tensor as out for fp32 inputs), else None.
    """
    batch, q_heads, num_queries, head_dim = q.shape
    kv_heads, num_keys = k.shape[1], k.shape[2]
    out = torch.empty((batch, q_heads, num_queries, head_dim), device=q.device, dtype=q.dtype)
    lse = torch.full((batch, q_heads, num_queries), float("-inf"), device=q.device,
                     dtype=torch.float32)
    store_f32 = keep_f32 and q.dtype != torch.float32
    out32 = torch.empty(out.shape, device=q.device, dtype=torch.float32) if store_f32 else out
    if out.numel() > 0:
        args = (q, k, v, key_bias, out, out32, lse, scale, *_strides(q, k, v),
                q_heads, kv_heads, num_queries, num_keys, q_heads // kv_heads)
        meta = {**_meta(q, causal), "STORE_F32": store_f32}
        _launch("fwd", num_queries, batch * q_heads, "BLOCK_M", args, meta, blocks,
                (num_queries, num_keys))
    return out, lse, (out32 if keep_f32 else None)


def _row_dot(out: torch.Tensor, grad_out: torch.Tensor) -> torch.Tensor:
    """Delta = rowsum(dO * O) in fp32, shape [B, Hq, M]."""
    rows = out.numel() // out.shape[-1]
    delta = torch.empty(out.shape[:-1], device=out.device, dtype=torch.float32)
    block = 64 if _interpreting() else 32
    _row_dot_kernel[(triton.cdiv(rows, block),)](out, grad_out, delta, rows,
                                                 HEAD_DIM=out.shape[-1], BLOCK_M=block)
    return delta


def _backward(ctx, grad_out):
    """Run the backward kernels; returns (dq, dk, dv, dbias), each None when not needed."""
    q, k, v, key_bias, out32, lse = ctx.saved_tensors
    need_dq, need_dk, need_dv, need_dbias = ctx.needs_input_grad[:4]
    need_dkv = need_dk or need_dv
    batch, q_heads, num_queries, _ = q.shape
    kv_heads, num_keys = k.shape[1], k.shape[2]
    if out32.numel() == 0 or num_keys == 0:
        zeros = [torch.zeros_like(t) if need else None
                 for t, need in zip((q, k, v, key_bias), (need_dq, need_dk, need_dv, need_dbias))]
        return tuple(zeros)
    grad_out = grad_out.contiguous()
    delta = _row_dot(out32, grad_out)
    shared = (*_strides(q, k, v), q_heads, kv_heads, num_queries, num_keys, q_heads // kv_heads)
    meta = _meta(q, ctx.causal)
    sizes = (num_queries, num_keys)
    dq = dk = dv = dbias = None
    if need_dq:
        dq = torch.empty(q.shape, device=q.device, dtype=q.dtype)
        args = (q, k, v, key_bias, grad_out, lse, delta, dq, ctx.scale, *shared)
        _launch("dq", num_queries, batch * q_heads, "BLOCK_M", args, meta, ctx.blocks, sizes)
    if need_dbias or need_dkv:
        # The key-bias gradient is a by-product of the key-block kernel: always stored.
        # Without NEED_DKV the kernel never touches DK / DV: dbias stands in for them.
        dbias = torch.empty_like(key_bias)
        dk_buf = torch.empty(k.shape, device=k.device, dtype=k.dtype) if need_dkv else dbias
        dv_buf = torch.empty(v.shape, device=v.device, dtype=v.dtype) if need_dkv else dbias
        args = (q, k, v, key_bias, grad_out, lse, delta, dbias, dk_buf, dv_buf, ctx.scale, *shared)
        _launch("dkv" if need_dkv else "dbias", num_keys, batch * kv_heads, "BLOCK_N", args,
                {**meta, "NEED_DKV": need_dkv}, ctx.blocks, sizes)
        dk = dk_buf if need_dk else None
        dv = dv_buf if need_dv else None
        dbias = dbias if need_dbias else None
    return dq, dk, dv, dbias


class _ScoredAttention(torch.autograd.Function):
    """Autograd wrapper: saves q, k, v, bias, the fp32 output and lse; grads for q, k, v, key_bias.

    The fp32 output (B*Hq*M*d*4 bytes, kept only when a gradient is needed) keeps
    D = rowsum(dO * O) free of the output's fp16/bf16 rounding, which otherwise dominates
    the key-bias gradient error in bf16 (docs/design.md §5).
    """

    @staticmethod
    def forward(ctx, q, k, v, key_bias, scale, causal, blocks):
        keep_f32 = any(ctx.needs_input_grad[:4])
        out, lse, out32 = _forward(q, k, v, key_bias, scale, causal, blocks, keep_f32)
        if keep_f32:
            ctx.save_for_backward(q, k, v, key_bias, out32, lse)
        ctx.scale, ctx.causal, ctx.blocks = scale, causal, blocks
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        dq, dk, dv, dbias = _backward(ctx, grad_out)
        return dq, dk, dv, dbias, None, None, None


def scored_attention_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    key_bias: torch.Tensor,
    *,
    scale: float | None = None,
    causal: bool = True,
    block_m: int | None = None,
    block_n: int | None = None,
) -> torch.Tensor:
    """Fused attention with an additive per-key bias (Triton), differentiable in q, k, v, key_bias.

    Computes ``softmax(q k^T * scale + key_bias [+ causal mask]) v`` per query head, with
    query head h reading KV head ``h // (q_heads / kv_heads)``; fp32 accumulation.

    Args:
        q: (batch, q_heads, M, head_dim) queries, fp16 / bf16 / fp32; head_dim a power of
            two >= 16.
        k: (batch, kv_heads, N, head_dim) keys, q's dtype; gradient in its dtype.
        v: (batch, kv_heads, N, head_dim) values, q's dtype; gradient in its dtype.
        key_bias: (batch, kv_heads, N) bias added to every logit of that key (0 keeps,
            -inf evicts); computed in fp32, gradient returned in its dtype. A row whose
            visible keys are all -inf outputs 0.
        scale: logit scale, default head_dim ** -0.5.
        causal: bottom-right causal masking (query i sees keys j <= i + N - M).
        block_m: query block size (power of two >= 16); None picks one (autotuned on CUDA).
        block_n: key block size (power of two >= 16); None picks one.

    Returns:
        (batch, q_heads, M, head_dim) tensor in q's dtype.

    Raises:
        ValueError: bad shapes, dtypes, devices or block sizes.
    """
    _validate(q, k, v, key_bias)
    _check_block("block_m", block_m)
    _check_block("block_n", block_n)
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    bias32 = key_bias.float().contiguous()
    q, k, v = (_last_dim_contiguous(t) for t in (q, k, v))
    return _ScoredAttention.apply(q, k, v, bias32, scale, bool(causal), (block_m, block_n))


def attention_partial_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scale: float | None = None,
    causal: bool = True,
    block_m: int | None = None,
    block_n: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward-only plain attention (no bias) with its log-sum-exp, to merge with attention over other keys.

    Args:
        q: (batch, q_heads, M, head_dim); k, v: (batch, kv_heads, N, head_dim), as in
            :func:`scored_attention_triton`.
        scale, causal, block_m, block_n: as in :func:`scored_attention_triton`.

    Returns:
        (out (batch, q_heads, M, head_dim) fp32, lse (batch, q_heads, M) fp32): the softmax-
        normalised output and the row log-sum-exp of the scaled logits; rows that see no key
        give 0 and -inf.
    """
    bias = torch.zeros(k.shape[:3], device=k.device, dtype=torch.float32)
    _validate(q, k, v, bias)
    _check_block("block_m", block_m)
    _check_block("block_n", block_n)
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    q, k, v = (_last_dim_contiguous(t) for t in (q, k, v))
    _, lse, out32 = _forward(q, k, v, bias, scale, bool(causal), (block_m, block_n), keep_f32=True)
    return out32, lse
