"""Hybrid models (docs/runtime.md, "Hybrid models"): sliding-window layers kept as transformers keeps them, the
full-attention layers compressed; QK-norm and head_dim 256 through the torch path. Tiny random Gemma 3 and Qwen 3."""

import math

import pytest
import torch
from transformers import DynamicCache, Gemma3ForCausalLM, Gemma3TextConfig, Qwen3Config, Qwen3ForCausalLM

from curkv_train.core.errors import CurKVError
from curkv_train.core.shapes import kv_shape
from curkv_train.eval.runtime_caches import held_bytes, held_tokens
from curkv_train.models.families import build_estimator
from curkv_train.runtime import CurKVCache, Scorer, TierConfig, model_fingerprint
from curkv_train.runtime.hybrid import SlidingWindowLayer
from runtime_helpers import TORCH, greedy, prompt

SLIDING_WINDOW = 24
VOCAB = 512
GEMMA_TYPES = ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]
SMALL = dict(hidden_size=64, intermediate_size=128, num_attention_heads=2, head_dim=256, vocab_size=VOCAB,
             max_position_embeddings=2048)


def tiny_gemma3() -> Gemma3ForCausalLM:
    """4 layers alternating sliding (window 24) and full attention, head_dim 256, 1 KV head, QK-norm."""
    torch.manual_seed(0)
    config = Gemma3TextConfig(**SMALL, num_hidden_layers=4, num_key_value_heads=1, layer_types=GEMMA_TYPES,
                              sliding_window=SLIDING_WINDOW, attn_implementation="sdpa")
    return Gemma3ForCausalLM(config).eval()


def tiny_qwen3() -> Qwen3ForCausalLM:
    """2 full-attention layers with QK-norm, head_dim 256, 2 KV heads."""
    torch.manual_seed(0)
    config = Qwen3Config(**SMALL, num_hidden_layers=2, num_key_value_heads=2, attn_implementation="sdpa")
    return Qwen3ForCausalLM(config).eval()


def scorer_for(model, family: str = "seed") -> Scorer:
    """A random scorer of ``family`` sized for ``model`` (one estimator row per model layer), with its fingerprint."""
    torch.manual_seed(1)
    options = {"observation_window": 8} if family == "query_aware" else {}
    estimator = build_estimator(family, kv_shape(model.config), **options)
    with torch.no_grad():
        for parameter in estimator.parameters():
            parameter.normal_()
    base = {"id": type(model).__name__, "fingerprint": model_fingerprint(model.config)}
    return Scorer(estimator.eval(), n_sink=4, window=8, metadata={"base_model": base})


@pytest.fixture(scope="module")
def gemma():
    return tiny_gemma3()


@pytest.fixture(scope="module")
def qwen():
    return tiny_qwen3()


def full_layers(model) -> list[int]:
    types = getattr(model.config, "layer_types", None) or ["full_attention"] * model.config.num_hidden_layers
    return [index for index, kind in enumerate(types) if kind == "full_attention"]


@pytest.mark.parametrize("name", ["gemma", "qwen"])
def test_keep_one_generates_the_plain_models_tokens(name, request):
    model = request.getfixturevalue(name)
    ids = prompt(3 * SLIDING_WINDOW)  # longer than the sliding window
    with CurKVCache(scorer_for(model), model, keep_ratio=1.0, compute=TORCH) as cache:
        assert torch.equal(greedy(model, ids, cache, new=30), greedy(model, ids, new=30))
    for index in full_layers(model):
        assert cache.held_tokens(index) == 3 * SLIDING_WINDOW + 29


@pytest.mark.parametrize("family", ["seed", "query_aware"])
def test_keep_half_compresses_the_full_layers_and_leaves_the_sliding_ones_their_window(gemma, family):
    ids = prompt(200)
    with CurKVCache(scorer_for(gemma, family), gemma, keep_ratio=0.5, compute=TORCH) as cache:
        greedy(gemma, ids, cache, new=60)  # several re-compressions past the window
        seen = 200 + 59
        for index, layer in enumerate(cache.layers):
            if index in full_layers(gemma):
                assert layer.compressible_seen > 200  # re-compressed during decoding
                assert math.ceil(0.5 * seen) <= cache.held_tokens(index) <= cache.token_bound(index)
                assert cache.held_tokens(index) < 0.6 * seen
            else:
                assert isinstance(layer, SlidingWindowLayer)
                assert cache.held_tokens(index) <= SLIDING_WINDOW
                assert layer.get_seq_length() == seen
        assert held_tokens(cache) == sum(cache.held_tokens(index) for index in range(4)) / 4


