"""CurKVPress inside kvpress: the pipeline runs, kvpress's kept count holds, sinks and window survive."""

import pytest
import torch
from transformers import DynamicCache, pipeline

from curkv_train.models.base import TINY_RANDOM, load_tokenizer
from curkv_train.runtime import Scorer

kvpress = pytest.importorskip("kvpress")
from kvpress.utils import compute_n_kept  # noqa: E402

from curkv_train.runtime import CurKVPress  # noqa: E402
from runtime_helpers import random_scorer

N_SINK, WINDOW = 4, 16


pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.fixture(scope="module")
def scorer():
    # high scores everywhere: protection must come from the press itself
    return random_scorer(n_sink=N_SINK, window=WINDOW, bias=5.0)


def test_runs_in_kvpress_pipeline_with_promised_kept_count(model, scorer):
    pipe = pipeline("kv-press-text-generation", model=model, tokenizer=load_tokenizer(TINY_RANDOM), device="cpu")
    context = "The passkey is 7421. " * 20
    cache = DynamicCache()
    press = CurKVPress(scorer=scorer, compression_ratio=0.6)
    result = pipe(context, question="What is the passkey?", press=press, cache=cache, max_new_tokens=4)
    assert isinstance(result["answer"], str)
    context_tokens = len(pipe.preprocess(context, [""], "", 10**9)["context_ids"][0])
    for layer in cache.layers:
        assert layer.keys.shape[2] == compute_n_kept(context_tokens, 0.6)


def test_sinks_and_window_are_kept(model, scorer):
    ids = torch.randint(3, 512, (1, 120), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        full = DynamicCache()
        model(ids, past_key_values=full)
        press, cache = CurKVPress(scorer=scorer, compression_ratio=0.7), DynamicCache()
        with press(model):
            model(ids, past_key_values=cache)
    kept = compute_n_kept(120, 0.7)
    for full_layer, layer in zip(full.layers, cache.layers):
        assert layer.keys.shape == (1, 2, kept, 16)
        for head in range(2):
            held = layer.keys[0, head]
            for position in list(range(N_SINK)) + list(range(120 - WINDOW, 120)):
                assert (held == full_layer.keys[0, head, position]).all(dim=-1).any(), position


def test_scores_lift_protected_tokens(model, scorer):
    press = CurKVPress(scorer=scorer, compression_ratio=0.5)
    press.post_init_from_model(model)
    keys, values = torch.randn(1, 2, 50, 16), torch.randn(1, 2, 50, 16)
    module = model.model.layers[1].self_attn
    scores = press.score(module, torch.zeros(1, 50, 64), keys, values, None, {})
    assert scores.shape == (1, 2, 50)
    protected = torch.zeros(50, dtype=torch.bool)
    protected[:N_SINK] = protected[-WINDOW:] = True
    assert scores[..., protected].min() > scores[..., ~protected].max()
    raw = scorer.score_layer(model, 1, keys, values)
    torch.testing.assert_close(scores[..., ~protected], raw[..., ~protected])


def test_press_loads_a_scorer_folder_checked_against_the_model(model, scorer, tmp_path):
    from curkv_train.runtime import model_fingerprint, save_scorer

    folder = save_scorer(scorer, tmp_path / "scorer", base_model=TINY_RANDOM, fingerprint=model_fingerprint(model.config))
    press, cache = CurKVPress(scorer=str(folder), compression_ratio=0.5), DynamicCache()
    with torch.no_grad(), press(model):
        model(torch.randint(3, 512, (1, 60)), past_key_values=cache)
    assert isinstance(press.scorer, Scorer) and cache.layers[0].keys.shape[2] == compute_n_kept(60, 0.5)


def test_press_without_scorer_is_a_user_error():
    from curkv_train.core.errors import CurKVError

    with pytest.raises(CurKVError, match="needs a scorer"):
        CurKVPress(compression_ratio=0.5)


def test_a_layer_budget_gives_each_layer_its_ratio_and_generation_runs(scorer):
    """Layers keep int(n·ρ_l), the ρ_l averaging to the press's keep ratio, and greedy generation after the
    press runs (the mask, built for layer 0, fitted to the others); ``layer_budget="uniform"`` ignores it."""
    import copy

    from curkv_train.core.errors import CurKVError
    from curkv_train.models.base import load_base_model
    from curkv_train.runtime.allocation import LayerBudget

    model = load_base_model(TINY_RANDOM)
    budgeted = copy.deepcopy(scorer)
    budgeted.layer_budget = LayerBudget((0.1, 4.0), 1.0)
    ids = torch.randint(3, 512, (1, 120), generator=torch.Generator().manual_seed(0))
    ratios = budgeted.layer_budget.ratios(0.5)
    lengths = {}
    for mode in ("scorer", "uniform"):
        press, cache = CurKVPress(scorer=budgeted, compression_ratio=0.5, layer_budget=mode), DynamicCache()
        with torch.no_grad(), press(model):
            model(ids, past_key_values=cache)
        lengths[mode] = [layer.keys.shape[2] for layer in cache.layers]
        step = model(torch.tensor([[7, 8, 9]]), past_key_values=cache,
                     position_ids=torch.arange(120, 123)[None]).logits
        assert torch.isfinite(step).all()
    assert lengths["scorer"] == [int(120 * ratio) for ratio in ratios] and lengths["scorer"][0] < 60 < lengths["scorer"][1]
    assert lengths["uniform"] == [compute_n_kept(120, 0.5)] * 2
    with pytest.raises(CurKVError, match="layer_budget must be"):
        CurKVPress(scorer=budgeted, compression_ratio=0.5, layer_budget="pyramid")


def test_decoding_press_over_curkv_press_is_refused(model, scorer):
    """kvpress's DecodingPress hands its base press the hidden states of the last steps only, and a cache whose
    tokens are not at positions 0..n-1 once it has compressed: CurKVPress would score them as a fresh prefill."""
    from kvpress import DecodingPress

    from curkv_train.core.errors import CurKVError

    press = DecodingPress(base_press=CurKVPress(scorer=scorer), compression_interval=4, target_size=40)
    ids = torch.randint(3, 512, (1, 60), generator=torch.Generator().manual_seed(0))
    cache = DynamicCache()
    with torch.no_grad(), press(model), pytest.raises(CurKVError, match="DecodingPress"):
        model(ids, past_key_values=cache)
        for _ in range(4):
            model(torch.tensor([[5]]), past_key_values=cache)
