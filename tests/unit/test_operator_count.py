"""The operators a CurKVCache prefill adds per layer (benchmarks/operator_count.py) cannot silently grow.

On a GPU each aten operator is a launch, so scoring's cost there follows this count. The pins are
today's counts for the shipped scorer's family and features on the tiny Llama: lower them when
scoring takes fewer operators; never raise them without saying why in the commit.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from curkv_train.runtime import CurKVCache, TierConfig
from runtime_helpers import TORCH, family_scorer

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from operator_count import OperatorCounter, added_per_layer  # noqa: E402

CONTEXT = 256
# (allocation, scoring_batch_tokens) -> most operators a layer may add: 0 scores each layer alone (a long prefill),
# the default groups both tiny layers (a short one); joint adds the ragged storage and the choice over both layers
PINNED = {("per_head", 0): 158, ("per_head", None): 110, ("joint", 0): 191, ("joint", None): 136}


def shipped_family_scorer():
    return family_scorer("query_aware", features=["expected_attention", "value_norm"])


@pytest.mark.parametrize("allocation, batch_tokens", sorted(PINNED, key=str))
def test_the_operators_a_cache_adds_per_layer_stay_pinned(model, allocation, batch_tokens):
    tiers = TierConfig(allocation=allocation) if batch_tokens is None else TierConfig(
        allocation=allocation, scoring_batch_tokens=batch_tokens)
    scorer = shipped_family_scorer()
    added = added_per_layer(model, lambda: CurKVCache(scorer, model, keep_ratio=0.5, tiers=tiers, compute=TORCH),
                            CONTEXT)
    assert 0 < added["operators_per_layer"] <= PINNED[allocation, batch_tokens], added


def test_the_counter_sees_every_operator():
    """Negative control: one more operator in the counted code is one more count."""
    x = torch.ones(4)
    with OperatorCounter() as once:
        x.add(1)
    with OperatorCounter() as twice:
        x.add(1).mul(2)
    assert twice.total == once.total + 1 and once.counts["add"] == 1
