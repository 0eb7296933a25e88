"""Per-token measures of a continuation, their per-example sums, and the task metrics built from sums.

The logits at position t predict token t + 1, so M continuation tokens give M − 1 scored predictions, and
an answer span [start, end) is predicted by the logits at [start − 1, end − 1). Every example's sums are
kept, so a metric can be computed over any multiset of examples (a bootstrap resample).
"""

from __future__ import annotations

import numpy as np
import torch

# Sums accumulated per (method, ratio, task[, tag]) over examples.
SUM_KEYS = ("examples", "tokens", "nll", "kl", "answer_tokens", "answer_hits", "answer_nll", "answer_exact",
            "kept_tokens", "context_tokens", "kv_bytes", "prefill_seconds")


def token_nll(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Negative log-likelihood per prediction: logits (batch, M, vocab), targets (batch, M) -> (batch, M)."""
    logp = logits.float().log_softmax(dim=-1)
    return -logp.gather(-1, targets[..., None]).squeeze(-1)


def token_kl(reference_logits: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """KL(p_reference ‖ p) per prediction: (batch, M, vocab) twice -> (batch, M)."""
    reference = reference_logits.float().log_softmax(dim=-1)
    compressed = logits.float().log_softmax(dim=-1)
    return (reference.exp() * (reference - compressed)).sum(dim=-1)


def perplexity(nll_sum, count):
    """exp(mean NLL); NaN without predictions. Numbers or arrays (elementwise)."""
    return _number(np.exp(_ratio(nll_sum, count)))


def continuation_sums(logits: torch.Tensor, reference_logits: torch.Tensor, continuation_ids: torch.Tensor,
                      answer: tuple[int, int] | None) -> dict[str, float]:
    """Sums of one example's measures: tokens / nll / kl over the M − 1 predictions of ``logits`` (batch, M, vocab)
    against ``reference_logits`` (the full cache's) and ``continuation_ids`` (batch, M); with an ``answer`` span
    [start, end) (start ≥ 1), answer_tokens / answer_hits / answer_nll / answer_exact (all its tokens the argmax)."""
    predicted, targets = logits[:, :-1], continuation_ids[:, 1:]
    nll = token_nll(predicted, targets)
    sums = {"examples": float(targets.shape[0]), "tokens": float(targets.numel()), "nll": float(nll.sum()),
            "kl": float(token_kl(reference_logits[:, :-1], predicted).sum())}
    if answer is not None:
        start, end = answer
        if start < 1 or end <= start or end > continuation_ids.shape[1]:
            raise ValueError(f"answer span [{start}, {end}) must lie in [1, {continuation_ids.shape[1]}]")
        rows = slice(start - 1, end - 1)
        hits = predicted[:, rows].argmax(dim=-1) == targets[:, rows]  # teacher-forced greedy hits
        sums.update(answer_tokens=float(hits.numel()), answer_hits=float(hits.sum()),
                    answer_nll=float(nll[:, rows].sum()), answer_exact=float(hits.all(dim=-1).sum()))
    return sums


class ExampleSums:
    """Every example's sums per (method, ratio, task), in example order; a key an example lacks (the answer keys
    of perplexity tasks) counts 0 for it, and :meth:`sums` returns only the keys some example had."""

    def __init__(self) -> None:
        self.cells: dict[tuple[str, float, str], list[dict[str, float]]] = {}

    def add(self, method: str, ratio: float, task: str, sums: dict[str, float]) -> None:
        """Append one example's ``sums`` to cell (method, ratio, task)."""
        unknown = set(sums) - set(SUM_KEYS)
        if unknown:
            raise ValueError(f"unknown sum keys {sorted(unknown)}; expected a subset of {SUM_KEYS}")
        self.cells.setdefault((method, ratio, task), []).append(dict(sums))

    def sums(self, method: str, ratio: float, task: str) -> dict[str, np.ndarray]:
        """Key -> (examples,) float64 per-example sums of the cell (empty if it has none)."""
        examples = self.cells.get((method, ratio, task), [])
        keys = [key for key in SUM_KEYS if any(key in example for example in examples)]
        return {key: np.array([example.get(key, 0.0) for example in examples], dtype=np.float64) for key in keys}


def total(sums: dict[str, np.ndarray], weights: np.ndarray | None = None) -> dict:
    """Sums over examples: numbers, or with ``weights`` (resamples, examples) one total per resample."""
    if weights is None:
        return {key: float(np.sum(values)) for key, values in sums.items()}
    return {key: weights @ values for key, values in sums.items()}


def _number(value):
    """A 0-d result as a Python float; arrays unchanged."""
    return float(value) if np.ndim(value) == 0 else value


def _ratio(numerator, denominator):
    """numerator / denominator, NaN where the denominator is 0; numbers or arrays."""
    numerator, denominator = np.asarray(numerator, dtype=np.float64), np.asarray(denominator, dtype=np.float64)
    safe = np.where(denominator != 0, denominator, 1.0)
    return _number(np.where(denominator != 0, numerator / safe, np.nan))


def finalize(task_kind: str, sums: dict, full: dict | None) -> dict:
    """Task metrics from summed ``sums`` (``full``: the full cache's sums of the same examples), numbers or arrays (per
    example or bootstrap resample) alike: ``ppl`` (perplexity, its increase over full %), ``passkey`` (accuracy),
    ``span`` (answer token accuracy and NLL); every kind also kl, kept tokens, bytes held and, if timed, prefill time.
    """
    metrics: dict[str, float] = {}
    if task_kind == "ppl":
        metrics["ppl"] = perplexity(sums.get("nll", 0.0), sums.get("tokens", 0.0))
        if full is not None:
            reference = perplexity(full.get("nll", 0.0), full.get("tokens", 0.0))
            metrics["ppl_increase_pct"] = _number(100.0 * (np.asarray(metrics["ppl"]) / reference - 1.0))
    elif task_kind == "passkey":
        metrics["accuracy"] = _ratio(sums.get("answer_exact", 0.0), sums.get("examples", 0.0))
    elif task_kind == "span":
        metrics["token_accuracy"] = _ratio(sums.get("answer_hits", 0.0), sums.get("answer_tokens", 0.0))
        metrics["nll"] = _ratio(sums.get("answer_nll", 0.0), sums.get("answer_tokens", 0.0))
    else:
        raise ValueError(f"unknown task kind {task_kind!r}")
    metrics["kl"] = _ratio(sums.get("kl", 0.0), sums.get("tokens", 0.0))
    metrics["kept_tokens"] = _ratio(sums.get("kept_tokens", 0.0), sums.get("examples", 0.0))
    metrics["context_tokens"] = _ratio(sums.get("context_tokens", 0.0), sums.get("examples", 0.0))
    metrics["kv_bytes"] = _ratio(sums.get("kv_bytes", 0.0), sums.get("examples", 0.0))
    if "prefill_seconds" in sums:
        metrics["prefill_seconds"] = _ratio(sums["prefill_seconds"], sums.get("examples", 0.0))
    return metrics
