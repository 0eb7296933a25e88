"""Curriculum: ordered training stages driven by the recipe (DESIGN §4 hardening)."""

from __future__ import annotations

import logging
import random
from dataclasses import asdict, dataclass, fields

import lightning as L
from lightning.pytorch.callbacks import Callback

from curkv_train.errors import CurKVError
from curkv_train.objective import TrainingSettings
from curkv_train.core.selection import check_keep_ratio, check_recent_share

log = logging.getLogger(__name__)


@dataclass
class Stage:
    """One curriculum stage; fields left ``None`` keep the previous stage's value.

    Attributes:
        steps: optimizer steps in this stage.
        context_length, continuation_length: block shape of its training data.
        keep_ratio: target ρ, or a list of ρ cycled step by step (one scorer for several ratios).
        compression_range: [low, high]: instead of ``keep_ratio``, draw the compression ratio
            1 − ρ uniformly from this range at every step (seeded by the step, so a resumed run
            draws the same ones).
        budget_weight: λ of the budget penalty.
        temperature: score temperature T.
        hard_topk: exact top-⌈ρ·n⌉ forward with straight-through gradients.
        warm_start: the dense ranking term alone against the reconstruction target (no
            continuation, no backward through the LLM) instead of distillation.
        streaming_rounds: compress the context in this many rounds ``compress_every`` windows apart, the
            way CurKVCache compresses a growing context (0: one selection).
        hot_windows: recent windows each streaming round protects (the cache's hot tier).
        compress_every: windows between two streaming rounds (the cache's compression interval).
        recent_share: share of each streaming round's kept places given to the newest tokens (the
            cache's ``recent_share``).
        count_protected: whether sinks and hot tier count inside ρ in streaming rounds (unset: the
            model's setting, True by default, as CurKVCache counts them; False reproduces scorers
            trained before 2026-12-04).
    """

    steps: int
    context_length: int | None = None
    continuation_length: int | None = None
    keep_ratio: float | list[float] | None = None
    compression_range: list[float] | None = None
    budget_weight: float | None = None
    temperature: float | None = None
    hard_topk: bool = False
    warm_start: bool = False
    streaming_rounds: int | None = None
    hot_windows: int | None = None
    compress_every: int | None = None
    recent_share: float | None = None
    count_protected: bool | None = None


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
            if stage.compression_range is not None:
                _check_range(index, stage.compression_range)
            if stage.recent_share is not None:
                check_recent_share(stage.recent_share)
            if stage.compress_every is not None and stage.compress_every < 1:
                raise CurKVError(f"curriculum stage {index}: compress_every must be >= 1, got {stage.compress_every}")
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
        stage = self.stages[self.stage_at(step)]
        if stage.compression_range is not None:
            low, high = stage.compression_range
            settings["keep_ratio"] = 1.0 - random.Random(f"curriculum/{step}").uniform(low, high)
        else:
            ratios = _as_list(settings.get("keep_ratio"))
            if ratios:
                settings["keep_ratio"] = ratios[step % len(ratios)]
        return settings

    def apply(self, trainer: L.Trainer, module: L.LightningModule, step: int) -> None:
        """Apply the settings of optimizer step ``step`` to the module and the training data.

        The module takes a :class:`~curkv_train.objective.TrainingSettings` through
        ``apply_stage`` (fields a stage leaves unset keep the module's current value); the data
        module takes the block shape through ``set_block_shape``.
        """
        settings = self.settings_at(step)
        names = {field.name for field in fields(TrainingSettings)}
        current = asdict(module.settings)
        module.apply_stage(TrainingSettings(**{name: settings.get(name, current[name]) for name in names}))
        data = trainer.datamodule
        if data is not None and ("context_length" in settings or "continuation_length" in settings):
            data.set_block_shape(settings.get("context_length"), settings.get("continuation_length"))
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


def _check_range(index: int, bounds) -> None:
    """A CurKVError unless ``bounds`` is [low, high] with 0 <= low <= high < 1."""
    if len(bounds) != 2 or not 0.0 <= bounds[0] <= bounds[1] < 1.0:
        raise CurKVError(f"curriculum stage {index} has compression_range {bounds}; expected [low, high] with "
                         "0 <= low <= high < 1 (compression ratio = 1 - keep ratio)")


def _as_list(value) -> list:
    if value is None:
        return []
    return list(value) if isinstance(value, (list, tuple)) else [value]
