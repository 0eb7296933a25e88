"""The joint allocation: the hard stage keeps ⌈ρ·N⌉ over every layer and KV head of an example, by score."""

import math

import pytest
import torch

from curkv_train.core.errors import CurKVError
from curkv_train.core.selection import (check_head_floor, compressible_mask, joint_floor_count, joint_keep_mask,
                                        kept_count, newest_places)
from curkv_train.models.base import TINY_RANDOM
from curkv_train.runtime import load_scorer
from curkv_train.runtime.joint import Competition, joint_choice
from curkv_train.training.callbacks.curriculum import Curriculum, Stage
from curkv_train.training.export import export
from curkv_train.training.objective import (EVICTED_WEIGHT, BudgetController, TrainingSettings, budget_keep,
                                            joint_round_kept, keep_bias, streaming_keep_bias)
from curkv_train.training.system import CurKVModule

pytestmark = pytest.mark.usefixtures("single_thread")
LAYERS, BATCH, HEADS, TOKENS = 3, 2, 2, 37


def kept(bias: torch.Tensor, compressible: torch.Tensor) -> torch.Tensor:
    """(layers, batch, kv_heads) compressible tokens a hard bias keeps."""
    return (bias[..., compressible] > math.log(EVICTED_WEIGHT) / 2).sum(dim=-1)


