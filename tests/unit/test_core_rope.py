"""RoPE helpers against transformers' own rotary module, for every kind of rope scaling."""

import pytest
import torch
from transformers import LlamaForCausalLM

from curkv_train.core.observation import decoder_of
from curkv_train.core.rope import (average_rotation, key_view, pair_rotary_tables, position_table, rotary_module,
                                   rotary_tables, rotate, rotate_half)
from curkv_train.models.base import tiny_llama_config

ROPES = [None, {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
         {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0, "original_max_position_embeddings": 256},
         {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}]


def llama(rope: dict | None, dtype: torch.dtype = torch.float32) -> LlamaForCausalLM:
    config = tiny_llama_config()
    config.max_position_embeddings = 512
    if rope is not None:
        config.rope_parameters = rope
    model = LlamaForCausalLM(config).to(dtype)
    assert model.model.rotary_emb.rope_type == (rope or {}).get("rope_type", "default")  # the config took it
    return model


@pytest.mark.parametrize("rope", ROPES, ids=lambda rope: "default" if rope is None else rope["rope_type"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_pair_tables_are_the_first_half_of_the_modules_tables(rope, dtype):
    model = llama(rope, dtype)
    positions = torch.randint(0, 2000, (1, 2, 50))  # past the original length: dynamic rescales
    like = torch.zeros(1, dtype=dtype)
    cos, sin = rotary_tables(model, positions, like)
    pair_cos, pair_sin = pair_rotary_tables(model, positions, like)
    assert pair_cos.shape == (1, 2, 50, 8)
    torch.testing.assert_close(pair_cos, cos[..., :8], rtol=0, atol=0)
    torch.testing.assert_close(pair_sin, sin[..., :8], rtol=0, atol=0)
    torch.testing.assert_close(cos[..., 8:], cos[..., :8])  # what pairing relies on


@pytest.mark.parametrize("rope", ROPES[:3], ids=["default", "linear", "yarn"])
def test_pre_rope_view_undoes_the_rotation_of_each_key(rope):
    model = llama(rope)
    keys, positions = torch.randn(1, 2, 30, 16), torch.randint(0, 400, (1, 2, 30))
    rotated = rotate(keys, *rotary_tables(model, positions, keys))
    torch.testing.assert_close(key_view(model, rotated, positions, "pre_rope"), keys, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("rope", ROPES, ids=lambda rope: "default" if rope is None else rope["rope_type"])
def test_average_rotation_is_the_mean_of_the_modules_rotations(rope):
    model = llama(rope)
    queries = torch.randn(5, 16)
    cos, sin = rotary_tables(model, torch.arange(300, 340), queries)  # (40, 16) each
    expected = (queries[:, None] * cos + rotate_half(queries[:, None]) * sin).mean(dim=1)
    torch.testing.assert_close(queries @ average_rotation(model, 300, 40, 16, queries).T, expected)


def test_a_scorers_tables_past_the_models_length_leave_its_rope_as_it_was():
    """A dynamic-NTK module rescales its frequencies for the positions its forward gets: the expected attention's
    future rotation (positions end .. end + 512) changed the model's own RoPE for every later token."""
    model = llama(ROPES[3])
    rotary = model.model.rotary_emb
    position = torch.tensor([[300]])
    before = rotary(torch.zeros(1), position)[0].clone()
    average_rotation(model, 2000, 512, 16, torch.zeros(1))
    rotary_tables(model, torch.arange(1500, 1600), torch.zeros(1))
    torch.testing.assert_close(rotary(torch.zeros(1), position)[0], before, rtol=0, atol=0)


def test_the_pre_rope_views_table_grows_with_the_sequence_and_follows_the_frequencies():
    """key_view reads its tables from one kept on the rotary module: a longer sequence must grow it, and a model
    whose frequencies change (weights loaded in place) must not be unrotated with the old ones."""
    model = llama(None)
    keys = torch.randn(1, 2, 30, 16)
    for end in (40, 3000):  # the second is past the first table's 256 rows
        positions = torch.randint(0, end, (1, 2, 30))
        rotated = rotate(keys, *rotary_tables(model, positions, keys))
        torch.testing.assert_close(key_view(model, rotated, positions, "pre_rope", end), keys, atol=1e-5, rtol=1e-5)
        assert position_table(model, end, keys).shape[0] >= end
    model.model.rotary_emb.inv_freq.mul_(0.5)  # in place: the same tensor, a new version
    rotated = rotate(keys, *rotary_tables(model, positions, keys))
    torch.testing.assert_close(key_view(model, rotated, positions, "pre_rope", 3000), keys, atol=1e-5, rtol=1e-5)


def test_the_decoder_is_looked_up_once_per_model_and_keeps_no_model_alive():
    import gc
    import weakref

    model = llama(None)
    assert decoder_of(model) is model.get_decoder() and rotary_module(model) is model.get_decoder().rotary_emb
    model.get_decoder = lambda: pytest.fail("looked up again")
    assert decoder_of(model) is model.model
    alive = weakref.ref(model)
    del model
    gc.collect()
    assert alive() is None
