"""Shipped model configs and meta-device models (DESIGN §8)."""

import pytest
import torch

from curkv_train.core.errors import CurKVError
from curkv_train.models.configs import build_meta_model, kv_shape, load_model_config, shipped_model_ids
from curkv_train.models.seed_estimator import ValueEstimator

LLAMA2_70B = "meta-llama/Llama-2-70b-hf"
LLAMA2_7B = "meta-llama/Llama-2-7b-hf"
SMOLLM2 = "HuggingFaceTB/SmolLM2-135M-Instruct"


def test_both_llama2_configs_ship():
    assert {LLAMA2_7B, LLAMA2_70B} <= set(shipped_model_ids())


def test_shipped_smollm2_config_has_the_embedded_models_geometry():
    """What a GPU benchmark builds with random weights (the embedded GGUF does not travel to it) is the embedded model."""
    shipped, embedded = load_model_config(SMOLLM2), load_model_config("embedded:smollm2-135m-instruct")
    assert kv_shape(shipped) == kv_shape(embedded)
    for name in ("hidden_size", "intermediate_size", "vocab_size", "max_position_embeddings", "tie_word_embeddings"):
        assert getattr(shipped, name) == getattr(embedded, name), name
    assert shipped.rope_parameters == embedded.rope_parameters


@pytest.mark.parametrize(
    ("model_id", "hidden", "intermediate", "layers", "heads", "kv_heads"),
    [(LLAMA2_7B, 4096, 11008, 32, 32, 32), (LLAMA2_70B, 8192, 28672, 80, 64, 8)],
)
def test_shipped_config_has_the_public_values(model_id, hidden, intermediate, layers, heads, kv_heads):
    config = load_model_config(model_id)
    assert (config.hidden_size, config.intermediate_size, config.num_hidden_layers) == (hidden, intermediate, layers)
    assert (config.num_attention_heads, config.num_key_value_heads) == (heads, kv_heads)
    assert (config.vocab_size, config.max_position_embeddings, config.rms_norm_eps) == (32000, 4096, 1e-5)
    assert config.rope_parameters["rope_theta"] == 10000.0
    assert not config.tie_word_embeddings


def test_llama2_70b_on_meta_has_the_right_shapes():
    config = load_model_config(LLAMA2_70B)
    model = build_meta_model(config)
    shape = kv_shape(config)
    assert (shape.num_layers, shape.num_kv_heads, shape.head_dim) == (80, 8, 128)
    assert len(model.model.layers) == 80
    attention = model.model.layers[0].self_attn
    assert attention.k_proj.weight.shape == (8 * 128, 8192)
    assert attention.q_proj.weight.shape == (64 * 128, 8192)
    parameters = list(model.parameters())
    assert all(p.device.type == "meta" and p.dtype == torch.bfloat16 and not p.requires_grad for p in parameters)
    assert sum(p.numel() for p in parameters) == 68_976_648_192  # the published 69.0 B


def test_llama2_70b_estimator_size():
    estimator = ValueEstimator(80, 8, 128)
    count = sum(p.numel() for p in estimator.parameters())
    # per (layer, head): key 128 + position 8 + value MLP 128·32 + 32 + 32 + bias 1 = 4297
    assert count == 80 * 8 * 4297 == 2_750_080


def test_llama2_7b_parameter_count():
    model = build_meta_model(load_model_config(LLAMA2_7B))
    assert sum(p.numel() for p in model.parameters()) == 6_738_415_616


def test_unknown_model_is_a_one_line_error():
    with pytest.raises(CurKVError, match="no config for model 'nobody/nothing'.*shipped: "):
        load_model_config("nobody/nothing")


def test_tiny_model_config_needs_no_files():
    assert kv_shape(load_model_config("tiny-random-llama")).head_dim == 16