def independent_bytes(cache: CurKVCache) -> int:
    """Bytes of every storage every layer references, sliding ones included, counted without nbytes()."""
    storages = {}
    for layer in cache.layers:
        tensors = [layer.keys, layer.values]
        if not isinstance(layer, SlidingWindowLayer):
            tensors += [layer.positions, layer.token_scores]
            tensors += [t for part in layer.observer.__dict__.values() if isinstance(part, torch.Tensor) for t in [part]]
        storages.update({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors if t is not None})
    return sum(storages.values())


def test_nbytes_counts_every_layer_sliding_ones_included(gemma):
    with CurKVCache(scorer_for(gemma), gemma, keep_ratio=0.5, compute=TORCH) as cache:
        greedy(gemma, prompt(150), cache, new=20)
        assert cache.nbytes() == held_bytes(cache) == independent_bytes(cache)
        sliding = sum(cache.layers[index].nbytes() for index in (0, 2))
        # a sliding layer holds its window (window - 1 tokens, or the window while a step's view is held), 1 KV head
        per_token = 2 * 256 * 4
        assert 2 * (SLIDING_WINDOW - 1) * per_token <= sliding <= 2 * SLIDING_WINDOW * per_token


def test_max_bytes_pays_the_sliding_windows_then_the_full_layers(gemma):
    scorer = scorer_for(gemma)
    dense = CurKVCache(scorer, gemma, keep_ratio=1.0, compute=TORCH)
    per_token, sliding = dense.bytes_per_token(), dense.sliding_bytes()
    dense.close()
    assert per_token == 2 * 1 * (2 * 256 * 4 + 4) and sliding == 2 * SLIDING_WINDOW * 2 * 256 * 4
    budget = sliding + 100 * per_token
    with CurKVCache(scorer, gemma, keep_ratio=1.0, max_bytes=budget, compute=TORCH) as cache:
        assert cache.settings.max_tokens == 99
        greedy(gemma, prompt(200), cache, new=30)
        assert cache.nbytes() <= budget
    with pytest.raises(CurKVError, match="sliding-window layers hold") as error:
        CurKVCache(scorer, gemma, keep_ratio=0.5, max_bytes=sliding)
    assert "\n" not in str(error.value)


def test_press_compresses_the_full_layers_and_leaves_the_sliding_ones(gemma):
    from curkv_train.runtime import CurKVPress

    press = CurKVPress(scorer=scorer_for(gemma), compression_ratio=0.5)
    ids = prompt(120)
    implementation, hooks = gemma.config._attn_implementation, hook_count(gemma)
    with torch.no_grad(), press(gemma):
        cache = DynamicCache(config=gemma.config)
        gemma(ids, past_key_values=cache)
    assert [layer.keys.shape[2] for layer in cache.layers] == [SLIDING_WINDOW - 1, 60, SLIDING_WINDOW - 1, 60]
    plain = DynamicCache(config=gemma.config)
    with torch.no_grad():
        gemma(ids, past_key_values=plain)
    for index in (0, 2):
        assert torch.equal(cache.layers[index].keys, plain.layers[index].keys)
        assert torch.equal(cache.layers[index].values, plain.layers[index].values)
    assert gemma.config._attn_implementation == implementation and hook_count(gemma) == hooks


def hook_count(model) -> int:
    """Forward hooks and pre-hooks on every module of ``model``."""
    return sum(len(module._forward_hooks) + len(module._forward_pre_hooks) for module in model.modules())


def test_a_scorer_for_one_family_refuses_the_others_model(gemma, qwen):
    for scorer, model in ((scorer_for(gemma), qwen), (scorer_for(qwen), gemma)):
        with pytest.raises(CurKVError, match="model_type: scorer") as error:
            CurKVCache(scorer, model, keep_ratio=0.5)
        message = str(error.value)
        assert "\n" not in message and "gemma3_text" in message and "qwen3" in message


def test_joint_allocation_shares_the_full_layers_tokens(gemma):
    ids = prompt(200)
    tiers = TierConfig(allocation="joint")
    with CurKVCache(scorer_for(gemma), gemma, keep_ratio=0.5, tiers=tiers, compute=TORCH) as cache:
        greedy(gemma, ids, cache, new=10)
        full = [cache.layers[index] for index in full_layers(gemma)]
        held = sum(layer.held_tokens for layer in full)
        assert held < 0.6 * len(full) * 209
        for index in (0, 2):
            assert cache.held_tokens(index) <= SLIDING_WINDOW
    with CurKVCache(scorer_for(gemma), gemma, keep_ratio=1.0, tiers=tiers, compute=TORCH) as cache:
        assert torch.equal(greedy(gemma, ids, cache, new=20), greedy(gemma, ids, new=20))


