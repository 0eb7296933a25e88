"""Metrics against hand-computed values on toy logits."""

from __future__ import annotations

import math

import pytest
import torch

from curkv_train.eval.metrics import continuation_sums, finalize, perplexity, token_kl, token_nll


def logits_of(probabilities: list[list[float]]) -> torch.Tensor:
    """(1, M, vocab) logits whose softmax is exactly ``probabilities``."""
    return torch.tensor(probabilities).log()[None]


def test_perplexity_from_known_logits():
    logits = logits_of([[0.5, 0.25, 0.25], [0.25, 0.25, 0.5]])
    nll = token_nll(logits, torch.tensor([[0, 1]]))
    assert torch.allclose(nll, torch.tensor([[math.log(2), math.log(4)]]))
    assert perplexity(float(nll.sum()), 2) == pytest.approx(2**1.5)


def test_kl_against_hand_value_and_zero_on_itself():
    reference = logits_of([[0.5, 0.5]])
    compressed = logits_of([[0.25, 0.75]])
    expected = 0.5 * math.log(0.5 / 0.25) + 0.5 * math.log(0.5 / 0.75)
    assert token_kl(reference, compressed).item() == pytest.approx(expected, rel=1e-6)
    assert token_kl(reference, reference).item() == pytest.approx(0.0, abs=1e-7)


def test_continuation_shift_and_answer_accuracy():
    # continuation tokens x, 0, 1, 2; logits at t predict token t + 1
    continuation = torch.tensor([[2, 0, 1, 2]])
    logits = logits_of([[0.6, 0.2, 0.2], [0.2, 0.6, 0.2], [0.6, 0.2, 0.2], [1 / 3, 1 / 3, 1 / 3]])
    sums = continuation_sums(logits, logits, continuation, answer=(1, 4))
    assert sums["tokens"] == 3
    assert sums["nll"] == pytest.approx(2 * math.log(1 / 0.6) + math.log(1 / 0.2), rel=1e-6)
    assert sums["answer_tokens"] == 3 and sums["answer_hits"] == 2 and sums["answer_exact"] == 0
    exact = continuation_sums(logits, logits, continuation, answer=(1, 3))
    assert exact["answer_hits"] == 2 and exact["answer_exact"] == 1
    with pytest.raises(ValueError):
        continuation_sums(logits, logits, continuation, answer=(0, 2))


def test_finalize_ppl_increase_accuracy_and_budget():
    full = {"examples": 2, "tokens": 10, "nll": 10 * math.log(4), "kl": 0.0, "kept_tokens": 200,
            "context_tokens": 200, "kv_bytes": 2000}
    compressed = {**full, "nll": 10 * math.log(5), "kl": 1.0, "kept_tokens": 100, "kv_bytes": 1000}
    metrics = finalize("ppl", compressed, full)
    assert metrics["ppl"] == pytest.approx(5.0)
    assert metrics["ppl_increase_pct"] == pytest.approx(25.0)
    assert metrics["kl"] == pytest.approx(0.1)
    assert metrics["kept_tokens"] == 50 and metrics["kv_bytes"] == 500
    passkey = finalize("passkey", {"examples": 4, "answer_exact": 3, "tokens": 4}, None)
    assert passkey["accuracy"] == 0.75
    span = finalize("span", {"examples": 1, "answer_tokens": 8, "answer_hits": 6, "answer_nll": 4.0}, None)
    assert span["token_accuracy"] == 0.75 and span["nll"] == 0.5
