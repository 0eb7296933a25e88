"""A training-free rule's own layer budget: ``curkv-train calibrate --method RULE``, and its ``RULE@own`` row."""

from __future__ import annotations

import json

import pytest
import torch

kvpress = pytest.importorskip("kvpress")

from curkv_train.core.errors import CurKVError  # noqa: E402
from curkv_train.eval.calibrate import calibrate  # noqa: E402
from curkv_train.eval.rule_budget import load_rule_budgets  # noqa: E402
from curkv_train.models.base import TINY_RANDOM  # noqa: E402
from curkv_train.runtime.serialization import save_scorer  # noqa: E402
from runtime_helpers import random_scorer  # noqa: E402

pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.fixture()
def folder(tmp_path):
    return save_scorer(random_scorer(window=16), tmp_path / "scorer", base_model=TINY_RANDOM)


def test_a_rules_budget_is_measured_on_a_prefill_and_read_back(folder, tmp_path):
    out = tmp_path / "budgets" / "knorm.json"
    before = (folder / "scorer.json").read_text()
    budget = calibrate(str(folder), method="knorm", out=str(out), exponents=[1.0], floors=[0.5], context=96,
                       continuation=16)
    assert (folder / "scorer.json").read_text() == before  # the scorer's own budget is untouched
    record = json.loads(out.read_text())
    assert record["method"] == "knorm" and len(budget.sensitivity) == 2
    assert any(value != 0 for value in budget.sensitivity)  # compressing one layer moves the continuation
    assert set(record["calibration"]["ppl_increase_pct_by_exponent_floor"]) == {"0,1", "1,0.5"}
    assert load_rule_budgets(f"knorm={out}") == {"knorm": budget}
    with pytest.raises(CurKVError, match="holds the budget of 'knorm', not 'snapkv'"):
        load_rule_budgets(f"snapkv={out}")


def test_bad_rule_budget_entries_are_one_line(folder, tmp_path):
    with pytest.raises(CurKVError, match="RULE=FILE"):
        load_rule_budgets("pyramid=x.json")
    with pytest.raises(CurKVError, match="cannot read the layer budget"):
        load_rule_budgets(f"snapkv={tmp_path / 'missing.json'}")
    with pytest.raises(CurKVError, match="pass --out FILE"):
        calibrate(str(folder), method="snapkv")
    with pytest.raises(CurKVError, match="unknown rule 'pyramid'"):
        calibrate(str(folder), method="pyramid", out=str(tmp_path / "p.json"), context=96, continuation=16)
