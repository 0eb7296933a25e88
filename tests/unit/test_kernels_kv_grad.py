"""dK and dV of the Triton score-biased attention vs autograd on the PyTorch reference.

In a multi-layer student the keys and values passed to the fused attention are
[frozen context cache | the continuation's own K/V], and the latter require grad from
layer 1 on, so the kernel must return dK and dV. CPU under TRITON_INTERPRET=1, tiny
shapes, 16-wide blocks so every case spans several ragged blocks.
"""

from __future__ import annotations

import pytest
import torch

from curkv_train.kernels.reference import scored_attention_reference
from curkv_train.kernels.scored_attention_triton import scored_attention_triton

BLOCK = 16
NAMES = ("out", "dq", "dk", "dv", "dbias")
# (atol, rtol) of the kernel against the reference on the same inputs. The dk / dv bounds
# are a few ulps of the input dtype at their magnitudes (|dv| reaches ~8 when a KV head's
# group of 3 query heads attends to few keys), and fp16/bf16 P and dS are rounded to the
# input dtype before the dK / dV matmuls, as on GPU.
TOLERANCES = {
    torch.float32: {"out": (2e-5, 1e-5), "dq": (1e-4, 1e-4), "dk": (1e-4, 1e-4),
                    "dv": (1e-4, 1e-4), "dbias": (1e-4, 1e-4)},
    torch.float16: {"out": (4e-3, 4e-3), "dq": (4e-3, 4e-3), "dk": (4e-3, 4e-3),
                    "dv": (4e-3, 4e-3), "dbias": (2e-3, 2e-3)},
    torch.bfloat16: {"out": (2e-2, 2e-2), "dq": (3e-2, 3e-2), "dk": (3e-2, 3e-2),
                     "dv": (3e-2, 3e-2), "dbias": (2e-2, 2e-2)},
}


