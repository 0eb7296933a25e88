"""Triton score-biased attention vs the PyTorch reference (CPU, TRITON_INTERPRET=1).

Shapes are tiny and blocks are 16 so that every case spans several ragged blocks
while the interpreter stays fast.
"""

from __future__ import annotations

import pytest
import torch

from curkv_train.kernels import scored_attention
from curkv_train.kernels.dispatch import resolve_backend
from curkv_train.kernels.reference import scored_attention_reference
from curkv_train.kernels.scored_attention_triton import scored_attention_triton

# (atol, rtol) of the kernel against the reference on the same inputs. fp16/bf16 round
# the output and dQ to the input dtype and feed fp16/bf16 probabilities to P @ V, so
# their bounds are a few ulps of values of magnitude ~1-4.
TOLERANCES = {
    torch.float32: {"out": (2e-5, 1e-5), "dq": (1e-4, 1e-4), "dbias": (1e-4, 1e-4)},
    torch.float16: {"out": (4e-3, 4e-3), "dq": (4e-3, 4e-3), "dbias": (2e-3, 2e-3)},
    torch.bfloat16: {"out": (2e-2, 2e-2), "dq": (3e-2, 3e-2), "dbias": (2e-2, 2e-2)},
}
# |sum_j dbias_j| relative to sum_j |dbias_j| per (batch, KV head): softmax invariance.
IDENTITY_TOLERANCE = {
    torch.float64: 1e-12,
    torch.float32: 1e-5,
    torch.float16: 1e-3,
    torch.bfloat16: 1e-2,
}
BLOCK = 16
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def make_inputs(dtype, batch=2, q_heads=4, kv_heads=2, num_queries=13, num_keys=37, head_dim=16,
                seed=0):
    """Random q, k, v and a key bias with -inf entries.

    KV head (0, 0) evicts its first N - M + 1 keys, so under causal masking query 0 sees
    only -inf keys; KV head (-1, -1) evicts every key (all its rows are fully -inf);
    the others get scattered -inf entries.
    """
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, q_heads, num_queries, head_dim, generator=gen).to(dtype)
    k = torch.randn(batch, kv_heads, num_keys, head_dim, generator=gen).to(dtype)
    v = torch.randn(batch, kv_heads, num_keys, head_dim, generator=gen).to(dtype)
    bias = 2.0 * torch.randn(batch, kv_heads, num_keys, generator=gen)
    bias[torch.rand(bias.shape, generator=gen) < 0.2] = float("-inf")
    bias[0, 0, : max(num_keys - num_queries + 1, 0)] = float("-inf")
    if batch * kv_heads > 1:
        bias[-1, -1] = float("-inf")
    return q, k, v, bias


def run(fn, q, k, v, bias, grad_out=None, **kwargs):
    """Forward + backward of fn; returns (out, dq, dbias) in float32 (float64 stays)."""
    q = q.detach().clone().requires_grad_()
    bias = bias.detach().clone().requires_grad_()
    out = fn(q, k, v, bias, **kwargs)
    if grad_out is None:
        grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(out.dtype)
    out.backward(grad_out)
    results = (out.detach(), q.grad, bias.grad)
    return tuple(t.to(torch.promote_types(t.dtype, torch.float32)) for t in results)


def assert_matches(got, want, dtype):
    """Compare (out, dq, dbias) triples with the per-dtype tolerances."""
    for name, g, w in zip(("out", "dq", "dbias"), got, want):
        assert torch.isfinite(g).all(), f"{name} has non-finite values"
        atol, rtol = TOLERANCES[dtype][name]
        torch.testing.assert_close(g, w, atol=atol, rtol=rtol, msg=lambda m, n=name: f"{n}: {m}")


def triton_blocks(block_m=BLOCK, block_n=BLOCK):
    """scored_attention_triton with fixed small blocks."""
    def fn(*args, **kwargs):
        return scored_attention_triton(*args, block_m=block_m, block_n=block_n, **kwargs)
    return fn


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("group", [1, 3, 4])
@pytest.mark.parametrize("causal", [True, False])
def test_matches_reference(dtype, group, causal):
    q, k, v, bias = make_inputs(dtype, q_heads=2 * group, kv_heads=2)
    got = run(triton_blocks(), q, k, v, bias, causal=causal)
    want = run(scored_attention_reference, q, k, v, bias, causal=causal)
    assert_matches(got, want, dtype)


