"""Estimator families: one feature function gives the same scores in training capture, CurKVCache and
CurKVPress; a query-aware scorer starts out ranking like its training-free rule; bad input is refused."""

import dataclasses

import pytest
import torch

from curkv_train.training.scored_attention import patch_model
from curkv_train.core.observation import Observation, QueryStatistics
from curkv_train.core.rope import KEY_VIEWS
from curkv_train.core.selection import compressible_mask
from curkv_train.core.shapes import kv_shape
from curkv_train.core.errors import CurKVError
from curkv_train.models.base import TINY_RANDOM, load_base_model
from curkv_train.training.capture import estimator_inputs, prefill_context
from curkv_train.models.seed_estimator import ValueEstimator, position_features
from curkv_train.models.families import FAMILIES, build_estimator
from curkv_train.runtime import ComputeConfig, CurKVCache, Scorer
from curkv_train.runtime.layer import CurKVLayer
from runtime_helpers import family_scorer

CONTEXT = 120


pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.fixture(scope="module")
def ids():
    return torch.randint(0, 259, (1, CONTEXT), generator=torch.Generator().manual_seed(5))


def training_logits(scorer, ids):
    """What the training step computes: prefill capture -> estimator_inputs -> estimator."""
    base = patch_model(load_base_model(TINY_RANDOM))
    estimator = scorer.estimator
    capture = prefill_context(base, ids, record_hidden=bool(estimator.needs))
    with torch.no_grad():
        return estimator(estimator_inputs(base, estimator, capture, scorer.key_view))


def cache_logits(scorer, model, ids, **options):
    """What CurKVCache (``options``: its ComputeConfig's keywords) scores at its first compression, right after the
    prefill (one layer at a time, or a group of layers at a time)."""
    cache = CurKVCache(scorer, model=model, keep_ratio=0.5, compute=ComputeConfig(backend="torch", **options))
    seen = {}
    original = cache._score

    def spy(layer, *args, **kwargs):
        seen[layer] = original(layer, *args, **kwargs)
        return seen[layer]

    def batched_spy(layers):  # a prefill's first compressions, scored a group of layers at a time
        logits = batched(layers)
        seen.update({layer.layer_idx: each for layer, each in zip(layers, logits)})
        return logits

    batched = cache._score_layers
    cache._score_layers = batched_spy
    for layer in cache.layers:
        layer.score_fn = spy
    with torch.no_grad():
        model(ids, past_key_values=cache)
    return torch.stack([seen[layer] for layer in sorted(seen)])


def press_logits(scorer, model, ids, **options):
    """What CurKVPress (``options`` its keywords) gives each layer during a kvpress prefill (protection lifted
    back off)."""
    pytest.importorskip("kvpress")
    from curkv_train.runtime import CurKVPress
    from curkv_train.runtime.press import PROTECTED_SCORE

    press = CurKVPress(scorer=scorer, compression_ratio=0.5, n_sink=0, window=0, **options)
    seen = {}
    original = press.score

    def spy(module, *args):
        seen[module.layer_idx] = original(module, *args)
        return seen[module.layer_idx]

    press.score = spy
    with torch.no_grad(), press(model):
        model(ids)
    assert PROTECTED_SCORE > 0
    return torch.stack([seen[layer] for layer in sorted(seen)])


