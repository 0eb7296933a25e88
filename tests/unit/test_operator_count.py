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
PINNED = {("per_head", 0): 147, ("per_head", None): 99, ("joint", 0): 163, ("joint", None): 108}
DEEP = 30  # SmolLM2's depth: a prefill's scoring pass is shared by this many layers


def shipped_family_scorer(num_layers: int = 2):
    return family_scorer("query_aware", features=["expected_attention", "value_norm"], num_layers=num_layers)


@pytest.mark.parametrize("allocation, batch_tokens", sorted(PINNED, key=str))
def test_the_operators_a_cache_adds_per_layer_stay_pinned(model, allocation, batch_tokens):
    tiers = TierConfig(allocation=allocation) if batch_tokens is None else TierConfig(
        allocation=allocation, scoring_batch_tokens=batch_tokens)
    scorer = shipped_family_scorer()
    added = added_per_layer(model, lambda: CurKVCache(scorer, model, keep_ratio=0.5, tiers=tiers, compute=TORCH),
                            CONTEXT)
    assert 0 < added["operators_per_layer"] <= PINNED[allocation, batch_tokens], added


def test_a_deep_model_under_the_joint_allocation_adds_at_most_30_operators_per_layer():
    """The issue's target on a model as deep as SmolLM2: under joint, a prefill scores every layer in one pass and
    packs them together, so what each layer adds is its own recording and gather (29.6 on SmolLM2 at 1K and 4K)."""
    from transformers import AutoModelForCausalLM

    from curkv_train.models.base import TINY_RANDOM
    from curkv_train.models.configs import load_model_config

    config = load_model_config(TINY_RANDOM)
    config.num_hidden_layers = DEEP
    torch.manual_seed(0)
    deep = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()
    scorer = shipped_family_scorer(DEEP)
    added = added_per_layer(deep, lambda: CurKVCache(scorer, deep, keep_ratio=0.5, compute=TORCH,
                                                     tiers=TierConfig(allocation="joint")), 1024)
    assert 0 < added["operators_per_layer"] <= 30, added


def test_the_counter_sees_every_operator():
    """Negative control: one more operator in the counted code is one more count."""
    x = torch.ones(4)
    with OperatorCounter() as once:
        x.add(1)
    with OperatorCounter() as twice:
        x.add(1).mul(2)
    assert twice.total == once.total + 1 and once.counts["add"] == 1
