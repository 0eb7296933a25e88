"""CurKVCache with TierConfig(allocation="joint"): ragged storage, its bytes, its attention, its refusals."""

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from transformers import DynamicCache
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from curkv_train.core.errors import CurKVError
from curkv_train.core.selection import joint_keep_mask
from curkv_train.models.base import TINY_RANDOM, load_base_model
from curkv_train.runtime import CurKVCache, LayerBudget, TierConfig
from curkv_train.runtime.attention import check_ragged_implementation
from curkv_train.runtime.joint import joint_choice
from runtime_helpers import TORCH, greedy, prompt, random_scorer

WINDOW, N_SINK = 16, 4
JOINT = TierConfig(allocation="joint")

pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.fixture(scope="module")
def scorer():
    return random_scorer(n_sink=N_SINK, window=WINDOW)


def prefilled(model, scorer, ids: torch.Tensor, keep_ratio: float, tiers: TierConfig) -> CurKVCache:
    cache = CurKVCache(scorer, model, keep_ratio=keep_ratio, tiers=tiers, compute=TORCH)
    with torch.no_grad():
        model(ids, past_key_values=cache)
    return cache


def total_held(cache: CurKVCache) -> int:
    return sum(int(layer.held_lengths().sum()) if layer.keys is None else layer.keys.shape[0] * layer.keys.shape[1]
               * layer.keys.shape[2] for layer in cache.layers)


def test_keep_one_generates_the_plain_models_greedy_tokens(model, scorer):
    ids = prompt(150)
    cache = CurKVCache(scorer, model, keep_ratio=1.0, tiers=JOINT, compute=TORCH)
    assert torch.equal(greedy(model, ids, cache), greedy(model, ids))
    assert all(layer.store is not None for layer in cache.layers)  # it did move into ragged storage


@pytest.mark.parametrize("keep_ratio", [0.5, 0.3])
def test_a_prefill_keeps_per_heads_total_but_heads_vary(model, scorer, keep_ratio):
    ids = prompt(1024)
    per_head = prefilled(model, scorer, ids, keep_ratio, TierConfig())
    joint = prefilled(model, scorer, ids, keep_ratio, JOINT)
    assert total_held(joint) == total_held(per_head)
    lengths = torch.stack([layer.held_lengths() for layer in joint.layers])
    assert len(lengths.unique()) > 1
    floor = joint.settings.head_floor * (lengths.max() - N_SINK - 2 * WINDOW)  # hot tier: 2 windows
    assert int((lengths - N_SINK - 2 * WINDOW).min()) >= int(floor) - 1


def test_every_segment_keeps_its_sinks_and_hot_tier_in_age_order(model, scorer):
    joint = prefilled(model, scorer, prompt(512), 0.3, JOINT)
    for layer in joint.layers:
        for head in range(2):
            start, length = int(layer.store.offsets[0, head]), int(layer.lengths[0, head])
            positions = layer.row_positions[start:start + length].long()
            assert positions[:N_SINK].tolist() == list(range(N_SINK))
            assert positions[-2 * WINDOW:].tolist() == list(range(512 - 2 * WINDOW, 512))
            assert bool((positions.diff() > 0).all())


def counted_bytes(cache: CurKVCache) -> tuple[int, int]:
    """(KV bytes, all bytes) from the host lengths and capacities, independent of nbytes()."""
    kv = everything = 0
    for layer in cache.layers:
        rows = int(layer.capacities.sum())
        kv += rows * 2 * 16 * layer.store.keys.element_size()
        everything += rows * 2 * 16 * layer.store.keys.element_size() + rows * layer.row_positions.element_size()
        everything += layer.observer.nbytes()
    return kv, everything


