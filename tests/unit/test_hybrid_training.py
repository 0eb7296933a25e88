"""Hybrid and QK-norm bases through training: tiny random Gemma 3 (sliding-window and full-attention layers,
head_dim 256, one KV head, query_pre_attn_scalar scale) and Qwen3 (QK-norm, head_dim 256).

Sliding-window layers are never compressed: they attend as the plain model does in every pass, and only
full-attention layers get the student's bias, the budget term, the dense target and gradients.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, Gemma2Config

from curkv_train.core.errors import CurKVError
from curkv_train.core.observation import attention_module
from curkv_train.core.rope import rotate
from curkv_train.core.selection import kept_count
from curkv_train.models.base import TINY_RANDOM_GEMMA3, TINY_RANDOM_QWEN3, load_base_model
from curkv_train.training.capture import estimator_inputs
from curkv_train.training.objective import TrainingSettings, keep_bias
from curkv_train.training.scored_attention import (CompressionState, curkv_attention_forward, full_attention_layers,
                                                   patch_model)
from curkv_train.training.system import CurKVModule

CONTEXT, CONTINUATION = 48, 16  # past the tiny Gemma 3's sliding window of 16
TINY_BASES = (TINY_RANDOM_GEMMA3, TINY_RANDOM_QWEN3)


@pytest.fixture(scope="module", params=TINY_BASES)
def module(request, single_thread) -> CurKVModule:
    module = CurKVModule(base_model=request.param, n_sink=4, window=8, backend="torch")
    module.configure_model()
    return module


def token_ids(batch: int = 2) -> torch.Tensor:
    return torch.randint(3, 256, (batch, CONTEXT + CONTINUATION), generator=torch.Generator().manual_seed(0))


def test_the_tiny_bases_have_the_geometry_under_test():
    gemma = load_base_model(TINY_RANDOM_GEMMA3).config
    assert full_attention_layers(gemma) == [1, 3] and gemma.sliding_window < CONTEXT
    assert (gemma.head_dim, gemma.num_key_value_heads) == (256, 1)
    assert attention_module(load_base_model(TINY_RANDOM_GEMMA3), 1).scaling != gemma.head_dim ** -0.5
    qwen = load_base_model(TINY_RANDOM_QWEN3).config
    assert full_attention_layers(qwen) == [0, 1] and (qwen.head_dim, qwen.num_key_value_heads) == (256, 2)


def continuation_logits(module: CurKVModule, ids: torch.Tensor, keep_ratio: float) -> tuple[torch.Tensor, ...]:
    """(teacher, student) continuation logits at ``keep_ratio`` (soft scores, the estimator as initialised)."""
    capture = module.capture_context(ids, CONTEXT)
    continuation = ids[:, CONTEXT:]
    with torch.no_grad():
        teacher = module.teacher_hidden(capture, continuation)
        logits = module.full_rows(module.estimator(estimator_inputs(module.base, module.estimator, capture,
                                                                     "pre_rope")))
        bias, _ = keep_bias(logits, module.compressible(capture), temperature=1.0, keep_ratio=keep_ratio, hard=False)
        student = module.student_hidden(capture, continuation, bias)
    head = module.base.get_output_embeddings()
    return head(teacher), head(student)


def test_at_keep_one_the_student_is_the_plain_model(module):
    """Bias 0 everywhere: teacher and student both give the unpatched model's logits over the whole sequence,
    sliding windows included (the prompt is longer than the window)."""
    ids = token_ids()
    teacher, student = continuation_logits(module, ids, keep_ratio=1.0)
    plain = load_base_model(module.hparams.base_model)  # SDPA, its own cache and masks
    with torch.no_grad():
        expected = plain(ids).logits[:, CONTEXT:]
    torch.testing.assert_close(teacher, expected, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(student, expected, atol=2e-5, rtol=1e-4)


def test_the_prompt_exercises_gemmas_sliding_window():
    """Negative control: the same weights with a window covering the whole prompt give other logits."""
    ids = token_ids()
    windowed = load_base_model(TINY_RANDOM_GEMMA3)
    unbounded = load_base_model(TINY_RANDOM_GEMMA3)
    unbounded.config.sliding_window = 4096
    with torch.no_grad():
        difference = (windowed(ids).logits - unbounded(ids).logits)[:, CONTEXT:].abs().max()
    assert difference > 1e-3


def test_compression_moves_the_student(module):
    """Control for the test above: below keep 1 the student differs from the teacher."""
    teacher, student = continuation_logits(module, token_ids(), keep_ratio=0.5)
    assert (teacher - student).abs().max() > 1e-4


@pytest.mark.parametrize("settings, dense", [
    (TrainingSettings(keep_ratio=0.5), True),
    (TrainingSettings(keep_ratio=0.4, hard_topk=True, allocation="joint"), False),
    (TrainingSettings(keep_ratio=0.5, hard_topk=True, streaming_rounds=2, hot_windows=1, compress_every=1), False),
    (TrainingSettings(keep_ratio=0.5, hard_topk=True, streaming_rounds=2, hot_windows=1, compress_every=1,
                      recent_share=0.5, allocation="joint"), False),
], ids=["soft-dense", "hard-joint", "streaming", "streaming-joint"])
def test_a_training_step_reaches_full_layers_only(module, settings, dense):
    ids = token_ids()
    module.estimator.zero_grad()
    capture = module.capture_context(ids, CONTEXT)
    continuation = ids[:, CONTEXT:]
    target = module.dense_target(capture) if dense else None
    if dense:
        assert target.shape[0] == len(module.full_layers) and torch.isfinite(target).all()
    out = module.distill(capture, continuation, module.teacher_hidden(capture, continuation), settings, target)
    assert torch.isfinite(out["loss"]) and out["loss"] > 0
    out["loss"].backward()
    layers = len(module.base.config.layer_types)
    for name, parameter in module.estimator.named_parameters():
        if parameter.grad is None:
            continue
        per_layer = parameter.grad.reshape(layers, -1).abs().sum(dim=1)
        for layer in range(layers):
            assert (per_layer[layer] > 0) == (layer in module.full_layers), (name, layer)
    assert module.estimator.key_weight.grad is not None
    if settings.allocation == "joint" and not settings.streaming_rounds:  # ⌈ρ·N⌉ over the full layers' compressible tokens of each example
        n = int(module.compressible(capture).sum())
        per_example = len(module.full_layers) * module.base.config.num_key_value_heads * n
        kept = out["kept_layer"].sum() * n * module.base.config.num_key_value_heads
        assert out["kept_layer"].shape == (len(module.full_layers),)
        assert math.isclose(float(kept), kept_count(per_example, settings.keep_ratio), rel_tol=1e-6)


def reference_attention(module: torch.nn.Module, query, key, value, bias) -> torch.Tensor:
    """SDPA with a float mask: bias on every key, bottom-right causal among the continuation."""
    queries, keys = query.shape[2], key.shape[2]
    causal = torch.ones(queries, keys, dtype=torch.bool).tril(keys - queries)
    mask = bias[:, :, None, :].repeat_interleave(query.shape[1] // key.shape[1], dim=1)
    mask = mask.masked_fill(~causal, float("-inf"))
    out = F.scaled_dot_product_attention(query, key.repeat_interleave(query.shape[1] // key.shape[1], dim=1),
                                         value.repeat_interleave(query.shape[1] // key.shape[1], dim=1),
                                         attn_mask=mask, scale=module.scaling)
    return out.transpose(1, 2)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_a_full_layers_scored_attention_is_sdpa_with_the_bias_at_head_dim_256(backend):
    """Gemma 3's layer 1 (full attention, 2 query heads on 1 KV head, head_dim 256, its own logit scale)
    against SDPA with a float mask; the Triton path runs under TRITON_INTERPRET in the suite. Gradients of
    the bias, the queries and the keys too."""
    model = load_base_model(TINY_RANDOM_GEMMA3)
    generator = torch.Generator().manual_seed(1)
    queries, keys, context = 16, 48, 32
    query = torch.randn(1, 2, queries, 256, generator=generator, requires_grad=True)
    key = torch.randn(1, 1, keys, 256, generator=generator, requires_grad=True)
    value = torch.randn(1, 1, keys, 256, generator=generator)
    context_bias = (-3 * torch.rand(1, 1, context, generator=generator)).requires_grad_()
    state = CompressionState("scored", context, [None, context_bias, None, None], backend=backend)
    layer = attention_module(model, 1)
    out, _ = curkv_attention_forward(layer, query, key, value, None, scaling=layer.scaling, curkv_state=state)
    full_bias = torch.cat([context_bias, torch.zeros(1, 1, keys - context)], dim=-1)
    expected = reference_attention(layer, query, key, value, full_bias)
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=1e-4)
    weights = torch.randn(out.shape, generator=generator)
    got = torch.autograd.grad((out * weights).sum(), (context_bias, query, key))
    want = torch.autograd.grad((expected * weights).sum(), (context_bias, query, key))
    for name, a, b in zip(("bias", "query", "key"), got, want):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-3, msg=name)


def test_a_sliding_layer_ignores_the_bias():
    """Scored mode on Gemma 3's layer 0 (sliding window): plain attention, whatever bias the state holds."""
    model = load_base_model(TINY_RANDOM_GEMMA3)
    generator = torch.Generator().manual_seed(2)
    query = torch.randn(1, 2, 8, 256, generator=generator)
    key, value = torch.randn(2, 1, 1, 24, 256, generator=generator)
    layer = attention_module(model, 0)
    state = CompressionState("scored", 16, [torch.full((1, 1, 16), -20.0), None, None, None], backend="torch")
    out, _ = curkv_attention_forward(layer, query, key, value, None, scaling=layer.scaling, curkv_state=state)
    expected = reference_attention(layer, query, key, value, torch.zeros(1, 1, 24))
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=1e-4)