@pytest.mark.parametrize("key_view", KEY_VIEWS)
@pytest.mark.parametrize("family", FAMILIES)
def test_training_cache_and_press_score_a_prefill_alike(model, ids, family, key_view):
    scorer = family_scorer(family, key_view)
    trained = training_logits(scorer, ids)
    cached = cache_logits(scorer, model, ids)
    pressed = press_logits(scorer, model, ids)
    assert trained.shape == cached.shape == pressed.shape == (2, 1, 2, CONTEXT)
    assert trained.std() > 0.1  # not a constant score
    torch.testing.assert_close(cached, trained, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(pressed, trained, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("family", FAMILIES)
def test_keep_one_generation_is_unchanged(model, ids, family):
    scorer = family_scorer(family)
    with torch.no_grad():
        plain = model.generate(ids, max_new_tokens=24, do_sample=False)
        cached = model.generate(ids, past_key_values=CurKVCache(scorer, model=model, keep_ratio=1.0),
                                max_new_tokens=24, do_sample=False)
    assert torch.equal(plain, cached)


def test_untrained_query_aware_ranks_like_expected_attention(model, ids):
    """Before training, z = log expected attention + log ||v|| (centred): the ExpectedAttention baseline's
    order (kvpress's ExpectedAttentionPress: statistics of every query but the sinks', the value norm) on every
    non-sink token."""
    shape = kv_shape(model.config)
    estimator = build_estimator("query_aware", shape, future_positions=64, statistics_skip=4)
    base = patch_model(load_base_model(TINY_RANDOM))
    capture = prefill_context(base, ids, record_hidden=True)
    with torch.no_grad():
        logits = estimator(estimator_inputs(base, estimator, capture, "pre_rope"))
    rule = pytest.importorskip("kvpress").ExpectedAttentionPress(n_future_positions=64, n_sink=4)
    for layer in range(shape.num_layers):
        module = base.get_decoder().layers[layer].self_attn
        module.rotary_emb = base.get_decoder().rotary_emb  # what kvpress's ``with press(model)`` sets
        scores = rule.score(module, capture.hidden[layer], capture.cached_keys(layer), capture.values[layer], None, {})
        assert torch.equal(logits[layer][..., 4:].argsort(dim=-1), scores[..., 4:].argsort(dim=-1))


def test_query_aware_cache_without_observations_is_an_error(model):
    scorer = family_scorer("query_aware")
    cache = CurKVCache(scorer, model=model, keep_ratio=0.5, compute=ComputeConfig(backend="torch"))
    keys = torch.randn(1, 2, 200, 16)
    with pytest.raises(CurKVError, match="observation window"):
        cache.update(keys, keys, 0)


def test_hidden_cache_without_hidden_states_is_an_error(model):
    scorer = family_scorer("hidden")
    cache = CurKVCache(scorer, model=model, keep_ratio=0.5, compute=ComputeConfig(backend="torch"))
    keys = torch.randn(1, 2, 10, 16)
    with pytest.raises(CurKVError, match="hidden states were not observed"):
        cache.update(keys, keys, 0)


def test_unknown_family_is_refused():
    with pytest.raises(CurKVError, match="unknown estimator family 'snapkv'"):
        build_estimator("snapkv", kv_shape(load_base_model(TINY_RANDOM).config))


def test_scorer_json_of_another_family_than_its_weights_is_refused(tmp_path, model):
    import json

    from curkv_train.runtime import load_scorer, save_scorer
    from curkv_train.runtime.serialization import CONFIG_FILE, file_sha256

    folder = save_scorer(family_scorer("seed"), tmp_path / "seed")
    record = json.loads((folder / CONFIG_FILE).read_text())
    record["estimator"]["family"] = "hidden"
    (folder / CONFIG_FILE).write_text(json.dumps(record))
    with pytest.raises(CurKVError, match="does not fit the estimator"):
        load_scorer(folder)
    record["estimator"]["family"] = "oracle"
    (folder / CONFIG_FILE).write_text(json.dumps(record))
    with pytest.raises(CurKVError, match="unknown estimator family 'oracle'"):
        load_scorer(folder)
    assert file_sha256(folder / "scorer.safetensors")


def test_family_round_trips_through_export(tmp_path):
    from curkv_train.runtime import load_scorer, save_scorer

    for family in FAMILIES:
        scorer = family_scorer(family)
        loaded = load_scorer(save_scorer(scorer, tmp_path / family))
        assert loaded.family == family and loaded.estimator.config() == scorer.estimator.config()
        for name, tensor in scorer.estimator.state_dict().items():
            assert torch.equal(loaded.estimator.state_dict()[name], tensor)


def test_observation_window_takes_the_last_tokens():
    observation = Observation(torch.arange(10.0).view(1, 1, 10, 1), torch.arange(5, 15), QueryStatistics())
    last = observation.last(3)
    assert last.queries.flatten().tolist() == [7.0, 8.0, 9.0] and last.positions.tolist() == [12, 13, 14]
    assert compressible_mask(10, 2, 3).sum() == 5


def test_cache_and_press_score_with_the_precision_they_are_given(model, ids):
    scorer = family_scorer("query_aware")
    medium = dataclasses.replace(scorer, matmul_precision="medium")
    highest = cache_logits(scorer, model, ids)
    cached = cache_logits(scorer, model, ids, scorer_precision="medium")
    assert torch.equal(cached, cache_logits(medium, model, ids))  # the cache's option is the scorer's setting
    assert not torch.equal(cached, highest)  # bfloat16 operands moved the logits...
    torch.testing.assert_close(cached, highest, atol=0.5, rtol=0.05)  # ...a little
    torch.testing.assert_close(press_logits(scorer, model, ids, scorer_precision="medium"), cached,
                               atol=1e-4, rtol=1e-4)


def test_unknown_scorer_precision_is_refused(model):
    scorer = family_scorer("query_aware")
    with pytest.raises(CurKVError, match="unknown matmul precision 'bf16'"):
        dataclasses.replace(scorer, matmul_precision="bf16")
    with pytest.raises(CurKVError, match="unknown matmul precision 'bf16'"):
        CurKVCache(scorer, model=model, compute=ComputeConfig(scorer_precision="bf16"))
    pytest.importorskip("kvpress")
    from curkv_train.runtime import CurKVPress

    with pytest.raises(CurKVError, match="unknown matmul precision 'bf16'"):
        CurKVPress(scorer=scorer, compression_ratio=0.5, scorer_precision="bf16")


LEAN = ["expected_attention", "value_norm"]


def test_a_scorer_of_fewer_query_features_scores_alike_everywhere_and_keeps_them_through_export(model, ids,
                                                                                               tmp_path):
    from curkv_train.runtime import load_scorer, save_scorer

    scorer = family_scorer("query_aware", features=LEAN)
    assert scorer.estimator.feature_weight.shape[-1] == 2
    trained = training_logits(scorer, ids)
    torch.testing.assert_close(cache_logits(scorer, model, ids), trained, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(press_logits(scorer, model, ids), trained, atol=1e-4, rtol=1e-4)
    loaded = load_scorer(save_scorer(scorer, tmp_path / "lean"))
    assert loaded.estimator.features == tuple(LEAN) and loaded.estimator.config()["features"] == LEAN


def test_a_scorer_json_without_features_loads_with_all_four(tmp_path):
    import json

    from curkv_train.core.features import QUERY_FEATURES
    from curkv_train.runtime import load_scorer, save_scorer
    from curkv_train.runtime.serialization import CONFIG_FILE

    folder = save_scorer(family_scorer("query_aware"), tmp_path / "old")
    record = json.loads((folder / CONFIG_FILE).read_text())
    del record["estimator"]["config"]["features"]  # as scorers exported before the option recorded it
    (folder / CONFIG_FILE).write_text(json.dumps(record))
    assert load_scorer(folder).estimator.features == QUERY_FEATURES


@pytest.mark.parametrize(("features", "message"), [
    (["window_attention", "key_norm"], "unknown query features \\['key_norm'\\]"),
    ([], "unknown query features none given"),
    (["value_norm", "expected_attention"], "must be distinct and in the order"),
    (["window_attention", "value_norm"], "init_rule 'expected_attention' weighs the query features "
                                         "\\['expected_attention'\\]"),
])
def test_bad_feature_lists_are_refused_with_one_line(features, message):
    with pytest.raises(CurKVError, match=message):
        build_estimator("query_aware", kv_shape(load_base_model(TINY_RANDOM).config), features=features)


def test_the_estimators_position_table_gives_each_positions_features_for_every_end():
    """The seed terms gather position features from a table kept for the last end asked: a new end must replace it
    (the features measure distances to the end), for shared and for per-head positions."""
    estimator = ValueEstimator(num_layers=2, num_kv_heads=2, head_dim=16)
    for end, positions in [(50, torch.arange(50)), (80, torch.randint(0, 80, (1, 2, 33))), (50, torch.arange(7, 50))]:
        torch.testing.assert_close(estimator.position_features(positions, end),
                                   position_features(positions, end, estimator.max_positions), rtol=0, atol=0)


@pytest.mark.parametrize("key_view", KEY_VIEWS)
@pytest.mark.parametrize("family", FAMILIES)
def test_shared_positions_score_as_each_heads_own_copy_of_them(model, family, key_view):
    """Before its first eviction the cache hands the scorer one (tokens,) row of positions for every head
    instead of its (batch, kv_heads, tokens) tensor: the logits must not change."""
    scorer = family_scorer(family, key_view)
    generator = torch.Generator().manual_seed(2)
    keys, values = (torch.randn(1, 2, 90, 16, generator=generator) for _ in range(2))
    extra = scorer.prefill_inputs(model, 1, torch.randn(1, 90, model.config.hidden_size, generator=generator))
    shared = scorer.score_layer(model, 1, keys, values, torch.arange(90), end=90, **extra)
    per_head = scorer.score_layer(model, 1, keys, values, torch.arange(90).expand(1, 2, 90).clone(), end=90, **extra)
    torch.testing.assert_close(shared, per_head, rtol=0, atol=1e-6)


@pytest.mark.parametrize("key_view", KEY_VIEWS)
def test_a_prefill_scores_from_the_projected_keys_as_from_the_cached_ones(model, ids, key_view, monkeypatch):
    """A prefill's first compression hands the scorer the keys as the model projected them (the pre_rope view
    without turning the cached keys back); later compressions, which hold older tokens, do not. The logits are
    those of the cached keys turned back, up to rounding, for every key view."""
    scorer = family_scorer("query_aware", key_view)
    handed, original = [], Scorer.score_layer

    def spy(self, *args, projected_keys=None, **kwargs):
        handed.append(projected_keys is not None)
        return original(self, *args, projected_keys=projected_keys, **kwargs)

    monkeypatch.setattr(Scorer, "score_layer", spy)
    with_projected = cache_logits(scorer, model, ids)
    assert handed and all(handed)
    monkeypatch.setattr(CurKVLayer, "observe_keys", lambda self, keys: None)
    handed.clear()
    torch.testing.assert_close(cache_logits(scorer, model, ids), with_projected, rtol=0, atol=1e-5)
    assert handed and not any(handed)
    monkeypatch.undo()
    monkeypatch.setattr(Scorer, "score_layer", spy)
    handed.clear()
    cache = CurKVCache(scorer, model=model, keep_ratio=0.5, compute=ComputeConfig(backend="torch"))
    with torch.no_grad():
        model.generate(ids, past_key_values=cache, max_new_tokens=70, min_new_tokens=70, do_sample=False)
    assert handed[0] and not any(handed[model.config.num_hidden_layers:])  # the decode-time compressions
    assert len(handed) > model.config.num_hidden_layers
