"""The training step gives the same loss and estimator gradients with the torch and triton backends.

The student's keys in layer l >= 1 are [frozen context cache | the continuation's own
keys], and the latter depend on the key bias through earlier layers, so this needs the
Triton kernel's dK and dV. Tiny model, context 40 + continuation 8, Triton under the
CPU interpreter (conftest sets TRITON_INTERPRET=1).
"""

from __future__ import annotations

import pytest
import torch

from curkv_train.training.objective import TrainingSettings
from curkv_train.training.system import CurKVModule

# fp32 base: the backends differ only in accumulation order (fused online softmax vs
# einsum). Measured: |loss difference| ~2e-8 (the KL is ~1e-4 to 1e-3), gradient
# differences <= 1e-6 of the tensor's largest entry. Detaching the continuation's K/V
# (i.e. dropping dK/dV) changes the KL gradients by >= 2e-2 of their largest entry.
LOSS_ATOL = 1e-6
GRAD_REL = 1e-5  # max |triton - torch| <= GRAD_REL * max |torch|, per parameter


def build(backend: str, state_dict: dict | None = None) -> CurKVModule:
    torch.manual_seed(0)
    module = CurKVModule(base_model="tiny-random-llama", window=8, n_sink=2, backend=backend)
    module.configure_model()
    if state_dict is not None:
        module.load_state_dict(state_dict)
    return module


@pytest.fixture(scope="module")
def modules():
    reference = build("torch")
    return reference, build("triton", reference.state_dict())


def distill_step(module: CurKVModule, hard: bool) -> dict:
    """One distill pass (context 40, continuation 8) and its backward.

    Returns:
        loss and kl (0-d), grads: estimator gradients of the loss by name, kl_grads:
        those of the KL alone (the part that flows through the attention).
    """
    ids = torch.randint(0, 259, (2, 48), generator=torch.Generator().manual_seed(3))
    module.estimator.zero_grad(set_to_none=True)
    capture = module.capture_context(ids, 40)
    continuation = ids[:, 40:]
    teacher = module.teacher_hidden(capture, continuation)
    out = module.distill(capture, continuation, teacher, TrainingSettings(keep_ratio=0.5, hard_topk=hard))
    names, params = zip(*module.estimator.named_parameters())
    kl_grads = torch.autograd.grad(out["kl"], params, retain_graph=True)
    out["loss"].backward()
    return {"loss": out["loss"].detach(), "kl": out["kl"].detach(),
            "grads": {name: p.grad.clone() for name, p in zip(names, params)},
            "kl_grads": dict(zip(names, kl_grads))}


def relative_errors(got: dict, want: dict) -> dict:
    """max |got - want| / max |want| per name."""
    return {name: ((got[name] - w).abs().max() / w.abs().max()).item() for name, w in want.items()}


@pytest.mark.parametrize("hard", [False, True], ids=["soft", "hard"])
def test_distill_loss_and_estimator_grads_match(modules, hard):
    torch_module, triton_module = modules
    for name, value in torch_module.estimator.state_dict().items():
        assert torch.equal(value, triton_module.estimator.state_dict()[name]), name
    want, got = distill_step(torch_module, hard), distill_step(triton_module, hard)
    assert want["kl"] > 10 * LOSS_ATOL
    for key in ("loss", "kl"):
        torch.testing.assert_close(got[key], want[key], atol=LOSS_ATOL, rtol=0)
    for key in ("grads", "kl_grads"):
        assert got[key].keys() == want[key].keys()
        assert all(g.abs().max() > 0 for g in want[key].values()), key
        errors = relative_errors(got[key], want[key])
        assert max(errors.values()) <= GRAD_REL, (key, errors)


def test_continuation_kv_gradients_matter(modules, monkeypatch):
    """Guard against a vacuous parity test: without dK/dV (the continuation's K/V detached
    in the student attention) the KL gradients move far beyond GRAD_REL."""
    import curkv_train.training.scored_attention as attention

    torch_module, _ = modules
    full = distill_step(torch_module, hard=False)["kl_grads"]
    scored_attention = attention.scored_attention

    def frozen_kv(q, k, v, bias, **kwargs):
        return scored_attention(q, k.detach(), v.detach(), bias, **kwargs)

    monkeypatch.setattr(attention, "scored_attention", frozen_kv)
    detached = distill_step(torch_module, hard=False)["kl_grads"]
    assert min(relative_errors(detached, full).values()) > 100 * GRAD_REL
