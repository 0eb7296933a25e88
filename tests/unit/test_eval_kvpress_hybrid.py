"""kvpress's presses on a hybrid model (tiny random Gemma 3): only the full-attention layers pressed, the
sliding-window ones as a plain prefill leaves them, and the model as it was afterwards."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

pytest.importorskip("kvpress")

from curkv_train.core.observation import attention_modules  # noqa: E402
from curkv_train.eval import kvpress_bridge  # noqa: E402
from runtime_helpers import prompt  # noqa: E402
from test_runtime_hybrid import SLIDING_WINDOW, tiny_gemma3  # noqa: E402

TOKENS = 120


@pytest.fixture(scope="module")
def gemma():
    return tiny_gemma3()


@pytest.mark.parametrize("rule", ["snapkv", "expected_attention", "pyramidkv"])
def test_a_kvpress_rule_presses_only_the_full_layers_of_a_hybrid_model(gemma, rule):
    press = kvpress_bridge.make_press(rule, 0.5, n_sink=4, window=8, seed=0)
    rotary = [module._modules.get("rotary_emb") for module in attention_modules(gemma)]
    decoder_rotary = gemma.model.rotary_emb
    ids = prompt(TOKENS)
    cache, _ = kvpress_bridge.press_cache(gemma, kvpress_bridge.PRESSES[rule], press, ids, seed=0)
    plain = DynamicCache(config=gemma.config)
    with torch.no_grad():
        gemma.model(input_ids=ids, past_key_values=plain, use_cache=True)
    held = [layer.keys.shape[2] for layer in cache.layers]
    assert held[0] == held[2] == SLIDING_WINDOW - 1
    assert all(held[index] < TOKENS for index in (1, 3))  # pressed
    for index in (0, 2):
        assert torch.equal(cache.layers[index].keys, plain.layers[index].keys)
    assert [module._modules.get("rotary_emb") for module in attention_modules(gemma)] == rotary
    assert gemma.model.rotary_emb is decoder_rotary and "forward_hook" not in vars(press)


def test_a_pressed_hybrid_cache_continues_causally(gemma):
    """Its full layers hold fewer tokens than its sliding ones have seen: no continuation token may see a later one,
    and the whole cache continues as one forward over context and continuation does."""
    from curkv_train.eval.compressed import batched_continuation_logits

    ids = prompt(TOKENS + 16)
    context, continuation = ids[:, :TOKENS], ids[:, TOKENS:]
    changed = continuation.clone()
    changed[:, -1] = (changed[:, -1] + 1) % gemma.config.vocab_size
    press = kvpress_bridge.make_press("snapkv", 0.7, n_sink=4, window=8, seed=0)
    logits = [batched_continuation_logits(gemma, [kvpress_bridge.press_cache(
        gemma, kvpress_bridge.PRESSES["snapkv"], press, context, seed=0)[0]], tokens, TOKENS)[0]
        for tokens in (continuation, changed)]
    assert torch.equal(logits[0][:, :-1], logits[1][:, :-1])
    full = DynamicCache(config=gemma.config)
    with torch.no_grad():
        gemma.model(input_ids=context, past_key_values=full, use_cache=True)
        whole = gemma(ids).logits[:, TOKENS:].float()
    assert torch.allclose(batched_continuation_logits(gemma, [full], continuation, TOKENS)[0], whole, atol=1e-4)


@pytest.mark.parametrize("uneven", [False, True])
def test_a_pressed_hybrid_cache_continues_in_one_forward_as_token_by_token(gemma, uneven):
    """The continuation's one forward (a mask per layer type, the full layers' fitted to each one's held tokens
    where they differ, as a layer-adaptive press leaves them) gives the logits of feeding the same tokens one at a
    time."""
    import copy

    from curkv_train.eval.compressed import continuation_logits

    ids = prompt(TOKENS + 16)
    context, continuation = ids[:, :TOKENS], ids[:, TOKENS:]
    press = kvpress_bridge.make_press("snapkv", 0.6, n_sink=4, window=8, seed=0)
    cache = kvpress_bridge.press_cache(gemma, kvpress_bridge.PRESSES["snapkv"], press, context, seed=0)[0]
    if uneven:  # layer 3 also drops its first 10 kept tokens after the sinks
        layer = cache.layers[3]
        layer.keys, layer.values = (torch.cat([each[:, :, :4], each[:, :, 14:]], dim=2)
                                    for each in (layer.keys, layer.values))
    assert (cache.layers[1].keys.shape[2] != cache.layers[3].keys.shape[2]) == uneven
    stepped, parts = copy.deepcopy(cache), []
    with torch.no_grad():
        for index in range(continuation.shape[1]):
            position = torch.tensor([TOKENS + index])
            parts.append(gemma(input_ids=continuation[:, index:index + 1], past_key_values=stepped, use_cache=True,
                               position_ids=position[None], cache_position=position).logits.float())
    torch.testing.assert_close(continuation_logits(gemma, cache, continuation, TOKENS), torch.cat(parts, dim=1),
                               atol=1e-4, rtol=1e-4)


def test_kvpress_refusing_a_model_is_one_line(gemma):
    """kvpress 0.5.5's KVzip refuses Gemma 3: the harness says so in one line, naming the press and the model."""
    from curkv_train.core.errors import CurKVError

    press = kvpress_bridge.make_press("kvzip", 0.5, n_sink=4, window=8, seed=0)
    with pytest.raises(CurKVError, match="KVzipPress refused Gemma3ForCausalLM") as refused:
        kvpress_bridge.press_cache(gemma, kvpress_bridge.PRESSES["kvzip"], press, prompt(TOKENS), seed=0)
    assert "\n" not in str(refused.value)


def test_a_masked_press_on_a_hybrid_model_counts_the_sliding_layers_windows(gemma):
    """AdaKV hides keys in the full layers only: the tokens it leaves visible, averaged over every layer, are the
    sliding layers' windows and the full layers' context less what it hides (as the dropping presses count)."""
    press = kvpress_bridge.make_press("adakv", 0.5, n_sink=4, window=8, seed=0)
    cache = kvpress_bridge.press_cache(gemma, kvpress_bridge.PRESSES["adakv"], press, prompt(TOKENS), seed=0)[0]
    hidden = sum(len(module.masked_key_indices[0]) for module in attention_modules(gemma)
                 if getattr(module, "masked_key_indices", None) is not None)
    assert hidden > 0
    expected = (2 * (SLIDING_WINDOW - 1) + 2 * TOKENS - hidden) / 4  # one KV head
    assert kvpress_bridge.masked_kept(gemma, cache) == pytest.approx(expected)
    assert kvpress_bridge.masked_kept(gemma, cache) < (2 * (SLIDING_WINDOW - 1) + 2 * TOKENS) / 4
    for module in attention_modules(gemma):
        module.masked_key_indices = None
