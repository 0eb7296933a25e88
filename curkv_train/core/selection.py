"""The selection arithmetic every method shares: which tokens are protected, how many are kept, which ones.

Trained scorer and training-free baselines differ only in the scores they give; which
tokens survive, and how they are gathered, is decided here (DESIGN §6).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import torch

from curkv_train.core.errors import CurKVError
from curkv_train.kernels import compact_kept

ADAPTIVE = "adaptive"


def check_keep_ratio(keep_ratio: float | str, *, allow_adaptive: bool = False) -> float | str:
    """``keep_ratio`` as a float in (0, 1] (or ``"adaptive"`` where allowed), else a one-line CurKVError."""
    if allow_adaptive and keep_ratio == ADAPTIVE:
        return keep_ratio
    adaptive = " or 'adaptive'" if allow_adaptive else ""
    if isinstance(keep_ratio, (str, bool)) or not 0.0 < float(keep_ratio) <= 1.0:
        raise CurKVError(f"keep_ratio must be in (0, 1]{adaptive}, got {keep_ratio!r} "
                         "(compression ratio = 1 - keep_ratio)")
    return float(keep_ratio)


def compressible_span(context_length: int, n_sink: int, window: int) -> tuple[int, int]:
    """(start, stop): the tokens start, ..., stop − 1 are neither sinks nor in the recent window (maybe none)."""
    start = min(n_sink, context_length)
    return start, max(start, context_length - window)


def compressible_mask(context_length: int, n_sink: int, window: int, device=None) -> torch.Tensor:
    """(context_length,) bool: True for tokens that are neither sinks nor in the recent window."""
    start, stop = compressible_span(context_length, n_sink, window)
    positions = torch.arange(context_length, device=device)
    return (positions >= start) & (positions < stop)


def kept_count(num_compressible: int, keep_ratio: float) -> int:
    """Compressible tokens kept at ``keep_ratio``: ceil(ρ·n), never rounding a kept token away."""
    return min(num_compressible, math.ceil(keep_ratio * num_compressible - 1e-9))


def share_of_compressible(compressible: int, protected: int, keep_ratio: float) -> float:
    """The share of ``compressible`` tokens to keep so that ρ of every token seen is held, the
    ``protected`` ones (sinks, hot tier) counted inside that budget: (ρ·(compressible + protected) −
    protected) / compressible, within [0, 1]. How the runtime cache, and the training rounds that
    imitate it, turn ``keep_ratio`` into a count: keep 0.5 holds half the tokens seen, as in kvpress.
    """
    if not compressible:
        return keep_ratio
    return min(1.0, max(0.0, keep_ratio * (compressible + protected) - protected) / compressible)


def check_recent_share(recent_share: float) -> float:
    """``recent_share`` as a float in [0, 1], else a one-line CurKVError."""
    if isinstance(recent_share, (str, bool)) or not 0.0 <= float(recent_share) <= 1.0:
        raise CurKVError(f"recent_share must be in [0, 1], got {recent_share!r}")
    return float(recent_share)


def newest_places(competing: torch.Tensor, keep: int, recent_share: float) -> torch.Tensor:
    """The newest ⌊share·keep⌋ competing tokens of each row: the places a budget reserves for them.

    A selection keeps these whatever their score and fills the rest of ``keep`` by score among
    the older ones: H2O's split of a budget between a recent window and heavy hitters, with the
    estimator choosing the heavy hitters. Runtime compressions and the training's streaming
    rounds both take their split from here.

    Args:
        competing: (..., tokens) bool, the tokens that compete for ``keep`` places (position
            order along the last dim).
        keep: places the competing tokens get.
        recent_share: share of them reserved for the newest, in [0, 1].

    Returns:
        (..., tokens) bool, all False where ``⌊share·keep⌋`` is 0.
    """
    recent = int(recent_share * keep + 1e-9)
    from_end = competing.flip(-1).cumsum(-1).flip(-1)  # competing tokens at or after each position
    return competing & (from_end <= recent)


def expected_kept(context_length: int, n_sink: int, window: int, keep_ratio: float) -> int:
    """Tokens :func:`select_kept` keeps per (layer, KV head): sinks + window + ⌈ρ·n_compressible⌉."""
    start, stop = compressible_span(context_length, n_sink, window)
    return context_length - (stop - start) + kept_count(stop - start, keep_ratio)


@functools.lru_cache(maxsize=256)
def protected_positions(tokens: int, start: int, stop: int, device: torch.device) -> torch.Tensor:
    """(tokens − (stop − start),) int64: the positions 0, ..., start − 1 and stop, ..., tokens − 1, which
    :func:`select_kept` keeps whatever their scores. Made once per (tokens, span, device), outside inference
    mode so that autograd may save it, and never written: a prefill's layers share one table."""
    with torch.inference_mode(False):
        # ranges, not a boolean mask: a mask's selection waits for the device to count it
        return torch.cat([torch.arange(start, device=device), torch.arange(stop, tokens, device=device)])