@pytest.mark.parametrize("num_queries,num_keys", [(40, 23), (1, 50), (32, 32), (17, 64)])
@pytest.mark.parametrize("causal", [True, False])
def test_ragged_sizes(num_queries, num_keys, causal):
    """M > N (early queries see no key under causal), M = 1, block multiples, M < N."""
    q, k, v, bias = make_inputs(torch.float32, batch=1, q_heads=2, kv_heads=1,
                                num_queries=num_queries, num_keys=num_keys)
    got = run(triton_blocks(), q, k, v, bias, causal=causal)
    want = run(scored_attention_reference, q, k, v, bias, causal=causal)
    assert_matches(got, want, torch.float32)


def test_rows_without_visible_keys_are_zero_with_zero_grads():
    q, k, v, bias = make_inputs(torch.float32, batch=1, q_heads=2, kv_heads=1,
                                num_queries=20, num_keys=8)
    bias[:] = 0.0
    out, dq, _ = run(triton_blocks(), q, k, v, bias, causal=True)
    blind = 20 - 8  # bottom-right causal: queries 0..11 see no key
    assert torch.equal(out[:, :, :blind], torch.zeros_like(out[:, :, :blind]))
    assert torch.equal(dq[:, :, :blind], torch.zeros_like(dq[:, :, :blind]))
    q, k, v, bias = make_inputs(torch.float32, batch=1, q_heads=2, kv_heads=1)
    bias[:] = float("-inf")
    out, dq, dbias = run(triton_blocks(), q, k, v, bias, causal=False)
    for t in (out, dq, dbias):
        assert torch.equal(t, torch.zeros_like(t))


@pytest.mark.parametrize("head_dim", [64, 128])
def test_large_head_dims(head_dim):
    q, k, v, bias = make_inputs(torch.float16, batch=1, q_heads=2, kv_heads=1, num_queries=5,
                                num_keys=20, head_dim=head_dim)
    got = run(triton_blocks(), q, k, v, bias, causal=True)
    want = run(scored_attention_reference, q, k, v, bias, causal=True)
    assert_matches(got, want, torch.float16)


@pytest.mark.parametrize("blocks", [(32, 16), (16, 32), (None, None)], ids=str)
def test_block_sizes(blocks):
    q, k, v, bias = make_inputs(torch.float32, batch=1, q_heads=3, kv_heads=1, num_queries=35,
                                num_keys=50)
    got = run(triton_blocks(*blocks), q, k, v, bias, causal=True, scale=0.3)
    want = run(scored_attention_reference, q, k, v, bias, causal=True, scale=0.3)
    assert_matches(got, want, torch.float32)


def test_strided_inputs():
    """q as a transposed (B, M, H, d) view and k / v as slices of a longer cache."""
    batch, q_heads, kv_heads, num_queries, num_keys, head_dim = 2, 4, 2, 13, 37, 16
    _, _, _, bias = make_inputs(torch.float32, batch, q_heads, kv_heads, num_queries, num_keys)
    q = torch.randn(batch, num_queries, q_heads, head_dim).transpose(1, 2)
    cache = torch.randn(2, batch, kv_heads, num_keys + 11, head_dim)
    k, v = cache[0, :, :, :num_keys], cache[1, :, :, :num_keys]
    assert not (q.is_contiguous() or k.is_contiguous())
    got = run(triton_blocks(), q, k, v, bias, causal=True)
    want = run(scored_attention_reference, q, k, v, bias, causal=True)
    assert_matches(got, want, torch.float32)


def test_gradient_of_one_input_only():
    q, k, v, bias = make_inputs(torch.float32, batch=1, q_heads=2, kv_heads=1)
    bias_leaf = bias.clone().requires_grad_()
    scored_attention_triton(q, k, v, bias_leaf, block_m=BLOCK, block_n=BLOCK).sum().backward()
    ref_bias = bias.clone().requires_grad_()
    scored_attention_reference(q, k, v, ref_bias).sum().backward()
    torch.testing.assert_close(bias_leaf.grad, ref_bias.grad, atol=1e-4, rtol=1e-4)
    q_leaf = q.clone().requires_grad_()
    out = scored_attention_triton(q_leaf, k, v, bias, block_m=BLOCK, block_n=BLOCK)
    out.sum().backward()
    assert q_leaf.grad is not None and torch.isfinite(q_leaf.grad).all()


