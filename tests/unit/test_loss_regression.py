"""Regression anchor (torchtune-style): ``fit --recipe tiny-debug`` from its fixed seed reproduces recorded losses.

The recorded values were produced by this test's own run of the recipe (seed 0, random 2-layer
Llama, CPU, float32). A change that moves them is either a bug or an intended change of the
objective; in the latter case re-record them (``RECORD=1 pytest tests/unit/test_loss_regression.py -s``
prints the new list) and say why in the commit. The negative control shows the anchor catches a
sign error in the loss.
"""

from __future__ import annotations

import os

import pytest
import torch
from lightning.pytorch.callbacks import Callback

import curkv_train.training.system as system
from curkv_train.cli import build_cli

STEPS = 8
# train/loss of steps 0..7, recorded 2026-12-03 (tiny-debug: seed family, keep 0.5, two-sided budget)
RECORDED = [7.567454e-04, 4.355661e-04, 2.704599e-04, 2.55994e-04, 1.643072e-04, 2.467704e-04, 3.291826e-04,
            3.18839e-04]
RTOL, ATOL = 1e-3, 1e-7


class LossRecorder(Callback):
    """Keeps the training loss of every step."""

    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        self.losses.append(float(loss))


def tiny_debug_losses(folder, steps: int = STEPS) -> list[float]:
    """train/loss of the first ``steps`` steps of tiny-debug, in-process."""
    cli = build_cli(["fit", "--recipe", "tiny-debug", f"--trainer.max_steps={steps}",
                     f"--trainer.default_root_dir={folder}", "--trainer.enable_progress_bar=false",
                     "--trainer.logger=false",
                     "--trainer.val_check_interval=1000", "--trainer.enable_model_summary=false"], run=False)
    recorder = LossRecorder()
    cli.trainer.callbacks.append(recorder)
    cli.trainer.fit(cli.model, cli.datamodule)
    return recorder.losses


def test_tiny_debug_reproduces_the_recorded_losses(tmp_path):
    losses = tiny_debug_losses(tmp_path)
    if os.environ.get("RECORD"):
        print("RECORDED =", [float(f"{value:.6e}") for value in losses])
    assert len(losses) == STEPS and RECORDED is not None
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(RECORDED), rtol=RTOL, atol=ATOL)


def test_a_flipped_loss_term_breaks_the_anchor(tmp_path, monkeypatch):
    """Negative control: the KL term entering the loss with the wrong sign moves the recorded values."""
    chunked_kl = system.chunked_kl
    monkeypatch.setattr(system, "chunked_kl", lambda *args, **kwargs: -chunked_kl(*args, **kwargs))
    losses = tiny_debug_losses(tmp_path, steps=2)  # the first steps already move
    with pytest.raises(AssertionError):
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(RECORDED[:2]), rtol=RTOL, atol=ATOL)
