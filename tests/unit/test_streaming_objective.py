"""The streaming stage: the student's kept set is the one CurKVCache keeps while the context grows."""

import pytest
import torch

from curkv_train.training.scored_attention import patch_model
from curkv_train.core.errors import CurKVError
from curkv_train.models.base import TINY_RANDOM, load_base_model
from curkv_train.training.capture import estimator_inputs, prefill_context
from curkv_train.training.objective import TrainingSettings, streaming_ends, streaming_keep_bias
from curkv_train.runtime import ComputeConfig, CurKVCache, TierConfig
from curkv_train.training.system import CurKVModule
from runtime_helpers import family_scorer

N_SINK, WINDOW, HOT_WINDOWS, ROUNDS, CONTEXT = 4, 16, 2, 4, 192


pytestmark = pytest.mark.usefixtures("single_thread")


def held_positions(layer, head: int) -> set[int]:
    """Positions a cache layer holds in batch row 0, KV head ``head`` (dense or ragged storage)."""
    if getattr(layer, "store", None) is None:
        return set(layer.positions[0, head].tolist())
    start, length = int(layer.store.offsets[0, head]), int(layer.lengths[0, head])
    return set(layer.row_positions[start:start + length].tolist())


@pytest.mark.parametrize("family", ["seed", "query_aware"])
@pytest.mark.parametrize("keep_ratio, recent_share, compress_every, allocation", [
    (0.3, 0.0, 2, "per_head"), (0.6, 0.0, 2, "per_head"), (0.3, 0.5, 2, "per_head"), (0.3, 0.5, 1, "per_head"),
    (0.3, 0.5, 2, "joint"), (0.6, 0.0, 1, "joint")])
def test_rounds_keep_what_the_cache_keeps(family, keep_ratio, recent_share, compress_every, allocation):
    """Layer 0 keeps the same tokens per head. (Deeper layers' K/V of tokens that arrived after a
    compression were computed over a compressed past in the cache, over the full one in training: the
    rounds reproduce the cache's selection rule, not that drift. Under ``joint`` the first round ranks every
    layer, which then still agree, and later rounds rank each layer's heads.)"""
    scorer = family_scorer(family, n_sink=N_SINK, window=WINDOW)
    ids = torch.randint(0, 259, (1, CONTEXT), generator=torch.Generator().manual_seed(2))
    stride = compress_every * WINDOW
    ends = streaming_ends(CONTEXT, ROUNDS, stride)  # the first end holds an interval past the hot tier

    model = load_base_model(TINY_RANDOM, attn_implementation="sdpa")
    tiers = TierConfig(hot_windows=HOT_WINDOWS, recent_share=recent_share, compress_every=compress_every,
                       allocation=allocation)
    cache = CurKVCache(scorer, model=model, keep_ratio=keep_ratio, tiers=tiers, compute=ComputeConfig(backend="torch"))
    with torch.no_grad():
        model(ids[:, : ends[0]], past_key_values=cache)
        for start in ends[:-1]:
            model(ids[:, start : start + stride], past_key_values=cache)
    assert cache.layers[0].seen == CONTEXT

    base = patch_model(load_base_model(TINY_RANDOM))
    estimator = scorer.estimator
    capture = prefill_context(base, ids, record_hidden=bool(estimator.needs))
    with torch.no_grad():
        logits = [estimator(estimator_inputs(base, estimator, capture, scorer.key_view, end=end)) for end in ends]
    bias, _ = streaming_keep_bias(logits, ends, n_sink=N_SINK, hot=HOT_WINDOWS * WINDOW, temperature=1.0,
                                  keep_ratio=keep_ratio, hard=True, recent_share=recent_share, allocation=allocation)
    kept = [set(torch.nonzero(bias[0, 0, head] > -1).flatten().tolist()) for head in range(2)]
    held = [held_positions(cache.layers[0], head) for head in range(2)]
    assert kept == held and len(held[0]) < CONTEXT


