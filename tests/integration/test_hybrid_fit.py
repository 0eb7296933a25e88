"""`curkv-train fit` a few steps on the tiny random Gemma 3 (sliding-window and full-attention layers, head_dim 256),
export its last checkpoint and load the scorer for the same base."""

import pytest
import torch

from curkv_train.models.base import TINY_RANDOM_GEMMA3, load_base_model
from curkv_train.runtime import load_scorer
from curkv_train.training.export import export
from curkv_train.training.scored_attention import full_attention_layers
from fit_helpers import estimator_state, run_fit

pytestmark = pytest.mark.integration


def test_fit_export_and_load_on_tiny_gemma3(tmp_path):
    run = run_fit({"model": {"base_model": TINY_RANDOM_GEMMA3}}, tmp_path, "--trainer.max_steps=3",
                  "--trainer.val_check_interval=3")
    assert run.returncode == 0, run.stderr[-3000:]
    ckpt = tmp_path / "lightning_logs" / "version_0" / "checkpoints" / "last.ckpt"
    checkpoint = torch.load(ckpt, weights_only=False, map_location="cpu")
    assert checkpoint["global_step"] == 3

    model = load_base_model(TINY_RANDOM_GEMMA3)
    layers, full = len(model.config.layer_types), full_attention_layers(model.config)
    # AdamW's second moments: every step's gradient reached the full layers' rows and never the sliding ones'
    for moments in checkpoint["optimizer_states"][0]["state"].values():
        per_layer = moments["exp_avg_sq"].reshape(layers, -1).abs().sum(dim=1)
        assert [layer for layer in range(layers) if per_layer[layer] > 0] == full

    folder = export(ckpt, tmp_path / "scorer")
    scorer = load_scorer(folder, model=model)
    state = estimator_state(ckpt)
    for name, parameter in scorer.estimator.named_parameters():
        assert parameter.shape[0] == layers and torch.equal(parameter, state[f"estimator.{name}"]), name
