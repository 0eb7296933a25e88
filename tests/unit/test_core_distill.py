"""The distillation step: teacher/student agreement, frozen base, estimator learning."""

import pytest
import torch

from curkv_train.core.rope import key_view
from curkv_train.core.selection import compressible_mask, kept_count, newest_places
from curkv_train.training.capture import prefill_context
from curkv_train.training.objective import TrainingSettings, chunked_kl, hard_keep_mask, keep_bias
from curkv_train.training.system import CurKVModule


@pytest.fixture()
def module():
    torch.manual_seed(0)
    system = CurKVModule(base_model="tiny-random-llama", window=8, n_sink=2, backend="torch", learning_rate=0.05)
    system.configure_model()
    return system


def batch(context=40, continuation=12, size=2):
    generator = torch.Generator().manual_seed(3)
    return torch.randint(0, 259, (size, context + continuation), generator=generator), context


def teacher_pass(module, ids, context):
    """(capture, continuation ids, teacher hidden states) of one batch."""
    capture = module.capture_context(ids, context)
    continuation = ids[:, context:]
    return capture, continuation, module.teacher_hidden(capture, continuation)


def student_logits(module, ids, context, bias):
    capture, continuation, teacher = teacher_pass(module, ids, context)
    student = module.student_hidden(capture, continuation, bias)
    head = module.base.get_output_embeddings()
    return head(teacher), head(student)


def test_keep_scores_of_one_give_teacher_logits(module):
    ids, context = batch()
    zero_bias = torch.zeros(2, 2, 2, context)  # log(1) on every key: (layers, batch, kv_heads, context)
    teacher, student = student_logits(module, ids, context, zero_bias)
    torch.testing.assert_close(student, teacher, atol=1e-5, rtol=1e-5)


def test_evicting_keys_changes_student(module):
    ids, context = batch()
    bias = torch.zeros(2, 2, 2, context)
    bias[..., 2:-8] = float("-inf")
    teacher, student = student_logits(module, ids, context, bias)
    assert (teacher - student).abs().max() > 1e-3


def test_keep_ratio_one_gives_zero_loss(module):
    ids, context = batch()
    capture, continuation, teacher = teacher_pass(module, ids, context)
    for hard in (False, True):
        out = module.distill(capture, continuation, teacher, TrainingSettings(keep_ratio=1.0, hard_topk=hard))
        assert out["loss"].item() == pytest.approx(0.0, abs=1e-6)


def test_training_step_updates_only_the_estimator(module):
    ids, context = batch()
    base_before = {name: p.clone() for name, p in module.base.named_parameters()}
    estimator_before = {name: p.clone() for name, p in module.estimator.named_parameters()}
    optimizer = module.configure_optimizers()
    capture, continuation, teacher = teacher_pass(module, ids, context)
    out = module.distill(capture, continuation, teacher, TrainingSettings(keep_ratio=0.5))
    out["loss"].backward()
    optimizer.step()
    for name, parameter in module.base.named_parameters():
        assert parameter.grad is None, name
        assert torch.equal(parameter, base_before[name]), name
    changed = [not torch.equal(p, estimator_before[n]) for n, p in module.estimator.named_parameters()]
    assert all(changed)


def test_hard_stage_keeps_exact_count_and_passes_gradient_to_evicted(module):
    logits = torch.randn(2, 1, 2, 30, requires_grad=True)
    compressible = compressible_mask(30, 2, 8)
    bias, scores = keep_bias(logits, compressible, temperature=1.0, keep_ratio=0.3, hard=True)
    kept = (bias[..., compressible] > -1).sum(dim=-1)
    assert torch.all(kept == kept_count(20, 0.3))
    assert torch.all(bias[..., ~compressible] == 0)
    bias.sum().backward()
    assert torch.all(logits.grad[..., compressible] != 0)


def test_kept_count_never_rounds_a_token_away():
    assert kept_count(10, 0.5) == 5
    assert kept_count(10, 0.51) == 6
    assert kept_count(3, 1 / 3) == 1
    assert hard_keep_mask(torch.arange(7.0), 0.3).tolist() == [0, 0, 0, 0, 1, 1, 1]  # ceil(2.1) = 3


def test_newest_places_are_the_newest_competing_tokens_of_each_row():
    competing = torch.tensor([[1, 0, 1, 1, 0, 1], [1, 1, 0, 0, 0, 0]], dtype=torch.bool)
    assert newest_places(competing, keep=4, recent_share=0.5).nonzero().tolist() == [[0, 3], [0, 5], [1, 0], [1, 1]]
    assert not newest_places(competing, keep=1, recent_share=0.5).any()  # ⌊0.5⌋ = 0


def test_chunked_kl_matches_direct_kl():
    head = torch.nn.Linear(8, 50, bias=False)
    teacher, student = torch.randn(2, 9, 8), torch.randn(2, 9, 8, requires_grad=True)
    direct = torch.nn.functional.kl_div(head(student).log_softmax(-1), head(teacher).log_softmax(-1),
                                        log_target=True, reduction="sum") / 18
    chunked = chunked_kl(teacher, student, head, chunk_size=4)
    torch.testing.assert_close(chunked, direct)
    chunked.backward()
    assert student.grad is not None


def test_pre_rope_key_view_recovers_projected_keys(module):
    ids, _ = batch(context=20, continuation=0, size=1)
    capture = prefill_context(module.base, ids)
    layer = module.base.model.layers[0]
    hidden = layer.input_layernorm(module.base.model.embed_tokens(ids))
    projected = layer.self_attn.k_proj(hidden).view(1, 20, 2, 16).transpose(1, 2)
    viewed = key_view(module.base, capture.cached_keys(0), capture.positions, "pre_rope")
    torch.testing.assert_close(viewed, projected, atol=1e-5, rtol=1e-5)
    relative = key_view(module.base, capture.cached_keys(0), capture.positions, "end_relative")
    assert relative.shape == projected.shape


def test_validation_measures_the_recipe_ratio_not_the_curriculum_one(module, monkeypatch):
    seen = []
    original = module.distill

    def spy(capture, continuation, teacher, settings, target=None):
        seen.append(settings.keep_ratio)
        return original(capture, continuation, teacher, settings, target)

    monkeypatch.setattr(module, "distill", spy)
    module.apply_stage(TrainingSettings(keep_ratio=0.3))  # what a curriculum stage would set
    ids, context = batch()
    module.validation_step({"input_ids": ids, "context_length": context}, 0)
    assert seen == [0.5, 0.5]
