"""Lightning's ModelCheckpoint, with ``last.ckpt`` holding the run's last step."""

from __future__ import annotations

import re
from pathlib import Path

import lightning as L
from lightning.pytorch.callbacks import ModelCheckpoint


class LastStepCheckpoint(ModelCheckpoint):
    """ModelCheckpoint that also saves when fit ends, so ``last.ckpt`` holds the last step.

    Lightning saves every ``every_n_train_steps`` steps only; a run whose ``max_steps`` is not
    a multiple of it would end with ``last.ckpt`` (and the top-k file) at an earlier step.
    The step reaching ``max_steps`` is saved as a periodic one; a fit ending otherwise (``max_epochs``,
    ``max_time``) is saved at its end, unless that step is saved already. A run stopped by an exception (e.g. a non-finite loss)
    keeps its last good checkpoint: ``on_train_end`` does not run then.

    Takes ModelCheckpoint's arguments; ``curkv-train fit`` sets ``save_last=True``,
    ``every_n_train_steps=50`` and ``filename="{step}"`` by default (``--checkpoint.*`` flags,
    ``checkpoint:`` in a recipe).
    """

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args, **kwargs) -> None:
        """Lightning's periodic save, with the step that reaches ``max_steps`` counted as a periodic one: saved
        there, its loops state is the one a resumed run continues exactly (after fit ends Lightning has closed the
        epoch, and a run resumed from a save in ``on_train_end`` would start the next one)."""
        every = self._every_n_train_steps
        if self.save_last and every >= 1 and 0 < trainer.max_steps <= trainer.global_step:
            self._every_n_train_steps = trainer.global_step  # Lightning's own logic then saves (or defers) it
        try:
            super().on_train_batch_end(trainer, pl_module, *args, **kwargs)
        finally:
            self._every_n_train_steps = every

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.save_last and not self._should_skip_saving_checkpoint(trainer):
            candidates = self._monitor_candidates(trainer)
            self._save_topk_checkpoint(trainer, candidates)
            self._save_last_checkpoint(trainer, candidates)
        super().on_train_end(trainer, pl_module)


def last_checkpoint_of_earlier_runs(trainer: L.Trainer) -> Path | None:
    """``last.ckpt`` of the newest earlier run under the trainer's versioned logger, or None.

    Lightning looks ``--ckpt_path last`` up in the checkpoint folder of the run it starts; without a
    ``checkpoint.dirpath`` that folder is the new run's own (TensorBoard's next ``version_N``), empty,
    so a resumed run would train from step 0. This finds ``root_dir/version_N/checkpoints/last.ckpt``
    with the largest N instead. None where Lightning finds it itself (a ``dirpath`` is set, no
    versioned logger, or a logger given its version: that run's own folder is the one to resume) or where no
    earlier run left one.
    """
    callback, root = trainer.checkpoint_callback, getattr(trainer.logger, "root_dir", None)
    if callback is None or callback.dirpath is not None or root is None:
        return None
    if getattr(trainer.logger, "_version", None) is not None:  # given (or already drawn): not the next version_N
        return None
    found = []
    for path in Path(root).glob("version_*/checkpoints/last.ckpt"):
        number = re.fullmatch(r"version_(\d+)", path.parent.parent.name)
        if number:
            found.append((int(number.group(1)), path))
    return max(found)[1] if found else None
