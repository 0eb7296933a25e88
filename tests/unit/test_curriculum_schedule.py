"""Curriculum: stage boundaries, values applied to the module and the data, state across a resume."""

import pytest

from curkv_train.training.callbacks.curriculum import Curriculum, Stage
from curkv_train.core.errors import CurKVError
from curkv_train.training.objective import TrainingSettings

STAGES = [
    Stage(steps=2, context_length=96, continuation_length=8, warm_start=True),
    Stage(steps=3, context_length=128, keep_ratio=0.4, temperature=0.5),
    Stage(steps=2, keep_ratio=[0.5, 0.3], hard_topk=True),
]


class FakeModule:
    """What the curriculum needs of the LightningModule: its settings, apply_stage and check_stage."""

    def __init__(self, settings: TrainingSettings | None = None) -> None:
        self.settings = settings or TrainingSettings()
        self.checked = []

    def apply_stage(self, settings: TrainingSettings) -> None:
        self.settings = settings

    def check_stage(self, settings: TrainingSettings, context_length: int) -> None:
        self.checked.append((settings.keep_ratio, context_length))
        if settings.streaming_rounds > 3:
            raise CurKVError("too many rounds")


class FakeData:
    """What the curriculum needs of the data module: set_block_shape and check_shape."""

    def __init__(self, num_workers: int = 0) -> None:
        self.context_length, self.continuation_length, self.num_workers = 64, 16, num_workers

    def set_block_shape(self, context_length=None, continuation_length=None) -> None:
        self.context_length = context_length or self.context_length
        self.continuation_length = continuation_length or self.continuation_length

    def check_shape(self, context_length=None, continuation_length=None) -> tuple[int, int]:
        if (context_length or self.context_length) > 1000:
            raise CurKVError("longer than the model's positions")
        return context_length or self.context_length, continuation_length or self.continuation_length


class FakeTrainer:
    def __init__(self, num_workers: int = 0) -> None:
        self.global_step, self.datamodule = 0, FakeData(num_workers)


def fake_run(num_workers: int = 0):
    """A module, a data module and a trainer holding it."""
    trainer = FakeTrainer(num_workers)
    return trainer, FakeModule(), trainer.datamodule


@pytest.mark.parametrize(("step", "stage"), [(0, 0), (1, 0), (2, 1), (4, 1), (5, 2), (6, 2), (100, 2)])
def test_stage_boundaries(step, stage):
    assert Curriculum(STAGES).stage_at(step) == stage


def test_values_are_applied_and_inherited():
    trainer, module, train_set = fake_run()
    curriculum = Curriculum(STAGES)
    seen = []
    for step in range(7):
        curriculum.apply(trainer, module, step)
        settings = module.settings
        seen.append((curriculum.stage_index, train_set.context_length, train_set.continuation_length,
                     settings.keep_ratio, settings.temperature, settings.hard_topk, settings.warm_start))
    assert seen == [
        (0, 96, 8, 0.5, 1.0, False, True),
        (0, 96, 8, 0.5, 1.0, False, True),
        (1, 128, 8, 0.4, 0.5, False, False),
        (1, 128, 8, 0.4, 0.5, False, False),
        (1, 128, 8, 0.4, 0.5, False, False),
        (2, 128, 8, 0.3, 0.5, True, False),  # the ratio list cycles by step: 5 % 2 -> 0.3
        (2, 128, 8, 0.5, 0.5, True, False),
    ]


def test_state_is_restored_on_resume():
    trainer, module, train_set = fake_run()
    before = Curriculum(STAGES)
    before.apply(trainer, module, 3)
    state = before.state_dict()

    resumed_trainer, resumed_module, resumed_set = fake_run()
    after = Curriculum(STAGES)
    after.load_state_dict(state)
    assert after.stage_index == 1
    resumed_trainer.global_step = 3
    after.on_train_start(resumed_trainer, resumed_module)
    assert resumed_module.settings == module.settings and vars(resumed_set) == vars(train_set)


def test_compression_range_draws_each_step_within_the_range_and_repeats_on_resume():
    stages = [Stage(steps=50, compression_range=[0.3, 0.8], hard_topk=True)]
    trainer, module, _ = fake_run()
    ratios = []
    for step in range(50):
        Curriculum(stages).apply(trainer, module, step)
        ratios.append(module.settings.keep_ratio)
    assert all(0.2 <= ratio <= 0.7 for ratio in ratios) and len(set(ratios)) == 50
    assert min(ratios) < 0.3 and max(ratios) > 0.6  # spread over the range
    again = FakeModule()
    Curriculum(stages).apply(trainer, again, 17)
    assert again.settings.keep_ratio == ratios[17]


@pytest.mark.parametrize("bounds", [[0.8, 0.3], [0.3, 1.0], [0.5]])
def test_bad_compression_range_is_rejected(bounds):
    with pytest.raises(CurKVError, match="compression_range"):
        Curriculum([Stage(steps=1, compression_range=bounds)])


def test_bad_recent_share_is_rejected():
    with pytest.raises(CurKVError, match="recent_share"):
        Curriculum([Stage(steps=1, recent_share=2.0)])


def test_a_compression_interval_below_one_window_is_rejected():
    with pytest.raises(CurKVError, match="compress_every must be >= 1"):
        Curriculum([Stage(steps=1, streaming_rounds=2, compress_every=0)])


