"""Reliability guards: a non-finite loss stops the run keeping the last good checkpoint; bad output folders fail early."""

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from curkv_train.training.callbacks.guards import NonFiniteLossGuard, OutputSpaceGuard, check_output_folder
from curkv_train.cli import main
from curkv_train.training.data.datamodule import CurKVDataModule, DataSource
from curkv_train.core.errors import CurKVError
from curkv_train.training.system import CurKVModule

BAD_STEP = 2


class NaNAtStep(CurKVModule):
    """The tiny-debug module whose loss turns NaN at optimizer step ``BAD_STEP`` (0-based)."""

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        return loss * float("nan") if self.global_step == BAD_STEP else loss


def tiny_data() -> CurKVDataModule:
    return CurKVDataModule(sources=[DataSource(kind="pydoc")], context_length=48, continuation_length=8,
                           batch_size=1, train_size=16, val_size=1, window=8)


def test_nan_loss_stops_and_keeps_the_last_good_checkpoint(tmp_path):
    checkpoints = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True, every_n_train_steps=1)
    trainer = L.Trainer(max_steps=6, accelerator="cpu", logger=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=[NonFiniteLossGuard(), checkpoints],
                        default_root_dir=tmp_path)
    with pytest.raises(CurKVError, match=rf"step {BAD_STEP + 1}: the loss is not finite \(nan\).*last good"):
        trainer.fit(NaNAtStep(window=8, backend="torch"), datamodule=tiny_data())
    last = torch.load(tmp_path / "ckpt" / "last.ckpt", weights_only=False)
    assert last["global_step"] == BAD_STEP
    estimator = {k: v for k, v in last["state_dict"].items() if k.startswith("estimator.")}
    assert estimator and all(torch.isfinite(v).all() for v in estimator.values())


def test_unwritable_output_folder_fails_before_training(tmp_path, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    code = main(["fit", "--recipe", "tiny-debug", "--trainer.default_root_dir", str(blocker / "run")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert err[-1].startswith("curkv-train: error: output folder") and "not writable" in err[-1]


def test_too_little_free_space_is_reported(tmp_path):
    with pytest.raises(CurKVError, match="GiB free, fewer than the 1e\\+09 GiB"):
        check_output_folder(tmp_path / "run", min_free_gb=1e9)


def test_output_guard_runs_at_fit_setup_only(tmp_path):
    guard = OutputSpaceGuard(min_free_gb=1e9)
    trainer = L.Trainer(default_root_dir=tmp_path, logger=False, enable_checkpointing=False)
    guard.setup(trainer, None, "validate")  # not a fit: nothing is written, nothing checked
    with pytest.raises(CurKVError):
        guard.setup(trainer, None, "fit")
