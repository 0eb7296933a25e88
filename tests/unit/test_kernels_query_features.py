"""The fused query-feature kernels vs the torch path of curkv_train.core.features (CPU, TRITON_INTERPRET=1).

Token and row blocks are 16 under the interpreter, so every case spans several ragged blocks.
"""

from __future__ import annotations

import pytest
import torch

from curkv_train.core import features
from curkv_train.core.observation import Observation, QueryStatistics
from curkv_train.kernels.limits import tileable_head_dim
from curkv_train.kernels.query_features_triton import merge_row_partials, query_feature_parts_triton


class Head:
    """A stand-in attention module: the output projection output_gram reads, the logit scale."""

    def __init__(self, hidden: int, heads: int, head_dim: int, gen: torch.Generator) -> None:
        self.o_proj = torch.nn.Linear(heads * head_dim, hidden, bias=False)
        torch.nn.init.normal_(self.o_proj.weight, generator=gen)
        self.scaling = head_dim**-0.5


def parts_inputs(batch=2, kv_heads=2, group=2, window=5, tokens=37, head_dim=16, per_head=False, seed=0,
                 dtype=torch.float32):
    """Random kernel inputs as query_features prepares them; returns (args, module) for both paths."""
    gen = torch.Generator().manual_seed(seed)
    keys = (torch.randn(batch, kv_heads, tokens, head_dim, generator=gen) * 2).to(dtype)
    values = torch.randn(batch, kv_heads, tokens, head_dim, generator=gen).to(dtype)
    if per_head:  # a compressed cache: each head holds its own ascending positions, with gaps
        positions = torch.stack([torch.randperm(3 * tokens, generator=gen)[:tokens].sort().values
                                 for _ in range(batch * kv_heads)]).reshape(batch, kv_heads, tokens)
        end = int(positions.max()) + 1
    else:
        positions, end = torch.arange(tokens), tokens
    query_positions = torch.arange(end - window, end)
    queries = torch.randn(batch, kv_heads, group * window, head_dim, generator=gen)
    mean = torch.randn(batch, kv_heads, group, head_dim, generator=gen)
    factor = torch.randn(batch, kv_heads, group, head_dim, head_dim, generator=gen) / head_dim**0.5
    covariance = factor @ factor.transpose(-1, -2)
    module = Head(24, kv_heads * group, head_dim, gen)
    gram = features.output_gram(module, kv_heads, group)
    return (queries, query_positions, keys, positions, values, mean, covariance, gram, module.scaling), module


def torch_parts(queries, query_positions, keys, positions, values, mean, covariance, gram, scale, module):
    """The torch path's window mass, expected logits and group-mean output norms."""
    group = mean.shape[2]
    return (features.window_mass(queries, keys.float(), positions, query_positions),
            features.expected_logits(scale * mean, 0.5 * scale**2 * covariance, keys.float()),
            features.output_norms(module, values, group, gram))


def assert_parts_close(args, module, atol=1e-5, rtol=1e-5):
    for name, fused, reference in zip(("window mass", "expected logits", "output norm"),
                                      query_feature_parts_triton(*args), torch_parts(*args, module)):
        assert fused.shape == reference.shape, name
        torch.testing.assert_close(fused, reference, atol=atol, rtol=rtol, msg=name)


@pytest.mark.parametrize("per_head", [False, True])
@pytest.mark.parametrize("group", [1, 3])
def test_parts_match_the_torch_path(per_head, group):
    args, module = parts_inputs(group=group, per_head=per_head)
    assert_parts_close(args, module)


def test_wide_heads_read_their_matrices_in_column_chunks():
    args, module = parts_inputs(batch=1, kv_heads=1, group=2, window=3, tokens=20, head_dim=128)
    assert_parts_close(args, module, atol=1e-4, rtol=1e-4)


def test_half_precision_and_strided_keys():
    args, module = parts_inputs(dtype=torch.bfloat16)
    queries, query_positions, keys, positions, values, *rest = args
    room = torch.zeros(*keys.shape[:2], keys.shape[2] + 9, keys.shape[3], dtype=keys.dtype)
    room[:, :, : keys.shape[2]] = keys  # a view with headroom, as the cache's append buffer holds keys
    strided = (queries, query_positions, room[:, :, : keys.shape[2]], positions, values, *rest)
    assert not strided[2].is_contiguous()
    assert_parts_close(strided, module, atol=1e-4, rtol=1e-4)


def test_rows_that_see_no_key_add_nothing():
    args, module = parts_inputs(batch=1, window=4)
    queries, query_positions, keys, positions, *rest = args
    positions = positions + 10  # the keys all come after the first queries
    query_positions = query_positions.clone()
    query_positions[:3] = 2
    args = (queries, query_positions, keys, positions, *rest)
    mass = query_feature_parts_triton(*args)[0]
    assert torch.isfinite(mass).all()
    assert_parts_close(args, module)


def test_merge_row_partials_is_the_log_sum_exp():
    logits = torch.randn(3, 5, 40)
    logits[0, 1] = float("-inf")
    blocks = logits.reshape(3, 5, 4, 10)
    top = blocks.amax(dim=-1)
    shift = torch.where(top == float("-inf"), 0.0, top)
    total = (blocks - shift[..., None]).exp().sum(dim=-1)
    merged = merge_row_partials(top, total)
    expected = logits.logsumexp(dim=-1)
    expected[0, 1] = float("inf")
    torch.testing.assert_close(merged, expected)


def test_query_features_are_the_same_through_either_backend(model):
    gen = torch.Generator().manual_seed(1)
    config = model.config
    kv_heads, heads = config.num_key_value_heads, config.num_attention_heads
    dim = config.hidden_size // heads
    keys, values = torch.randn(2, 1, kv_heads, 29, dim, generator=gen)
    queries = torch.randn(1, heads, 40, dim, generator=gen)
    observation = Observation(queries[:, :, -8:], torch.arange(21, 29), QueryStatistics.of(queries))
    module = model.model.layers[1].self_attn
    by_torch, by_kernels = (features.query_features(model, module, keys, values, torch.arange(29), 29, observation,
                                                    backend=backend) for backend in ("torch", "triton"))
    torch.testing.assert_close(by_kernels, by_torch, atol=1e-5, rtol=1e-5)


def test_auto_uses_the_kernels_on_cuda_only():
    cpu = torch.zeros(1, 1, 4, 16)
    assert features.feature_backend("auto", cpu, cpu) == "torch"  # even under TRITON_INTERPRET=1
    assert features.feature_backend("triton", cpu, cpu) == "triton"
    with pytest.raises(ValueError, match="unknown feature backend"):
        features.feature_backend("cuda", cpu, cpu)


def test_bad_shapes_are_refused():
    args, _ = parts_inputs()
    queries, query_positions, keys, *rest = args
    with pytest.raises(ValueError, match="query_positions must be"):
        query_feature_parts_triton(queries, query_positions[:-1], keys, *rest)


def test_head_dims_the_kernels_do_not_tile_are_refused_with_the_rule():
    args, _ = parts_inputs(head_dim=16)
    queries, query_positions, keys, positions, values, mean, covariance, gram, scale = args
    cut = (queries[..., :12], query_positions, keys[..., :12], positions, values[..., :12], mean[..., :12],
           covariance[..., :12, :12], gram[..., :12, :12], scale)
    with pytest.raises(ValueError, match="head_dim must be a power of two >= 16, got 12"):
        query_feature_parts_triton(*cut)
    assert [tileable_head_dim(dim) for dim in (8, 16, 64, 80, 128)] == [False, True, True, False, True]