def random_logits(seed: int = 0, tokens: int = TOKENS) -> torch.Tensor:
    return torch.randn(LAYERS, BATCH, HEADS, tokens, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("keep_ratio", [0.1, 0.3, 0.5, 0.77])
@pytest.mark.parametrize("head_floor", [0.0, 0.1, 0.5, 1.0])
def test_joint_mask_keeps_the_joint_total_and_every_heads_floor(keep_ratio, head_floor):
    mask = joint_keep_mask(random_logits() * torch.rand(LAYERS, 1, HEADS, 1) * 4, keep_ratio, head_floor)
    per_head = mask.sum(dim=-1)  # (layers, batch, kv_heads)
    assert per_head.sum(dim=(0, 2)).tolist() == [kept_count(LAYERS * HEADS * TOKENS, keep_ratio)] * BATCH
    assert per_head.min() >= joint_floor_count(TOKENS, LAYERS * HEADS, keep_ratio, head_floor)
    assert set(mask.unique().tolist()) <= {0.0, 1.0}


def test_a_heads_floor_is_its_share_of_ceil_rho_n_capped_at_the_equal_split():
    assert joint_floor_count(100, 6, 0.5, 0.1) == 5  # ⌈0.1·0.5·100⌉
    assert joint_floor_count(100, 6, 0.5, 0.0) == 0
    # 2 heads of 3 tokens at ρ 0.5: ⌈1.5⌉ = 2 each would ask 4 of the 3 places; each gets ⌊3/2⌋ = 1
    assert joint_floor_count(3, 2, 0.5, 1.0) == 1
    mask = joint_keep_mask(torch.randn(1, 1, 2, 3), 0.5, 1.0)
    assert mask.sum() == 3 and mask.sum(dim=-1).min() >= 1


def test_a_low_scoring_head_keeps_its_floor_and_no_more():
    logits = random_logits(1, tokens=100)
    logits[1, :, 0] = -100.0  # layer 1, head 0 scores far below every other token
    keep_ratio, head_floor = 0.5, 0.2
    per_head = joint_keep_mask(logits, keep_ratio, head_floor).sum(dim=-1)
    assert per_head[1, :, 0].tolist() == [math.ceil(head_floor * keep_ratio * 100)] * BATCH
    # negative control: without a floor the head is emptied
    assert joint_keep_mask(logits, keep_ratio, 0.0).sum(dim=-1)[1, :, 0].tolist() == [0] * BATCH


def test_the_allocation_follows_the_scores():
    """The same logits in every head, one head's raised: the joint mask gives that head more, per head does not."""
    logits = random_logits(2)[:1, :, :1].expand(LAYERS, BATCH, HEADS, TOKENS).clone()
    logits[2, :, 1] += 3.0
    compressible = torch.ones(TOKENS, dtype=torch.bool)
    options = dict(temperature=1.0, keep_ratio=0.3, hard=True)
    joint = kept(keep_bias(logits, compressible, allocation="joint", head_floor=0.1, **options)[0], compressible)
    others = joint.clone()
    others[2, :, 1] = -1
    assert (joint[2, :, 1] > others.amax(dim=(0, 2))).all()
    per_head = kept(keep_bias(logits, compressible, **options)[0], compressible)
    assert (per_head == kept_count(TOKENS, 0.3)).all()


def test_gradients_reach_every_compressible_logit_through_the_joint_mask():
    logits = random_logits(3).requires_grad_()
    compressible = compressible_mask(TOKENS, 2, 5)
    bias, scores = keep_bias(logits, compressible, temperature=2.0, keep_ratio=0.4, hard=True, allocation="joint")
    assert kept(bias, compressible).sum(dim=(0, 2)).tolist() == [kept_count(LAYERS * HEADS * 30, 0.4)] * BATCH
    assert torch.all(bias[..., ~compressible] == 0)
    bias.sum().backward()
    assert torch.all(logits.grad[..., compressible] != 0) and torch.all(logits.grad[..., ~compressible] == 0)


def test_soft_stages_hold_the_mean_over_everything_under_joint():
    scores = torch.tensor([0.2, 0.8]).reshape(1, 1, 2, 1).expand(2, 3, 2, 5)  # heads apart, overall mean 0.5
    controller = BudgetController(2, 2)
    assert controller(budget_keep(scores, "joint"), 0.5, weight=1.0) == 0
    assert controller(budget_keep(scores), 0.5, weight=1.0) > 0  # per head: each head is held at ρ
    lagrange = BudgetController(2, 2, mode="lagrange")
    lagrange.dual_step(budget_keep(scores, "joint"), 0.4)
    assert torch.allclose(lagrange.multipliers, torch.full((2, 2), 0.05 * 0.1))  # one gap for every head


@pytest.mark.parametrize("head_floor", [-0.1, 1.5, True, "0.1"])
def test_a_floor_outside_zero_one_is_refused(head_floor):
    with pytest.raises(CurKVError, match=r"head_floor must be in \[0, 1\]"):
        check_head_floor(head_floor)
    with pytest.raises(CurKVError, match="curriculum stage 0: head_floor"):
        Curriculum([Stage(steps=1, head_floor=head_floor)])


def test_an_unknown_allocation_is_refused():
    with pytest.raises(CurKVError, match="unknown allocation 'global'; expected one of per_head, joint"):
        Curriculum([Stage(steps=1, allocation="global")])


@pytest.fixture()
def module():
    torch.manual_seed(0)
    system = CurKVModule(base_model=TINY_RANDOM, window=8, n_sink=2, backend="torch")
    system.configure_model()
    return system


def test_the_model_refuses_a_bad_floor_and_takes_joint_with_streaming_rounds(module):
    with pytest.raises(CurKVError, match="head_floor must be in"):
        CurKVModule(base_model=TINY_RANDOM, allocation="joint", head_floor=2.0)
    module.apply_stage(TrainingSettings(allocation="joint", streaming_rounds=2))
    assert module.settings.allocation == "joint" and module.settings.streaming_rounds == 2


def ragged_round(seed: int, count: int = 9, width: int = 20):
    """Scores, held tokens (each head already ragged) and the newest places of one later streaming round."""
    generator = torch.Generator().manual_seed(seed)
    z = torch.randn(LAYERS, BATCH, HEADS, width, generator=generator)
    held = torch.rand(LAYERS, BATCH, HEADS, width, generator=generator) < 0.8
    return z, held, newest_places(held, count, 0.25)


@pytest.mark.parametrize("head_floor", [0.0, 0.3, 1.0])
def test_a_later_streaming_round_chooses_what_the_runtime_cache_chooses(head_floor):
    count = 9
    z, held, newest = ragged_round(4, count)
    kept_places = joint_round_kept(z, held, newest, count, head_floor, across_layers=False).bool()
    for layer in range(LAYERS):
        competition = Competition(candidates=held[layer].sum(-1), recent=newest[layer].sum(-1), target=count, n_sink=0)
        chosen = joint_choice(z[layer], held[layer] & ~newest[layer], competition.places(),
                              competition.floor(head_floor))
        assert torch.equal(kept_places[layer], chosen | newest[layer])
    assert not (kept_places & ~held).any()


def test_a_first_streaming_round_shares_its_places_over_every_layer_and_head():
    z = random_logits(5, tokens=20)
    z[0, :, 1] += 5.0  # one head of one layer outranks the rest
    everyone = torch.ones_like(z, dtype=torch.bool)
    newest = newest_places(everyone, 8, 0.25)
    kept_places = joint_round_kept(z, everyone, newest, 8, 0.1, across_layers=True)
    per_head = kept_places.sum(-1)
    assert per_head.sum(dim=(0, 2)).tolist() == [LAYERS * HEADS * 8] * BATCH
    assert (per_head[0, :, 1] > 8).all() and (per_head >= 2 + math.ceil(0.1 * 6)).all()
    assert (kept_places.bool() | ~newest).all()  # the newest places always stay


def test_joint_streaming_rounds_keep_the_per_head_total_and_never_revive_a_token():
    generator = torch.Generator().manual_seed(6)
    ends = [24, 32, 40]
    logits = [torch.randn(LAYERS, BATCH, HEADS, end, generator=generator) * torch.tensor([1.0, 4.0]).view(1, 1, 2, 1)
              for end in ends]
    options = dict(n_sink=2, hot=4, temperature=1.0, keep_ratio=0.4, hard=True, recent_share=0.25)
    joint, _ = streaming_keep_bias(logits, ends, allocation="joint", head_floor=0.1, **options)
    per_head, _ = streaming_keep_bias(logits, ends, **options)
    threshold = math.log(EVICTED_WEIGHT) / 2
    span = slice(2, 36)
    joint_kept, head_kept = (joint[..., span] > threshold).sum(-1), (per_head[..., span] > threshold).sum(-1)
    assert torch.equal(joint_kept.sum(-1), head_kept.sum(-1))  # each layer holds what one count per head holds
    assert (joint_kept != head_kept).any()  # and the heads hold different counts


def test_joint_with_a_layer_budget_is_refused():
    compressible = torch.ones(TOKENS, dtype=torch.bool)
    with pytest.raises(CurKVError, match="drop model.layer_budget"):
        keep_bias(random_logits(), compressible, temperature=1.0, keep_ratio=(0.3, 0.5, 0.7), hard=True,
                  allocation="joint")


class FakeTrainer:
    global_step, datamodule = 0, None


def test_a_curriculum_stage_with_joint_reaches_the_objective(module):
    curriculum = Curriculum([Stage(steps=1, keep_ratio=0.5), Stage(steps=1, keep_ratio=0.3, hard_topk=True,
                                                                    allocation="joint", head_floor=0.25)])
    trainer = FakeTrainer()
    curriculum.apply(trainer, module, 0)
    assert module.settings.allocation == "per_head"
    curriculum.apply(trainer, module, 1)
    assert (module.settings.allocation, module.settings.head_floor) == ("joint", 0.25)

    ids = torch.randint(0, 259, (2, 52), generator=torch.Generator().manual_seed(3))
    capture = module.capture_context(ids, 40)
    seen, student_hidden = {}, module.student_hidden

    def recording_student(capture, continuation, bias):
        seen["bias"] = bias
        return student_hidden(capture, continuation, bias)

    module.student_hidden = recording_student
    try:
        out = module.distill(capture, ids[:, 40:], module.teacher_hidden(capture, ids[:, 40:]), module.settings)
    finally:
        module.student_hidden = student_hidden
    compressible = module.compressible(capture)
    n, heads = int(compressible.sum()), 2 * 2  # tiny model: 2 layers × 2 KV heads
    per_head = kept(seen["bias"], compressible)
    assert per_head.sum(dim=(0, 2)).tolist() == [kept_count(heads * n, 0.3)] * 2
    assert per_head.min() >= joint_floor_count(n, heads, 0.3, 0.25)
    assert out["mean_keep"].shape == (1, 1)  # the budget holds the mean over everything
    assert torch.allclose(out["kept_layer"].mean(), torch.tensor(kept_count(heads * n, 0.3) / (heads * n)))
    out["loss"].backward()
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in module.estimator.parameters())
    module.estimator.zero_grad()


def test_export_records_the_allocation(tmp_path):
    module = CurKVModule(base_model=TINY_RANDOM, window=16, hard_topk=True, allocation="joint", head_floor=0.2)
    module.configure_model()
    checkpoint = {"state_dict": module.state_dict(), "hyper_parameters": dict(module.hparams), "global_step": 1}
    module.on_save_checkpoint(checkpoint)
    path = tmp_path / "run" / "checkpoints" / "last.ckpt"
    path.parent.mkdir(parents=True)
    torch.save(checkpoint, path)
    scorer = load_scorer(export(path, tmp_path / "exported"))
    settings = scorer.metadata["training"]["last_step_settings"]
    assert (settings["allocation"], settings["head_floor"]) == ("joint", 0.2)
    assert (scorer.allocation, scorer.head_floor) == ("joint", 0.2)  # what the runtime cache defaults to
