"""CurKVCache on the tiny random Llama: exactness at ρ = 1, bytes held, bounded decoding, tiers."""

import math

import pytest
import torch
from transformers import DynamicCache

from curkv_train.core.errors import CurKVError
from curkv_train.models.base import TINY_RANDOM, load_base_model
from curkv_train.models.seed_estimator import ValueEstimator
from curkv_train.runtime import ComputeConfig, CurKVCache, Scorer, TierConfig
from runtime_helpers import TORCH, family_scorer, greedy, prompt, random_scorer

WINDOW, N_SINK = 16, 4
TIERS_OFF = TierConfig(hot=False)  # the hot tier down to one window, no cold tier


pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.fixture(scope="module")
def scorer():
    return random_scorer(n_sink=N_SINK, window=WINDOW)


def decode(model, ids: torch.Tensor, cache, new: int, on_step) -> None:
    """Greedy decoding one token per forward, calling ``on_step()`` after the prefill and every step."""
    with torch.no_grad():
        logits = model(ids, past_key_values=cache).logits
        on_step()
        for _ in range(new):
            logits = model(logits[:, -1:].argmax(dim=-1), past_key_values=cache).logits
            on_step()


def held_tensor_bytes(cache: CurKVCache) -> int:
    """Bytes of every storage the cache's layers reference (allocated room included), counted independently of
    nbytes()."""
    storages = {}
    for layer in cache.layers:
        tensors = [layer.keys, layer.values, layer.positions, layer.token_scores]
        tensors += [t for block in layer.cold for t in block.keys.tensors() + block.values.tensors()]
        storages.update({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors if t is not None})
    return sum(storages.values())


@pytest.fixture(scope="module")
def plain_tokens(model):
    return greedy(model, prompt(150))


@pytest.mark.parametrize("options", [{"tiers": TIERS_OFF}, {}, {"keep_ratio": "adaptive"}])
def test_keep_ratio_one_generates_like_plain_cache(model, scorer, plain_tokens, options):
    ids = prompt(150)
    settings = {"keep_ratio": 1.0, "compute": TORCH, **options}
    cache = CurKVCache(scorer, model=model, **settings)
    assert torch.equal(greedy(model, ids, cache), plain_tokens)
    assert cache.held_tokens(0) == cache.get_seq_length() == 150 + 39
    assert cache.layers[0].compressible_seen > 0  # recompression ran and evicted nothing


def test_half_keep_after_prefill_holds_at_most_52_percent(model, scorer):
    ids = prompt(1024)
    full = DynamicCache(config=model.config)
    with torch.no_grad():
        model(ids, past_key_values=full)
        cache = CurKVCache(scorer, model=model, keep_ratio=0.5, tiers=TIERS_OFF, compute=TORCH)
        model(ids, past_key_values=cache)
    full_bytes = sum(layer.keys.nbytes + layer.values.nbytes for layer in full.layers)
    kept = 1024 // 2  # sinks and window inside the half
    for layer in cache.layers:
        assert layer.keys.shape == (1, 2, kept, 16) and layer.values.shape == (1, 2, kept, 16)
        assert layer.positions.shape == (1, 2, kept)
    assert cache.nbytes() == held_tensor_bytes(cache)
    assert cache.nbytes() <= 0.52 * full_bytes
    assert cache.get_seq_length() == 1024


def test_heads_keep_different_tokens_but_sinks_and_window_always(model, scorer):
    cache = CurKVCache(scorer, model=model, keep_ratio=0.3, tiers=TIERS_OFF, compute=TORCH)
    with torch.no_grad():
        model(prompt(400), past_key_values=cache)
    positions = cache.layers[0].positions.long()[0]
    assert not torch.equal(positions[0], positions[1])
    for head in positions:
        assert head[:N_SINK].tolist() == list(range(N_SINK))
        assert head[-WINDOW:].tolist() == list(range(400 - WINDOW, 400))
        assert torch.all(head[1:] > head[:-1])


