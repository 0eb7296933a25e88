"""``curkv-train calibrate`` on the tiny Llama: sensitivities measured, the best exponent recorded in place."""

import json

import pytest

from curkv_train.core.errors import CurKVError
from curkv_train.eval.calibrate import calibrate
from curkv_train.models.base import TINY_RANDOM
from curkv_train.runtime.serialization import load_scorer, save_scorer
from runtime_helpers import random_scorer

pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.fixture()
def folder(tmp_path):
    return save_scorer(random_scorer(window=16), tmp_path / "scorer", base_model=TINY_RANDOM)


def test_calibrate_writes_the_budget_it_measured(folder):
    weights = json.loads((folder / "scorer.json").read_text())["weights"]
    budget = calibrate(str(folder), exponents=[1.0, 4.0], floors=[0.3, 0.9], length=192, prefix=64, chunk=16)
    record = json.loads((folder / "scorer.json").read_text())
    assert record["weights"] == weights
    entry = record["layer_budget"]
    assert entry["sensitivity"] == pytest.approx(list(budget.sensitivity)) and len(budget.sensitivity) == 2
    assert any(value != 0 for value in budget.sensitivity)
    tried = entry["calibration"]["ppl_increase_pct_by_exponent_floor"]
    assert set(tried) == {"0,1", "1,0.3", "1,0.9", "4,0.3", "4,0.9"}
    assert tried[f"{budget.exponent:g},{budget.floor:g}"] == min(tried.values())
    assert entry["calibration"]["documents"] == 2  # one block of each of the default recipe's stdlib and pydoc
    assert load_scorer(folder).layer_budget == budget


def test_calibrate_refuses_bad_settings(folder):
    with pytest.raises(CurKVError, match="length > prefix"):
        calibrate(str(folder), length=64, prefix=64)
    with pytest.raises(CurKVError, match="0 < probe_keep"):
        calibrate(str(folder), probe_keep=1.0)
    with pytest.raises(CurKVError, match=r"floors in \(0, 1\]"):
        calibrate(str(folder), floors=[0.0])


def test_calibrate_refuses_a_hybrid_model_in_one_line(tmp_path):
    from curkv_train.core.shapes import kv_shape
    from curkv_train.models.base import TINY_RANDOM_GEMMA3, load_base_model
    from curkv_train.models.families import build_estimator
    from curkv_train.runtime import Scorer

    estimator = build_estimator("seed", kv_shape(load_base_model(TINY_RANDOM_GEMMA3).config))
    folder = save_scorer(Scorer(estimator, n_sink=4, window=16), tmp_path / "gemma", base_model=TINY_RANDOM_GEMMA3)
    with pytest.raises(CurKVError, match="hybrid model") as error:
        calibrate(str(folder))
    assert "\n" not in str(error.value)
