"""The distillation objective (DESIGN §4): chunked KL, budget control, keep biases, the dense ranking term."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from curkv_train.core.errors import CurKVError
from curkv_train.core.selection import joint_keep_mask, kept_count, newest_places, share_of_compressible

BUDGET_MODES = ("two_sided", "hinge", "lagrange")
# Keep weight of an evicted token in the hard stage: small enough to leave the
# forward pass as top-k does, large enough that log(weight) keeps the gradient
# an evicted token would get if it were put back (straight-through in weight space).
EVICTED_WEIGHT = 1e-6
# Added to reconstruction scores before the log: attention shares below it count as "never read".
DENSE_FLOOR = 1e-6


@dataclass(frozen=True)
class TrainingSettings:
    """The knobs of the objective a curriculum changes from step to step.

    Attributes:
        keep_ratio: target ρ = kept / compressible tokens.
        temperature: score temperature T in s = σ(z / T).
        hard_topk: exact top-⌈ρ·n⌉ forward with straight-through gradients.
        budget_weight: λ of the budget penalty.
        warm_start: only the dense ranking term (no continuation, no backward through the LLM).
        streaming_rounds: compress the context the way CurKVCache compresses a growing one, in
            this many rounds at ends ``compress_every`` windows apart (0: one selection after the prefill).
        hot_windows: with streaming rounds, the recent windows each round protects (the cache's hot tier).
        compress_every: with streaming rounds, windows between two rounds (the cache's ``compress_every``).
        recent_share: with streaming rounds, the share of each round's kept places given to the newest
            competing tokens (the cache's ``recent_share``; 0: every place by score).
        count_protected: with streaming rounds, sinks and hot tier count inside ρ, as CurKVCache counts
            them; False: ρ of the competing span only (the smollm2-135m recipe trains so).
        allocation: where the hard stage's kept places go: ``per_head`` (⌈ρ·n⌉ in every layer and KV head)
            or ``joint`` (⌈ρ·N⌉ over all of an example's layers and KV heads, by score; the budget term
            then holds the mean keep over everything at ρ).
        head_floor: with ``joint``, the share of its ⌈ρ·n⌉ every head keeps whatever the others score, in [0, 1].
    """

    keep_ratio: float = 0.5
    temperature: float = 1.0
    hard_topk: bool = False
    budget_weight: float = 0.4
    warm_start: bool = False
    streaming_rounds: int = 0
    hot_windows: int = 2
    compress_every: int = 2
    recent_share: float = 0.0
    count_protected: bool = True
    allocation: str = "per_head"
    head_floor: float = 0.1


def _chunk_kl(teacher_hidden: torch.Tensor, student_hidden: torch.Tensor, lm_head: nn.Module) -> torch.Tensor:
    """Summed KL(teacher ‖ student) over the tokens of one chunk of hidden states."""
    teacher_logp = lm_head(teacher_hidden).float().log_softmax(dim=-1)
    student_logp = lm_head(student_hidden).float().log_softmax(dim=-1)
    return (teacher_logp.exp() * (teacher_logp - student_logp)).sum()


def chunked_kl(
    teacher_hidden: torch.Tensor, student_hidden: torch.Tensor, lm_head: nn.Module, chunk_size: int = 64
) -> torch.Tensor:
    """Mean per-token KL(p_teacher ‖ p_student) without holding all logits at once.

    Each chunk's logits are recomputed in backward (activation checkpointing), so at
    most ``chunk_size`` tokens × vocabulary logits live at a time.

    Args:
        teacher_hidden, student_hidden: (batch, tokens, hidden) last hidden states.
        lm_head: the model's output projection.
    """
    batch, tokens, hidden = student_hidden.shape
    teacher_flat = teacher_hidden.reshape(-1, hidden)
    student_flat = student_hidden.reshape(-1, hidden)
    total = student_hidden.new_zeros((), dtype=torch.float32)
    for start in range(0, teacher_flat.shape[0], chunk_size):
        stop = start + chunk_size
        total = total + checkpoint(
            _chunk_kl, teacher_flat[start:stop], student_flat[start:stop], lm_head, use_reentrant=False
        )
    return total / (batch * tokens)


def hard_keep_mask(logits: torch.Tensor, keep_ratio: float) -> torch.Tensor:
    """Top-⌈ρ·n⌉ of ``logits`` (..., n) along the last dim as a 0/1 float mask."""
    count = kept_count(logits.shape[-1], keep_ratio)
    mask = torch.zeros_like(logits)
    if count > 0:
        mask.scatter_(-1, logits.topk(count, dim=-1).indices, 1.0)
    return mask


KeepRatio = float | Sequence[float]


def _layer_by_layer(keep_ratio: Sequence[float],
                    bias_of_layer: Callable[[slice, float], tuple[torch.Tensor, torch.Tensor]]
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """(bias, scores) of every layer at its own keep ratio, concatenated along the layer dim.

    ``bias_of_layer(layers, ratio)`` computes one layer's pair from the ``layers`` slice of its inputs.
    """
    parts = [bias_of_layer(slice(layer, layer + 1), float(ratio)) for layer, ratio in enumerate(keep_ratio)]
    return torch.cat([bias for bias, _ in parts]), torch.cat([scores for _, scores in parts])


def keep_bias(
    logits: torch.Tensor,
    compressible: torch.Tensor,
    *,
    temperature: float,
    keep_ratio: KeepRatio,
    hard: bool,
    allocation: str = "per_head",
    head_floor: float = 0.1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention biases on context keys from estimator logits.

    Args:
        logits: (layers, batch, kv_heads, context) estimator logits z.
        compressible: (context,) bool mask of compressible tokens.
        keep_ratio: ρ for every layer, or one ρ_l per layer (a layer budget's split; ``per_head`` only).
        allocation: with ``hard``, ``per_head`` keeps the top-⌈ρ·n⌉ of every (layer, KV head); ``joint``
            the top-⌈ρ·N⌉ of each example's N compressible tokens over all of them, every head keeping at
            least its floor (:func:`~curkv_train.core.selection.joint_keep_mask`).
        head_floor: the joint allocation's per-head floor, a share of the head's ⌈ρ·n⌉.

    Returns:
        (bias, scores): bias (layers, batch, kv_heads, context) = log keep weight on
        compressible keys, 0 on sinks / window; scores (layers, batch, kv_heads, n_compressible)
        = σ(z/T) on the compressible tokens. With ``hard``, the forward keeps exactly
        the top-⌈ρ·n⌉ tokens and gradients pass straight through to the soft scores.
        With ρ = 1 nothing is compressed and the bias is 0.
    """
    if isinstance(keep_ratio, Sequence):
        if allocation == "joint":
            raise CurKVError("allocation joint chooses each layer's share itself; drop model.layer_budget "
                             "or train with allocation per_head")
        return _layer_by_layer(keep_ratio, lambda layers, ratio: keep_bias(
            logits[layers], compressible, temperature=temperature, keep_ratio=ratio, hard=hard))
    scores = torch.sigmoid(logits[..., compressible] / temperature)
    bias = torch.zeros_like(logits)
    if keep_ratio >= 1.0:
        return bias, scores
    if hard:
        competing = logits[..., compressible]
        mask = (joint_keep_mask(competing, keep_ratio, head_floor) if allocation == "joint"
                else hard_keep_mask(competing, keep_ratio))
        weight = mask * (1 - EVICTED_WEIGHT) + EVICTED_WEIGHT + scores - scores.detach()
    else:
        weight = scores
    bias[..., compressible] = torch.log(weight.clamp_min(torch.finfo(torch.float32).tiny))
    return bias, scores


def streaming_ends(context_length: int, rounds: int, stride: int) -> list[int]:
    """The ends of ``rounds`` compression rounds ``stride`` tokens apart, the last at the context's end."""
    return [context_length - (rounds - 1 - index) * stride for index in range(rounds)]


def joint_round_kept(z: torch.Tensor, competing: torch.Tensor, newest: torch.Tensor, count: int, head_floor: float,
                     *, across_layers: bool) -> torch.Tensor:
    """One streaming round's kept places under the joint allocation, as CurKVCache chooses them.

    Each (layer, KV head) would keep ``count`` under ``per_head``; here a group shares the places its heads would
    fill by score together (at most what they hold), each head first keeping its own top ⌈floor·(count − recent)⌉:
    the group is every layer and KV head of an example (``across_layers``: a prefill's first compression) or each
    layer's KV heads (a later one).

    Args:
        z: (layers, batch, kv_heads, m) scores of the round's span.
        competing: (layers, batch, kv_heads, m) bool, tokens still held (earlier rounds evicted the rest).
        newest: (layers, batch, kv_heads, m) bool, the newest places kept whatever their score.
        count: tokens one head keeps from the span, ``newest`` included.

    Returns:
        (layers, batch, kv_heads, m) 0/1 float, the kept places (``newest`` included).
    """
    layers, batch, heads, width = z.shape
    group_heads = layers * heads if across_layers else heads

    def grouped(tensor: torch.Tensor) -> torch.Tensor:  # (batch, groups, group_heads, width)
        return tensor.transpose(0, 1).reshape(batch, -1, group_heads, width)

    held, fixed = grouped(competing), grouped(newest)
    places = torch.clamp(held.sum((-2, -1)), max=group_heads * count) - fixed.sum((-2, -1))
    floor = math.ceil(head_floor * max(0, count - int(newest.sum(-1).max())) - 1e-9)
    floor = min(floor, int(places.min()) // group_heads)
    open_places = held & ~fixed
    ranked = grouped(z).float().masked_fill(~open_places, float("-inf"))
    if floor > 0:  # each head's own top ``floor`` outrank every other token of the group
        top = ranked.topk(min(floor, width), dim=-1).indices
        ranked = ranked.scatter(-1, top, float("inf")).masked_fill(~open_places, float("-inf"))
    flat = ranked.flatten(-2)
    take = (torch.arange(flat.shape[-1], device=z.device) < places[..., None]).float()
    kept = torch.zeros_like(flat).scatter_(-1, flat.argsort(dim=-1, descending=True), take)
    kept = kept.view_as(ranked) + fixed.float()
    return kept.reshape(batch, layers, heads, width).transpose(0, 1).contiguous()


def streaming_keep_bias(round_logits: list[torch.Tensor], ends: list[int], *, n_sink: int, hot: int,
                        temperature: float, keep_ratio: KeepRatio, hard: bool,
                        recent_share: float = 0.0, count_protected: bool = True, allocation: str = "per_head",
                        head_floor: float = 0.1) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention biases of a context compressed in rounds, as CurKVCache compresses it while it grows.

    At round r (sequence end e_r) the tokens in [n_sink, e_r − hot) that survived the earlier
    rounds compete, scored by that round's logits, and as many stay as make ρ of the e_r tokens
    held, sinks and hot tier counted inside the budget as CurKVCache counts them
    (:func:`share_of_compressible`; with ``count_protected`` False, ⌈ρ·(e_r − hot − n_sink)⌉ of them);
    the newest ⌊recent_share·kept⌋ of them stay whatever their score
    (:func:`newest_places`, with weight 1 and no gradient), and evicted tokens never come back. A
    token's log keep weight is the sum over the rounds it competed in (hard: straight-through top-k
    per round; soft: σ(z/T) per round, i.e. the product of its keep probabilities).

    Args:
        round_logits: per round, (layers, batch, kv_heads, e_r) logits scored at end e_r.
        ends: the rounds' ends, increasing; the last is the context length.
        hot: tokens before each end that are protected (the cache's hot tier).
        keep_ratio: ρ for every layer, or one ρ_l per layer (a layer budget's split; ``per_head`` only).
        allocation: ``per_head``: every (layer, KV head) keeps the same count each round; ``joint``: the first
            round's places are shared by every layer and KV head, a later round's by each layer's KV heads
            (:func:`joint_round_kept`, as CurKVCache under ``TierConfig(allocation="joint")``).
        head_floor: the joint allocation's per-head floor.

    Returns:
        (bias (layers, batch, kv_heads, context), scores (layers, batch, kv_heads, n) = σ(z/T) of
        the last round on its n competing positions, for the budget term).
    """
    if isinstance(keep_ratio, Sequence):
        if allocation == "joint":
            raise CurKVError("allocation joint chooses each layer's share itself; drop model.layer_budget "
                             "or train with allocation per_head")
        return _layer_by_layer(keep_ratio, lambda layers, ratio: streaming_keep_bias(
            [logits[layers] for logits in round_logits], ends, n_sink=n_sink, hot=hot, temperature=temperature,
            keep_ratio=ratio, hard=hard, recent_share=recent_share, count_protected=count_protected))
    context = ends[-1]
    bias = torch.zeros(*round_logits[-1].shape[:-1], context, device=round_logits[-1].device)
    alive = torch.ones_like(bias, dtype=torch.bool)
    scores = bias[..., :0]
    first = True
    for logits, end in zip(round_logits, ends):
        stop = end - hot
        if stop <= n_sink:
            continue
        z = logits[..., n_sink:stop].float()
        competing = alive[..., n_sink:stop].clone()
        scores = torch.sigmoid(z / temperature)
        if keep_ratio >= 1.0:
            continue
        protected = end - stop + n_sink if count_protected else 0
        count = kept_count(stop - n_sink, share_of_compressible(stop - n_sink, protected, keep_ratio))
        newest = newest_places(competing, count, recent_share)
        weight = scores
        if hard and allocation == "joint":
            kept = joint_round_kept(z, competing, newest, count, head_floor, across_layers=first)
        elif hard:
            ranked = z.masked_fill(~competing, float("-inf")).masked_fill(newest, float("inf"))
            kept = torch.zeros_like(z).scatter_(-1, ranked.topk(count).indices, 1.0)
        first = False
        if hard:
            weight = kept * (1 - EVICTED_WEIGHT) + EVICTED_WEIGHT + scores - scores.detach()
            alive[..., n_sink:stop] = competing & kept.bool()
        weight = weight.masked_fill(newest, 1.0)
        log_weight = torch.log(weight.clamp_min(torch.finfo(torch.float32).tiny))
        bias = bias + torch.nn.functional.pad(torch.where(competing, log_weight, 0.0), (n_sink, context - stop))
    return bias, scores


def budget_keep(scores: torch.Tensor, allocation: str = "per_head") -> torch.Tensor:
    """The mean keep score the budget term holds at ρ.

    Args:
        scores: (layers, batch, kv_heads, n) keep scores of the compressible tokens.
        allocation: ``per_head``: the mean of every (layer, KV head), (layers, kv_heads); ``joint``: one
            mean over everything, (1, 1), so heads and layers may keep more or less than ρ between them.
    """
    if allocation == "joint":
        return scores.mean().reshape(1, 1)
    return scores.mean(dim=(1, 3))


class BudgetController(nn.Module):
    """Penalty that keeps the mean keep score per (layer, KV head) at the target ratio ρ.

    Modes: ``two_sided`` λ·|mean − ρ| (default); ``hinge`` λ·relu(mean − ρ) (the seed's,
    which lets the mean sink below ρ); ``lagrange``: ν·(mean − ρ) with a multiplier ν per
    (layer, head) raised and lowered by dual ascent (``dual_step`` after each step). A (1, 1) mean keep (the
    joint allocation's, :func:`budget_keep`) broadcasts: one gap for every (layer, head).

    Args:
        num_layers, num_kv_heads: the multiplier grid (the full-attention layers only: a hybrid model's
            sliding-window layers are never compressed).
        mode: one of BUDGET_MODES.
        dual_lr: dual ascent step size for ``lagrange``.
    """

    def __init__(self, num_layers: int, num_kv_heads: int, mode: str = "two_sided", dual_lr: float = 0.05) -> None:
        super().__init__()
        if mode not in BUDGET_MODES:
            raise ValueError(f"unknown budget mode {mode!r}; expected one of {', '.join(BUDGET_MODES)}")
        self.mode, self.dual_lr = mode, dual_lr
        self.register_buffer("multipliers", torch.zeros(num_layers, num_kv_heads))

    def forward(self, mean_keep: torch.Tensor, keep_ratio: KeepRatio, weight: float) -> torch.Tensor:
        """Penalty for ``mean_keep`` (layers, kv_heads) against ``keep_ratio`` (ρ, or ρ_l per layer)."""
        gap = mean_keep - _per_layer(keep_ratio, mean_keep)
        if self.mode == "two_sided":
            return weight * gap.abs().mean()
        if self.mode == "hinge":
            return weight * torch.relu(gap).mean()
        return (self.multipliers * gap).mean()

    @torch.no_grad()
    def dual_step(self, mean_keep: torch.Tensor, keep_ratio: KeepRatio) -> None:
        """Dual ascent: raise ν where the mean keep is above ρ (ρ_l), lower it where below."""
        if self.mode == "lagrange":
            self.multipliers.add_(self.dual_lr * (mean_keep.detach() - _per_layer(keep_ratio, mean_keep)))


def _per_layer(keep_ratio: KeepRatio, mean_keep: torch.Tensor) -> torch.Tensor | float:
    """``keep_ratio`` broadcastable against ``mean_keep`` (layers, kv_heads): ρ, or a (layers, 1) column of ρ_l."""
    if isinstance(keep_ratio, Sequence):
        return torch.tensor(keep_ratio, dtype=mean_keep.dtype, device=mean_keep.device)[:, None]
    return keep_ratio


def dense_loss(logits: torch.Tensor, target: torch.Tensor, compressible: torch.Tensor) -> torch.Tensor:
    """1 − Pearson correlation of the logits with the log dense target, over compressible tokens.

    Scale- and shift-free, so it grades only how the estimator orders tokens (top-k is all the
    runtime uses) and leaves the keep scores' level to the budget term.

    Args:
        logits: (layers, batch, kv_heads, context) estimator logits z.
        target: (layers, batch, kv_heads, context) reconstruction scores (≥ 0).
        compressible: (context,) bool mask of the tokens that compete.

    Returns:
        Scalar mean over (layer, batch, KV head), in [0, 2].
    """
    z = logits[..., compressible].float()
    t = torch.log(target[..., compressible].float() + DENSE_FLOOR)
    z = z - z.mean(dim=-1, keepdim=True)
    t = t - t.mean(dim=-1, keepdim=True)
    correlation = (z * t).sum(dim=-1) / (z.norm(dim=-1) * t.norm(dim=-1)).clamp_min(1e-12)
    return (1 - correlation).mean()
