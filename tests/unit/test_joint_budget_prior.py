"""A calibrated layer budget as the joint allocation's prior (TierConfig.budget_prior): the floors it sets, the
layer shares a cache ends with, the memory it leaves unchanged, and its refusals."""

import dataclasses

import pytest
import torch

from curkv_train.core.errors import CurKVError
from curkv_train.core.selection import joint_floor_count, joint_keep_mask, kept_count, prior_floor_counts
from curkv_train.runtime import CurKVCache, LayerBudget, TierConfig
from runtime_helpers import TORCH, prompt, random_scorer

WINDOW, N_SINK = 16, 4
BUDGET = LayerBudget((1.0, 30.0))  # layer 1 thirty times as sensitive: it gets most of the memory

pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.fixture(scope="module")
def scorer():
    return dataclasses.replace(random_scorer(n_sink=N_SINK, window=WINDOW), allocation="joint", layer_budget=BUDGET)


@pytest.mark.parametrize("prior", [0.0, 0.3, 0.7, 1.0])
@pytest.mark.parametrize("keep_ratio", [0.15, 0.5, 0.85])
def test_the_prior_floors_never_ask_for_more_than_the_joint_total(prior, keep_ratio):
    n, heads, layers = 97, 3, 8
    ratios = LayerBudget(tuple(float(value) for value in torch.rand(layers) * 5)).ratios(keep_ratio)
    floors = prior_floor_counts(n, keep_ratio, 0.1, ratios, prior)
    assert heads * sum(floors) <= kept_count(layers * heads * n, keep_ratio)
    if prior == 1.0:  # the budget's own split, to a token per head
        assert all(abs(floor - ratio * n) < 1 for floor, ratio in zip(floors, ratios))


def test_every_head_keeps_its_layers_floor_and_the_total_is_exact():
    torch.manual_seed(0)
    scores = torch.randn(4, 2, 3, 50) + torch.tensor([3.0, 0.0, -3.0, 0.0]).view(4, 1, 1, 1)
    floors = [2, 5, 20, 0]
    mask = joint_keep_mask(scores, 0.4, 0.1, floors)
    per_head = mask.sum(dim=-1)
    assert torch.equal(mask.sum(dim=(0, 2, 3)), torch.full((2,), float(kept_count(4 * 3 * 50, 0.4))))
    assert all(bool((per_head[layer] >= floor).all()) for layer, floor in enumerate(floors))
    assert per_head[2].min() == 20  # layer 2 scores lowest: it holds its floor and no more
    # without the floors layer 2 is all but emptied: the floors are what kept it
    assert joint_keep_mask(scores, 0.4, 0.0)[2].sum() < 3 * 20


def test_equal_layer_floors_choose_what_the_head_floor_chooses():
    scores = torch.randn(3, 1, 2, 40)
    floor = joint_floor_count(40, 6, 0.3, 0.5)
    assert torch.equal(joint_keep_mask(scores, 0.3, 0.5, [floor] * 3), joint_keep_mask(scores, 0.3, 0.5))


def layer_totals(cache: CurKVCache) -> list[int]:
    return [int(layer.held_lengths().sum()) for layer in cache.layers]


def test_every_layer_keeps_its_share_of_the_budget_and_the_total_is_unchanged(model, scorer):
    ids = prompt(600)
    protected = N_SINK + 2 * WINDOW  # sinks and a hot tier of 2 windows, per head (no recent share)
    competing = 600 - protected
    kept = {}  # prior -> per layer, competing tokens kept per head (mean over the 2 heads)
    for prior in (0.0, 0.5, 1.0):
        cache = CurKVCache(scorer, model, keep_ratio=0.5, tiers=TierConfig(budget_prior=prior, recent_share=0.0),
                           compute=TORCH)
        with torch.no_grad():
            model(ids, past_key_values=cache)
        kept[prior] = [float(layer.held_lengths().float().mean()) - protected for layer in cache.layers]
        lowest = [int(layer.held_lengths().min()) - protected for layer in cache.layers]
        split = [ratio * competing for ratio in BUDGET.ratios(sum(kept[prior]) / 2 / competing)]
        assert all(least >= prior * want - 1 for least, want in zip(lowest, split))  # every head keeps its floor
        if prior == 1.0:  # the budget's split, to the floors' rounding
            assert all(abs(held - want) <= 2 for held, want in zip(kept[prior], split))
    assert len({sum(each) for each in kept.values()}) == 1  # the same memory whatever the prior
    assert kept[0.0][1] < kept[1.0][1] - 50  # the scores alone give the sensitive layer far less than the budget


def test_a_prior_without_a_budget_is_refused(model, scorer):
    with pytest.raises(CurKVError, match="budget_prior needs a layer budget"):
        CurKVCache(scorer, model, keep_ratio=0.5, layer_budget="uniform", tiers=TierConfig(budget_prior=0.5))
    unbudgeted = dataclasses.replace(scorer, layer_budget=None)
    with pytest.raises(CurKVError, match="budget_prior needs a layer budget"):
        CurKVCache(unbudgeted, model, keep_ratio=0.5, tiers=TierConfig(budget_prior=0.5))


def test_a_prior_of_another_layer_count_is_refused(model, scorer):
    with pytest.raises(CurKVError, match="covers 3 layers, the model has 2"):
        CurKVCache(scorer, model, keep_ratio=0.5, layer_budget=LayerBudget((1.0, 2.0, 3.0)),
                   tiers=TierConfig(budget_prior=0.5))


def test_a_prior_under_the_per_head_allocation_is_refused(model, scorer):
    with pytest.raises(CurKVError, match="budget_prior weighs a layer budget into the joint allocation"):
        TierConfig(allocation="per_head", budget_prior=0.5)
    per_head = dataclasses.replace(scorer, allocation="per_head")
    with pytest.raises(CurKVError, match="budget_prior weighs a layer budget into the joint allocation"):
        CurKVCache(per_head, model, keep_ratio=0.5, tiers=TierConfig(budget_prior=0.5))


@pytest.mark.parametrize("prior", [-0.1, 1.5, "0.5", True])
def test_a_prior_weight_outside_zero_one_is_refused(prior):
    with pytest.raises(CurKVError, match="budget_prior must be in"):
        TierConfig(budget_prior=prior)