def select_kept(scores: torch.Tensor, n_sink: int, window: int, keep_ratio: float) -> torch.Tensor:
    """Indices kept per (batch, KV head): sinks + recent window + top-⌈ρ·n⌉ compressible by score.

    Args:
        scores: (batch, kv_heads, tokens) higher = more worth keeping.
        n_sink, window: always-kept leading / trailing tokens.
        keep_ratio: ρ, share of the compressible tokens to keep.

    Returns:
        (batch, kv_heads, kept) int64 indices in increasing position order, with
        kept = sinks + window + ⌈ρ·n_compressible⌉ (all tokens when nothing is compressible).
    """
    batch, heads, tokens = scores.shape
    start, stop = compressible_span(tokens, n_sink, window)
    protected = protected_positions(tokens, start, stop, scores.device).expand(batch, heads, -1)
    chosen = scores[..., start:stop].float().topk(kept_count(stop - start, keep_ratio), dim=-1).indices + start
    return torch.cat([protected, chosen], dim=-1).sort(dim=-1).values


def compress_kv(keys: torch.Tensor, values: torch.Tensor, keep_idx: torch.Tensor, backend: str = "auto"):
    """Dense (keys, values) of the kept tokens: (batch, kv_heads, kept, head_dim) each."""
    return compact_kept(keys, values, keep_idx, backend=backend)


ALLOCATIONS = ("per_head", "joint")


def check_allocation(allocation: str) -> str:
    """``allocation`` as one of :data:`ALLOCATIONS`, else a one-line CurKVError."""
    if allocation not in ALLOCATIONS:
        raise CurKVError(f"unknown allocation {allocation!r}; expected one of {', '.join(ALLOCATIONS)}")
    return allocation


def check_head_floor(head_floor: float) -> float:
    """``head_floor`` as a float in [0, 1], else a one-line CurKVError.

    A floor of 1 asks every head for its whole ⌈ρ·n⌉ share, which leaves the joint selection nothing to
    move (the equal split); above 1 the heads together would ask for more than ρ of the tokens.
    """
    if isinstance(head_floor, (str, bool)) or not 0.0 <= float(head_floor) <= 1.0:
        raise CurKVError(f"head_floor must be in [0, 1] (the share of a head's ⌈ρ·n⌉ it always keeps), "
                         f"got {head_floor!r}")
    return float(head_floor)


