"""The tier settings of :class:`~curkv_train.runtime.cache.CurKVCache` (how many tokens each layer keeps)
and its cold blocks (CUR factors of keys and values)."""

from __future__ import annotations

from dataclasses import dataclass

from curkv_train.core.errors import CurKVError
from curkv_train.core.selection import ADAPTIVE, check_keep_ratio, kept_count, share_of_compressible
from curkv_train.runtime import cur
from curkv_train.runtime.allocation import LayerBudget
from curkv_train.runtime.cache_config import ComputeConfig, TierConfig, check_whole


def adaptive_keep_ratio(tokens: int) -> float:
    """The seed's length-adaptive keep ratio: < 1K tokens 1.0 (no compression), 1K–4K 0.5, > 4K 0.3."""
    if tokens < 1024:
        return 1.0
    return 0.5 if tokens <= 4096 else 0.3


@dataclass(frozen=True)
class TierSettings:
    """What one cache layer keeps, in tokens: a :class:`~curkv_train.runtime.cache_config.TierConfig` resolved against a
    scorer (its spans and head_dim fill the fields left None) and the cache's budget (:meth:`resolve`)."""

    keep_ratio: float | str
    n_sink: int
    window: int
    hot_tokens: int
    warm_tokens: int
    cold: bool
    cold_block: int
    cold_rows: int
    cold_channels: int
    cold_core: str
    compensation: bool
    compensation_ratio: float
    max_tokens: int | None
    backend: str
    recent_share: float
    interval: int  # tokens that pile up past the hot tier before a compression
    layer_budget: LayerBudget | None = None
    allocation: str = "per_head"  # TierConfig.allocation
    head_floor: float = 0.1  # TierConfig.head_floor
    budget_prior: float = 0.0  # TierConfig.budget_prior
    prior_budget: LayerBudget | None = None  # the budget it weighs in, under joint

    @classmethod
    def resolve(cls, tiers: TierConfig, compute: ComputeConfig, *, keep_ratio: float | str, max_tokens: int | None,
                n_sink: int, window: int, head_dim: int, layer_budget: LayerBudget | None,
                prior_budget: LayerBudget | None = None) -> "TierSettings":
        """The settings ``tiers`` and ``compute`` give a cache whose scorer protects ``n_sink`` sinks, works in
        windows of ``window`` tokens and reads keys ``head_dim`` wide (each used where ``tiers`` leaves it None)."""
        window = window if tiers.window is None else tiers.window
        half = max(1, head_dim // 2)
        return cls(keep_ratio=keep_ratio, n_sink=n_sink if tiers.n_sink is None else tiers.n_sink, window=window,
                   hot_tokens=window * (tiers.hot_windows if tiers.hot else 1), interval=window * tiers.compress_every,
                   warm_tokens=window * tiers.warm_windows if tiers.warm else 0, cold=tiers.cold,
                   cold_block=4 * window if tiers.cold_block is None else tiers.cold_block,
                   cold_rows=half if tiers.cold_rows is None else tiers.cold_rows,
                   cold_channels=half if tiers.cold_channels is None else tiers.cold_channels,
                   cold_core=tiers.cold_core, compensation=tiers.compensation,
                   compensation_ratio=tiers.compensation_ratio, max_tokens=max_tokens, backend=compute.backend,
                   recent_share=tiers.recent_share, layer_budget=layer_budget, allocation=tiers.allocation,
                   head_floor=tiers.head_floor, budget_prior=tiers.budget_prior, prior_budget=prior_budget)

    def __post_init__(self) -> None:
        """The budget's and the resolved spans' checks (TierConfig checked the sizes it was given)."""
        check_keep_ratio(self.keep_ratio, allow_adaptive=True)
        if self.window < 1 or self.n_sink < 0:
            raise CurKVError(f"need window >= 1 and n_sink >= 0, got window {self.window}, n_sink {self.n_sink} (the "
                             "scorer's unless given): pass TierConfig(window=..., n_sink=...)")
        check_whole("max_tokens", self.max_tokens)
        if self.max_tokens is not None and self.kept_cap < 0:
            raise CurKVError(f"a budget of {self.max_tokens} tokens per (layer, KV head) is smaller than what every "
                             f"layer always holds: {self.fixed_tokens} (n_sink {self.n_sink} + hot tier "
                             f"{self.hot_tokens} + {self.interval - 1} tokens arriving before the next compression); "
                             "raise the budget or lower n_sink / window / hot_windows / compress_every")

    @property
    def fixed_tokens(self) -> int:
        """Tokens a layer may hold per (batch, KV head) besides the kept ones: sinks, hot tier, pending arrivals."""
        return self.n_sink + self.hot_tokens + self.interval - 1

    @property
    def kept_cap(self) -> int | None:
        """Most compressible tokens (warm + cold) held under ``max_tokens``, or None without a budget."""
        return None if self.max_tokens is None else self.max_tokens - self.fixed_tokens

    def ratio(self, seen: int, layer: int | None = None) -> float:
        """The keep ratio ρ in force after ``seen`` tokens: the mean over layers, or ``layer``'s share of it
        under a layer budget."""
        ratio = adaptive_keep_ratio(seen) if self.keep_ratio == ADAPTIVE else self.keep_ratio
        return ratio if layer is None or self.layer_budget is None else self.layer_budget.ratios(ratio)[layer]

    def target(self, compressible_seen: int, seen: int, layer: int | None = None) -> int:
        """Compressible tokens to hold (warm + cold) after ``compressible_seen`` of the ``seen`` tokens went
        by, in ``layer`` (the mean layer's without it): with the ``seen − compressible_seen`` protected ones,
        ρ of the tokens seen (:func:`~curkv_train.core.selection.share_of_compressible`).

        A token budget caps the mean over layers: under a layer budget the capped mean ratio is split
        across the layers like any other, so the whole cache holds what a uniform one would.
        """
        ratio = share_of_compressible(compressible_seen, seen - compressible_seen, self.ratio(seen))
        if self.max_tokens is not None and compressible_seen:
            ratio = min(ratio, self.kept_cap / compressible_seen)
        if layer is not None and self.layer_budget is not None:
            ratio = self.layer_budget.ratios(ratio)[layer]
        return kept_count(compressible_seen, ratio)


@dataclass
class ColdBlock:
    """Keys and values of a block of cold tokens as CUR factors, (batch, kv_heads, tokens, head_dim) each."""

    keys: cur.CurFactors
    values: cur.CurFactors

    @property
    def tokens(self) -> int:
        """Tokens per (batch, KV head) in the block."""
        return self.keys.shape[-2]

    def nbytes(self) -> int:
        """Bytes held by both factorizations."""
        return cur.nbytes(self.keys) + cur.nbytes(self.values)
