"""Triton gather kernel: compact each (batch, KV head)'s kept tokens into dense K / V.

Semantics are those of :func:`curkv_train.kernels.reference.compact_kept_reference`;
the copy is bit-exact. Inputs may be strided views (e.g. a slice of a preallocated
cache) as long as the feature dimension is contiguous.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

BLOCK_TOKENS_CUDA = 32
BLOCK_TOKENS_INTERPRET = 64


@triton.jit
def _gather_rows_kernel(Src, Idx, Dst, N, K, H,
                        stride_sb, stride_sh, stride_sn,
                        DIM, BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr):
    """Dst[b, h, i, :] = Src[b, h, Idx[b, h, i], :]; one program per (index block, b * H + h).

    Out-of-range indices (not in [0, N)) are never read and give zero rows.
    """
    # int64 offsets: batch·heads·K·dim passes 2**31 for long contexts at large batches
    offs_k = tl.program_id(0).to(tl.int64) * BLOCK_K + tl.arange(0, BLOCK_K)
    pid_bh = tl.program_id(1).to(tl.int64)
    b = pid_bh // H
    h = pid_bh % H
    offs_d = tl.arange(0, BLOCK_D)
    in_k = offs_k < K
    idx = tl.load(Idx + pid_bh * K + offs_k, mask=in_k, other=0)
    valid = in_k & (idx >= 0) & (idx < N)
    d_mask = offs_d[None, :] < DIM
    src = Src + b * stride_sb + h * stride_sh + idx[:, None] * stride_sn + offs_d[None, :]
    rows = tl.load(src, mask=valid[:, None] & d_mask, other=0.0)
    dst = Dst + (pid_bh * K + offs_k)[:, None] * DIM + offs_d[None, :]
    tl.store(dst, rows, mask=in_k[:, None] & d_mask)


def _gather_rows(src: torch.Tensor, keep_idx: torch.Tensor) -> torch.Tensor:
    """Dense (batch, heads, K, dim) copy of the rows of src (batch, heads, N, dim) at keep_idx."""
    if src.stride(-1) != 1:
        src = src.contiguous()
    batch, heads, num_tokens, dim = src.shape
    kept = keep_idx.shape[-1]
    out = torch.empty((batch, heads, kept, dim), device=src.device, dtype=src.dtype)
    if out.numel() == 0:
        return out
    interpreting = os.environ.get("TRITON_INTERPRET") == "1"
    block_k = BLOCK_TOKENS_INTERPRET if interpreting else BLOCK_TOKENS_CUDA
    grid = (triton.cdiv(kept, block_k), batch * heads)
    _gather_rows_kernel[grid](src, keep_idx, out, num_tokens, kept, heads, *src.stride()[:3], dim,
                              BLOCK_K=block_k, BLOCK_D=triton.next_power_of_2(dim))
    return out


def _validate(k: torch.Tensor, v: torch.Tensor, keep_idx: torch.Tensor) -> None:
    """Shape, dtype and device checks with clear messages."""
    if k.dim() != 4 or v.dim() != 4 or keep_idx.dim() != 3:
        raise ValueError("k, v must be (batch, kv_heads, N, dim) and keep_idx (batch, kv_heads, K)")
    if k.shape[:3] != v.shape[:3] or keep_idx.shape[:2] != k.shape[:2]:
        raise ValueError(
            f"shape mismatch: k {tuple(k.shape)}, v {tuple(v.shape)}, "
            f"keep_idx {tuple(keep_idx.shape)}"
        )
    if keep_idx.dtype != torch.int64:
        raise TypeError(f"keep_idx must be int64, got {keep_idx.dtype}")
    if len({k.device, v.device, keep_idx.device}) != 1:
        raise ValueError("k, v and keep_idx must be on the same device")
    if not k.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError(
            "the Triton kernels need CUDA tensors, or TRITON_INTERPRET=1 for CPU tensors"
        )


def compact_kept_triton(
    k: torch.Tensor, v: torch.Tensor, keep_idx: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gather each (batch, KV head)'s kept tokens into dense contiguous K and V (Triton).

    Args:
        k: (batch, kv_heads, N, head_dim) keys.
        v: (batch, kv_heads, N, head_dim_v) values.
        keep_idx: (batch, kv_heads, K) int64 token indices in [0, N), in output order.
            Unlike the reference (which raises), an out-of-range index yields a zero
            row instead of reading out of bounds; no device sync is spent checking.

    Returns:
        (keys, values): contiguous (batch, kv_heads, K, head_dim) and
        (batch, kv_heads, K, head_dim_v), in the input dtypes; not differentiable.
    """
    _validate(k, v, keep_idx)
    keep_idx = keep_idx.contiguous()
    return _gather_rows(k, keep_idx), _gather_rows(v, keep_idx)
