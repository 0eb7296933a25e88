"""Every shipped scorer loads and is what its recipe of the same name trains: its family and estimator options."""

import json
from pathlib import Path

import pytest
import yaml

from curkv_train.training.recipes import recipe_dir
from curkv_train.runtime import load_scorer

CHECKPOINTS = Path(__file__).resolve().parents[2] / "checkpoints"
SHIPPED = sorted(folder.name for folder in CHECKPOINTS.iterdir() if (folder / "scorer.json").is_file())


def test_one_scorer_ships_per_base_model_with_its_card():
    assert {"smollm2-135m", "gemma3-270m"} <= set(SHIPPED)
    assert all((CHECKPOINTS / name / "EVAL.md").is_file() for name in SHIPPED)
    bases = [json.loads((CHECKPOINTS / name / "scorer.json").read_text())["base_model"]["id"] for name in SHIPPED]
    assert len(bases) == len(set(bases)), f"two shipped scorers serve one base model: {SHIPPED}"


@pytest.mark.parametrize("name", SHIPPED)
def test_a_shipped_scorer_carries_its_recipes_estimator(name):
    model = yaml.safe_load((recipe_dir() / f"{name}.yaml").read_text())["model"]
    estimator = json.loads((CHECKPOINTS / name / "scorer.json").read_text())["estimator"]
    assert estimator["family"] == model["estimator"]
    options = model.get("estimator_options") or {}
    assert {option: estimator["config"].get(option) for option in options} == options
    loaded = load_scorer(CHECKPOINTS / name)  # the weights fit that estimator
    assert loaded.family == model["estimator"]
    assert {option: loaded.estimator.config()[option] for option in options} == options