def make_inputs(dtype, batch=2, q_heads=4, kv_heads=2, num_queries=13, num_keys=37, head_dim=16,
                seed=0):
    """Random q, k, v and a float32 key bias with -inf entries.

    KV head (0, 0) evicts its first N - M + 1 keys, so under causal masking its query 0
    sees only -inf keys; KV head (-1, -1) evicts every key; the others get scattered -inf.
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


def triton_fn(block_m=BLOCK, block_n=BLOCK):
    def fn(*args, **kwargs):
        return scored_attention_triton(*args, block_m=block_m, block_n=block_n, **kwargs)
    return fn


def run_all(fn, q, k, v, bias, needs=(True, True, True, True), **kwargs):
    """Forward + backward of fn with grads for the inputs flagged in `needs` (q, k, v, bias).

    Returns:
        dict name -> fp32 tensor (out, and the gradients that were requested).
    """
    leaves = [t.detach().clone().requires_grad_(need) for t, need in zip((q, k, v, bias), needs)]
    out = fn(*leaves, **kwargs)
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(out.dtype)
    out.backward(grad_out)
    results = {"out": out.detach().float()}
    for name, leaf, need in zip(NAMES[1:], leaves, needs):
        if need:
            assert leaf.grad is not None, name
            assert leaf.grad.dtype == leaf.dtype, name
            results[name] = leaf.grad.float()
        else:
            assert leaf.grad is None, name
    return results


def assert_matches(got, want, dtype):
    assert got.keys() == want.keys()
    for name in got:
        assert torch.isfinite(got[name]).all(), f"{name} has non-finite values"
        atol, rtol = TOLERANCES[dtype][name]
        torch.testing.assert_close(got[name], want[name], atol=atol, rtol=rtol,
                                   msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("group", [1, 3])
@pytest.mark.parametrize("causal", [True, False])
def test_kv_grads_match_reference(dtype, group, causal):
    """make_inputs has scattered -inf biases, a KV head whose first causal query sees only
    -inf keys, and a fully evicted KV head."""
    q, k, v, bias = make_inputs(dtype, q_heads=2 * group, kv_heads=2)
    got = run_all(triton_fn(), q, k, v, bias, causal=causal)
    want = run_all(scored_attention_reference, q, k, v, bias, causal=causal)
    assert_matches(got, want, dtype)
    # The fully evicted KV head (-1, -1) receives exactly zero dK and dV.
    for name in ("dk", "dv"):
        assert torch.equal(got[name][-1, -1], torch.zeros_like(got[name][-1, -1])), name


@pytest.mark.parametrize("num_queries,num_keys", [(40, 23), (1, 50), (17, 64)])
@pytest.mark.parametrize("causal", [True, False])
def test_kv_grads_ragged_sizes(num_queries, num_keys, causal):
    """M > N (early causal queries see no key), M = 1, M < N with partial blocks; GQA 3."""
    q, k, v, bias = make_inputs(torch.float32, batch=1, q_heads=3, kv_heads=1,
                                num_queries=num_queries, num_keys=num_keys)
    got = run_all(triton_fn(), q, k, v, bias, causal=causal)
    want = run_all(scored_attention_reference, q, k, v, bias, causal=causal)
    assert_matches(got, want, torch.float32)


@pytest.mark.parametrize("blocks", [(32, 16), (16, 32), (None, None)], ids=str)
def test_kv_grads_block_sizes(blocks):
    q, k, v, bias = make_inputs(torch.float16, batch=1, q_heads=3, kv_heads=1, num_queries=35,
                                num_keys=50)
    got = run_all(triton_fn(*blocks), q, k, v, bias, causal=True, scale=0.3)
    want = run_all(scored_attention_reference, q, k, v, bias, causal=True, scale=0.3)
    assert_matches(got, want, torch.float16)


@pytest.mark.parametrize("needs", [(False, True, False, False), (False, False, True, False),
                                   (True, True, True, False), (False, True, True, True)],
                         ids=["k", "v", "q-k-v", "k-v-bias"])
def test_subsets_of_gradients(needs):
    """Any subset of inputs may require grad; the others get none."""
    q, k, v, bias = make_inputs(torch.float32, batch=1, q_heads=4, kv_heads=2)
    got = run_all(triton_fn(), q, k, v, bias, needs=needs)
    want = run_all(scored_attention_reference, q, k, v, bias, needs=needs)
    assert_matches(got, want, torch.float32)


def test_dbias_identical_with_and_without_kv_grads():
    """Switching dK/dV on must not change the key-bias gradient (same fp32 accumulation),
    and the backward is deterministic (no atomics)."""
    q, k, v, bias = make_inputs(torch.float32, q_heads=6, kv_heads=2)
    bias_only = run_all(triton_fn(), q, k, v, bias, needs=(True, False, False, True))
    everything = run_all(triton_fn(), q, k, v, bias)
    again = run_all(triton_fn(), q, k, v, bias)
    assert torch.equal(bias_only["dbias"], everything["dbias"])
    assert torch.equal(bias_only["dq"], everything["dq"])
    for name in NAMES:
        assert torch.equal(everything[name], again[name]), name


def test_cache_concatenation_like_the_student():
    """The student's keys are cat([frozen context cache, continuation K]); only the
    continuation's part carries a gradient, and strided (sliced, transposed) inputs work."""
    batch, q_heads, kv_heads, num_queries, context, head_dim = 1, 4, 2, 9, 30, 16
    _, _, _, bias = make_inputs(torch.float32, batch, q_heads, kv_heads, num_queries,
                                context + num_queries)
    gen = torch.Generator().manual_seed(5)
    cache = torch.randn(2, batch, kv_heads, context + 7, head_dim, generator=gen)
    own = torch.randn(batch, num_queries, 2 * kv_heads, head_dim, generator=gen).transpose(1, 2)
    q = torch.randn(batch, num_queries, q_heads, head_dim, generator=gen).transpose(1, 2)
    grads = []
    for fn in (triton_fn(), scored_attention_reference):
        own_leaf = own.detach().clone().requires_grad_()
        k = torch.cat([cache[0, :, :, :context], own_leaf[:, :kv_heads]], dim=2)
        v = torch.cat([cache[1, :, :, :context], own_leaf[:, kv_heads:]], dim=2)
        fn(q, k, v, bias, causal=True).square().sum().backward()
        grads.append(own_leaf.grad)
    assert grads[0].abs().max() > 0
    torch.testing.assert_close(grads[0], grads[1], atol=1e-4, rtol=1e-4)


def test_double_backward_raises():
    """Second-order gradients are not implemented: a clear error, never a silent zero."""
    q, k, v, bias = make_inputs(torch.float32, batch=1, q_heads=2, kv_heads=1)
    k = k.clone().requires_grad_()
    out = scored_attention_triton(q, k, v, bias, block_m=BLOCK, block_n=BLOCK)
    (grad_k,) = torch.autograd.grad(out.square().sum(), k, create_graph=True)
    with pytest.raises(RuntimeError, match="twice|double backward|once_differentiable"):
        grad_k.sum().backward()
