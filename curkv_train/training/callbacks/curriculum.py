"""Curriculum: ordered training stages driven by the recipe (DESIGN §4 hardening)."""

from __future__ import annotations

import logging
import random
from dataclasses import asdict, dataclass, fields, replace

import lightning as L
from lightning.pytorch.callbacks import Callback

from curkv_train.core.errors import CurKVError
from curkv_train.training.objective import TrainingSettings
from curkv_train.core.selection import check_allocation, check_head_floor, check_keep_ratio, check_recent_share

log = logging.getLogger(__name__)


@dataclass
class Stage:
    """One curriculum stage; fields left ``None`` keep the previous stage's value (``warm_start`` excepted).

    Attributes:
        steps: optimizer steps in this stage.
        context_length, continuation_length: block shape of its training data.
        keep_ratio: target ρ, or a list of ρ cycled step by step (one scorer for several ratios).
        compression_range: [low, high]: instead of ``keep_ratio``, draw the compression ratio
            1 − ρ uniformly from this range at every step (seeded by the step, so a resumed run
            draws the same ones). A stage sets at most one of the two; a later stage that sets
            neither keeps whichever was set last.
        budget_weight: λ of the budget penalty.
        temperature: score temperature T.
        hard_topk: exact top-⌈ρ·n⌉ forward with straight-through gradients (unset before any
            stage sets it: the model's ``hard_topk``).
        warm_start: this stage (only; not inherited) trains the dense ranking term alone against
            the reconstruction target (no continuation, no backward through the LLM) instead of
            distillation.
        streaming_rounds: compress the context in this many rounds ``compress_every`` windows apart, the
            way CurKVCache compresses a growing context (0: one selection). Every round must leave
            tokens to compete: the first round's end, context − (rounds − 1)·compress_every·window,
            must exceed n_sink + hot_windows·window (checked when training starts).
        hot_windows: recent windows each streaming round protects (the cache's hot tier).
        compress_every: windows between two streaming rounds (the cache's compression interval).
        recent_share: share of each streaming round's kept places given to the newest tokens (the
            cache's ``recent_share``).
        count_protected: whether sinks and hot tier count inside ρ in streaming rounds (unset: the
            model's setting, True by default, as CurKVCache counts them; False: ρ of the competing span only).
        allocation: per_head or joint: where the hard stage's kept places go (unset: the model's ``allocation``);
            with streaming rounds, joint shares the first round's places over every layer and head and a later
            round's over each layer's heads, as CurKVCache does.
        head_floor: with joint, the share of its ⌈ρ·n⌉ every head keeps, in [0, 1] (unset: the model's).
    """

    steps: int
    context_length: int | None = None
    continuation_length: int | None = None
    keep_ratio: float | list[float] | None = None
    compression_range: list[float] | None = None
    budget_weight: float | None = None
    temperature: float | None = None
    hard_topk: bool | None = None
    warm_start: bool = False
    streaming_rounds: int | None = None
    hot_windows: int | None = None
    compress_every: int | None = None
    recent_share: float | None = None
    count_protected: bool | None = None
    allocation: str | None = None
    head_floor: float | None = None


