"""Guards that stop a run early and clearly: a non-finite loss, an output folder that cannot take checkpoints."""

from __future__ import annotations

import math
import shutil
import tempfile
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

from curkv_train.core.errors import CurKVError


class NonFiniteLossGuard(Callback):
    """Stops training when the loss is NaN or infinite, before that step can be checkpointed.

    Lightning runs checkpoint callbacks after every other callback, so raising in
    ``on_train_batch_end`` leaves the last checkpoint as the last good one. Under DDP
    or FSDP the ranks agree first (any rank non-finite stops all of them).
    """

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch,
                           batch_idx: int) -> None:
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        finite = loss is None or bool(torch.isfinite(torch.as_tensor(loss).detach()).all())
        if trainer.strategy.reduce_boolean_decision(not finite, all=False):
            step = trainer.global_step
            raise CurKVError(f"training stopped at step {step}: the loss is not finite ({_describe(loss)}); "
                             f"{_last_checkpoint_hint(trainer)}; lower model.learning_rate or check the data, "
                             "then resume with --ckpt_path last")


def _describe(loss) -> str:
    if loss is None:
        return "on another rank"
    value = float(torch.as_tensor(loss).detach().float().reshape(-1)[0])
    return "nan" if math.isnan(value) else str(value)


def _last_checkpoint_hint(trainer: L.Trainer) -> str:
    """Where the last good checkpoint is, for the error message."""
    for callback in trainer.checkpoint_callbacks:
        last = getattr(callback, "last_model_path", "") or getattr(callback, "best_model_path", "")
        if last:
            return f"the last good checkpoint is {last}"
    return "no checkpoint was written before it"


class OutputSpaceGuard(Callback):
    """Fails before training when the run's output folders cannot take checkpoints.

    Checks ``trainer.default_root_dir``, the logger's folder and every checkpoint
    folder: each must be creatable and writable, with at least ``min_free_gb`` free.
    ``curkv-train fit`` runs the check before Lightning touches any folder
    (:func:`check_before_fit`); the ``setup`` hook covers plain ``Trainer.fit``.

    Args:
        min_free_gb: free space required on every output file system, in GiB.
    """

    def __init__(self, min_free_gb: float = 1.0) -> None:
        self.min_free_gb = min_free_gb

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if stage == "fit":
            self.check(trainer)

    def check(self, trainer: L.Trainer) -> None:
        """Check every output folder of ``trainer`` (see :func:`check_output_folder`)."""
        for folder in output_folders(trainer):
            check_output_folder(folder, self.min_free_gb)


def check_before_fit(trainer: L.Trainer) -> None:
    """Run the trainer's :class:`OutputSpaceGuard` checks now, before Lightning creates any folder.

    Lightning's loggers create their folders before callbacks' ``setup``; the CLI calls
    this first so a bad folder is a one-line error. Without the guard, nothing is checked.
    """
    for callback in trainer.callbacks:
        if isinstance(callback, OutputSpaceGuard):
            callback.check(trainer)


def output_folders(trainer: L.Trainer) -> list[Path]:
    """The folders a fit run writes to (root, logger, checkpoints), without duplicates."""
    folders = [trainer.default_root_dir]
    folders += [logger.save_dir for logger in trainer.loggers if getattr(logger, "save_dir", None)]
    folders += [callback.dirpath for callback in trainer.checkpoint_callbacks
                if isinstance(callback, ModelCheckpoint) and callback.dirpath]
    unique: list[Path] = []
    for folder in folders:
        path = Path(folder).expanduser().absolute()
        if path not in unique and "://" not in str(folder):
            unique.append(path)
    return unique


def check_output_folder(folder: Path, min_free_gb: float) -> None:
    """Create ``folder`` if needed, write and delete a probe file in it, and check its free space.

    Raises:
        CurKVError: the folder cannot be created or written, or has too little free space.
    """
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".curkv-write-probe-"):
            pass
    except OSError as error:
        raise CurKVError(f"output folder {folder} is not writable ({error.strerror or error}); "
                         "set trainer.default_root_dir to a writable folder") from None
    free_gb = shutil.disk_usage(folder).free / 2**30
    if free_gb < min_free_gb:
        raise CurKVError(f"output folder {folder} has {free_gb:.2f} GiB free, fewer than the {min_free_gb:g} GiB "
                         "needed for checkpoints; free space or set trainer.default_root_dir elsewhere")
