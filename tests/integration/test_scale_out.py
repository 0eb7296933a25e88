"""Scale-out through Lightning's own DDP: 2 CPU processes (gloo) × batch 1 train the same estimator as
1 process × batch 2 (the loss is a mean over equal-length continuations, so the averaged gradients match)."""

import pytest
from fit_helpers import assert_same_estimator, checkpoint_config, estimator_state, run_fit

pytestmark = pytest.mark.integration

STEPS = 3


def config(ckpt_dir, per_process_batch: int) -> dict:
    return {"trainer": {"max_steps": STEPS, "limit_val_batches": 0, "logger": False, "accelerator": "cpu",
                        "enable_progress_bar": False, "enable_model_summary": False},
            "checkpoint": checkpoint_config(ckpt_dir, STEPS),
            # The budget penalty is a function of the batch-mean keep score, not a mean of per-example
            # terms, so it is switched off here: with it, the per-rank penalties average to something else.
            "model": {"backend": "torch", "window": 16, "budget_weight": 0.0},
            "data": {"batch_size": per_process_batch, "train_size": 32}}


def test_ddp_two_processes_match_one_process_with_the_same_global_batch(tmp_path):
    single = run_fit(config(tmp_path / "single" / "ckpt", 2), tmp_path / "single",
                     "--trainer.devices", "1")
    assert single.returncode == 0, single.stderr[-3000:]
    ddp = run_fit(config(tmp_path / "ddp" / "ckpt", 1), tmp_path / "ddp",
                  "--trainer.devices", "2", "--trainer.strategy", "ddp")
    assert ddp.returncode == 0, ddp.stderr[-3000:]
    assert "world_size: 2" in ddp.stderr or "MEMBER: 2/2" in ddp.stderr, ddp.stderr[-3000:]
    assert "find_unused_parameters" not in ddp.stderr  # DDP never asks for it: the base has no grads

    single_state = estimator_state(tmp_path / "single" / "ckpt" / "last.ckpt")
    ddp_state = estimator_state(tmp_path / "ddp" / "ckpt" / "last.ckpt")
    assert_same_estimator(single_state, ddp_state, atol=1e-5)
