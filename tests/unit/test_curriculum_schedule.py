"""Curriculum: stage boundaries, values applied to the module and the data, state across a resume."""

from types import SimpleNamespace

import pytest

from curkv_train.callbacks.curriculum import Curriculum, Stage

STAGES = [
    Stage(steps=2, context_length=96, continuation_length=8, warm_start=True),
    Stage(steps=3, context_length=128, keep_ratio=0.4, temperature=0.5),
    Stage(steps=2, keep_ratio=[0.5, 0.3], hard_topk=True),
]


def fake_run():
    """A module, a train dataset and a trainer holding them, with the attributes the callback sets."""
    module = SimpleNamespace(keep_ratio=0.5, budget_weight=0.4, temperature=1.0, hard_topk=False, warm_start=False)
    train_set = SimpleNamespace(context_length=64, continuation_length=16)
    trainer = SimpleNamespace(global_step=0, datamodule=SimpleNamespace(datasets={"train": train_set}))
    return trainer, module, train_set


@pytest.mark.parametrize(("step", "stage"), [(0, 0), (1, 0), (2, 1), (4, 1), (5, 2), (6, 2), (100, 2)])
def test_stage_boundaries(step, stage):
    assert Curriculum(STAGES).stage_at(step) == stage


def test_values_are_applied_and_inherited():
    trainer, module, train_set = fake_run()
    curriculum = Curriculum(STAGES)
    seen = []
    for step in range(7):
        curriculum.apply(trainer, module, step)
        seen.append((curriculum.stage_index, train_set.context_length, train_set.continuation_length,
                     module.keep_ratio, module.temperature, module.hard_topk, module.warm_start))
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
    assert vars(resumed_module) == vars(module) and vars(resumed_set) == vars(train_set)
