"""Layer budgets: the split of a keep ratio across layers, and CurKVCache holding it exactly."""

import json

import pytest
import torch

from curkv_train.core.selection import share_of_compressible
from curkv_train.core.errors import CurKVError
from curkv_train.models.base import TINY_RANDOM, load_base_model
from curkv_train.runtime import CurKVCache
from curkv_train.runtime.allocation import LayerBudget
from curkv_train.runtime.serialization import load_scorer, save_scorer
from runtime_helpers import random_scorer

pytestmark = pytest.mark.usefixtures("single_thread")
WINDOW = 16


@pytest.mark.parametrize("ratio", [0.2, 0.5, 0.7])
@pytest.mark.parametrize("exponent", [0.5, 1.0, 3.0])
def test_ratios_average_to_the_mean_and_follow_sensitivity(ratio, exponent):
    sensitivity = (0.2, 3.0, 0.0, 1.0, 0.5)
    ratios = LayerBudget(sensitivity, exponent, floor=0.4).ratios(ratio)
    assert sum(ratios) / len(ratios) == pytest.approx(ratio, abs=1e-6)
    assert min(ratios) >= 0.4 * ratio - 1e-9 and max(ratios) <= 1.0
    order = sorted(range(5), key=lambda layer: sensitivity[layer])
    assert [ratios[layer] for layer in order] == sorted(ratios)  # more sensitive, more kept
    assert ratios[1] > ratio > ratios[2]


def test_exponent_zero_and_no_compression_are_uniform():
    assert LayerBudget((0.1, 5.0), 0.0).ratios(0.5) == (0.5, 0.5)
    assert LayerBudget((0.1, 5.0), 1.0).ratios(1.0) == (1.0, 1.0)


def test_exponent_zero_keeps_the_uniform_count_and_a_token_cap():
    """Every layer of an exponent-0 budget keeps what one ratio keeps, to the token, and no more than a token
    budget's cap (a ratio rounded up, 62/256 to 0.242188, kept a 63rd token)."""
    from curkv_train.runtime.tiers import TierSettings

    def settings(budget: LayerBudget | None, max_tokens: int | None = None) -> TierSettings:
        return TierSettings(0.5, 4, 64, 128, 0, False, 64, 16, 16, "optimal", False, 0.0, max_tokens, "torch", 0.5,
                            128, budget)

    flat = LayerBudget((0.1, 5.0), 0.0)
    for seen in range(200, 3000, 7):
        compressible = seen - 4 - 128
        assert settings(flat).target(compressible, seen, 1) == settings(None).target(compressible, seen, 1)
    capped = settings(flat, max_tokens=70 + 4 + 128 + 127)
    assert max(capped.target(compressible, compressible + 132, 0) for compressible in range(100, 3000)) == 70


def test_larger_exponents_concentrate_the_memory():
    mild, steep = (LayerBudget((0.1, 1.0, 4.0), exponent).ratios(0.5) for exponent in (0.5, 2.0))
    assert steep[2] > mild[2] and steep[0] <= mild[0] and steep[1] < mild[1]


def test_record_round_trip_and_bad_budgets():
    budget = LayerBudget((0.5, 1.5), 2.0, 0.3)
    assert LayerBudget.from_record(json.loads(json.dumps({**budget.record(), "calibration": {}}))) == budget
    with pytest.raises(CurKVError, match="one sensitivity per decoder layer"):
        LayerBudget(())
    with pytest.raises(CurKVError, match="exponent >= 0"):
        LayerBudget((1.0,), -1.0)
    with pytest.raises(CurKVError, match="exponent >= 0"):
        LayerBudget((1.0,), float("nan"))
    for bad in (float("nan"), float("inf")):  # a NaN weight would make every layer's ratio NaN
        with pytest.raises(CurKVError, match=r"sensitivities must be finite .*got \[" + repr(bad)):
            LayerBudget((1.0, bad))
    # a layer whose measured loss did not move, or fell (calibration noise), evicts the most
    ratios = LayerBudget((0.0, -0.05, 1.0)).ratios(0.5)
    assert ratios[0] == ratios[1] and ratios == pytest.approx((0.25, 0.25, 1.0), abs=1e-3)


