"""The estimator's per-(layer, KV head) products against their einsum definitions, values and gradients."""

import pytest
import torch

from curkv_train.models.seed_estimator import add_per_head_dot_, per_head_affine, per_head_dot


def inputs_and_weights(batch: int, transposed: bool):
    """(L'=2, batch, heads=3, tokens=5, d=4) inputs (a strided view if ``transposed``) and per-head parameters."""
    generator = torch.Generator().manual_seed(batch)
    inputs = torch.randn(2, batch, 5, 3, 4, generator=generator).transpose(2, 3) if transposed else \
        torch.randn(2, batch, 3, 5, 4, generator=generator)
    weight = torch.randn(2, 3, 4, 6, generator=generator)
    return inputs.requires_grad_(), weight.requires_grad_(), torch.randn(2, 3, 6, generator=generator).requires_grad_()


@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("transposed", [False, True])
def test_per_head_affine_is_each_heads_own_map(batch, transposed):
    inputs, weight, bias = inputs_and_weights(batch, transposed)
    got = per_head_affine(inputs, weight, bias)
    want = torch.einsum("lbhnd,lhdk->lbhnk", inputs, weight) + bias[:, None, :, None, :]
    torch.testing.assert_close(got, want)
    grads = torch.autograd.grad(got.square().sum(), (inputs, weight, bias))
    for mine, reference in zip(grads, torch.autograd.grad(want.square().sum(), (inputs, weight, bias))):
        torch.testing.assert_close(mine, reference)


@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("transposed", [False, True])
def test_per_head_dots_add_each_term_in_its_product(batch, transposed):
    inputs, weights, biases = inputs_and_weights(batch, transposed)
    weight, other, bias = weights[..., 0], weights[..., 1], biases[..., 0]
    got = add_per_head_dot_(per_head_dot(inputs, weight, bias, scale=0.5), inputs.flip(-1), other)
    want = (0.5 * torch.einsum("lbhnd,lhd->lbhn", inputs, weight) + bias[:, None, :, None]
            + torch.einsum("lbhnd,lhd->lbhn", inputs.flip(-1), other))
    torch.testing.assert_close(got, want)
    grads = torch.autograd.grad(got.square().sum(), (inputs, weights, biases))
    for mine, reference in zip(grads, torch.autograd.grad(want.square().sum(), (inputs, weights, biases))):
        torch.testing.assert_close(mine, reference)
