"""``last.ckpt`` holds the run's last step, also when max_steps is not a multiple of the checkpoint interval."""

import torch

from curkv_train.cli import main

QUIET = ["--trainer.logger=false", "--trainer.enable_progress_bar=false", "--trainer.enable_model_summary=false",
         "--trainer.limit_val_batches=0", "--model.backend=torch"]


def test_last_checkpoint_holds_the_last_step(tmp_path):
    # Lightning's ModelCheckpoint alone saves at step 2 only: last.ckpt would hold step 2 of 3.
    code = main(["fit", "--recipe", "tiny-debug", "--trainer.max_steps=3", "--checkpoint.every_n_train_steps=2",
                 f"--checkpoint.dirpath={tmp_path / 'ckpt'}", f"--trainer.default_root_dir={tmp_path}", *QUIET])
    assert code == 0
    assert torch.load(tmp_path / "ckpt" / "last.ckpt", weights_only=False)["global_step"] == 3
    assert sorted(path.name for path in (tmp_path / "ckpt").iterdir()) == ["last.ckpt", "step=3.ckpt"]