def keep_ratios(stages, steps):
    trainer, module, _ = fake_run()
    curriculum = Curriculum(stages)
    ratios = []
    for step in range(steps):
        curriculum.apply(trainer, module, step)
        ratios.append(module.settings.keep_ratio)
    return ratios


def test_a_later_stage_keeps_the_compression_range_until_a_keep_ratio_replaces_it():
    ratios = keep_ratios([Stage(steps=3, compression_range=[0.3, 0.8]), Stage(steps=3, temperature=0.5),
                          Stage(steps=2, keep_ratio=0.9), Stage(steps=2, hard_topk=True)], 10)
    assert len(set(ratios[:6])) == 6 and all(0.2 <= ratio <= 0.7 for ratio in ratios[:6])
    assert ratios[6:] == [0.9] * 4


def test_a_range_replaces_an_earlier_keep_ratio():
    ratios = keep_ratios([Stage(steps=2, keep_ratio=0.9), Stage(steps=3, compression_range=[0.3, 0.8])], 5)
    assert ratios[:2] == [0.9, 0.9] and all(0.2 <= ratio <= 0.7 for ratio in ratios[2:])


def test_a_stage_with_a_keep_ratio_and_a_range_is_rejected():
    with pytest.raises(CurKVError, match="both keep_ratio and compression_range"):
        Curriculum([Stage(steps=1, keep_ratio=0.5, compression_range=[0.3, 0.8])])


def test_hard_topk_is_inherited_and_unset_stages_keep_the_models_value():
    trainer, _, _ = fake_run()
    module = FakeModule(TrainingSettings(hard_topk=True))
    curriculum = Curriculum([Stage(steps=1, temperature=0.5), Stage(steps=1, hard_topk=False), Stage(steps=1)])
    seen = []
    for step in range(3):
        curriculum.apply(trainer, module, step)
        seen.append(module.settings.hard_topk)
    assert seen == [True, False, False]


def test_warm_start_is_not_inherited():
    trainer, module, _ = fake_run()
    curriculum = Curriculum([Stage(steps=1, warm_start=True), Stage(steps=1, keep_ratio=0.4)])
    curriculum.apply(trainer, module, 1)
    assert module.settings.warm_start is False


def test_a_step_end_reshapes_the_data_for_the_next_step_but_leaves_the_module_on_this_one():
    trainer, module, data = fake_run()
    curriculum = Curriculum(STAGES)
    curriculum.apply(trainer, module, 1)
    trainer.global_step = 2  # the optimizer step of step 1 has run: the next step is stage 1's
    curriculum.on_train_batch_end(trainer, module, None, None, 0)
    assert (data.context_length, module.settings.warm_start, curriculum.stage_index) == (128, True, 0)


def test_every_stage_is_checked_against_the_module_when_training_starts():
    trainer, module, _ = fake_run()
    Curriculum(STAGES).on_train_start(trainer, module)
    assert module.checked == [(0.5, 96), (0.4, 128), (0.3, 128)]  # each stage at its first step
    with pytest.raises(CurKVError, match="curriculum stage 1: too many rounds"):
        Curriculum([Stage(steps=1), Stage(steps=1, streaming_rounds=4)]).on_train_start(trainer, module)
    with pytest.raises(CurKVError, match="curriculum stage 2: longer than"):  # the data's checks too, up front
        Curriculum([Stage(steps=1), Stage(steps=1), Stage(steps=1, context_length=4096)]).on_train_start(trainer,
                                                                                                          module)


def test_a_changing_block_shape_is_refused_with_loader_workers():
    trainer, module, _ = fake_run(num_workers=2)
    with pytest.raises(CurKVError, match="num_workers"):
        Curriculum(STAGES).on_train_start(trainer, module)
    same_shape = [Stage(steps=1, context_length=96, keep_ratio=0.4), Stage(steps=1, context_length=96)]
    Curriculum(same_shape).on_train_start(trainer, module)
    assert trainer.datamodule.context_length == 96


@pytest.mark.parametrize(("field", "value"), [("streaming_rounds", -1), ("hot_windows", -1)])
def test_negative_streaming_settings_are_rejected(field, value):
    with pytest.raises(CurKVError, match=f"{field} must be >= 0"):
        Curriculum([Stage(steps=1, **{field: value})])


def test_an_empty_keep_ratio_list_is_rejected():
    with pytest.raises(CurKVError, match="stage 1 has an empty keep_ratio list"):
        Curriculum([Stage(steps=1), Stage(steps=1, keep_ratio=[])])


def test_a_stage_validation_cannot_run_at_the_recipes_context_is_refused_when_validation_runs():
    """Validation keeps the recipe's block shape (64 tokens here) but runs the stage's settings on it."""
    def short_contexts_refused(settings: TrainingSettings, context_length: int) -> None:
        if settings.streaming_rounds and context_length < 128:
            raise CurKVError("rounds start too early")

    stages = [Stage(steps=1, context_length=256, streaming_rounds=4)]
    for validation, refused in ((0, False), (1.0, True)):
        trainer, module, _ = fake_run()
        trainer.limit_val_batches, module.check_stage = validation, short_contexts_refused
        if not refused:
            Curriculum(stages).on_train_start(trainer, module)
            continue
        with pytest.raises(CurKVError, match="stage 0, as validation runs it on the recipe's 64-token contexts"):
            Curriculum(stages).on_train_start(trainer, module)
