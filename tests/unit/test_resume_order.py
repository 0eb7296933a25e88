"""Resuming: the blocks a resumed run trains on (Lightning with the project's loader and checkpoint callback, a
dummy module recording which block each step saw), which checkpoint ``--ckpt_path last`` takes, which settings."""

from __future__ import annotations

import lightning as L
import pytest
import torch

from curkv_train.training.callbacks.checkpoint import LastStepCheckpoint
from curkv_train.training.data.sampling import BlockSampler, ResumableLoader


class Blocks:
    """8 blocks; any index is a block (the index itself, like MixedBlocks' fresh block per index)."""

    def __len__(self) -> int:
        return 8

    def __getitem__(self, index: int) -> int:
        return index


class Recording(L.LightningModule):
    """Records (epoch, block) of every training step."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1))
        self.seen: list[tuple[int, int]] = []

    def training_step(self, batch, index):
        self.seen.append((self.current_epoch, int(batch[0])))
        return self.weight.square().sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def fit(folder, max_steps: int, every: int, resume: bool = False) -> list[tuple[int, int]]:
    checkpoint = LastStepCheckpoint(dirpath=folder, every_n_train_steps=every, save_last=True, save_top_k=-1,
                                    filename="{step}")
    trainer = L.Trainer(max_steps=max_steps, logger=False, callbacks=[checkpoint], accelerator="cpu",
                        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)
    module = Recording()
    loader = ResumableLoader(Blocks(), batch_size=1, sampler=BlockSampler(Blocks()))
    trainer.fit(module, loader, ckpt_path=str(folder / "last.ckpt") if resume else None)
    return module.seen


@pytest.mark.parametrize(("stop", "every", "total"), [
    (3, 3, 14),  # a periodic checkpoint mid-epoch, resumed across two epoch ends
    (3, 2, 7),  # the checkpoint of the last step, which is not a periodic one
    (8, 8, 11),  # a checkpoint at the epoch's end
])
def test_a_resumed_run_sees_the_blocks_of_an_uninterrupted_one(tmp_path, stop, every, total):
    whole = fit(tmp_path / "whole", total, every)
    assert fit(tmp_path / "split", stop, every) == whole[:stop]
    assert torch.load(tmp_path / "split" / "last.ckpt", weights_only=False)["global_step"] == stop
    assert fit(tmp_path / "split", total, every, resume=True) == whole[stop:]


def test_ckpt_path_last_of_a_logger_given_its_version_is_left_to_lightning(tmp_path):
    """Only an auto-numbered logger's new run looks in the newest earlier version_N; a logger given a version
    resumes its own folder (which Lightning finds), not another run's."""
    from types import SimpleNamespace

    from lightning.pytorch.loggers import TensorBoardLogger

    from curkv_train.training.callbacks.checkpoint import last_checkpoint_of_earlier_runs

    for version in ("version_0", "version_3", "exp1"):
        (tmp_path / "lightning_logs" / version / "checkpoints").mkdir(parents=True)
        (tmp_path / "lightning_logs" / version / "checkpoints" / "last.ckpt").write_bytes(b"")

    def found(logger) -> object:
        return last_checkpoint_of_earlier_runs(SimpleNamespace(checkpoint_callback=LastStepCheckpoint(),
                                                               logger=logger))

    assert found(TensorBoardLogger(tmp_path)) == tmp_path / "lightning_logs" / "version_3" / "checkpoints" / "last.ckpt"
    assert found(TensorBoardLogger(tmp_path, version="exp1")) is None
    assert found(TensorBoardLogger(tmp_path, version=0)) is None


def test_resuming_warns_of_settings_given_otherwise_than_the_checkpoints(recwarn):
    """Without a curriculum a resumed run keeps the checkpoint's settings; a changed --model.keep_ratio is named."""
    from dataclasses import asdict

    from curkv_train.models.base import TINY_RANDOM
    from curkv_train.training.objective import TrainingSettings
    from curkv_train.training.system import SETTINGS_KEY, CurKVModule

    module = CurKVModule(base_model=TINY_RANDOM, window=16, keep_ratio=0.3)
    with pytest.warns(UserWarning, match=r"checkpoint's training settings keep_ratio 0.5 \(given: 0.3\)"):
        module.on_load_checkpoint({SETTINGS_KEY: asdict(TrainingSettings(keep_ratio=0.5))})
    assert module.settings.keep_ratio == 0.5
    module.on_load_checkpoint({SETTINGS_KEY: asdict(TrainingSettings(keep_ratio=0.5))})  # the same: no warning
    assert not [warning for warning in recwarn if "training settings" in str(warning.message)]