@pytest.fixture(scope="module", params=["sdpa", "eager"])
def model(request):
    return load_base_model(TINY_RANDOM, attn_implementation=request.param)


def ids(length: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, 512, (1, length), generator=torch.Generator().manual_seed(seed))


def budget_cache(model, sensitivity=(0.1, 4.0)) -> CurKVCache:
    return CurKVCache(random_scorer(window=WINDOW), model=model, keep_ratio=0.5,
                      layer_budget=LayerBudget(sensitivity, 1.0, 0.4))


@torch.no_grad()
def test_layers_hold_their_share_and_chunks_match_single_tokens(model):
    """Layers hold different counts; a chunk (4D mask built for layer 0, fitted per layer) gives the logits
    the same tokens give one at a time (no mask)."""
    prompt, tail = ids(200), ids(8, seed=1)
    chunked, stepped = budget_cache(model), budget_cache(model)
    model(prompt, past_key_values=chunked)
    model(prompt, past_key_values=stepped)
    sizes = chunked.tier_sizes(0), chunked.tier_sizes(1)
    assert sizes[0]["warm"] < sizes[1]["warm"]
    compressible = 200 - chunked.settings.n_sink - chunked.settings.hot_tokens
    ratios = chunked.settings.layer_budget.ratios(share_of_compressible(compressible, 200 - compressible, 0.5))
    for layer in range(2):
        assert chunked.tier_sizes(layer)["warm"] == chunked.settings.target(compressible, 200, layer)
        assert chunked.settings.target(compressible, 200, layer) == pytest.approx(ratios[layer] * compressible, abs=1)
    whole = model(tail, past_key_values=chunked).logits
    single = torch.cat([model(tail[:, index : index + 1], past_key_values=stepped).logits for index in range(8)], 1)
    torch.testing.assert_close(whole, single, atol=1e-4, rtol=1e-4)


@torch.no_grad()
def test_mean_held_tokens_match_a_uniform_cache(model):
    uniform = CurKVCache(random_scorer(window=WINDOW), model=model, keep_ratio=0.5, layer_budget="uniform")
    budgeted = budget_cache(model)
    for cache in (uniform, budgeted):
        model(ids(400), past_key_values=cache)
    held = [sum(cache.held_tokens(layer) for layer in range(2)) for cache in (uniform, budgeted)]
    assert abs(held[0] - held[1]) <= 2  # ceil per layer


def test_scorer_folder_carries_the_budget_and_bad_ones_are_refused(model, tmp_path):
    scorer = random_scorer(window=WINDOW)
    scorer.layer_budget = LayerBudget((0.3, 2.0), 1.0)
    folder = save_scorer(scorer, tmp_path / "scorer", base_model=TINY_RANDOM)
    loaded = load_scorer(folder, model=model)
    assert loaded.layer_budget == scorer.layer_budget
    assert CurKVCache(loaded, model=model, keep_ratio=0.5).settings.layer_budget == scorer.layer_budget
    assert CurKVCache(loaded, model=model, keep_ratio=0.5, layer_budget="uniform").settings.layer_budget is None
    with pytest.raises(CurKVError, match="layer_budget must be"):
        CurKVCache(loaded, model=model, layer_budget="pyramid")
    with pytest.raises(CurKVError, match="covers 3 layers"):
        CurKVCache(loaded, model=model, layer_budget=LayerBudget((1.0, 1.0, 1.0)))
    record = json.loads((folder / "scorer.json").read_text())
    record["layer_budget"] = {"exponent": 1.0}
    (folder / "scorer.json").write_text(json.dumps(record))
    with pytest.raises(CurKVError, match="malformed layer_budget"):
        load_scorer(folder)
