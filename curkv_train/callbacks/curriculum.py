"""Curriculum: ordered training stages driven by the recipe (DESIGN §4 hardening)."""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass

import lightning as L
from lightning.pytorch.callbacks import Callback

from curkv_train.errors import CurKVError
from curkv_train.core.selection import check_keep_ratio

log = logging.getLogger(__name__)


@dataclass
class Stage:
    """One curriculum stage; fields left ``None`` keep the previous stage's value.

    Attributes:
        steps: optimizer steps in this stage.
        context_length, continuation_length: block shape of its training data.
        keep_ratio: target ρ, or a list of ρ cycled step by step (one scorer for several ratios).
        budget_weight: λ of the budget penalty.
        temperature: score temperature T.
        hard_topk: exact top-⌈ρ·n⌉ forward with straight-through gradients.
        warm_start: ranking loss against the captured value-weighted attention mass
            (no backward through the LLM) instead of distillation.
    """

    steps: int
    context_length: int | None = None
    continuation_length: int | None = None
    keep_ratio: float | list[float] | None = None
    budget_weight: float | None = None
    temperature: float | None = None
    hard_topk: bool = False
    warm_start: bool = False


class Curriculum(Callback):
    """Applies the stage of the current global step to the module and the training data.

    The stage is a function of ``trainer.global_step``, so a resumed run continues
    the same schedule; the stage index is also saved in the checkpoint and checked.
    After the last stage the last stage's settings stay in force.

    Args:
        stages: the ordered stages.
    """

    def __init__(self, stages: list[Stage]) -> None:
        if not stages:
            raise CurKVError("a curriculum needs at least one stage")
        for index, stage in enumerate(stages):
            if stage.steps < 1:
                raise CurKVError(f"curriculum stage {index} has {stage.steps} steps; each stage needs >= 1")
            for ratio in _as_list(stage.keep_ratio):
                check_keep_ratio(ratio)
        self.stages = stages
        self.stage_index = -1

    def stage_at(self, step: int) -> int:
        """Index of the stage that covers optimizer step ``step``."""
        end = 0
        for index, stage in enumerate(self.stages):
            end += stage.steps
            if step < end:
                return index
        return len(self.stages) - 1

    def settings_at(self, step: int) -> dict:
        """Resolved settings at ``step``: every field, inherited from earlier stages when None."""
        settings: dict = {}
        for stage in self.stages[: self.stage_at(step) + 1]:
            settings.update({k: v for k, v in asdict(stage).items() if v is not None})
        ratios = _as_list(settings.get("keep_ratio"))
        if ratios:
            settings["keep_ratio"] = ratios[step % len(ratios)]
        return settings

    def apply(self, trainer: L.Trainer, module: L.LightningModule, step: int) -> None:
        """Set the module's and the training data's values for optimizer step ``step``."""
        settings = self.settings_at(step)
        for name in ("keep_ratio", "budget_weight", "temperature", "hard_topk", "warm_start"):
            if name in settings:
                setattr(module, name, settings[name])
        data = getattr(trainer, "datamodule", None)
        train_set = getattr(data, "datasets", {}).get("train") if data is not None else None
        for name in ("context_length", "continuation_length"):
            if name in settings and train_set is not None:
                setattr(train_set, name, settings[name])
        index = self.stage_at(step)
        if index != self.stage_index:
            log.info("curriculum stage %d from step %d: %s", index, step, settings)
            self.stage_index = index

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.apply(trainer, pl_module, trainer.global_step)

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch, batch_idx: int) -> None:
        self.apply(trainer, pl_module, trainer.global_step)
        pl_module.log("curriculum/stage", float(self.stage_index))

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch,
                           batch_idx: int) -> None:
        # Reshape the data for the next step now: the loader fetches ahead of the step.
        self.apply(trainer, pl_module, trainer.global_step)

    def state_dict(self) -> dict:
        return {"stage_index": self.stage_index, "stages": [asdict(stage) for stage in self.stages]}

    def load_state_dict(self, state_dict: dict) -> None:
        if state_dict.get("stages") != [asdict(stage) for stage in self.stages]:
            log.warning("resuming with a different curriculum than the checkpoint's; using the new one")
        self.stage_index = state_dict.get("stage_index", -1)


def _as_list(value) -> list:
    if value is None:
        return []
    return list(value) if isinstance(value, (list, tuple)) else [value]
