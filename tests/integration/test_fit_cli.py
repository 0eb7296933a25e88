"""`curkv-train fit --recipe tiny-debug` end to end through the installed console script."""

import re
import shutil
import subprocess

import pytest
import torch
from fit_helpers import user_env
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

pytestmark = pytest.mark.integration

# What `fit` used to print that a user can do nothing about.
NOISE = ["LightningCLI's args parameter", "in eval mode at the start of training", "flops_per_batch", "litlogger",
         "LeafSpec", "Epoch 0/-2", "💡"]


def test_fit_tiny_debug_writes_checkpoint_tensorboard_and_config(tmp_path):
    executable = shutil.which("curkv-train")
    assert executable, "the package's console script is not installed"
    env = user_env()
    # 24 steps: TokenThroughput reports tokens/s once its 20-batch window is full.
    result = subprocess.run([executable, "fit", "--recipe", "tiny-debug", "--trainer.max_steps=24",
                             f"--trainer.default_root_dir={tmp_path}"],
                            capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    output = result.stdout + result.stderr
    assert not [noise for noise in NOISE if noise in output], output[-3000:]
    assert not re.search(r"\.py:\d+: ", result.stderr), result.stderr[-3000:]  # no Python warning at all
    assert "Epoch 0" in output  # the progress bar stays
    run = tmp_path / "lightning_logs" / "version_0"
    assert (run / "config.yaml").is_file()
    checkpoint = torch.load(run / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
    assert checkpoint["global_step"] == 24
    assert all(key.startswith(("estimator.", "budget.")) for key in checkpoint["state_dict"])
    events = EventAccumulator(str(run))
    events.Reload()
    scalars = set(events.Tags()["scalars"])
    assert {"train/loss", "train/kl", "train/budget", "train/mean_keep", "val/kl_hard", "keep_layer/00"} <= scalars
    assert any(tag.startswith("train/") and tag.endswith("items_per_sec") for tag in scalars)
