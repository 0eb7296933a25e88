"""Attention over CUR-factored cold blocks + dense keys: reference vs reconstruction, Triton vs reference.

CPU, TRITON_INTERPRET=1. Shapes are tiny and token blocks are 16 so that every case
spans several ragged blocks and token splits while the interpreter stays fast.
"""

from __future__ import annotations

import pytest
import torch

from curkv_train.kernels import factored_attention
from curkv_train.kernels.factored_attention_triton import factored_attention_triton, merge_partials
from curkv_train.kernels.reference import factored_attention_reference, scored_attention_reference
from curkv_train.runtime import cur

# (atol, rtol) of the kernel against the reference on the same factors. fp16/bf16: the
# dense part feeds fp16/bf16 probabilities to P @ V and the output is rounded to the dtype.
TOLERANCES = {torch.float32: (2e-5, 1e-5), torch.float16: (4e-3, 4e-3), torch.bfloat16: (2e-2, 2e-2)}
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
BLOCK = 16


def cold_block(tokens: int, dtype: torch.dtype, residual: bool, batch: int = 1, kv_heads: int = 2,
               head_dim: int = 16, rank: int = 6, seed: int = 0) -> tuple[cur.CurFactors, cur.CurFactors]:
    """Key and value factors of a random (batch, kv_heads, tokens, head_dim) block at rank < head_dim."""
    gen = torch.Generator().manual_seed(seed)
    factors = []
    for _ in range(2):
        matrix = torch.randn(batch, kv_heads, tokens, head_dim, generator=gen).to(dtype)
        block = cur.cur_decompose(matrix, rank, rank)
        if residual:
            block = cur.compensate(block, matrix, cur.residual_count(tokens, head_dim, 0.05))
        factors.append(block)
    return factors[0], factors[1]


