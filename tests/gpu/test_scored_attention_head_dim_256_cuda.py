"""The scored-attention kernel at Gemma 3's head_dim 256 on a real GPU (skipped without CUDA).

The autotuned block configurations were chosen at head_dim 64 and 128; at 256 each program's [BLOCK, head_dim]
fp32 accumulators are twice as large, so this checks that some configuration compiles and that forward and all
four gradients match the reference.
"""

import pytest
import torch

from curkv_train.kernels import scored_attention
from curkv_train.kernels.reference import scored_attention_reference

pytestmark = pytest.mark.gpu

TOLERANCE = {torch.bfloat16: 3e-2, torch.float32: 1e-4}
GEMMA3_HEADS = {"270m": (4, 1), "4b": (8, 4)}  # (query heads, KV heads), head_dim 256 both


def leaves(dtype, q_heads, kv_heads, num_queries=256, num_keys=2048 + 256, head_dim=256):
    """Inputs (q, k, v, bias) on CUDA, seeded."""
    generator = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(1, q_heads, num_queries, head_dim, device="cuda", generator=generator).to(dtype)
    k, v = (torch.randn(1, kv_heads, num_keys, head_dim, device="cuda", generator=generator).to(dtype)
            for _ in range(2))
    bias = torch.log(torch.rand(1, kv_heads, num_keys, device="cuda", generator=generator))
    return q, k, v, bias


def forward_backward(fn, tensors):
    """The output and the gradients of q, k, v and the bias for a seeded O(1) upstream gradient, float32."""
    inputs = [t.detach().clone().requires_grad_() for t in tensors]
    out = fn(*inputs, causal=True)
    upstream = torch.randn(out.shape, device="cuda", generator=torch.Generator(device="cuda").manual_seed(1))
    out.backward(upstream.to(out.dtype))
    return [out.detach().float()] + [t.grad.float() for t in inputs]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("model", sorted(GEMMA3_HEADS))
def test_triton_matches_reference_at_head_dim_256(dtype, model):
    tensors = leaves(dtype, *GEMMA3_HEADS[model])
    got = forward_backward(lambda *a, **kw: scored_attention(*a, backend="triton", **kw), tensors)
    want = forward_backward(scored_attention_reference, tensors)
    for name, g, w in zip(("out", "dq", "dk", "dv", "dbias"), got, want):
        error = ((g - w).abs().max() / w.abs().max().clamp_min(1e-6)).item()
        assert error < TOLERANCE[dtype], f"{name}: relative error {error:.2e}"
