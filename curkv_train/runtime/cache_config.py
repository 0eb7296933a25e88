"""The settings a user gives :class:`~curkv_train.runtime.cache.CurKVCache` besides its budget: the tiers
(:class:`TierConfig`) and how it computes (:class:`ComputeConfig`). Both are frozen and checked when made."""

from __future__ import annotations

import numbers
from dataclasses import dataclass

from curkv_train.core.errors import CurKVError
from curkv_train.core.features import check_matmul_precision
from curkv_train.core.selection import check_allocation, check_budget_prior, check_head_floor, check_recent_share
from curkv_train.kernels import BACKENDS
from curkv_train.runtime import cur

# A prefill's first compressions are scored a group of layers at a time, as many as hold this many tokens: layer by
# layer, scoring is tens of small operators whose cost hardly depends on the tokens below some thousands
SCORING_BATCH_TOKENS = 4096
# Under the joint allocation every layer waits for the others' scores anyway (the whole prompt is held until the last
# layer), so a larger group costs no held tokens, only the pass's stacked copy of its layers' keys and values: all of
# a 4K prefill's layers (up to 32) in one pass, 8 at 16K, one beyond 128K
JOINT_SCORING_BATCH_TOKENS = 32 * SCORING_BATCH_TOKENS


def default_scoring_batch_tokens(allocation: str) -> int:
    """``scoring_batch_tokens`` when a TierConfig leaves it None: :data:`JOINT_SCORING_BATCH_TOKENS` under the joint
    allocation, else :data:`SCORING_BATCH_TOKENS`."""
    return JOINT_SCORING_BATCH_TOKENS if allocation == "joint" else SCORING_BATCH_TOKENS


