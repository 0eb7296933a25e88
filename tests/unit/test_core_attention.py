"""The curkv attention function against transformers' own attention."""

import pytest
import torch
from transformers.models.llama.modeling_llama import eager_attention_forward

from curkv_train.training.scored_attention import CompressionState, curkv_attention_forward, patch_model
from curkv_train.models.base import TINY_RANDOM, load_base_model


@pytest.fixture(scope="module")
def models():
    patched = patch_model(load_base_model(TINY_RANDOM))
    reference = load_base_model(TINY_RANDOM)
    reference.set_attn_implementation("eager")
    return patched, reference


def test_scored_attention_with_zero_bias_equals_transformers_layer(models):
    patched, _ = models
    layer = patched.model.layers[0].self_attn
    torch.manual_seed(1)
    query, key, value = torch.randn(2, 4, 7, 16), torch.randn(2, 2, 19, 16), torch.randn(2, 2, 19, 16)
    state = CompressionState("scored", context_length=12, key_bias=[torch.zeros(2, 2, 12)] * 2, backend="torch")
    ours, _ = curkv_attention_forward(layer, query, key, value, None, scaling=0.25, curkv_state=state)
    visible = torch.arange(19)[None, :] <= torch.arange(7)[:, None] + 12  # bottom-right causal
    mask = torch.zeros(7, 19).masked_fill(~visible, float("-inf"))
    theirs, _ = eager_attention_forward(layer, query, key, value, mask, scaling=0.25)
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)


def test_mask_none_is_read_bottom_right_causal(models):
    """transformers passes attention_mask=None for causal batches: we must mask ourselves."""
    patched, _ = models
    layer = patched.model.layers[0].self_attn
    query, key, value = torch.randn(1, 4, 3, 16), torch.randn(1, 2, 5, 16), torch.randn(1, 2, 5, 16)
    state = CompressionState("scored", context_length=2, key_bias=[torch.zeros(1, 2, 2)] * 2, backend="torch")
    out, _ = curkv_attention_forward(layer, query, key, value, None, scaling=0.25, curkv_state=state)
    changed = value.clone()
    changed[:, :, -1] += 100.0  # only the last query may see the last key
    moved, _ = curkv_attention_forward(layer, query, key, changed, None, scaling=0.25, curkv_state=state)
    torch.testing.assert_close(out[:, :2], moved[:, :2])
    assert not torch.allclose(out[:, 2], moved[:, 2])


@pytest.mark.parametrize("mode", ["full", "reconstruct", "scored"])
def test_patched_model_matches_eager_model(models, mode):
    patched, reference = models
    ids = torch.randint(0, 259, (2, 40))
    bias = [torch.zeros(2, 2, 10)] * 2 if mode == "scored" else None
    state = CompressionState(mode, context_length=10, key_bias=bias, backend="torch")
    with torch.no_grad():
        torch.testing.assert_close(patched(ids, curkv_state=state).logits, reference(ids).logits,
                                   atol=1e-5, rtol=1e-5)
    if mode == "reconstruct":
        assert set(state.reconstruction) == {0, 1}
        assert state.reconstruction[0].shape == (2, 2, 10)


def test_a_padded_batch_is_masked_in_full_mode_and_refused_when_compressed():
    """The padding mask reaches the curkv function (transformers passed none without a mask function)."""
    from transformers import DynamicCache

    from curkv_train.core.errors import CurKVError

    patched, reference = patch_model(load_base_model(TINY_RANDOM)), load_base_model(TINY_RANDOM)
    ids = torch.randint(3, 200, (2, 6), generator=torch.Generator().manual_seed(0))
    mask = torch.tensor([[1] * 6, [0, 0, 0, 1, 1, 1]])
    with torch.no_grad():
        ours, theirs = (model(ids, attention_mask=mask).logits for model in (patched, reference))
        torch.testing.assert_close(ours[1, 3:], theirs[1, 3:], atol=1e-5, rtol=1e-5)
        cache = DynamicCache(config=patched.config)
        patched(ids, attention_mask=mask, past_key_values=cache)
        state = CompressionState("scored", context_length=6, key_bias=[torch.zeros(2, 2, 6)] * 2, backend="torch")
        with pytest.raises(CurKVError, match="padded batches"):
            patched.get_decoder()(input_ids=ids[:, :2], attention_mask=torch.cat([mask, mask[:, :2]], dim=1),
                                  past_key_values=cache, curkv_state=state)
