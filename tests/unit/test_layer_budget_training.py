"""Training under a layer budget (``model.layer_budget``): each layer keeps its own ρ_l, as at inference."""

import math

import pytest
import torch

from curkv_train.core.errors import CurKVError
from curkv_train.training.export import export
from curkv_train.models.base import TINY_RANDOM, tiny_llama_config
from curkv_train.models.seed_estimator import ValueEstimator
from curkv_train.training.objective import EVICTED_WEIGHT, BudgetController, TrainingSettings, keep_bias, streaming_keep_bias
from curkv_train.runtime import Scorer, load_scorer, model_fingerprint, save_scorer
from curkv_train.runtime.allocation import LayerBudget
from curkv_train.training.system import CurKVModule

pytestmark = pytest.mark.usefixtures("single_thread")
BUDGET = LayerBudget((0.1, 5.0), exponent=1.0)  # layer 1 is the sensitive one: it keeps more


def kept_per_layer(bias: torch.Tensor, compressible: torch.Tensor) -> list[int]:
    """Compressible tokens a hard bias keeps, per layer (the same in every head)."""
    kept = bias[..., compressible] > math.log(EVICTED_WEIGHT) / 2
    counts = kept.sum(dim=-1)
    assert (counts == counts[:, :1, :1]).all()
    return counts[:, 0, 0].tolist()


def test_keep_bias_keeps_each_layers_own_share():
    logits = torch.randn(3, 1, 2, 40, requires_grad=True)
    compressible = torch.ones(40, dtype=torch.bool)
    compressible[:4] = False
    ratios = (0.2, 0.55, 1.0)
    bias, scores = keep_bias(logits, compressible, temperature=1.0, keep_ratio=ratios, hard=True)
    assert kept_per_layer(bias, compressible) == [math.ceil(0.2 * 36), math.ceil(0.55 * 36), 36]
    for layer, ratio in enumerate(ratios):  # each layer is what it would be alone at its ratio
        alone, alone_scores = keep_bias(logits[layer:layer + 1], compressible, temperature=1.0, keep_ratio=ratio,
                                        hard=True)
        torch.testing.assert_close(bias[layer:layer + 1], alone)
        torch.testing.assert_close(scores[layer:layer + 1], alone_scores)
    bias.sum().backward()
    assert logits.grad[:2, ..., compressible].abs().sum() > 0  # straight-through gradients in every compressed layer


def test_streaming_rounds_keep_each_layers_own_share():
    round_logits = [torch.randn(2, 1, 2, end) for end in (96, 128)]
    ratios = (0.3, 0.7)
    options = dict(ends=[96, 128], n_sink=4, hot=32, temperature=1.0, hard=True, recent_share=0.5)
    bias, _ = streaming_keep_bias(round_logits, keep_ratio=ratios, **options)
    for layer, ratio in enumerate(ratios):
        alone, _ = streaming_keep_bias([logits[layer:layer + 1] for logits in round_logits], keep_ratio=ratio,
                                       **options)
        torch.testing.assert_close(bias[layer:layer + 1], alone)
    other, _ = streaming_keep_bias([logits[:1] for logits in round_logits], keep_ratio=0.7, **options)
    assert not torch.equal(bias[:1], other)  # the layers did not all get one ratio


@pytest.mark.parametrize("mode", ["two_sided", "hinge", "lagrange"])
def test_budget_term_targets_each_layers_ratio(mode):
    controller = BudgetController(2, 2, mode=mode)
    on_target = torch.tensor([[0.2, 0.2], [0.8, 0.8]])
    controller.dual_step(on_target, (0.2, 0.8))
    assert controller.multipliers.abs().sum() == 0
    assert controller(on_target, (0.2, 0.8), weight=1.0) == 0
    if mode != "lagrange":  # one ratio for both layers: layer 1 sits above it
        assert controller(on_target, 0.5, weight=1.0) > 0
    else:  # the multipliers move: down where layer 0 sits below ρ, up where layer 1 sits above
        controller.dual_step(on_target, 0.5)
        assert (controller.multipliers[0] < 0).all() and (controller.multipliers[1] > 0).all()


def budgeted_scorer(tmp_path, budget: LayerBudget | None = BUDGET):
    """A scorer folder for the tiny model (2 layers), with ``budget`` in its scorer.json."""
    config = tiny_llama_config()
    folder = tmp_path / "budgeted"
    save_scorer(Scorer(ValueEstimator(2, 2, 16, max_positions=2048), layer_budget=budget), folder,
                base_model=TINY_RANDOM, fingerprint=model_fingerprint(config))
    return folder


def test_training_step_compresses_each_layer_at_its_budgeted_ratio(tmp_path):
    module = CurKVModule(base_model=TINY_RANDOM, window=16, layer_budget=str(budgeted_scorer(tmp_path)))
    module.configure_model()
    assert module.layer_budget == BUDGET
    ids = torch.randint(0, 259, (1, 160), generator=torch.Generator().manual_seed(0))
    capture = module.capture_context(ids, 128)
    continuation = ids[:, 128:]
    seen, student_hidden = {}, module.student_hidden

    def recording_student(capture, continuation, bias):
        seen["bias"] = bias
        return student_hidden(capture, continuation, bias)

    module.student_hidden = recording_student
    settings = TrainingSettings(keep_ratio=0.5, hard_topk=True)
    out = module.distill(capture, continuation, module.teacher_hidden(capture, continuation), settings)
    compressible = module.compressible(capture)
    ratios = BUDGET.ratios(0.5)
    assert ratios[0] < 0.5 < ratios[1]
    assert kept_per_layer(seen["bias"], compressible) == [math.ceil(r * int(compressible.sum())) for r in ratios]
    assert torch.isfinite(out["loss"])


def test_export_carries_the_budget_trained_under(tmp_path):
    module = CurKVModule(base_model=TINY_RANDOM, window=16, layer_budget=str(budgeted_scorer(tmp_path)))
    module.configure_model()
    checkpoint = {"state_dict": module.state_dict(), "hyper_parameters": dict(module.hparams), "global_step": 1}
    module.on_save_checkpoint(checkpoint)
    path = tmp_path / "run" / "checkpoints" / "last.ckpt"
    path.parent.mkdir(parents=True)
    torch.save(checkpoint, path)
    exported = load_scorer(export(path, tmp_path / "exported"))
    assert exported.layer_budget == BUDGET
    assert exported.metadata["layer_budget"]["source"] == module.hparams.layer_budget  # where it was calibrated


def test_a_scorer_without_a_budget_is_refused(tmp_path):
    folder = budgeted_scorer(tmp_path, budget=None)
    with pytest.raises(CurKVError, match="has no layer budget: run curkv-train calibrate"):
        CurKVModule(base_model=TINY_RANDOM, window=16, layer_budget=str(folder)).configure_model()
