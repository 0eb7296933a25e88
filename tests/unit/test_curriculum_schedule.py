"""Curriculum: stage boundaries, values applied to the module and the data, state across a resume."""

import pytest

from curkv_train.callbacks.curriculum import Curriculum, Stage
from curkv_train.errors import CurKVError
from curkv_train.objective import TrainingSettings

STAGES = [
    Stage(steps=2, context_length=96, continuation_length=8, warm_start=True),
    Stage(steps=3, context_length=128, keep_ratio=0.4, temperature=0.5),
    Stage(steps=2, keep_ratio=[0.5, 0.3], hard_topk=True),
]


class FakeModule:
    """What the curriculum needs of the LightningModule: its settings and apply_stage."""

    def __init__(self) -> None:
        self.settings = TrainingSettings()

    def apply_stage(self, settings: TrainingSettings) -> None:
        self.settings = settings


class FakeData:
    """What the curriculum needs of the data module: set_block_shape."""

    def __init__(self) -> None:
        self.context_length, self.continuation_length = 64, 16

    def set_block_shape(self, context_length=None, continuation_length=None) -> None:
        self.context_length = context_length or self.context_length
        self.continuation_length = continuation_length or self.continuation_length


class FakeTrainer:
    def __init__(self) -> None:
        self.global_step, self.datamodule = 0, FakeData()


def fake_run():
    """A module, a data module and a trainer holding it."""
    trainer = FakeTrainer()
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