def test_pre_rope_keys_are_the_normalised_projections(module):
    """The capture's pre-RoPE keys rotate into the cached keys (k_norm applied, before RoPE)."""
    capture = module.capture_context(token_ids(1), CONTEXT)
    decoder = module.base.get_decoder()
    positions = torch.arange(CONTEXT)[None]
    gemma = module.hparams.base_model == TINY_RANDOM_GEMMA3
    for layer in range(len(decoder.config.layer_types)):
        kind = decoder.config.layer_types[layer]  # Gemma 3's local and global layers rotate with different bases
        cos, sin = decoder.rotary_emb(capture.values, positions, *([kind] if gemma else []))
        rotated = rotate(capture.pre_rope_keys[layer], cos[:, None], sin[:, None])
        torch.testing.assert_close(rotated, capture.cached_keys(layer).float(), atol=1e-5, rtol=1e-5)


def test_soft_capped_attention_is_refused():
    """Gemma 2 caps its attention logits, which the curkv attention does not: refused with a one-line error."""
    config = Gemma2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                          num_attention_heads=2, num_key_value_heads=1, head_dim=16, sliding_window=8)
    with pytest.raises(CurKVError, match="attn_logit_softcapping"):
        patch_model(AutoModelForCausalLM.from_config(config))


@pytest.mark.parametrize("layer_types, message", [(["sliding_attention"] * 2, "every layer"),
                                                   (["chunked_attention", "full_attention"], "chunked_attention")])
def test_bases_without_a_full_layer_or_with_other_layer_types_are_refused(layer_types, message):
    model = load_base_model(TINY_RANDOM_QWEN3)
    model.config.layer_types = layer_types
    with pytest.raises(CurKVError, match=message):
        patch_model(model)


def test_a_layer_budget_on_a_hybrid_base_is_refused():
    """The runtime refuses a layer budget on a hybrid model, so training does too (before reading the budget)."""
    module = CurKVModule(base_model=TINY_RANDOM_GEMMA3, layer_budget="checkpoints/any")
    with pytest.raises(CurKVError, match="layer budget on a hybrid base"):
        module.configure_model()
