"""Curriculum fine-tuning: ``model.init_scorer`` starts the estimator from an exported scorer folder."""

import pytest
import torch

from curkv_train.core.errors import CurKVError
from curkv_train.models.base import tiny_llama_config
from curkv_train.models.seed_estimator import ValueEstimator
from curkv_train.runtime import Scorer, model_fingerprint, save_scorer
from curkv_train.training.system import CurKVModule


def exported(tmp_path, key_view: str = "pre_rope", layers: int = 2):
    """A scorer folder for the tiny model (2 layers, 2 KV heads, head_dim 16) with recognisable weights."""
    torch.manual_seed(123)
    estimator = ValueEstimator(layers, 2, 16, max_positions=2048)
    with torch.no_grad():
        estimator.bias.fill_(1.25)
    config = tiny_llama_config()
    config.num_hidden_layers = layers
    folder = tmp_path / f"scorer-{key_view}-{layers}"
    save_scorer(Scorer(estimator, key_view=key_view), folder, base_model="tiny-random-llama",
                fingerprint=model_fingerprint(config))
    return folder, estimator


def test_estimator_starts_from_the_scorer(tmp_path):
    folder, source = exported(tmp_path)
    module = CurKVModule(init_scorer=str(folder))
    module.configure_model()
    for name, tensor in source.state_dict().items():
        torch.testing.assert_close(module.estimator.state_dict()[name], tensor)
    assert all(parameter.requires_grad for parameter in module.estimator.parameters())  # still trainable


def test_scorer_for_another_key_view_is_refused(tmp_path):
    folder, _ = exported(tmp_path, key_view="post_rope")
    with pytest.raises(CurKVError, match="trained on post_rope keys.*set model.key_view: post_rope"):
        CurKVModule(init_scorer=str(folder)).configure_model()


def test_scorer_for_another_base_is_refused(tmp_path):
    folder, _ = exported(tmp_path, layers=3)
    with pytest.raises(CurKVError, match="num_hidden_layers"):
        CurKVModule(init_scorer=str(folder)).configure_model()