def test_attention_runs_over_held_tokens_at_true_positions(model, scorer):
    """A compressed CurKVCache gives the logits of a plain cache holding the same tokens, positions continued."""
    ids, chunk = prompt(300), prompt(5, seed=1)
    for implementation in ("sdpa", "eager"):
        model.set_attn_implementation(implementation)
        cache = CurKVCache(scorer, model=model, keep_ratio=0.5, tiers=TIERS_OFF, compute=TORCH)
        with torch.no_grad():
            model(ids, past_key_values=cache)
            reference = DynamicCache(config=model.config)
            for index, layer in enumerate(cache.layers):
                reference.update(layer.keys.clone(), layer.values.clone(), index)
            positions = torch.arange(300, 305)[None]
            expected = model(chunk, past_key_values=reference, position_ids=positions).logits
            actual = model(chunk, past_key_values=cache, attention_mask=torch.ones(1, 305, dtype=torch.long)).logits
        torch.testing.assert_close(actual, expected)
    model.set_attn_implementation("sdpa")


class OldestFirstCache(CurKVCache):
    """Scores the oldest tokens highest, so what recent_share adds is told apart from the score's choice."""

    def _score(self, layer, keys, values, positions, end, observation, token_scores, projected_keys=None, valid=None):
        return -positions.float()


@pytest.mark.parametrize("share, recent", [(0.0, 0), (0.5, 90), (1.0, 180)])
def test_recent_share_gives_the_newest_their_places_and_the_score_the_rest(model, scorer, share, recent):
    cache = OldestFirstCache(scorer, model=model, keep_ratio=0.5, tiers=TierConfig(hot=False, recent_share=share),
                             compute=TORCH)
    with torch.no_grad():
        model(prompt(400), past_key_values=cache)
    # 200 held, 20 of them the 4 sinks and the 16-token window: 180 of the 380 compressible tokens kept
    scored = list(range(N_SINK, N_SINK + 180 - recent))
    newest = list(range(400 - WINDOW - recent, 400 - WINDOW))
    expected = list(range(N_SINK)) + scored + newest + list(range(400 - WINDOW, 400))
    for head in cache.layers[0].positions.long()[0]:
        assert head.tolist() == expected


@pytest.mark.parametrize("share", [-0.1, 1.5, "half"])
def test_recent_share_outside_range_is_a_user_error(model, scorer, share):
    with pytest.raises(CurKVError, match="recent_share must be in"):
        CurKVCache(scorer, model=model, tiers=TierConfig(recent_share=share))


def test_decoding_recompresses_and_stays_within_bound(model, scorer):
    cache = CurKVCache(scorer, model=model, keep_ratio=0.5, tiers=TIERS_OFF, compute=TORCH)
    with torch.no_grad():
        output = model(prompt(200), past_key_values=cache)
        token = output.logits[:, -1:].argmax(-1)
        sizes = []
        for _ in range(4 * WINDOW):
            output = model(token, past_key_values=cache)
            token = output.logits[:, -1:].argmax(-1)
            for index in range(len(cache.layers)):
                assert cache.held_tokens(index) <= cache.token_bound(index)
            sizes.append(cache.held_tokens(0))
    assert cache.get_seq_length() == 200 + 4 * WINDOW
    assert cache.tier_sizes(0)["hot"] < 3 * WINDOW  # one window protected, recompressed every 2
    assert max(sizes) < 200 + 4 * WINDOW
    assert cache.layers[0].compressible_seen == 200 + 4 * WINDOW - N_SINK - cache.tier_sizes(0)["hot"]


@pytest.mark.parametrize("keep_ratio", [0.3, 0.5, 0.8])
def test_keep_ratio_is_the_share_of_every_token_seen_held_after_a_compression(model, scorer, keep_ratio):
    """Sinks and the hot tier count inside ρ: right after each compression every layer holds ⌈ρ·seen⌉."""
    cache = CurKVCache(scorer, model=model, keep_ratio=keep_ratio, layer_budget="uniform", compute=TORCH)
    layer, after = cache.layers[0], []
    compress = layer.compress
    layer.compress = lambda *scores: (compress(*scores), after.append((layer.seen, cache.held_tokens(0))))
    decode(model, prompt(300), cache, 6 * WINDOW, lambda: None)
    assert len(after) >= 3
    assert all(held == math.ceil(keep_ratio * seen - 1e-9) for seen, held in after)


