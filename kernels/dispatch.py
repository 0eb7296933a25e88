"""Backend selection for the compression kernels."""

from __future__ import annotations

import os
from typing import Sequence

import torch

from curkv_train.kernels.limits import SUPPORTED_DTYPES, tileable_head_dim, triton_available
from curkv_train.kernels.reference import (
    Factors,
    compact_kept_reference,
    factored_attention_reference,
    ragged_attention_reference,
    scored_attention_reference,
)

BACKENDS = ("auto", "torch", "triton")


def resolve_backend(backend: str, tensor: torch.Tensor, tiled: bool = True) -> str:
    """Map ``auto`` to ``triton`` on CUDA (or under the interpreter) where the kernels take ``tensor``
    (a :data:`SUPPORTED_DTYPES` dtype and, for the ``tiled`` attention kernels, a :func:`tileable_head_dim`
    last dimension), and to ``torch`` otherwise: the same semantics either way."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown kernel backend {backend!r}; expected one of {', '.join(BACKENDS)}")
    if backend != "auto":
        return backend
    interpreting = os.environ.get("TRITON_INTERPRET") == "1"
    fits = tensor.dtype in SUPPORTED_DTYPES and (not tiled or tileable_head_dim(tensor.shape[-1]))
    if (tensor.is_cuda or interpreting) and fits and triton_available():
        return "triton"
    return "torch"


def scored_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    key_bias: torch.Tensor,
    *,
    scale: float | None = None,
    causal: bool = True,
    backend: str = "auto",
) -> torch.Tensor:
    """Attention with a per-key additive bias; see :func:`scored_attention_reference` for shapes."""
    if resolve_backend(backend, q) == "torch":
        return scored_attention_reference(q, k, v, key_bias, scale=scale, causal=causal)
    from curkv_train.kernels.scored_attention_triton import scored_attention_triton

    return scored_attention_triton(q, k, v, key_bias, scale=scale, causal=causal)


def compact_kept(
    k: torch.Tensor, v: torch.Tensor, keep_idx: torch.Tensor, *, backend: str = "auto"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense K/V of the kept tokens; see :func:`compact_kept_reference` for shapes."""
    if resolve_backend(backend, k, tiled=False) == "torch":
        return compact_kept_reference(k, v, keep_idx)
    from curkv_train.kernels.compact_triton import compact_kept_triton

    return compact_kept_triton(k, v, keep_idx)


def factored_attention(
    q: torch.Tensor,
    cold_keys: Sequence[Factors],
    cold_values: Sequence[Factors],
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scale: float | None = None,
    causal: bool = True,
    backend: str = "auto",
) -> torch.Tensor:
    """Attention over [CUR-factored cold blocks | dense keys]; see :func:`factored_attention_reference`."""
    if resolve_backend(backend, q) == "torch":
        return factored_attention_reference(q, cold_keys, cold_values, k, v, scale=scale, causal=causal)
    from curkv_train.kernels.factored_attention_triton import factored_attention_triton

    return factored_attention_triton(q, cold_keys, cold_values, k, v, scale=scale, causal=causal)


def ragged_attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    offsets: torch.Tensor,
    lengths: torch.Tensor,
    *,
    scale: float | None = None,
    check_bounds: bool = True,
    backend: str = "auto",
) -> torch.Tensor:
    """Causal attention of the newest queries over ragged KV segments; see :func:`ragged_attention_reference`.

    The storage (packed (rows, head_dim) keys and values, (batch, kv_heads) offsets and lengths)
    is described in :mod:`curkv_train.kernels.ragged`. ``check_bounds=False`` skips the Triton
    path's bounds check (a device sync) for a caller that built the offsets itself; the
    reference, the CPU path, always checks.
    """
    if resolve_backend(backend, q) == "torch":
        return ragged_attention_reference(q, keys, values, offsets, lengths, scale=scale)
    from curkv_train.kernels.ragged_attention_triton import ragged_attention_triton

    return ragged_attention_triton(q, keys, values, offsets, lengths, scale=scale, check_bounds=check_bounds)