def test_a_layer_budget_on_a_hybrid_model_is_refused_in_one_line(gemma):
    from curkv_train.runtime import CurKVPress, LayerBudget

    budget = LayerBudget((1.0, 2.0, 3.0, 4.0))
    with pytest.raises(CurKVError, match="layer_budget='uniform'") as error:
        CurKVCache(scorer_for(gemma), gemma, keep_ratio=0.5, layer_budget=budget)
    assert "\n" not in str(error.value)
    press, hooks = CurKVPress(scorer=scorer_for(gemma), compression_ratio=0.5, layer_budget=budget), hook_count(gemma)
    with pytest.raises(CurKVError, match="layer_budget='uniform'"):
        with press(gemma):
            pass
    assert hook_count(gemma) == hooks and gemma.config._attn_implementation == "sdpa"


def test_tiers_of_a_sliding_layer_are_refused_in_one_line(gemma):
    with CurKVCache(scorer_for(gemma), gemma, keep_ratio=0.5, compute=TORCH) as cache:
        with pytest.raises(CurKVError, match=r"sliding-window layer.*\[1, 3\]"):
            cache.tier_sizes(0)
        assert cache.tier_sizes(1)["seen"] == 0


@pytest.mark.parametrize("allocation", ["per_head", "joint"])
def test_the_triton_kernels_keep_what_the_torch_path_keeps_at_head_dim_256(gemma, allocation):
    """Compaction (per head) and ragged attention (joint) under TRITON_INTERPRET=1, head_dim 256."""
    from curkv_train.runtime import ComputeConfig

    ids, tiers, tokens = prompt(80), TierConfig(allocation=allocation), {}
    for backend in ("torch", "triton"):
        with CurKVCache(scorer_for(gemma), gemma, keep_ratio=0.5, tiers=tiers,
                        compute=ComputeConfig(backend=backend)) as cache:
            tokens[backend] = greedy(gemma, ids, cache, new=6)
    assert torch.equal(tokens["torch"], tokens["triton"])


@pytest.mark.parametrize("name", ["gemma", "qwen"])
def test_the_recorded_queries_are_the_normed_ones_per_head(name, request):
    """Qwen 3 norms the queries before moving the heads, Gemma 3 after: both reach the layer as (batch, heads, new,
    head_dim), the module's normed queries, also where the new tokens are as many as the heads."""
    from curkv_train.runtime.attention import projected_heads

    model = request.getfixturevalue(name)
    attention, seen = model.model.layers[1].self_attn, {}

    def pre_hook(module, args, kwargs):
        seen["hidden"] = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]

    def norm_hook(module, args, output):
        seen["heads"] = projected_heads(attention, output)[1]

    with CurKVCache(scorer_for(model, "query_aware"), model, keep_ratio=0.5, compute=TORCH) as cache:
        handles = [attention.register_forward_pre_hook(pre_hook, with_kwargs=True),
                   attention.q_norm.register_forward_hook(norm_hook)]
        for tokens in (2, 5, 1):  # 2: as many as the query heads
            with torch.no_grad():
                model(prompt(tokens, seed=tokens), past_key_values=cache)
                hidden = seen["hidden"]
                projected = attention.q_proj(hidden).view(1, tokens, -1, attention.head_dim)
                expected = attention.q_norm(projected).transpose(1, 2)
            assert seen["heads"].shape == (1, 2, tokens, 256)
            torch.testing.assert_close(seen["heads"], expected)
        for handle in handles:
            handle.remove()


def test_a_full_layers_cached_keys_turn_back_into_its_normed_keys(gemma):
    """Gemma 3 rotates sliding and full layers with different frequencies: the pre-RoPE key view of a full layer uses
    the full layers' (the sliding ones would not give the k_norm output back)."""
    from curkv_train.core.rope import key_view

    attention, seen = gemma.model.layers[1].self_attn, {}
    handle = attention.k_norm.register_forward_hook(lambda module, args, output: seen.update(keys=output))
    cache = DynamicCache(config=gemma.config)
    with torch.no_grad():
        gemma(prompt(40), past_key_values=cache)
    handle.remove()
    keys = cache.layers[1].keys
    unrotated = key_view(gemma, keys, torch.arange(40), "pre_rope", end=40)
    torch.testing.assert_close(unrotated, seen["keys"], atol=1e-4, rtol=1e-4)  # Gemma 3 norms (batch, heads, ...)


@pytest.mark.parametrize("layer_types, refusal", [
    (["linear_attention", "full_attention"], "linear_attention"),
    (["sliding_attention", "sliding_attention"], "no full-attention layer"),
])
def test_other_layer_types_and_all_sliding_models_are_refused_in_one_line(layer_types, refusal):
    from types import SimpleNamespace

    from curkv_train.runtime.hybrid import sliding_layers

    config = Qwen3Config(**SMALL, num_hidden_layers=2, num_key_value_heads=2)
    config.layer_types = layer_types
    with pytest.raises(CurKVError, match=refusal) as error:
        sliding_layers(SimpleNamespace(config=config))
    assert "\n" not in str(error.value)
