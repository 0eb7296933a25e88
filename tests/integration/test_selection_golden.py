"""Every shipped scorer keeps, on one held-out prefill, exactly the tokens recorded in tests/golden/selections.json."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from golden.replay import selections

GOLDEN = json.loads((Path(__file__).resolve().parents[1] / "golden" / "selections.json").read_text())
CHECKPOINTS = Path(__file__).resolve().parents[2] / "checkpoints"

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def smollm2():
    from curkv_train.models.base import load_base_model

    return load_base_model(GOLDEN["base"], attn_implementation="sdpa")


@pytest.mark.parametrize("name", sorted(GOLDEN["scorers"]))
def test_a_shipped_scorer_keeps_the_recorded_tokens(smollm2, name):
    if not (CHECKPOINTS / name / "scorer.json").is_file():
        pytest.skip(f"{name} is no longer shipped")
    kept = selections(smollm2, CHECKPOINTS / name, torch.tensor([GOLDEN["ids"]]), GOLDEN["keep_ratio"])
    expected = GOLDEN["scorers"][name]
    for path in ("cache", "press"):
        changed = [layer for layer, (a, b) in enumerate(zip(kept[path], expected[path])) if a != b]
        assert not changed, f"{name}: {path} keeps other tokens in layers {changed}"
