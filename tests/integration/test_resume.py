"""Kill-and-resume: a run SIGKILLed mid-training and resumed from its last checkpoint ends where an
uninterrupted run with the same seed ends (same estimator, same curriculum stage)."""

import signal

import pytest
import torch
from fit_helpers import assert_same_estimator, checkpoint_config, estimator_state, run_fit

pytestmark = pytest.mark.integration

MAX_STEPS, CHECKPOINT_EVERY, KILL_AFTER = 8, 2, 5

STAGES = [
    {"steps": 3, "context_length": 96, "continuation_length": 8, "keep_ratio": 0.5},
    {"steps": 3, "context_length": 112, "keep_ratio": 0.4, "temperature": 0.5},
    {"steps": 2, "hard_topk": True, "keep_ratio": [0.5, 0.3]},
]


def config(ckpt_dir, kill_after: int | None = None) -> dict:
    callbacks = [{"class_path": "curkv_train.callbacks.curriculum.Curriculum", "init_args": {"stages": STAGES}}]
    if kill_after is not None:
        callbacks.insert(0, {"class_path": "killer.KillAtStep", "init_args": {"step": kill_after}})
    return {"trainer": {"max_steps": MAX_STEPS, "limit_val_batches": 0, "logger": False,
                        "enable_progress_bar": False, "enable_model_summary": False, "callbacks": callbacks},
            "checkpoint": checkpoint_config(ckpt_dir, CHECKPOINT_EVERY),
            "model": {"backend": "torch", "window": 8},
            "data": {"context_length": 96, "continuation_length": 8, "batch_size": 2, "train_size": 64}}


def test_killed_and_resumed_run_matches_an_uninterrupted_one(tmp_path):
    whole = run_fit(config(tmp_path / "whole" / "ckpt"), tmp_path / "whole")
    assert whole.returncode == 0, whole.stderr[-3000:]

    killed_dir = tmp_path / "killed"
    killed = run_fit(config(killed_dir / "ckpt", kill_after=KILL_AFTER), killed_dir)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    at_kill = torch.load(killed_dir / "ckpt" / "last.ckpt", weights_only=False)
    assert at_kill["global_step"] == KILL_AFTER // CHECKPOINT_EVERY * CHECKPOINT_EVERY  # step 4, mid-epoch

    resumed = run_fit(config(killed_dir / "ckpt"), killed_dir, "--ckpt_path", "last")
    assert resumed.returncode == 0, resumed.stderr[-3000:]

    final = torch.load(killed_dir / "ckpt" / "last.ckpt", weights_only=False)
    reference = torch.load(tmp_path / "whole" / "ckpt" / "last.ckpt", weights_only=False)
    assert final["global_step"] == reference["global_step"] == MAX_STEPS
    assert_same_estimator(estimator_state(tmp_path / "whole" / "ckpt" / "last.ckpt"),
                          estimator_state(killed_dir / "ckpt" / "last.ckpt"), atol=1e-6)
    assert "not resumable" not in resumed.stderr
    curriculum = [state for key, state in final["callbacks"].items() if key.startswith("Curriculum")]
    assert curriculum and curriculum[0]["stage_index"] == len(STAGES) - 1
    loader_state = final["loops"]["fit_loop"]["state_dict"]["combined_loader"]
    assert loader_state == [{"batches_done": MAX_STEPS}]
