"""The Triton kernels on a real GPU at training sizes (skipped without CUDA)."""

import pytest
import torch

from curkv_train.kernels import compact_kept, factored_attention, scored_attention
from curkv_train.kernels.reference import (
    compact_kept_reference,
    factored_attention_reference,
    scored_attention_reference,
)
from curkv_train.runtime import cur

pytestmark = pytest.mark.gpu

TOLERANCE = {torch.bfloat16: 3e-2, torch.float16: 5e-3, torch.float32: 1e-4}


def inputs(dtype, q_heads=32, kv_heads=4, num_queries=512, num_keys=4096 + 512, head_dim=128):
    gen = torch.Generator(device="cuda").manual_seed(0)
    shape_q, shape_kv = (1, q_heads, num_queries, head_dim), (1, kv_heads, num_keys, head_dim)
    q = torch.randn(shape_q, device="cuda", generator=gen).to(dtype).requires_grad_()
    k = torch.randn(shape_kv, device="cuda", generator=gen).to(dtype).requires_grad_()
    v = torch.randn(shape_kv, device="cuda", generator=gen).to(dtype).requires_grad_()
    bias = torch.log(torch.rand(1, kv_heads, num_keys, device="cuda", generator=gen)).requires_grad_()
    return q, k, v, bias


def forward_backward(fn, q, k, v, bias):
    """Output and input gradients for an O(1) upstream gradient.

    A loss like ``out.square().mean()`` over 2M outputs sends gradients of ~1e-6 back, below
    float16's normal range (6e-5): every float16 gradient is then a handful of subnormal steps,
    in the reference as much as in the kernel. Float16 training scales its loss for this reason.
    """
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v, bias)]
    out = fn(*leaves, causal=True)
    upstream = torch.randn(out.shape, device=out.device, generator=torch.Generator(device=out.device).manual_seed(1))
    out.backward(upstream.to(out.dtype))
    return [out.detach().float()] + [t.grad.float() for t in leaves]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_triton_matches_reference_on_cuda(dtype, head_dim):
    q, k, v, bias = inputs(dtype, head_dim=head_dim)
    got = forward_backward(lambda *a, **kw: scored_attention(*a, backend="triton", **kw), q, k, v, bias)
    want = forward_backward(lambda *a, **kw: scored_attention_reference(*a, **kw), q, k, v, bias)
    for name, g, w in zip(("out", "dq", "dk", "dv", "dbias"), got, want):
        scale = w.abs().max().clamp_min(1e-6)
        error = ((g - w).abs().max() / scale).item()
        assert error < TOLERANCE[dtype], f"{name}: relative error {error:.2e}"


def test_compact_kept_is_exact_on_cuda():
    k = torch.randn(2, 8, 4096, 128, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    keep = torch.rand(2, 8, 4096, device="cuda").topk(1500, dim=-1).indices.sort(dim=-1).values
    for got, want in zip(compact_kept(k, v, keep, backend="triton"), compact_kept_reference(k, v, keep)):
        assert torch.equal(got, want)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("num_queries", [1, 64])
def test_factored_attention_matches_reference_on_cuda(dtype, num_queries):
    """SmolLM2-like heads (9 query / 3 KV heads, head_dim 64), two cold blocks of 2K and 300 tokens, 5 % residual."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(1, 9, num_queries, 64, device="cuda", generator=gen).to(dtype)
    k = torch.randn(1, 3, 500, 64, device="cuda", generator=gen).to(dtype)
    v = torch.randn(1, 3, 500, 64, device="cuda", generator=gen).to(dtype)
    cold_keys, cold_values = [], []
    for tokens in (2048, 300):
        for blocks in (cold_keys, cold_values):
            matrix = torch.randn(1, 3, tokens, 64, device="cuda", generator=gen).to(dtype)
            factors = cur.cur_decompose(matrix, 32, 32)
            blocks.append(cur.compensate(factors, matrix, cur.residual_count(tokens, 64, 0.05)))
    got = factored_attention(q, cold_keys, cold_values, k, v, backend="triton").float()
    want = factored_attention_reference(q, cold_keys, cold_values, k, v).float()
    error = ((got - want).abs().max() / want.abs().max()).item()
    assert error < TOLERANCE[dtype], f"relative error {error:.2e}"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_query_feature_kernels_match_the_torch_path_on_cuda(dtype, kv_heads=8, group=8, window=64, tokens=4096 + 37,
                                                            head_dim=128):
    """Llama-2-70B's geometry at 4K: the fused kernels against the torch path on the same device."""
    from curkv_train.core import features
    from curkv_train.kernels.query_features_triton import query_feature_parts_triton

    gen = torch.Generator(device="cuda").manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, device="cuda", generator=gen)

    keys, values = (randn(1, kv_heads, tokens, head_dim).to(dtype) for _ in range(2))
    queries = randn(1, kv_heads, group * window, head_dim) * head_dim**-0.5
    query_positions = torch.arange(tokens - window, tokens, device="cuda")
    positions = torch.arange(tokens, device="cuda")
    mean = randn(1, kv_heads, group, head_dim)
    factor = randn(1, kv_heads, group, head_dim, head_dim) / head_dim
    covariance = factor @ factor.transpose(-1, -2)
    weight = randn(8192, kv_heads * group, head_dim).reshape(8192, kv_heads, group, head_dim) / 100
    gram = torch.einsum("ohgd,ohge->hgde", weight, weight)
    scale = head_dim**-0.5
    fused = query_feature_parts_triton(queries, query_positions, keys, positions, values, mean, covariance, gram, scale)
    reference = (features.window_mass(queries, keys.float(), positions, query_positions),
                 features.expected_logits(scale * mean, 0.5 * scale**2 * covariance, keys.float()),
                 features.output_norms(None, values, group, gram))  # the module: only for its gram
    for name, got, want in zip(("window mass", "expected logits", "output norm"), fused, reference):
        torch.testing.assert_close(got, want, atol=1e-4 * float(want.abs().max()), rtol=1e-3, msg=name)


def test_auto_takes_the_feature_kernels_for_the_head_dims_they_tile():
    from curkv_train.core.features import feature_backend

    def backend(head_dim, requires_grad=False, dtype=torch.float32):
        keys = torch.zeros(1, 2, 8, head_dim, device="cuda", requires_grad=requires_grad, dtype=dtype)
        return feature_backend("auto", keys, keys)

    assert backend(128) == backend(64) == backend(64, dtype=torch.bfloat16) == "triton"
    assert backend(80) == "torch"  # Phi-style heads: the torch path
    assert backend(128, requires_grad=True) == "torch"
    assert backend(64, dtype=torch.float64) == "torch"  # the kernels compute in at most fp32
