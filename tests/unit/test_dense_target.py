"""The dense target (KVzip+ reconstruction scores), its ranking loss, and training steps of every family."""

import pytest
import torch

from curkv_train.training.scored_attention import patch_model
from curkv_train.core.features import head_output_norms
from curkv_train.core.selection import compressible_mask
from curkv_train.models.base import TINY_RANDOM, load_base_model
from curkv_train.training.capture import prefill_context, reconstruction_target
from curkv_train.models.families import FAMILIES
from curkv_train.training.objective import TrainingSettings, dense_loss
from curkv_train.training.system import CurKVModule

CONTEXT, PROMPT = 40, 5


def test_reconstruction_scores_are_the_eager_attention_maxima():
    """Scores == max over reconstruction queries and the group's heads of the eager model's attention × ||W_O v||."""
    base = patch_model(load_base_model(TINY_RANDOM))
    ids = torch.randint(0, 259, (2, CONTEXT), generator=torch.Generator().manual_seed(0))
    prompt = torch.arange(10, 10 + PROMPT)
    capture = prefill_context(base, ids)
    scores = reconstruction_target(base, capture, prompt, backend="torch")
    assert scores.shape == (2, 2, 2, CONTEXT)

    eager = load_base_model(TINY_RANDOM, attn_implementation="eager")
    full = torch.cat([ids, prompt.expand(2, -1), ids], dim=1)
    with torch.no_grad():
        out = eager(full, output_attentions=True, use_cache=True)
    for layer, attention in enumerate(out.attentions):
        rows = attention[:, :, CONTEXT:, :CONTEXT]  # reconstruction queries -> context keys
        values = out.past_key_values.layers[layer].values[:, :, :CONTEXT]
        weight = head_output_norms(eager.model.layers[layer].self_attn, values, 2)  # (b, kv, g, C)
        expected = (rows.reshape(2, 2, 2, -1, CONTEXT) * weight[:, :, :, None]).amax(dim=(2, 3))
        torch.testing.assert_close(scores[layer], expected, atol=1e-5, rtol=1e-4)
    assert capture.cache.get_seq_length() == CONTEXT  # cropped back for the teacher and the student


def test_dense_loss_grades_the_order_only():
    target = torch.rand(2, 1, 2, 30) + 1e-3
    compressible = compressible_mask(30, 2, 4)
    same_order = torch.log(target) * 3.0 + 7.0
    assert dense_loss(same_order, target, compressible).item() == pytest.approx(0.0, abs=1e-5)
    assert dense_loss(-same_order, target, compressible).item() == pytest.approx(2.0, abs=1e-5)
    random = dense_loss(torch.randn(2, 1, 2, 30), target, compressible).item()
    assert 0.3 < random < 1.7


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("warm_start", [False, True], ids=["distill+dense", "warm_start"])
def test_training_step_of_every_family_moves_its_estimator(family, warm_start):
    torch.manual_seed(0)
    options = {"observation_window": 8} if family == "query_aware" else {}
    module = CurKVModule(base_model=TINY_RANDOM, estimator=family, estimator_options=options, window=8, n_sink=2,
                         backend="torch", dense_weight=0.5, learning_rate=0.05)
    module.configure_model()
    module.apply_stage(TrainingSettings(keep_ratio=0.5, hard_topk=True, warm_start=warm_start))
    ids = torch.randint(0, 259, (2, CONTEXT + 12), generator=torch.Generator().manual_seed(3))
    module.log = module.log_dict = lambda *args, **kwargs: None
    loss = module.training_step({"input_ids": ids, "context_length": CONTEXT}, 0)
    assert torch.isfinite(loss) and loss > 0
    loss.backward()
    grads = {name: p.grad for name, p in module.estimator.named_parameters()}
    assert any(g is not None and g.abs().max() > 0 for g in grads.values())
    assert all(p.grad is None for p in module.base.parameters())