@pytest.mark.parametrize("compress_every", [1, 2, 3])
def test_decoding_compresses_once_per_interval(model, scorer, compress_every):
    cache = CurKVCache(scorer, model=model, keep_ratio=0.5, tiers=TierConfig(compress_every=compress_every),
                       compute=TORCH)
    layer = cache.layers[0]
    calls = []
    compress = layer.compress
    layer.compress = lambda *scores: (calls.append(layer.seen), compress(*scores))
    held = []
    decode(model, prompt(200), cache, 6 * WINDOW, lambda: held.append(cache.held_tokens(0)))
    interval = compress_every * WINDOW
    assert calls[0] == 200 and calls[1:] == list(range(200 + interval, 200 + 6 * WINDOW + 1, interval))
    assert max(held) <= cache.token_bound(0)


def test_decoding_allocates_less_than_a_window_of_unused_room(model, scorer):
    """The dense tensors grow a window at a time: their unused room, counted as held, stays below one window
    (room for a whole compression interval would sit up to 2·WINDOW − 1 tokens empty)."""
    cache = CurKVCache(scorer, model=model, keep_ratio=0.5, tiers=TierConfig(compress_every=2), compute=TORCH)
    unused = []

    def on_step():
        keys = cache.layers[0].keys
        unused.append(keys.stride(1) // keys.stride(2) - keys.shape[-2])  # room allocated along tokens, unused

    decode(model, prompt(200), cache, 6 * WINDOW, on_step)
    assert 0 <= min(unused) and max(unused) == WINDOW - 1
    assert cache.nbytes() == held_tensor_bytes(cache)


def test_token_budget_bounds_memory_for_long_generation(model, scorer):
    budget = N_SINK + 3 * WINDOW + WINDOW - 1 + 40
    cache = CurKVCache(scorer, model=model, keep_ratio=0.5, max_tokens=budget, compute=TORCH)
    sizes = []
    decode(model, prompt(120), cache, 6 * WINDOW, lambda: sizes.append(cache.held_tokens(0)))
    assert max(sizes) <= budget and max(sizes) > budget - WINDOW  # the budget binds
    for index in range(len(cache.layers)):
        assert cache.held_tokens(index) <= budget
        assert cache.token_bound(index) == budget


def test_byte_budget_bounds_the_bytes_held(model, scorer):
    dense = CurKVCache(scorer, model=model, keep_ratio=1.0, compute=TORCH)
    greedy(model, prompt(300), dense, new=2 * WINDOW)
    budget = dense.nbytes() // 2
    cache = CurKVCache(scorer, model=model, keep_ratio=1.0, max_bytes=budget, compute=TORCH)
    held = []
    decode(model, prompt(300), cache, 6 * WINDOW, lambda: held.append(cache.nbytes()))
    assert max(held) <= budget and max(held) > budget * 0.6
    assert cache.settings.max_tokens == cache.tokens_within(budget)


@pytest.mark.parametrize("budget", [{"max_tokens": N_SINK + 3 * WINDOW}, {"max_bytes": 1000}])
def test_budget_smaller_than_what_every_layer_holds_is_refused(model, scorer, budget):
    with pytest.raises(CurKVError, match="every layer always holds"):
        CurKVCache(scorer, model=model, keep_ratio=0.5, compute=TORCH, **budget)


def test_tiers_hold_fewer_bytes_and_still_generate(model, scorer):
    ids = prompt(500)
    plain = CurKVCache(scorer, model=model, keep_ratio=0.5, compute=TORCH)
    tiered = CurKVCache(scorer, model=model, keep_ratio=0.5, tiers=TierConfig(cold=True), compute=TORCH)
    greedy(model, ids, plain, new=2 * WINDOW)
    tokens = greedy(model, ids, tiered, new=2 * WINDOW)
    assert tokens.shape == (1, 500 + 2 * WINDOW)
    sizes = tiered.tier_sizes(0)
    assert sizes["cold"] > 0 and sizes["hot"] >= 3 * WINDOW
    assert tiered.held_tokens(0) == plain.held_tokens(0)
    assert tiered.nbytes() == held_tensor_bytes(tiered) < plain.nbytes()


def test_compensation_and_warm_switches(model, scorer):
    ids = prompt(500)
    held = {}
    for name, options in {"all": {}, "no_comp": {"compensation": False}, "no_warm": {"warm": False}}.items():
        cache = CurKVCache(scorer, model=model, keep_ratio=0.5, tiers=TierConfig(cold=True, **options), compute=TORCH)
        with torch.no_grad():
            model(ids, past_key_values=cache)
        held[name] = (cache.nbytes(), cache.tier_sizes(0))
    assert held["no_comp"][0] < held["all"][0]
    assert held["no_warm"][1]["warm"] == 0 and held["no_warm"][1]["cold"] > held["all"][1]["cold"]


def test_triton_backend_compacts_like_torch(model, scorer):
    ids = prompt(120)
    caches = [CurKVCache(scorer, model=model, keep_ratio=0.5, tiers=TIERS_OFF, compute=ComputeConfig(backend=b))
              for b in ("torch", "auto")]
    with torch.no_grad():
        for cache in caches:
            model(ids, past_key_values=cache)
    assert torch.equal(caches[0].layers[1].keys, caches[1].layers[1].keys)


@pytest.mark.parametrize("compress_every", [0, -1])
def test_a_compression_interval_below_one_window_is_a_user_error(model, scorer, compress_every):
    with pytest.raises(CurKVError, match="compress_every must be a whole number >= 1"):
        CurKVCache(scorer, model=model, keep_ratio=0.5, tiers=TierConfig(compress_every=compress_every))


@pytest.mark.parametrize("keep_ratio", [0.0, -0.1, 1.5, "fast"])
def test_keep_ratio_outside_range_is_a_user_error(model, scorer, keep_ratio):
    with pytest.raises(CurKVError, match="keep_ratio"):
        CurKVCache(scorer, model=model, keep_ratio=keep_ratio)


def test_scorer_for_other_shapes_is_rejected(model):
    with pytest.raises(CurKVError, match="num_hidden_layers: scorer 3 vs model 2"):
        CurKVCache(Scorer(ValueEstimator(3, 2, 16)), model=model)


def test_crop_after_compression_is_rejected(model, scorer):
    cache = CurKVCache(scorer, model=model, keep_ratio=0.5, compute=TORCH)
    with torch.no_grad():
        model(prompt(200), past_key_values=cache)
    with pytest.raises(CurKVError, match="cropped"):
        cache.crop(100)


def test_a_crop_frees_what_it_drops_and_counts_what_it_holds(model, scorer):
    from curkv_train.runtime.buffer import buffer_of

    cache = CurKVCache(scorer, model=model, keep_ratio=0.5, compute=TORCH)
    with torch.no_grad():
        model(prompt(30), past_key_values=cache)
        for step in range(5):
            model(prompt(1, step), past_key_values=cache)
    cache.crop(20)
    layer = cache.layers[0]
    for name in ("keys", "values", "positions"):
        assert buffer_of(layer, name).nbytes() == getattr(layer, name).untyped_storage().nbytes()
    assert layer.keys.shape[-2] == 20


def test_a_falling_keep_ratio_evicts_the_oldest_cold_tokens_not_the_warm_ones(model):
    """The adaptive ratio falls from 0.5 to 0.3 past 4K tokens, below what the cold tier alone held: the oldest
    cold tokens go, the cache holds ⌈0.3·n⌉ and keeps warm tokens (it held 1920 with none, the cold tier intact)."""
    torch.manual_seed(0)
    estimator = ValueEstimator(2, 2, 16, max_positions=8192)
    with torch.no_grad():
        estimator.key_weight.normal_()
        estimator.position_weight.normal_()
    cache = CurKVCache(Scorer(estimator, n_sink=4, window=16), model=model, keep_ratio="adaptive", tiers=TierConfig(cold=True), compute=TORCH)
    with torch.no_grad():
        model(prompt(3000), past_key_values=cache)
        cold_before = cache.tier_sizes(0)["cold"]
        for chunk in range(12):
            model(prompt(100, chunk), past_key_values=cache)
    sizes = cache.tier_sizes(0)
    assert sizes["seen"] == 4200 and cold_before > math.ceil(0.3 * 4200) - 36
    assert cache.held_tokens(0) == math.ceil(0.3 * 4200) and sizes["warm"] > 0


def test_adaptive_keep_ratio_thresholds():
    from curkv_train.runtime.tiers import adaptive_keep_ratio

    assert [adaptive_keep_ratio(n) for n in (10, 1023, 1024, 4096, 4097)] == [1.0, 1.0, 0.5, 0.5, 0.3]


def flash_mask_stand_in() -> str:
    """An attention implementation with flash attention's mask function (a 2D padding mask, or none) that runs on
    a CPU: what a flash-attention model hands the attention modules."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask

    AttentionInterface.register("stand_in_2d_mask",
                                lambda module, *args, **kwargs: sdpa_attention_forward(module, *args[:3], None, **kwargs))
    AttentionMaskInterface.register("stand_in_2d_mask", flash_attention_mask)
    return "stand_in_2d_mask"


@pytest.mark.parametrize("implementation", ["sdpa", "eager", "flash", "flex_attention"])
def test_a_padded_batch_is_refused(scorer, implementation):
    implementation = flash_mask_stand_in() if implementation == "flash" else implementation
    padded_model = load_base_model(TINY_RANDOM, attn_implementation=implementation)
    ids = prompt(40).expand(2, -1).clone()
    mask = torch.ones_like(ids)
    mask[1, :5] = 0  # left padding on the second row
    cache = CurKVCache(scorer, model=padded_model, keep_ratio=0.5, compute=TORCH)
    with pytest.raises(CurKVError, match="padded batches"):
        padded_model.generate(ids, attention_mask=mask, past_key_values=cache, max_new_tokens=2, do_sample=False,
                              pad_token_id=0)


def test_a_chunk_longer_than_the_hot_tier_is_compressed_on_arrival(model, scorer):
    """Documented behaviour: like a prefill, a long chunk's older tokens compete as soon as it arrives."""
    cache = CurKVCache(scorer, model=model, keep_ratio=0.5, compute=TORCH)
    with torch.no_grad():
        model(prompt(100), past_key_values=cache)
        model(prompt(400)[:, 100:], past_key_values=cache)  # 300 new tokens, hot tier 2 windows = 32
    sizes = cache.tier_sizes(0)
    assert sizes["seen"] == 400 and sizes["hot"] == 2 * WINDOW
    assert cache.held_tokens(0) == N_SINK + 2 * WINDOW + sizes["warm"] < 400


def test_a_query_aware_cache_crops_within_its_observation_window_only(model):
    """Window of 8 queries: a crop from 6 to 4 tokens rolls it back; one from 12 cannot, and leaves the cache as it was."""
    cache = CurKVCache(family_scorer("query_aware"), model=model, keep_ratio=0.5, compute=TORCH)
    with torch.no_grad():
        model(prompt(6), past_key_values=cache)
        cache.crop(4)
        assert cache.get_seq_length() == 4 and cache.layers[0].observer.seen == 4
        model(prompt(8), past_key_values=cache)
    with pytest.raises(CurKVError, match="cannot forget the queries of its last 2 tokens"):
        cache.crop(10)
    assert cache.get_seq_length() == 12 and cache.layers[0].keys.shape[-2] == 12


@pytest.mark.parametrize("option", ["cold_block", "cold_rows", "cold_channels"])
@pytest.mark.parametrize("value", [0, -1])
def test_cold_sizes_below_one_are_refused_not_replaced_by_defaults(option, value):
    with pytest.raises(CurKVError, match=f"{option} must be a whole number >= 1"):
        TierConfig(cold=True, **{option: value})


@pytest.mark.parametrize("chunk", [1, 5])
def test_a_tight_byte_budget_holds_at_every_step(model, scorer, chunk):
    """Tokens fed one at a time or in chunks that do not divide the window: the room an append makes stops at
    the next compression, and the slot of the token that triggers it is paid for (both went over before)."""
    held = []
    for budget in range(19200, 27000, 1200):
        cache = CurKVCache(scorer, model=model, keep_ratio=1.0, max_bytes=budget, tiers=TierConfig(window=8), compute=TORCH)
        with torch.no_grad():
            model(prompt(200), past_key_values=cache)
            for step in range(12):
                model(prompt(chunk, seed=step), past_key_values=cache)
                held.append((cache.nbytes(), budget))
                assert cache.nbytes() == held_tensor_bytes(cache)
    assert all(nbytes <= budget for nbytes, budget in held)
    assert any(nbytes > budget - 600 for nbytes, budget in held)  # within about a token of each budget


@pytest.mark.parametrize("family", ["seed", "query_aware", "hidden"])
def test_a_prefill_under_inference_mode_then_decoding_under_no_grad(model, family):
    """Buffers made under torch.inference_mode are written in place by the later no_grad steps (DynamicCache
    concatenates and never hits this)."""
    scorer = family_scorer(family)
    cache = CurKVCache(scorer, model=model, keep_ratio=0.5, compute=TORCH)
    with torch.inference_mode():  # the second part leaves room in the buffers, made here
        model(prompt(120), past_key_values=cache)
        logits = model(prompt(3, seed=1), past_key_values=cache).logits
    with torch.no_grad():
        for _ in range(2 * WINDOW + 1):
            logits = model(logits[:, -1:].argmax(dim=-1), past_key_values=cache).logits
    assert cache.get_seq_length() == 123 + 2 * WINDOW + 1


def test_a_deep_copy_shares_the_model_and_scorer_and_decodes_apart(model, scorer):
    """transformers reuses a prompt's cache through copy.deepcopy: the copy holds its own tokens only."""
    import copy

    cache = CurKVCache(scorer, model=model, keep_ratio=0.5, compute=TORCH)
    with torch.no_grad():
        model(prompt(150), past_key_values=cache)
    twin = copy.deepcopy(cache)
    assert twin.model is model and twin.scorer is cache.scorer
    assert twin.layers[0].keys.data_ptr() != cache.layers[0].keys.data_ptr()
    assert twin.layers[0].score_fn.__self__ is twin
    longer = torch.cat([prompt(150), prompt(5, seed=1)], dim=-1)  # the prompt and what follows it
    assert torch.equal(greedy(model, longer, twin, new=3 * WINDOW), greedy(model, longer, cache, new=3 * WINDOW))


def test_the_least_byte_budget_an_error_names_is_accepted(model, scorer):
    import re

    with pytest.raises(CurKVError, match="give at least") as refused:
        CurKVCache(scorer, model=model, max_bytes=1000, compute=TORCH)
    least = int(re.search(r"give at least (\d+) bytes", str(refused.value)).group(1))
    CurKVCache(scorer, model=model, max_bytes=least, compute=TORCH)
    with pytest.raises(CurKVError, match="give at least"):
        CurKVCache(scorer, model=model, max_bytes=least - 1, compute=TORCH)


@pytest.mark.parametrize("budget", [{"max_tokens": 400.5}, {"max_bytes": 10.0**9}, {"max_tokens": True}])
def test_a_budget_that_is_not_a_whole_number_is_refused(model, scorer, budget):
    name, value = next(iter(budget.items()))
    with pytest.raises(CurKVError, match=f"{name} must be a whole number, got {value!r}"):
        CurKVCache(scorer, model=model, compute=TORCH, **budget)
