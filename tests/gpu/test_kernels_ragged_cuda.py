"""Ragged-KV attention on a real GPU at model sizes (skipped without CUDA)."""

import pytest
import torch

from curkv_train.kernels import append_ragged, pack_ragged, ragged_attention
from curkv_train.kernels.ragged_attention_triton import ragged_attention_triton
from curkv_train.kernels.reference import ragged_attention_reference

pytestmark = pytest.mark.gpu

TOLERANCE = {torch.bfloat16: 3e-2, torch.float16: 5e-3, torch.float32: 1e-4}
# (q_heads, kv_heads, head_dim): Llama-3-8B, Gemma 3 4B (head_dim 256).
GEOMETRIES = [(32, 8, 128), (8, 4, 256)]


def ragged_case(dtype, q_heads, kv_heads, head_dim, num_queries, tokens=4096, batch=2, headroom=0):
    """A cache keeping a different random share of 4K tokens per (batch, KV head), one segment of a single token."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    keys = torch.randn(batch, kv_heads, tokens, head_dim, device="cuda", generator=gen).to(dtype)
    values = torch.randn(batch, kv_heads, tokens, head_dim, device="cuda", generator=gen).to(dtype)
    lengths = torch.randint(num_queries, tokens + 1, (batch, kv_heads), device="cuda", generator=gen)
    lengths[0, 0] = 1
    keep = [[torch.randperm(tokens, device="cuda", generator=gen)[: int(n)].sort().values for n in row] for row in lengths]
    q = torch.randn(batch, q_heads, num_queries, head_dim, device="cuda", generator=gen).to(dtype)
    return pack_ragged(keys, values, keep, headroom=headroom), q


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.float(), want.float()
    return ((got - want).abs().max() / want.abs().max().clamp_min(1e-6)).item()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("num_queries", [1, 64], ids=["decode", "chunk"])
@pytest.mark.parametrize("q_heads,kv_heads,head_dim", GEOMETRIES, ids=["llama3-8b", "gemma3-4b"])
def test_ragged_attention_matches_reference_on_cuda(dtype, num_queries, q_heads, kv_heads, head_dim):
    cache, q = ragged_case(dtype, q_heads, kv_heads, head_dim, num_queries)
    args = (q, cache.keys, cache.values, cache.offsets, cache.lengths)
    want = ragged_attention_reference(*args)
    for num_splits in (None, 1):  # the default splits a decode step's segments; 1 is the plain pass
        got = ragged_attention_triton(*args, num_splits=num_splits)
        assert torch.isfinite(got).all()
        error = relative_error(got, want)
        assert error < TOLERANCE[dtype], f"num_splits={num_splits}: relative error {error:.2e}"


def test_ragged_decode_after_append_never_reads_headroom_on_cuda():
    """Headroom poisoned with NaN, one token appended in place, then the decode step through the dispatcher."""
    cache, q = ragged_case(torch.bfloat16, 8, 4, 256, 1, headroom=8)
    held = torch.zeros(cache.keys.shape[0], dtype=torch.bool, device="cuda")
    for start, length in zip(cache.offsets.flatten().tolist(), cache.lengths.flatten().tolist()):
        held[start:start + length] = True
    cache.keys[~held] = float("nan")
    cache.values[~held] = float("nan")
    new = torch.randn(2, 2, 4, 1, 256, device="cuda").to(torch.bfloat16)
    grown = append_ragged(cache, new[0], new[1])
    assert grown.keys.data_ptr() == cache.keys.data_ptr()  # in place: the headroom took the token
    args = (q, grown.keys, grown.values, grown.offsets, grown.lengths)
    got = ragged_attention(*args, backend="triton", check_bounds=False)
    assert torch.isfinite(got).all()
    assert relative_error(got, ragged_attention_reference(*args)) < TOLERANCE[torch.bfloat16]


def test_ragged_storage_allocates_only_the_kept_tokens_on_cuda():
    """The device memory a packed cache adds is its kept tokens' bytes (plus allocator rounding)."""
    torch.cuda.synchronize()
    keys = torch.randn(1, 8, 4096, 128, device="cuda", dtype=torch.bfloat16)
    values = torch.randn_like(keys)
    keep = [[torch.arange(0, 4096, step, device="cuda") for step in range(1, 9)]]
    before = torch.cuda.memory_allocated()
    cache = pack_ragged(keys, values, keep)
    grown = torch.cuda.memory_allocated() - before
    kept = sum(index.numel() for index in keep[0])
    assert cache.bytes_held == kept * 128 * 2 * 2
    assert cache.bytes_held <= grown <= cache.bytes_held + 16 * 1024  # offsets, lengths, capacities: 512 B blocks