def joint_floor_count(num_compressible: int, num_heads: int, keep_ratio: float, head_floor: float) -> int:
    """Compressible tokens each of ``num_heads`` heads keeps whatever the joint ranking says.

    ⌈floor·ρ·n⌉, capped at the equal share ⌊⌈ρ·heads·n⌉ / heads⌋ so the floors never ask for more than the
    joint total (the ceilings could: 2 heads of 3 tokens at ρ 0.5 keep 3 together, not 2 + 2).
    """
    total = kept_count(num_heads * num_compressible, keep_ratio)
    return min(math.ceil(head_floor * keep_ratio * num_compressible - 1e-9), total // num_heads)


def check_budget_prior(budget_prior: float) -> float:
    """``budget_prior`` as a float in [0, 1], else a one-line CurKVError."""
    if isinstance(budget_prior, (str, bool)) or not 0.0 <= float(budget_prior) <= 1.0:
        raise CurKVError(f"budget_prior must be in [0, 1] (0: the scores alone split the memory across layers, 1: "
                         f"the calibrated layer budget does), got {budget_prior!r}")
    return float(budget_prior)


def prior_floor_counts(num_compressible: int, keep_ratio: float, head_floor: float, layer_ratios: Sequence[float],
                       budget_prior: float) -> list[int]:
    """Per layer, the compressible tokens each of its KV heads keeps whatever the joint ranking says, when
    a calibrated layer budget is the joint allocation's prior.

    The floor's share of a layer's tokens mixes the head floor and the budget: ⌊((1 − w)·floor·ρ + w·r_l)·n⌋, with
    w = ``budget_prior`` and r_l the budget's keep ratio of layer l (mean ρ). The floors never ask for more than
    the joint total: Σ_l heads·((1 − w)·floor·ρ + w·r_l)·n ≤ ρ·N. At w = 1 they are the total, so every layer
    holds the budget's split and only the heads within a layer share by score (beyond the floor's rounding).

    Args:
        num_compressible: n, compressible tokens per (layer, KV head).
        keep_ratio: ρ, the mean keep share of the compressible tokens.
        head_floor: :func:`check_head_floor`'s floor.
        layer_ratios: per layer, the budget's keep ratio at ρ (:meth:`~curkv_train.runtime.allocation.LayerBudget.ratios`).
        budget_prior: w in [0, 1].
    """
    shares = [(1.0 - budget_prior) * head_floor * keep_ratio + budget_prior * ratio for ratio in layer_ratios]
    # 1e-6: a share the bisection left a hair above its exact value does not round a token up
    return [max(0, min(num_compressible, math.floor(share * num_compressible - 1e-6))) for share in shares]


def joint_keep_mask(scores: torch.Tensor, keep_ratio: float, head_floor: float,
                    layer_floors: Sequence[int] | None = None) -> torch.Tensor:
    """Joint allocation: per example, the top ⌈ρ·N⌉ of all N compressible tokens of every layer and KV head.

    Each (layer, KV head) first keeps its own top :func:`joint_floor_count` tokens (or ``layer_floors[l]``, for
    a prior on the layers' shares: :func:`prior_floor_counts`), so no head is emptied; the rest of the ⌈ρ·N⌉
    places go to the highest scores wherever they are. Scores must share one scale across heads and layers for
    this to mean anything.

    Args:
        scores: (layers, batch, kv_heads, n) scores of the compressible tokens, higher = more worth keeping.
        keep_ratio: ρ over all N = layers · kv_heads · n compressible tokens of an example.
        head_floor: share of a head's ⌈ρ·n⌉ it keeps whatever the others score, in [0, 1].
        layer_floors: per layer, the tokens each of its heads keeps first; None: the head floor's count.

    Returns:
        (layers, batch, kv_heads, n) 0/1 float mask, summing to ⌈ρ·N⌉ over each example.
    """
    layers, batch, heads, tokens = scores.shape
    ranked = scores.detach().float()
    if layer_floors is None:
        floor = joint_floor_count(tokens, layers * heads, keep_ratio, head_floor)
        if floor > 0:  # the floor's tokens outrank every other one
            ranked = ranked.scatter(-1, ranked.topk(floor, dim=-1).indices, float("inf"))
    else:
        ranked = _raise_floors(ranked, layer_floors)
    flat = ranked.transpose(0, 1).reshape(batch, -1)
    mask = torch.zeros_like(flat).scatter_(-1, flat.topk(kept_count(flat.shape[-1], keep_ratio), dim=-1).indices, 1.0)
    return mask.reshape(batch, layers, heads, tokens).transpose(0, 1).to(scores.dtype)


def _raise_floors(ranked: torch.Tensor, layer_floors: Sequence[int]) -> torch.Tensor:
    """``ranked`` (layers, batch, kv_heads, n) with each head's top ``layer_floors[l]`` raised to +inf."""
    if len(layer_floors) != ranked.shape[0]:
        raise CurKVError(f"joint selection got {len(layer_floors)} layer floors for {ranked.shape[0]} layers")
    most = max(layer_floors, default=0)
    if most <= 0:
        return ranked
    top = ranked.topk(most, dim=-1)
    floors = torch.tensor(layer_floors, device=ranked.device).view(-1, 1, 1, 1)
    raised = torch.where(torch.arange(most, device=ranked.device) < floors, float("inf"), top.values)
    return ranked.scatter(-1, top.indices, raised)