@pytest.mark.parametrize("keep_ratio", [0.5, 0.3])
def test_the_bytes_held_are_rho_of_the_full_caches_plus_headroom(model, scorer, keep_ratio):
    ids = prompt(1024)
    full = DynamicCache(config=model.config)
    with torch.no_grad():
        model(ids, past_key_values=full)
    full_kv = sum(layer.keys.nbytes + layer.values.nbytes for layer in full.layers)
    cache = prefilled(model, scorer, ids, keep_ratio, JOINT)
    kv, everything = counted_bytes(cache)
    assert cache.nbytes() == everything
    assert abs(kv - keep_ratio * full_kv) <= 0.01 * keep_ratio * full_kv  # no spare rows after a compression
    assert all(torch.equal(layer.capacities, layer.lengths) for layer in cache.layers)
    with torch.no_grad():  # a decode step reallocates with at most a window of room per segment
        model(torch.tensor([[7]]), past_key_values=cache)
    kv_after, everything = counted_bytes(cache)
    assert cache.nbytes() == everything
    spare = sum(int((layer.capacities - layer.lengths).sum()) for layer in cache.layers)
    assert 0 < spare <= 2 * 2 * WINDOW  # layers x heads x window
    assert kv_after <= keep_ratio * full_kv * 1.01 + spare * 2 * 16 * 4 + 2 * 2 * 2 * 16 * 4


def test_decoding_recompresses_within_each_layer_and_stays_within_the_per_head_total(model, scorer):
    ids = prompt(400)
    per_head = CurKVCache(scorer, model, keep_ratio=0.5, tiers=TierConfig(), compute=TORCH)
    joint = CurKVCache(scorer, model, keep_ratio=0.5, tiers=JOINT, compute=TORCH)
    greedy(model, ids, per_head, new=100)
    before = [layer.compressible_seen for layer in joint.layers]
    out = greedy(model, ids, joint, new=100)
    assert out.shape[-1] == 500 and joint.get_seq_length() == 499
    assert all(layer.compressible_seen > 0 for layer in joint.layers) and before == [0, 0]
    assert total_held(joint) <= total_held(per_head)
    for layer in joint.layers:  # a layer never holds more than its per-head total
        assert int(layer.lengths.sum()) <= per_head.layers[layer.layer_idx].keys.shape[-2] * 2


def test_one_layers_attention_equals_sdpa_over_each_heads_held_tokens(model, scorer):
    tiers = TierConfig(allocation="joint", recent_share=0.0)
    cache = CurKVCache(scorer, model, keep_ratio=0.3, tiers=tiers, compute=TORCH)
    greedy(model, prompt(300), cache, new=20)
    layer = next(layer for layer in cache.layers if len(layer.lengths.unique()) > 1)  # the wrapper reads the storage
    attention = model.model.layers[layer.layer_idx].self_attn
    seen = {}
    hooks = [attention.register_forward_pre_hook(lambda m, a, k: seen.update(inputs=k), with_kwargs=True),
             attention.o_proj.register_forward_pre_hook(lambda m, a: seen.update(output=a[0]))]
    with torch.no_grad():
        model(torch.tensor([[11]]), past_key_values=cache)
    for hook in hooks:
        hook.remove()
    hidden, (cos, sin) = seen["inputs"]["hidden_states"], seen["inputs"]["position_embeddings"]
    query = attention.q_proj(hidden).view(1, 1, -1, 16).transpose(1, 2)
    query, _ = apply_rotary_pos_emb(query, query, cos, sin)
    group = query.shape[1] // 2
    expected = []
    for head in range(2):  # the storage after the step holds each head's tokens, the new one last
        keys, values = layer.store.segment(0, head)
        expected.append(F.scaled_dot_product_attention(query[:, head * group:(head + 1) * group], keys[None, None],
                                                       values[None, None], scale=attention.scaling))
    expected = torch.cat(expected, dim=1).transpose(1, 2).reshape(1, 1, -1)
    torch.testing.assert_close(seen["output"], expected, rtol=1e-5, atol=1e-5)


def test_joint_choice_on_equal_heads_is_the_trainings_joint_keep_mask():
    torch.manual_seed(0)
    scores = torch.randn(3, 2, 4, 50)  # layers, batch, heads, tokens
    expected = joint_keep_mask(scores, 0.3, 0.5).bool()
    flat = scores.permute(1, 0, 2, 3).reshape(2, 12, 50)
    chosen = joint_choice(flat, torch.ones_like(flat, dtype=torch.bool), torch.tensor([180, 180]), 8)
    assert torch.equal(chosen, expected.permute(1, 0, 2, 3).reshape(2, 12, 50))


