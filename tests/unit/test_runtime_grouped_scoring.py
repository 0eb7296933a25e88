"""A prefill's first compressions scored a group of layers at a time (Scorer.score_layers, CurKVCache.update)."""

import pytest
import torch

from curkv_train.core.rope import KEY_VIEWS
from curkv_train.core.errors import CurKVError
from curkv_train.runtime import CurKVCache, TierConfig
from curkv_train.runtime.cache_config import JOINT_SCORING_BATCH_TOKENS, SCORING_BATCH_TOKENS
from runtime_helpers import TORCH, family_scorer

pytestmark = pytest.mark.usefixtures("single_thread")

LEAN = ["expected_attention", "value_norm"]  # no per-layer weights among the inputs: the layers batch
BATCHING = [("seed", {}), ("query_aware", {"features": LEAN}), ("hidden", {})]


def layer_inputs(scorer, model, layer: int, tokens: int, seed: int) -> dict:
    """Random prefill inputs of one layer, as score_layer takes them (its keys' pre-RoPE version included)."""
    from curkv_train.core.rope import rotary_tables, rotate

    generator = torch.Generator().manual_seed(seed)
    projected, values = (torch.randn(1, 2, tokens, 16, generator=generator) for _ in range(2))
    keys = rotate(projected, *rotary_tables(model, torch.arange(tokens), projected))
    hidden = torch.randn(1, tokens, model.config.hidden_size, generator=generator)
    return {"keys": keys, "values": values, "projected_keys": projected,
            **scorer.prefill_inputs(model, layer, hidden)}


@pytest.mark.parametrize("key_view", KEY_VIEWS)
@pytest.mark.parametrize("family, options", BATCHING)
def test_a_group_of_layers_scores_as_each_layer_alone(model, family, options, key_view):
    scorer = family_scorer(family, key_view, **options)
    assert scorer.batches_layers(torch.zeros(1))
    inputs = [layer_inputs(scorer, model, layer, 70, seed=layer) for layer in (0, 1)]
    grouped = scorer.score_layers(model, [0, 1], *(
        [each.get(name) for each in inputs]
        for name in ("keys", "values", "observation", "token_scores", "projected_keys")))
    for layer, (each, logits) in enumerate(zip(inputs, grouped)):
        torch.testing.assert_close(logits, scorer.score_layer(model, layer, **each), rtol=0, atol=1e-5)
        unprojected = {name: value for name, value in each.items() if name != "projected_keys"}
        torch.testing.assert_close(logits, scorer.score_layer(model, layer, **unprojected), rtol=0, atol=1e-5)


def test_a_scorer_reading_per_layer_weights_scores_layer_by_layer(model):
    scorer = family_scorer("query_aware")  # all four features: ‖W_O v‖ reads each layer's output projection
    assert not scorer.batches_layers(torch.zeros(1))
    inputs = [layer_inputs(scorer, model, layer, 70, seed=layer) for layer in (0, 1)]
    grouped = scorer.score_layers(model, [0, 1], *(
        [each.get(name) for each in inputs]
        for name in ("keys", "values", "observation", "token_scores", "projected_keys")))
    for layer, (each, logits) in enumerate(zip(inputs, grouped)):
        torch.testing.assert_close(logits, scorer.score_layer(model, layer, **each), rtol=0, atol=0)


def prefill(model, scorer, ids, **tiers) -> tuple[CurKVCache, list[int]]:
    """A CurKVCache (``tiers``: TierConfig's fields) after a prefill of ``ids``, and the sizes of the groups it scored
    together."""
    cache = CurKVCache(scorer, model=model, keep_ratio=0.5, tiers=TierConfig(**tiers), compute=TORCH)
    groups, batched = [], cache._score_layers

    def spy(layers):
        groups.append(len(layers))
        return batched(layers)

    cache._score_layers = spy
    with torch.no_grad():
        model(ids, past_key_values=cache)
    return cache, groups