def dbias_column_sums(dbias):
    """(|sum_j dbias_j|, sum_j |dbias_j|) per (batch, KV head)."""
    return dbias.sum(-1).abs(), dbias.abs().sum(-1)


@pytest.mark.parametrize("dtype", list(IDENTITY_TOLERANCE), ids=str)
def test_dbias_sums_to_zero(dtype):
    """Softmax is invariant to a per-row shift, so sum_j dS_ij = 0 for every row i and the
    key-bias gradient summed over all keys vanishes per (batch, KV head)."""
    q, k, v, bias = make_inputs(torch.float32)
    bias[-1, -1] = 0.0  # keep every head non-trivial
    q, k, v = (t.to(dtype) for t in (q, k, v))
    if dtype == torch.float64:
        bias = bias.double()
    grads = [run(scored_attention_reference, q, k, v, bias)[2]]
    if dtype != torch.float64:
        grads.append(run(triton_blocks(), q, k, v, bias)[2])
    for dbias in grads:
        total, scale = dbias_column_sums(dbias)
        assert (scale > 0).all()
        assert (total <= IDENTITY_TOLERANCE[dtype] * scale).all(), (total / scale).max()


@pytest.mark.parametrize("causal", [True, False])
def test_reference_gradcheck(causal):
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(1, 2, 3, 4, generator=gen, dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, 1, 5, 4, generator=gen, dtype=torch.float64)
    v = torch.randn(1, 1, 5, 4, generator=gen, dtype=torch.float64)
    bias = torch.randn(1, 1, 5, generator=gen, dtype=torch.float64)
    bias[0, 0, 1] = float("-inf")
    bias.requires_grad_()
    assert torch.autograd.gradcheck(
        lambda q_, b_: scored_attention_reference(q_, k, v, b_, causal=causal), (q, bias)
    )


def test_invalid_shapes_raise():
    q, k, v, bias = make_inputs(torch.float32, batch=1, q_heads=3, kv_heads=2)
    with pytest.raises(ValueError, match="multiple"):
        scored_attention_triton(q, k, v, bias)
    q, k, v, bias = make_inputs(torch.float32, batch=1, q_heads=2, kv_heads=1, head_dim=24)
    with pytest.raises(ValueError, match="power of two"):
        scored_attention_triton(q, k, v, bias)


def test_dispatch_backends_agree():
    q, k, v, bias = make_inputs(torch.float32)
    assert resolve_backend("auto", q) == "triton"  # conftest sets TRITON_INTERPRET=1
    torch_result = run(scored_attention, q, k, v, bias, backend="torch")
    triton_result = run(scored_attention, q, k, v, bias, backend="triton")
    assert_matches(triton_result, torch_result, torch.float32)


def test_dispatch_unknown_backend():
    q, k, v, bias = make_inputs(torch.float32, batch=1, q_heads=2, kv_heads=1)
    with pytest.raises(ValueError, match="unknown kernel backend"):
        scored_attention(q, k, v, bias, backend="cuda")


@pytest.mark.parametrize(("dtype", "head_dim"), [(torch.float32, 24), (torch.float64, 16)])
def test_auto_takes_the_reference_where_the_kernels_cannot(dtype, head_dim):
    """A head_dim the kernels cannot tile (e.g. Phi-3's 96) or float64: auto falls back, an explicit triton refuses."""
    q, k, v, bias = make_inputs(dtype, batch=1, q_heads=2, kv_heads=1, head_dim=head_dim)
    assert resolve_backend("auto", q) == "torch"
    untiled = "torch" if dtype == torch.float64 else "triton"  # the compaction kernel takes any head_dim
    assert resolve_backend("auto", k, tiled=False) == untiled
    torch.testing.assert_close(scored_attention(q, k, v, bias), scored_attention_reference(q, k, v, bias))
    with pytest.raises(ValueError):
        scored_attention(q, k, v, bias, backend="triton")