def test_joint_choice_never_chooses_a_token_that_does_not_compete():
    scores = torch.tensor([[[5.0, 4.0, 3.0, 9.0], [1.0, 0.0, -1.0, 9.0]]])
    competing = torch.tensor([[[True, True, True, False], [True, True, False, False]]])
    chosen = joint_choice(scores, competing, torch.tensor([3]), 1)
    assert chosen.tolist() == [[[True, True, False, False], [True, False, False, False]]]


def test_eager_attention_generates_and_beam_search_reorders(scorer):
    eager = load_base_model(TINY_RANDOM, attn_implementation="eager")
    ids = prompt(200)
    cache = CurKVCache(scorer, eager, keep_ratio=0.5, tiers=JOINT, compute=TORCH)
    assert greedy(eager, ids, cache, new=30).shape[-1] == 230
    beams = CurKVCache(scorer, eager, keep_ratio=0.5, tiers=JOINT, compute=TORCH)
    out = eager.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=20, num_beams=2, do_sample=False,
                         past_key_values=beams, pad_token_id=0, eos_token_id=None)
    assert out.shape[-1] == 220


def test_joint_with_the_cold_tier_is_refused():
    with pytest.raises(CurKVError, match="cold tier"):
        TierConfig(allocation="joint", cold=True)


@pytest.mark.parametrize("head_floor", [-0.1, 1.5, "0.2"])
def test_a_head_floor_outside_zero_one_is_refused(head_floor):
    with pytest.raises(CurKVError, match="head_floor"):
        TierConfig(allocation="joint", head_floor=head_floor)


def test_an_unknown_allocation_is_refused():
    with pytest.raises(CurKVError, match="allocation"):
        TierConfig(allocation="per_layer")


def test_joint_with_a_layer_budget_is_refused(model, scorer):
    with pytest.raises(CurKVError, match="a layer budget enters only as a prior"):
        CurKVCache(scorer, model, keep_ratio=0.5, tiers=JOINT, layer_budget=LayerBudget((1.0, 2.0)))


def test_the_allocation_a_scorer_was_trained_under_is_the_caches_default(model, scorer):
    """A joint-trained scorer's cache is joint (its calibrated budget set aside), unless the tiers say otherwise."""
    budgeted = dataclasses.replace(scorer, layer_budget=LayerBudget((1.0, 2.0)))
    joint = dataclasses.replace(budgeted, allocation="joint", head_floor=0.3)
    cache = CurKVCache(joint, model, keep_ratio=0.5)
    assert cache.joint and cache.settings.head_floor == 0.3 and cache.settings.layer_budget is None
    per_head = CurKVCache(joint, model, keep_ratio=0.5, tiers=TierConfig(allocation="per_head", head_floor=0.2))
    assert not per_head.joint and per_head.settings.layer_budget is not None and per_head.settings.head_floor == 0.2
    assert not CurKVCache(budgeted, model, keep_ratio=0.5).joint  # negative control: a per-head scorer
    with pytest.raises(CurKVError, match="unknown allocation 'global'"):
        dataclasses.replace(scorer, allocation="global")


def test_joint_on_a_flex_attention_model_is_refused(scorer):
    flex = load_base_model(TINY_RANDOM, attn_implementation="flex_attention")
    with pytest.raises(CurKVError, match="cannot take"):
        CurKVCache(scorer, flex, keep_ratio=0.5, tiers=JOINT)


@pytest.mark.parametrize("implementation", ["flex_attention", "flash_attention_2", "sdpa", "curkv_factored_eager"])
def test_joint_needs_an_implementation_that_takes_ragged_heads(implementation):
    if implementation in ("sdpa", "curkv_factored_eager"):
        check_ragged_implementation(implementation)
        return
    with pytest.raises(CurKVError, match="attn_implementation='sdpa' or 'eager'"):
        check_ragged_implementation(implementation)
