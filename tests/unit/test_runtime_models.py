"""CurKVCache on Llama-, Mistral- and Qwen-style models, beam search, and per-head position scoring."""

import pytest
import torch
from transformers import AutoModelForCausalLM, MistralConfig, Qwen2Config, Qwen3Config

from curkv_train.core.rope import KEY_VIEWS
from curkv_train.core.shapes import kv_shape
from curkv_train.core.errors import CurKVError
from curkv_train.models.base import TINY_RANDOM, load_base_model
from curkv_train.models.families import build_estimator
from curkv_train.runtime import CurKVCache, Scorer
from runtime_helpers import TORCH, random_scorer

SHAPES = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, max_position_embeddings=2048)


pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.fixture(scope="module")
def scorer():
    return random_scorer(n_sink=4, window=16)


def greedy(model, ids, cache=None, **options):
    return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=20, do_sample=False,
                          past_key_values=cache, pad_token_id=0, eos_token_id=None, **options)


@pytest.mark.parametrize("config", [MistralConfig(**SHAPES, sliding_window=None), Qwen2Config(**SHAPES),
                                    Qwen3Config(**SHAPES)], ids=["mistral", "qwen2", "qwen3"])
def test_other_families_generate_exactly_at_keep_ratio_one(scorer, config):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    ids = torch.randint(3, 512, (1, 120), generator=torch.Generator().manual_seed(0))
    assert torch.equal(greedy(model, ids, CurKVCache(scorer, model=model, keep_ratio=1.0)), greedy(model, ids))
    cache = CurKVCache(scorer, model=model, keep_ratio=0.5, compute=TORCH)
    assert greedy(model, ids, cache).shape == (1, 140) and cache.held_tokens(0) < 139


def test_beam_search_reorders_the_compressed_cache(scorer):
    model = load_base_model(TINY_RANDOM)
    ids = torch.randint(3, 512, (1, 90), generator=torch.Generator().manual_seed(1))
    cache = CurKVCache(scorer, model=model, keep_ratio=0.5, compute=TORCH)
    assert greedy(model, ids, cache, num_beams=2).shape == (1, 110)
    assert cache.layers[0].keys.shape[0] == cache.layers[0].positions.shape[0] == 2


@pytest.mark.parametrize("view", KEY_VIEWS)
def test_per_head_positions_score_like_shared_positions(scorer, view):
    model = load_base_model(TINY_RANDOM)
    viewed = Scorer(scorer.estimator, key_view=view)
    keys, values = torch.randn(1, 2, 12, 16), torch.randn(1, 2, 12, 16)
    positions = torch.arange(30, 42)
    shared = viewed.score_layer(model, 1, keys, values, positions)
    per_head = viewed.score_layer(model, 1, keys, values, positions.expand(1, 2, 12))
    torch.testing.assert_close(per_head, shared)
    sparse = torch.cat([torch.arange(0, 22, 2), torch.tensor([41])])  # another head's kept tokens, same last one
    per_head = viewed.score_layer(model, 1, keys, values, torch.stack([positions, sparse])[None], end=42)
    other = viewed.score_layer(model, 1, keys, values, sparse, end=42)
    torch.testing.assert_close(per_head[:, 0], shared[:, 0])
    torch.testing.assert_close(per_head[:, 1], other[:, 1])


def test_observation_bytes_count_the_query_ring_when_heads_are_wider_than_the_hidden_size():
    """Qwen3-style: 4 query heads of 32 = 128 query channels over a hidden size of 64. The byte budget's
    observation term must be what the buffers hold once filled (the ring of queries and their moments)."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(Qwen3Config(**{**SHAPES, "head_dim": 32})).eval()
    estimator = build_estimator("query_aware", kv_shape(model.config), observation_window=8).eval()
    cache = CurKVCache(Scorer(estimator, n_sink=4, window=16), model=model, keep_ratio=0.5, compute=TORCH)
    with torch.no_grad():
        model(torch.randint(3, 512, (1, 60), generator=torch.Generator().manual_seed(0)), past_key_values=cache)
    assert cache.observation_bytes() == sum(layer.observer.nbytes() for layer in cache.layers)


def test_a_sliding_window_model_is_served_within_the_window_and_refused_past_it(scorer):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(MistralConfig(**SHAPES, sliding_window=64)).eval()
    cache = CurKVCache(scorer, model=model, keep_ratio=1.0, compute=TORCH)
    with torch.no_grad():
        model(torch.randint(3, 512, (1, 50)), past_key_values=cache)
        model(torch.randint(3, 512, (1, 10)), past_key_values=cache)
        with pytest.raises(CurKVError, match=r"sliding window \(64 tokens\) is exceeded: 60 held \+ 10 new"):
            model(torch.randint(3, 512, (1, 10)), past_key_values=cache)


def test_a_step_past_the_sliding_window_is_refused_before_any_layer_appends(scorer):
    """Under a layer budget layer 0 holds fewer tokens than layer 1: its check alone let it append, and the
    layers fell out of step when layer 1 refused."""
    from curkv_train.runtime.allocation import LayerBudget

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(MistralConfig(**SHAPES, sliding_window=130)).eval()
    cache = CurKVCache(scorer, model=model, keep_ratio=0.5, layer_budget=LayerBudget((1.0, 5.0)), compute=TORCH)
    with torch.no_grad():
        model(torch.randint(3, 512, (1, 120)), past_key_values=cache)
        held = [cache.held_tokens(layer) for layer in range(2)]
        assert held[0] < held[1]
        with pytest.raises(CurKVError, match="sliding window"):
            model(torch.randint(3, 512, (1, 60)), past_key_values=cache)
    assert [cache.layers[layer].seen for layer in range(2)] == [120, 120]
    assert [cache.held_tokens(layer) for layer in range(2)] == held
