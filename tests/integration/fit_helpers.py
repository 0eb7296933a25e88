"""Helpers for integration tests that run ``curkv-train fit`` in subprocesses on the tiny model."""

import os
import subprocess
import sys
from pathlib import Path

import torch
import yaml

HERE = Path(__file__).parent


def user_env(**extra: str) -> dict[str, str]:
    """The environment of a user's ``curkv-train`` process: the suite's, offline, one thread, ``extra`` on top.

    Without the suite's TRITON_INTERPRET (set for the kernel tests): a user's CPU run takes the torch path.
    """
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    return {**env, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1", **extra}


def run_fit(config: dict, root: Path, *flags: str, timeout: float = 600) -> subprocess.CompletedProcess:
    """``curkv-train fit --recipe tiny-debug`` with ``config`` layered on top, in a fresh process.

    ``tests/integration`` is on the path so test-only callbacks (``killer.KillAtStep``) resolve.
    """
    root.mkdir(parents=True, exist_ok=True)
    path = root / "test-config.yaml"
    path.write_text(yaml.safe_dump(config))
    env = user_env(PYTHONPATH=os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]))
    command = [sys.executable, "-m", "curkv_train.cli", "fit", "--recipe", "tiny-debug", "--config", str(path),
               "--trainer.default_root_dir", str(root), *flags]
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env, cwd=root)


def estimator_state(checkpoint_path: Path) -> dict[str, torch.Tensor]:
    """The ``estimator.*`` tensors of a Lightning checkpoint."""
    checkpoint = torch.load(checkpoint_path, weights_only=False, map_location="cpu")
    return {key: value for key, value in checkpoint["state_dict"].items() if key.startswith("estimator.")}


def assert_same_estimator(expected: dict, actual: dict, atol: float) -> None:
    assert expected.keys() == actual.keys() and expected
    for key in expected:
        difference = (expected[key] - actual[key]).abs().max().item()
        assert difference <= atol, f"{key} differs by {difference:.3g} > {atol}"


def checkpoint_config(dirpath: Path, every: int) -> dict:
    """The CLI's ``checkpoint:`` section writing last.ckpt into ``dirpath`` every ``every`` steps."""
    return {"dirpath": str(dirpath), "save_last": True, "every_n_train_steps": every}