def make_inputs(dtype, cold_tokens=(40,), residual=True, batch=1, q_heads=4, kv_heads=2, num_queries=1,
                num_keys=11, head_dim=16, seed=0):
    """Queries, per-block key / value factors and dense keys / values (the last num_queries the queries' own)."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, q_heads, num_queries, head_dim, generator=gen).to(dtype)
    k = torch.randn(batch, kv_heads, num_keys, head_dim, generator=gen).to(dtype)
    v = torch.randn(batch, kv_heads, num_keys, head_dim, generator=gen).to(dtype)
    blocks = [cold_block(tokens, dtype, residual, batch, kv_heads, head_dim, seed=seed + 1 + index)
              for index, tokens in enumerate(cold_tokens)]
    return q, [b[0] for b in blocks], [b[1] for b in blocks], k, v


def triton_blocks(block_n=BLOCK, num_splits=None):
    """factored_attention_triton with small fixed token blocks."""
    def fn(*args, **kwargs):
        return factored_attention_triton(*args, block_n=block_n, num_splits=num_splits, **kwargs)
    return fn


def assert_matches(got, want, dtype):
    atol, rtol = TOLERANCES[dtype]
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got.float(), want.float(), atol=atol, rtol=rtol)


@pytest.mark.parametrize("residual", [True, False], ids=["residual", "bare"])
@pytest.mark.parametrize("num_queries", [1, 5], ids=["decode", "chunk"])
@pytest.mark.parametrize("group", [1, 3])
def test_reference_equals_dense_attention_over_reconstructed_blocks(residual, num_queries, group):
    """The factored reference is attention over [reconstruct(cold blocks) | dense keys]."""
    q, cold_keys, cold_values, k, v = make_inputs(torch.float64, cold_tokens=(40, 23), residual=residual,
                                                  q_heads=2 * group, num_queries=num_queries)
    keys = torch.cat([cur.reconstruct(block) for block in cold_keys] + [k], dim=-2)
    values = torch.cat([cur.reconstruct(block) for block in cold_values] + [v], dim=-2)
    bias = torch.zeros(keys.shape[:3], dtype=torch.float64)
    # Bottom-right causal over [cold | dense] leaves every cold key visible (the dense part holds >= M keys).
    want = scored_attention_reference(q, keys, values, bias, causal=True)
    got = factored_attention_reference(q, cold_keys, cold_values, k, v)
    torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("num_queries", [4, 15], ids=["M<N", "M>N"])
def test_reference_without_cold_blocks_is_plain_attention(num_queries):
    """No cold block: plain causal attention, rows that see no dense key (M > N) give 0."""
    q, _, _, k, v = make_inputs(torch.float32, cold_tokens=(), num_queries=num_queries)
    want = scored_attention_reference(q, k, v, torch.zeros(k.shape[:3]), causal=True)
    got = factored_attention_reference(q, [], [], k, v)
    torch.testing.assert_close(got, want)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(factored_attention_triton(q, [], [], k, v), want, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("residual", [True, False], ids=["residual", "bare"])
@pytest.mark.parametrize("num_queries", [1, 6], ids=["decode", "chunk"])
def test_kernel_matches_reference(dtype, residual, num_queries):
    q, cold_keys, cold_values, k, v = make_inputs(dtype, residual=residual, num_queries=num_queries)
    got = triton_blocks()(q, cold_keys, cold_values, k, v)
    want = factored_attention_reference(q, cold_keys, cold_values, k, v)
    assert got.dtype == dtype and got.shape == q.shape
    assert_matches(got, want, dtype)


@pytest.mark.parametrize("block_n,num_splits", [(16, 1), (16, 3), (32, 2), (None, None)], ids=str)
def test_kernel_multi_block_splits_and_gqa(block_n, num_splits):
    """Three blocks of ragged lengths (one shorter than a token block), GQA group 3, batch 2, a chunk."""
    q, cold_keys, cold_values, k, v = make_inputs(torch.float32, cold_tokens=(70, 9, 33), batch=2, q_heads=6,
                                                  num_queries=3)
    got = triton_blocks(block_n, num_splits)(q, cold_keys, cold_values, k, v, scale=0.3)
    want = factored_attention_reference(q, cold_keys, cold_values, k, v, scale=0.3)
    assert_matches(got, want, torch.float32)


def test_kernel_strided_queries_and_wide_ranks():
    """q as a transposed (B, M, H, d) view; ranks c = r = head_dim (exact factors) with a 64-wide head."""
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(1, 3, 2, 64, generator=gen).transpose(1, 2)
    k, v = torch.randn(1, 1, 4, 64, generator=gen), torch.randn(1, 1, 4, 64, generator=gen)
    matrix_k, matrix_v = torch.randn(2, 1, 1, 48, 64, generator=gen)
    cold_k = cur.compensate(cur.cur_decompose(matrix_k, 64, 64), matrix_k, 20)
    cold_v = cur.compensate(cur.cur_decompose(matrix_v, 64, 64), matrix_v, 20)
    assert not q.is_contiguous()
    got = triton_blocks()(q, [cold_k], [cold_v], k, v)
    want = factored_attention_reference(q, [cold_k], [cold_v], k, v)
    assert_matches(got, want, torch.float32)


def test_comparison_detects_a_wrong_kernel():
    """Negative control: the tolerance used above rejects a result missing the residual or the causal mask."""
    q, cold_keys, cold_values, k, v = make_inputs(torch.float32, num_queries=6)
    want = factored_attention_reference(q, cold_keys, cold_values, k, v)
    bare_values = [cur.CurFactors(b.columns, b.core, b.rows) for b in cold_values]
    without_residual = triton_blocks()(q, cold_keys, bare_values, k, v)
    with pytest.raises(AssertionError):
        assert_matches(without_residual, want, torch.float32)
    not_causal = triton_blocks()(q, cold_keys, cold_values, k, v, causal=False)
    with pytest.raises(AssertionError):
        assert_matches(not_causal, want, torch.float32)


def test_merge_partials_is_attention_over_the_union():
    q, _, _, k, v = make_inputs(torch.float64, cold_tokens=(), q_heads=2, kv_heads=1, num_keys=20)
    bias = torch.zeros(k.shape[:3], dtype=torch.float64)
    scale = q.shape[-1] ** -0.5
    parts = [(k[..., :7, :], v[..., :7, :]), (k[..., 7:, :], v[..., 7:, :])]
    outs, lses = [], []
    for part_k, part_v in parts:
        outs.append(scored_attention_reference(q, part_k, part_v, bias[..., :part_k.shape[-2]], causal=False))
        logits = torch.einsum("bhmd,bnd->bhmn", q, part_k[:, 0]) * scale  # one KV head
        lses.append(torch.logsumexp(logits, dim=-1))
    outs.append(torch.full_like(outs[0], 7.0))  # a part that saw no key: weight 0
    lses.append(torch.full_like(lses[0], float("-inf")))
    merged = merge_partials(torch.stack(outs), torch.stack(lses))
    torch.testing.assert_close(merged, scored_attention_reference(q, k, v, bias, causal=False))


def test_dispatch_backends_agree():
    q, cold_keys, cold_values, k, v = make_inputs(torch.float32, cold_tokens=(40, 20), num_queries=2)
    torch_out = factored_attention(q, cold_keys, cold_values, k, v, backend="torch")
    triton_out = factored_attention(q, cold_keys, cold_values, k, v, backend="triton")
    assert_matches(triton_out, torch_out, torch.float32)


def test_invalid_inputs_raise():
    q, cold_keys, cold_values, k, v = make_inputs(torch.float32)
    with pytest.raises(ValueError, match="cold value blocks"):
        factored_attention_triton(q, cold_keys, [], k, v)
    with pytest.raises(ValueError, match="cold value blocks"):
        factored_attention_reference(q, cold_keys, [], k, v)
    with pytest.raises(ValueError, match="multiple"):
        factored_attention_triton(q[:, :3], cold_keys, cold_values, k, v)
    with pytest.raises(ValueError, match="unknown kernel backend"):
        factored_attention(q, cold_keys, cold_values, k, v, backend="cuda")