def test_soft_rounds_multiply_keep_probabilities():
    logits = [torch.zeros(1, 1, 1, end) for end in (12, 16)]
    bias, scores = streaming_keep_bias(logits, [12, 16], n_sink=1, hot=4, temperature=1.0, keep_ratio=0.5, hard=False)
    half = torch.log(torch.tensor(0.5))
    assert torch.allclose(bias[0, 0, 0, 1:8], 2 * half)  # competed in both rounds
    assert torch.allclose(bias[0, 0, 0, 8:12], half) and torch.all(bias[0, 0, 0, 12:] == 0)
    assert torch.all(bias[0, 0, 0, :1] == 0) and scores.shape == (1, 1, 1, 11)


def test_newest_places_are_kept_without_gradient():
    logits = [torch.full((1, 1, 1, 16), -5.0, requires_grad=True)]
    bias, _ = streaming_keep_bias(logits, [16], n_sink=1, hot=4, temperature=1.0, keep_ratio=11 / 16, hard=False,
                                  recent_share=0.5)
    # 11 held, 5 of them sink and hot: 11 compete (positions 1..11) for 6 places, the newest 3 (9, 10, 11)
    # kept whatever their score
    assert torch.all(bias[0, 0, 0, 9:12] == 0) and torch.all(bias[0, 0, 0, 1:9] < -4)
    bias.sum().backward()
    assert torch.all(logits[0].grad[0, 0, 0, 9:12] == 0) and torch.all(logits[0].grad[0, 0, 0, 1:9] != 0)


@pytest.mark.parametrize("count_protected, kept", [(True, 6), (False, 8)])
def test_a_round_keeps_rho_of_what_it_saw_or_of_its_competing_span(count_protected, kept):
    """16 tokens, sink 1, hot 4, keep 11/16: 11 held with the 5 protected inside (6 kept of the 11 competing),
    or ⌈11/16·11⌉ = 8 of the competing span when the protected ones are not counted."""
    logits = [torch.randn(1, 1, 1, 16, generator=torch.Generator().manual_seed(0))]
    bias, _ = streaming_keep_bias(logits, [16], n_sink=1, hot=4, temperature=1.0, keep_ratio=11 / 16, hard=True,
                                  count_protected=count_protected)
    assert int((bias[0, 0, 0, 1:12] > -1).sum()) == kept


def test_streaming_training_step_runs_and_moves_the_estimator():
    torch.manual_seed(0)
    module = CurKVModule(base_model=TINY_RANDOM, estimator="query_aware", estimator_options={"observation_window": 8},
                         window=8, n_sink=2, backend="torch", learning_rate=0.05)
    module.configure_model()
    module.apply_stage(TrainingSettings(keep_ratio=0.5, hard_topk=True, streaming_rounds=3, hot_windows=2))
    module.log = module.log_dict = lambda *args, **kwargs: None
    ids = torch.randint(0, 259, (1, 72), generator=torch.Generator().manual_seed(3))
    loss = module.training_step({"input_ids": ids, "context_length": 60}, 0)
    loss.backward()
    assert any(p.grad is not None and p.grad.abs().max() > 0 for p in module.estimator.parameters())


@pytest.mark.parametrize(("settings", "context", "message"), [
    (TrainingSettings(streaming_rounds=4, hot_windows=2), 60, "start at token 12 of a 60-token context"),
    (TrainingSettings(streaming_rounds=1, hot_windows=8), 60, "not past the 66 sink and hot tokens"),
    (TrainingSettings(warm_start=True), 1010, "reconstruction pass of 2059 tokens exceeds the model's 2048"),
])
def test_a_stage_the_context_cannot_hold_is_refused(settings, context, message):
    module = CurKVModule(base_model=TINY_RANDOM, window=8, n_sink=2, backend="torch")
    module.configure_model()
    module.check_stage(TrainingSettings(streaming_rounds=3, hot_windows=2), 60)
    module.check_stage(TrainingSettings(warm_start=True), 1004)
    with pytest.raises(CurKVError, match=message):
        module.check_stage(settings, context)
