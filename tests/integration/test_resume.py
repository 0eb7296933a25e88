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
    callbacks = [{"class_path": "curkv_train.training.callbacks.curriculum.Curriculum", "init_args": {"stages": STAGES}}]
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
    assert loader_state == [{"batches_done": MAX_STEPS, "epoch": 0}]


def test_a_run_resumed_at_an_epoch_end_from_the_newest_version_folder_matches_an_uninterrupted_one(tmp_path):
    """An epoch of 4 batches and a checkpoint at step 4: the resumed run trains the next epoch's blocks (it
    trained nothing once: the loader resumed "after 4 of 4 batches" with nothing left). Without
    checkpoint.dirpath each run writes into its own lightning_logs/version_N; ``--ckpt_path last`` resumes from
    version_0's last.ckpt (Lightning alone would look in version_1's empty folder and start over)."""
    def settings(steps: int, ckpt_dir=None) -> dict:
        checkpoint = checkpoint_config(ckpt_dir, 4) if ckpt_dir else {"every_n_train_steps": 4, "save_top_k": -1}
        return {"trainer": {"max_steps": steps, "limit_val_batches": 0, "logger": ckpt_dir is None,
                            "enable_progress_bar": False, "enable_model_summary": False},
                "checkpoint": checkpoint,
                "model": {"backend": "torch", "window": 8},
                "data": {"context_length": 96, "continuation_length": 8, "batch_size": 2, "train_size": 8}}

    whole = run_fit(settings(8, tmp_path / "whole" / "ckpt"), tmp_path / "whole")
    assert whole.returncode == 0, whole.stderr[-3000:]
    split = tmp_path / "split"
    first = run_fit(settings(4), split)
    assert first.returncode == 0, first.stderr[-3000:]
    resumed = run_fit(settings(8), split, "--ckpt_path", "last")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    runs = split / "lightning_logs"
    assert f"--ckpt_path last: {runs / 'version_0' / 'checkpoints' / 'last.ckpt'}" in resumed.stdout + resumed.stderr
    second = runs / "version_1" / "checkpoints"
    assert sorted(path.name for path in second.glob("step=*.ckpt")) == ["step=8.ckpt"]  # no step 4: it resumed there
    assert torch.load(second / "last.ckpt", weights_only=False)["global_step"] == 8
    assert_same_estimator(estimator_state(tmp_path / "whole" / "ckpt" / "last.ckpt"),
                          estimator_state(second / "last.ckpt"), atol=1e-6)