def check_whole(name: str, value: object) -> None:
    """A one-line CurKVError unless ``value`` (a count of tokens, bytes or windows) is None or a whole number."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, numbers.Integral)):
        raise CurKVError(f"{name} must be a whole number, got {value!r}")


def check_count(name: str, value: object, least: int, *, optional: bool = False) -> None:
    """A one-line CurKVError unless ``value`` is a whole number >= ``least`` (or None, where ``optional``)."""
    if value is None and optional:
        return
    if value is None or isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < least:
        allowed = " (or None for the default)" if optional else ""
        raise CurKVError(f"{name} must be a whole number >= {least}{allowed}, got {value!r}")


@dataclass(frozen=True)
class TierConfig:
    """What each tier of a :class:`~curkv_train.runtime.CurKVCache` holds and when it compresses (DESIGN §6).

    Attributes:
        recent_share: share of the places compressible tokens compete for at each compression given to the
            newest of them; the estimator fills the rest from the older ones (H2O's recent + heavy-hitter split).
            0: every place by score (suits prompts that hide a needle); 1: a recent window. docs/runtime.md
            compares them.
        n_sink: always-kept leading tokens; None: the scorer's.
        window: the window unit of the tiers, in tokens; None: the scorer's.
        hot: protect the last ``hot_windows`` windows; False: only the last window.
        hot_windows: size of the hot tier in windows.
        compress_every: compress once this many windows of tokens have piled up past the hot tier. Each
            compression scores every held token, so 2 halves that work against 1.
        warm: hold up to ⌈ρ·warm_windows·window⌉ kept tokens densely before they go cold; False: kept tokens
            go straight to the cold tier. Matters only with ``cold``: without a cold tier every kept token
            stays dense.
        warm_windows: size of the warm tier's span in windows.
        cold: factor warm overflow into CUR blocks (not while ρ = 1). Off by default: it holds fewer bytes than
            the dense tiers at the same keep ratio but costs quality and decode speed (docs/runtime.md).
        cold_block: least tokens per cold block; None: 4 windows.
        cold_rows: CUR rank r (tokens) of a cold block; None: head_dim // 2.
        cold_channels: CUR rank c (channels) of a cold block; None: head_dim // 2.
        cold_core: ``optimal`` or ``intersection`` (see :mod:`curkv_train.runtime.cur`).
        compensation: keep the largest entries of each cold block's CUR residual.
        compensation_ratio: share of a block's entries kept as residual, in [0, 1].
        scoring_batch_tokens: a prefill's first compressions are scored several layers at a time, as many as
            hold this many of its tokens (:meth:`~curkv_train.runtime.Scorer.score_layers`): the same scores,
            from fewer, larger operators. Until its group is scored a layer holds the whole prompt; 0 or 1
            scores each layer as it runs. None: 4096 tokens, or under ``joint`` (where every layer waits for
            the last anyway) 131072 (:func:`default_scoring_batch_tokens`).
        allocation: None: the scorer's (``per_head`` unless it was trained under ``joint``); ``per_head``: every
            (layer, KV head) keeps the same count; ``joint``: a prefill's first
            compression keeps the top ⌈ρ·N⌉ compressible tokens jointly over every layer and KV head, later ones
            jointly over each layer's KV heads, and heads hold different counts in ragged storage (the same total;
            docs/runtime.md, "Joint allocation and ragged storage"). Not with ``cold``.
        head_floor: under ``joint``, the share of a head's equal share of the places filled by score that it keeps
            whatever the other heads score, in [0, 1]; None: the scorer's (its training's ``head_floor``).
        budget_prior: under ``joint``, the weight w in [0, 1] of a calibrated layer budget (the cache's
            ``layer_budget``, by default the scorer's) in a prefill's first compression: each head of layer l keeps
            at least ⌊((1 − w)·head_floor·ρ + w·r_l)·n⌋ of its n competing tokens, r_l the budget's ratio for l
            (:func:`~curkv_train.core.selection.prior_floor_counts`), the rest by the joint ranking. 0 (default):
            the scores alone decide each layer's share; 1: the budget's split, the heads sharing within each layer.
    """

    recent_share: float = 0.5
    n_sink: int | None = None
    window: int | None = None
    hot: bool = True
    hot_windows: int = 2
    compress_every: int = 2
    warm: bool = True
    warm_windows: int = 10
    cold: bool = False
    cold_block: int | None = None
    cold_rows: int | None = None
    cold_channels: int | None = None
    cold_core: str = "optimal"
    compensation: bool = True
    compensation_ratio: float = 0.05
    scoring_batch_tokens: int | None = None
    allocation: str | None = None
    head_floor: float | None = None
    budget_prior: float = 0.0

    def __post_init__(self) -> None:
        check_recent_share(self.recent_share)
        check_budget_prior(self.budget_prior)
        if self.allocation is not None:
            check_allocation(self.allocation)
        if self.head_floor is not None:
            check_head_floor(self.head_floor)
        if self.allocation == "joint" and self.cold:
            raise CurKVError("allocation='joint' does not support the cold tier yet; pass cold=False or "
                             "allocation='per_head'")
        if self.budget_prior and self.allocation == "per_head":
            raise CurKVError("budget_prior weighs a layer budget into the joint allocation; under allocation='per_head' "
                             "pass the budget itself (CurKVCache's layer_budget)")
        for name, least in (("hot_windows", 1), ("compress_every", 1), ("warm_windows", 0)):
            check_count(name, getattr(self, name), least)
        for name, least in (("n_sink", 0), ("window", 1), ("cold_block", 1), ("cold_rows", 1), ("cold_channels", 1),
                            ("scoring_batch_tokens", 0)):
            check_count(name, getattr(self, name), least, optional=True)
        if self.cold_core not in cur.CORES:
            raise CurKVError(f"unknown cold_core {self.cold_core!r}; expected one of {', '.join(cur.CORES)}")
        if isinstance(self.compensation_ratio, (str, bool)) or not 0.0 <= self.compensation_ratio <= 1.0:
            raise CurKVError(f"compensation_ratio must be in [0, 1], got {self.compensation_ratio!r}")


@dataclass(frozen=True)
class ComputeConfig:
    """How a :class:`~curkv_train.runtime.CurKVCache` computes; none of it changes which tokens it keeps
    (``scorer_precision`` aside, which rounds the scores' inputs).

    Attributes:
        backend: compaction and factored-attention kernel backend: ``auto``, ``torch`` or ``triton``.
        factored_attention: attend to cold blocks through their factors (the model's sdpa or eager attention is
            wrapped while the cache is open, see :mod:`curkv_train.runtime.attention`); False rebuilds them
            densely at each step.
        compile_scorer: score through ``torch.compile`` (:meth:`~curkv_train.runtime.Scorer.compiled`): the
            first compression pays the compilation (tens of seconds), later ones run fused kernels.
        scorer_precision: the scorer's :attr:`~curkv_train.runtime.Scorer.matmul_precision` for this cache
            (``highest`` or ``medium``: bfloat16 operands in the query features' three attention-sized
            products); None: the scorer's own.
        scoring_graphs: score through ``torch.compile``'s ``reduce-overhead`` mode
            (:meth:`~curkv_train.runtime.Scorer.graphed`): on a GPU every compression, the decode's included, replays
            a CUDA graph, one of four per doubling of the held tokens (widths padded, the padding masked); the first
            compression pays the compilation, as ``compile_scorer``, which it replaces.
    """

    backend: str = "auto"
    factored_attention: bool = True
    compile_scorer: bool = False
    scorer_precision: str | None = None
    scoring_graphs: bool = False

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise CurKVError(f"unknown backend {self.backend!r}; expected one of {', '.join(BACKENDS)}")
        if self.scorer_precision is not None:
            check_matmul_precision(self.scorer_precision)
