"""The torch path of the query features against plain per-row references, and the rotation shared by a round."""

import pytest
import torch

from curkv_train.core import features
from curkv_train.core.rope import average_rotation
from curkv_train.core.errors import CurKVError


def naive_window_mass(queries, keys, positions, query_positions):
    """Each row's softmax over the keys at or before its query's position, averaged over rows, one at a time."""
    batch, kv_heads, rows, _ = queries.shape
    window = query_positions.shape[0]
    mass = torch.zeros(batch, kv_heads, keys.shape[2])
    for b in range(batch):
        for h in range(kv_heads):
            head_positions = positions if positions.dim() == 1 else positions[b, h]
            for row in range(rows):
                visible = head_positions <= query_positions[row % window]
                if visible.any():
                    logits = keys[b, h, visible] @ queries[b, h, row]
                    mass[b, h, visible] += logits.softmax(dim=0) / rows
    return mass


def test_window_mass_masks_each_query_heads_rows_by_their_query_position():
    gen = torch.Generator().manual_seed(0)
    batch, kv_heads, group, window, tokens, dim = 2, 2, 3, 4, 19, 8
    positions = torch.stack([torch.randperm(40, generator=gen)[:tokens].sort().values
                             for _ in range(batch * kv_heads)]).reshape(batch, kv_heads, tokens)
    query_positions = torch.tensor([1, 20, 33, 39])  # the first query sees no key of some heads
    queries = torch.randn(batch, kv_heads, group * window, dim, generator=gen)
    keys = torch.randn(batch, kv_heads, tokens, dim, generator=gen)
    for token_positions in (positions, torch.arange(tokens) * 2):
        torch.testing.assert_close(features.window_mass(queries, keys, token_positions, query_positions),
                                   naive_window_mass(queries, keys, token_positions, query_positions))


def test_window_mass_gradient_matches_the_per_row_softmax():
    """A finite mask and the rows' mean as a product with weights: the gradient must still be the per-row softmax's."""
    gen = torch.Generator().manual_seed(1)
    queries = torch.randn(1, 2, 6, 8, generator=gen)
    keys = torch.randn(1, 2, 11, 8, generator=gen)
    positions, query_positions = torch.arange(2, 13), torch.tensor([1, 9, 12])  # the first query sees no key
    weights = torch.randn(1, 2, 11, generator=gen)
    grads = []
    for mass in (features.window_mass, naive_window_mass):
        leaves = (queries.clone().requires_grad_(), keys.clone().requires_grad_())
        (mass(*leaves, positions, query_positions) * weights).sum().backward()
        grads.append([leaf.grad for leaf in leaves])
    for tested, reference in zip(*grads):
        torch.testing.assert_close(tested, reference)


def test_expected_logits_are_each_query_heads_gaussian_logits():
    gen = torch.Generator().manual_seed(1)
    mean, keys = torch.randn(1, 2, 3, 8, generator=gen), torch.randn(1, 2, 11, 8, generator=gen)
    factor = torch.randn(1, 2, 3, 8, 8, generator=gen)
    covariance = factor @ factor.transpose(-1, -2)
    scale = 0.3
    reference = torch.stack([torch.stack([torch.stack([
        scale * keys[0, h, j] @ mean[0, h, g] + 0.5 * scale**2 * keys[0, h, j] @ covariance[0, h, g] @ keys[0, h, j]
        for j in range(11)]) for g in range(3)]) for h in range(2)])[None]
    torch.testing.assert_close(features.expected_logits(scale * mean, 0.5 * scale**2 * covariance, keys), reference)
    strided = torch.cat([keys, keys], dim=2)[:, :, :11]  # a cache's slice: heads do not merge with tokens
    torch.testing.assert_close(features.expected_logits(scale * mean, 0.5 * scale**2 * covariance, strided), reference)


def test_future_rotation_is_computed_once_per_end_and_matches_average_rotation(model):
    like = torch.zeros(1)
    dim = model.config.hidden_size // model.config.num_attention_heads
    first = features.future_rotation(model, 100, 32, dim, like)
    assert features.future_rotation(model, 100, 32, dim, like) is first  # every layer of the round: one rotation
    later = features.future_rotation(model, 164, 32, dim, like)
    torch.testing.assert_close(first, average_rotation(model, 100, 32, dim, like))
    torch.testing.assert_close(later, average_rotation(model, 164, 32, dim, like))
    assert not torch.allclose(first, later)


def test_medium_precision_products_are_bfloat16_operand_products():
    gen = torch.Generator().manual_seed(2)
    a, b = torch.randn(3, 40, 16, generator=gen), torch.randn(3, 16, 24, generator=gen)
    medium = features.product(a, b, "medium")
    assert medium.dtype == torch.float32
    assert torch.equal(medium, (a.bfloat16() @ b.bfloat16()).float())
    assert not torch.equal(medium, a @ b)  # rounded: the operands lost their low bits
    torch.testing.assert_close(medium, a @ b, atol=0.1, rtol=0.02)
    assert torch.equal(features.product(a, b), a @ b)


def test_unknown_matmul_precision_is_one_line_error():
    with pytest.raises(CurKVError, match="unknown matmul precision 'low'; expected highest or medium"):
        features.check_matmul_precision("low")


def test_a_subset_of_the_features_is_those_columns_and_computes_only_what_they_need(model, monkeypatch):
    from curkv_train.core.observation import Observation, QueryStatistics

    gen = torch.Generator().manual_seed(3)
    kv_heads, heads = model.config.num_key_value_heads, model.config.num_attention_heads
    dim = model.config.hidden_size // heads
    keys, values = torch.randn(2, 1, kv_heads, 29, dim, generator=gen)
    queries = torch.randn(1, heads, 40, dim, generator=gen)
    observation = Observation(queries[:, :, -8:], torch.arange(21, 29), QueryStatistics.of(queries))
    module = model.model.layers[1].self_attn
    every = features.query_features(model, module, keys, values, torch.arange(29), 29, observation)
    assert every.shape[-1] == len(features.QUERY_FEATURES)

    def not_needed(*args, **kwargs):
        raise AssertionError("computed a part no asked feature needs")

    monkeypatch.setattr(features, "window_mass", not_needed)
    monkeypatch.setattr(features, "output_norms", not_needed)
    lean = features.query_features(model, module, keys, values, torch.arange(29), 29, observation,
                                   names=("expected_attention", "value_norm"))
    torch.testing.assert_close(lean, every[..., 1:3], rtol=1e-5, atol=1e-6)  # the centring sums in another order
