"""The real pipeline: `curkv-train fit` on tiny-debug for 2 steps, then `curkv-train export` on its last.ckpt."""

import json
import subprocess
import sys

import pytest
import torch
from fit_helpers import user_env

from curkv_train.models.base import TINY_RANDOM, load_base_model
from curkv_train.runtime import CurKVCache, load_scorer

pytestmark = pytest.mark.integration


def curkv_train(*args: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-c", "import sys; from curkv_train.cli import main; sys.exit(main())", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=600, env=user_env())


def test_fit_then_export_then_generate(tmp_path):
    run = curkv_train("fit", "--recipe", "tiny-debug", "--trainer.max_steps=2", f"--trainer.default_root_dir={tmp_path}")
    assert run.returncode == 0, run.stderr[-2000:]
    ckpt = tmp_path / "lightning_logs" / "version_0" / "checkpoints" / "last.ckpt"
    out = tmp_path / "scorer"
    exported = curkv_train("export", "--ckpt", str(ckpt), "--out", str(out))
    assert exported.returncode == 0, exported.stderr[-2000:]

    record = json.loads((out / "scorer.json").read_text())
    assert record["training"]["config"]["model"]["base_model"] == TINY_RANDOM
    assert record["training"]["global_step"] == 2
    assert "val/kl_hard" in record["metrics"]["validation"] and "train/loss" in record["metrics"]["training"]

    state = torch.load(ckpt, map_location="cpu", weights_only=True)["state_dict"]
    model = load_base_model(TINY_RANDOM)
    scorer = load_scorer(out, model=model)
    for name, parameter in scorer.estimator.named_parameters():
        assert torch.equal(parameter, state[f"estimator.{name}"]), name
    ids = torch.randint(3, 512, (1, 64))
    tokens = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=3, do_sample=False,
                            past_key_values=CurKVCache(scorer, model=model, keep_ratio=0.5), pad_token_id=0)
    assert tokens.shape == (1, 67)
