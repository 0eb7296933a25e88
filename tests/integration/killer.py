"""A callback for the kill-and-resume test: SIGKILLs its own process after a given optimizer step."""

import os
import signal

from lightning.pytorch.callbacks import Callback


class KillAtStep(Callback):
    """Kills the process (SIGKILL, no cleanup) once ``step`` optimizer steps are done.

    Lightning runs checkpoint callbacks after this one, so a checkpoint due at ``step`` is never written.

    Args:
        step: optimizer steps after which to die.
    """

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        if trainer.global_step >= self.step:
            os.kill(os.getpid(), signal.SIGKILL)
