"""Triton compaction of kept KV tokens vs plain indexing (CPU, TRITON_INTERPRET=1)."""

from __future__ import annotations

import pytest
import torch

from curkv_train.kernels import compact_kept
from curkv_train.kernels.compact_triton import compact_kept_triton
from curkv_train.kernels.reference import compact_kept_reference


def make_cache(dtype, batch=2, kv_heads=3, num_tokens=50, head_dim=16, value_dim=24, seed=0):
    """Random keys (B, H, N, d) and values (B, H, N, dv)."""
    gen = torch.Generator().manual_seed(seed)
    k = torch.randn(batch, kv_heads, num_tokens, head_dim, generator=gen).to(dtype)
    v = torch.randn(batch, kv_heads, num_tokens, value_dim, generator=gen).to(dtype)
    return k, v


def random_keep(batch, kv_heads, num_tokens, kept, seed=0):
    """(B, H, kept) int64 distinct indices per head in a random (non-sorted) order."""
    gen = torch.Generator().manual_seed(seed)
    rows = [torch.randperm(num_tokens, generator=gen)[:kept] for _ in range(batch * kv_heads)]
    return torch.stack(rows).view(batch, kv_heads, kept)


def by_indexing(k, v, keep_idx):
    """Expected result with advanced indexing."""
    b = torch.arange(k.shape[0])[:, None, None]
    h = torch.arange(k.shape[1])[None, :, None]
    return k[b, h, keep_idx], v[b, h, keep_idx]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("kept", [1, 37, 50, 130])
def test_exact_against_indexing(dtype, kept):
    k, v = make_cache(dtype, num_tokens=50 if kept <= 50 else 200)
    keep_idx = random_keep(2, 3, k.shape[2], kept)
    keys, values = compact_kept_triton(k, v, keep_idx)
    want_keys, want_values = by_indexing(k, v, keep_idx)
    assert keys.is_contiguous() and values.is_contiguous()
    assert torch.equal(keys, want_keys) and torch.equal(values, want_values)
    ref_keys, ref_values = compact_kept_reference(k, v, keep_idx)
    assert torch.equal(keys, ref_keys) and torch.equal(values, ref_values)


def test_repeated_indices_and_strided_cache():
    """Indices may repeat; k / v may be slices of a longer preallocated cache."""
    cache_k, cache_v = make_cache(torch.float16, num_tokens=64, head_dim=32, value_dim=32)
    k, v = cache_k[:, :, :40], cache_v[:, :, :40]
    keep_idx = torch.randint(0, 40, (2, 3, 25), generator=torch.Generator().manual_seed(1))
    keep_idx[0, 0, :] = 7
    keys, values = compact_kept_triton(k, v, keep_idx)
    want_keys, want_values = by_indexing(k, v, keep_idx)
    assert torch.equal(keys, want_keys) and torch.equal(values, want_values)


def test_empty_selection():
    k, v = make_cache(torch.float32)
    keys, values = compact_kept_triton(k, v, torch.zeros(2, 3, 0, dtype=torch.int64))
    assert keys.shape == (2, 3, 0, 16) and values.shape == (2, 3, 0, 24)


def test_invalid_inputs_raise():
    k, v = make_cache(torch.float32)
    with pytest.raises(TypeError, match="int64"):
        compact_kept_triton(k, v, torch.zeros(2, 3, 4, dtype=torch.int32))
    with pytest.raises(ValueError, match="shape mismatch"):
        compact_kept_triton(k, v, torch.zeros(2, 2, 4, dtype=torch.int64))


def test_dispatch_backends_agree():
    k, v = make_cache(torch.bfloat16)
    keep_idx = random_keep(2, 3, 50, 20)
    torch_keys, torch_values = compact_kept(k, v, keep_idx, backend="torch")
    triton_keys, triton_values = compact_kept(k, v, keep_idx, backend="triton")
    assert torch.equal(torch_keys, triton_keys) and torch.equal(torch_values, triton_values)


def test_dispatch_unknown_backend():
    k, v = make_cache(torch.float32)
    with pytest.raises(ValueError, match="unknown kernel backend"):
        compact_kept(k, v, random_keep(2, 3, 50, 5), backend="numpy")