@pytest.mark.parametrize("family, options", BATCHING)
def test_a_prefill_scored_in_groups_keeps_what_layer_by_layer_scoring_keeps(model, family, options):
    scorer = family_scorer(family, **options)
    ids = torch.randint(3, 512, (1, 150), generator=torch.Generator().manual_seed(3))
    grouped, groups = prefill(model, scorer, ids)
    alone, none = prefill(model, scorer, ids, scoring_batch_tokens=0)
    assert groups == [model.config.num_hidden_layers] and none == []
    assert not grouped.awaiting and not any(layer.awaiting_scores for layer in grouped.layers)
    for mine, reference in zip(grouped.layers, alone.layers):
        assert torch.equal(mine.positions, reference.positions)
        assert torch.equal(mine.keys, reference.keys) and torch.equal(mine.values, reference.values)
    _, small = prefill(model, scorer, ids, scoring_batch_tokens=150)  # one layer's worth: no group
    assert small == []


def test_a_prompt_fed_in_chunks_scored_in_groups_keeps_what_layer_by_layer_scoring_keeps(model):
    """The first compression may come with a chunk shorter than what the layers hold: the chunk's projected keys
    are not all the held keys' then, and the group turns the cached keys back."""
    scorer = family_scorer("query_aware", features=LEAN)
    ids = torch.randint(3, 512, (1, 112), generator=torch.Generator().manual_seed(4))
    caches = []
    for tokens in (4096, 0):
        cache = CurKVCache(scorer, model=model, keep_ratio=0.5, tiers=TierConfig(scoring_batch_tokens=tokens),
                           compute=TORCH)
        with torch.no_grad():
            for chunk in ids.split(16, dim=1):
                model(chunk, past_key_values=cache)
        caches.append(cache)
    for mine, reference in zip(*(cache.layers for cache in caches)):
        assert mine.compressible_seen and torch.equal(mine.positions, reference.positions)
        assert torch.equal(mine.keys, reference.keys)


def test_a_layer_left_waiting_by_a_pass_that_stopped_is_scored_before_the_next_one(model):
    scorer = family_scorer("query_aware", features=LEAN)
    cache = CurKVCache(scorer, model=model, keep_ratio=0.5, compute=TORCH)
    last = model.model.layers[-1].self_attn

    def stop(*args, **kwargs):
        raise RuntimeError("stopped")

    hook = last.register_forward_pre_hook(stop)
    ids = torch.randint(3, 512, (1, 150), generator=torch.Generator().manual_seed(3))
    with torch.no_grad(), pytest.raises(RuntimeError, match="stopped"):
        model(ids, past_key_values=cache)
    hook.remove()
    first = cache.layers[0]
    assert cache.awaiting == [first] and first.held_tokens == 150
    cache.update(torch.zeros(1, 2, 1, 16), torch.zeros(1, 2, 1, 16), 0)
    assert not cache.awaiting and not first.awaiting_scores and first.held_tokens == 75 + 1


@pytest.mark.parametrize("tokens", [-1, 2.5])
def test_a_bad_scoring_batch_is_refused(model, tokens):
    with pytest.raises(CurKVError, match="scoring_batch_tokens"):
        CurKVCache(family_scorer("seed"), model=model, tiers=TierConfig(scoring_batch_tokens=tokens))


def test_the_joint_allocation_scores_a_prefill_in_one_pass_by_default(model):
    """Under joint every layer waits for the last anyway: its default group holds 32 times the tokens, so a prompt
    whose layers per_head scores one at a time is scored in one pass, keeping what one-at-a-time scoring keeps."""
    scorer = family_scorer("query_aware", features=LEAN)
    assert CurKVCache(scorer, model=model).scoring_batch_tokens == SCORING_BATCH_TOKENS
    joint = CurKVCache(scorer, model=model, tiers=TierConfig(allocation="joint"))
    assert joint.scoring_batch_tokens == JOINT_SCORING_BATCH_TOKENS == 32 * SCORING_BATCH_TOKENS
    assert CurKVCache(scorer, model=model, tiers=TierConfig(allocation="joint", scoring_batch_tokens=7)
                      ).scoring_batch_tokens == 7
    ids = torch.randint(3, 512, (1, 150), generator=torch.Generator().manual_seed(5))
    one_pass, groups = prefill(model, scorer, ids, allocation="joint")
    alone, singles = prefill(model, scorer, ids, allocation="joint", scoring_batch_tokens=150)
    assert groups == [model.config.num_hidden_layers] and singles == [1] * model.config.num_hidden_layers
    for mine, reference in zip(one_pass.layers, alone.layers):
        assert torch.equal(mine.lengths, reference.lengths)
        assert torch.equal(mine.row_positions, reference.row_positions)
        assert torch.equal(mine.store.keys, reference.store.keys)