class Curriculum(Callback):
    """Applies the stage of the current global step to the module and the training data.

    The stage is a function of ``trainer.global_step``, so a resumed run continues
    the same schedule; the stage index is also saved in the checkpoint and checked.
    After the last stage the last stage's settings stay in force. The module takes a
    step's settings when the step starts (so hooks at the step's end, the budget's dual
    step and checkpoints, see the step that ran); the data takes the next step's block
    shape when a step ends, before the loader draws the next batch.

    When training starts every stage is checked against the module (``check_stage``: e.g.
    streaming rounds that fit the context, positions for the reconstruction pass), and a
    schedule that changes the block shape is refused with DataLoader workers, which hold
    their own copy of the blocks and would not see the change.

    Args:
        stages: the ordered stages.
    """

    def __init__(self, stages: list[Stage]) -> None:
        if not stages:
            raise CurKVError("a curriculum needs at least one stage")
        for index, stage in enumerate(stages):
            if stage.steps < 1:
                raise CurKVError(f"curriculum stage {index} has {stage.steps} steps; each stage needs >= 1")
            if isinstance(stage.keep_ratio, (list, tuple)) and not stage.keep_ratio:
                raise CurKVError(f"curriculum stage {index} has an empty keep_ratio list; give one ratio or more")
            for ratio in _as_list(stage.keep_ratio):
                check_keep_ratio(ratio)
            if stage.compression_range is not None:
                _check_range(index, stage.compression_range)
                if stage.keep_ratio is not None:
                    raise CurKVError(f"curriculum stage {index} sets both keep_ratio and compression_range; "
                                     "set one (the range draws the ratio every step)")
            try:
                if stage.recent_share is not None:
                    check_recent_share(stage.recent_share)
                if stage.allocation is not None:
                    check_allocation(stage.allocation)
                if stage.head_floor is not None:
                    check_head_floor(stage.head_floor)
            except CurKVError as error:
                raise CurKVError(f"curriculum stage {index}: {error}") from None
            for name, least in (("compress_every", 1), ("streaming_rounds", 0), ("hot_windows", 0)):
                value = getattr(stage, name)
                if value is not None and value < least:
                    raise CurKVError(f"curriculum stage {index}: {name} must be >= {least}, got {value}")
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

    def stage_settings(self, index: int) -> dict:
        """Stage ``index`` with what it inherits: every field set by it or an earlier stage (a ratio list or range
        as written, before a step draws from it)."""
        settings: dict = {}
        for stage in self.stages[: index + 1]:
            if stage.keep_ratio is not None or stage.compression_range is not None:
                for name in ("keep_ratio", "compression_range"):
                    settings.pop(name, None)
            settings.update({k: v for k, v in asdict(stage).items() if v is not None})
        return settings

    def settings_at(self, step: int) -> dict:
        """Resolved settings at ``step``: :meth:`stage_settings` of its stage with this step's ratio drawn."""
        settings = self.stage_settings(self.stage_at(step))
        if "compression_range" in settings:
            low, high = settings["compression_range"]
            settings["keep_ratio"] = 1.0 - random.Random(f"curriculum/{step}").uniform(low, high)
        else:
            ratios = _as_list(settings.get("keep_ratio"))
            if ratios:
                settings["keep_ratio"] = ratios[step % len(ratios)]
        return settings

    def apply(self, trainer: L.Trainer, module: L.LightningModule, step: int) -> None:
        """Apply the settings of optimizer step ``step`` to the module and the training data.

        The module takes a :class:`~curkv_train.training.objective.TrainingSettings` through
        ``apply_stage`` (fields no stage has set keep the module's current value); the data
        module takes the block shape through ``set_block_shape``.
        """
        settings = self.settings_at(step)
        module.apply_stage(self.training_settings(settings, module.settings))
        self.reshape_data(trainer, step)
        index = self.stage_at(step)
        if index != self.stage_index:
            log.info("curriculum stage %d from step %d: %s", index, step, settings)
            self.stage_index = index

    @staticmethod
    def training_settings(settings: dict, current: TrainingSettings) -> TrainingSettings:
        """``current`` with the fields ``settings`` (of :meth:`settings_at`) resolves."""
        names = {field.name for field in fields(TrainingSettings)}
        return replace(current, **{name: settings[name] for name in names if name in settings})

    def reshape_data(self, trainer: L.Trainer, step: int) -> None:
        """Give the training data the block shape of step ``step`` (no-op where no stage sets one)."""
        settings, data = self.settings_at(step), trainer.datamodule
        if data is not None and ("context_length" in settings or "continuation_length" in settings):
            data.set_block_shape(settings.get("context_length"), settings.get("continuation_length"))

    def check(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        """A CurKVError for a stage the module cannot train or the data loader cannot reshape."""
        data, start = trainer.datamodule, 0
        shapes = set()
        # validation keeps the recipe's block shape but runs each stage's settings on it
        validated = getattr(data, "context_length", None) if getattr(trainer, "limit_val_batches", 0) else None
        for index, stage in enumerate(self.stages):
            settings = self.settings_at(start)
            context = settings.get("context_length") or getattr(data, "context_length", None)
            shapes.add((context, settings.get("continuation_length") or getattr(data, "continuation_length", None)))
            training = self.training_settings(settings, module.settings)
            try:
                if hasattr(data, "check_shape"):
                    data.check_shape(settings.get("context_length"), settings.get("continuation_length"))
                if context is not None:
                    module.check_stage(training, context)
            except CurKVError as error:
                raise CurKVError(f"curriculum stage {index}: {error}") from None
            if validated is not None and validated != context:
                try:
                    module.check_stage(training, validated)
                except CurKVError as error:
                    raise CurKVError(f"curriculum stage {index}, as validation runs it on the recipe's "
                                     f"{validated}-token contexts: {error}") from None
            start += stage.steps
        if len(shapes) > 1 and getattr(data, "num_workers", 0):
            raise CurKVError(f"the curriculum changes the block shape but data.num_workers is "
                             f"{data.num_workers}: workers keep their own copy of the blocks; set data.num_workers: 0")

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.check(trainer, pl_module)
        self.apply(trainer, pl_module, trainer.global_step)

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch, batch_idx: int) -> None:
        self.apply(trainer, pl_module, trainer.global_step)
        pl_module.log("curriculum/stage", float(self.stage_index))

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch,
                           batch_idx: int) -> None:
        # The loader draws the next batch before the next step starts; the module keeps this step's settings.
        self.reshape_data(trainer, trainer.global_step)

    def state_dict(self) -> dict:
        """The stage index, the stages as written and the current stage's inherited settings (read by export)."""
        settings = self.stage_settings(self.stage_index) if self.stage_index >= 0 else None
        return {"stage_index": self.stage_index, "stages": [asdict(stage) for stage in self.stages],
                "stage_settings": settings}

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
