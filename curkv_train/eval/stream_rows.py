"""The streaming task's rows: which caches it compares, at which memory setting, and how each is built.

See :mod:`curkv_train.eval.streaming` for the task and the meaning of every row."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field

from transformers import PreTrainedModel
from transformers.cache_utils import Cache

from curkv_train.core.errors import CurKVError
from curkv_train.core.selection import check_keep_ratio
from curkv_train.eval.methods import CURKV_UNIFORM
from curkv_train.eval.runtime_caches import RecencyCache, plain_cache
from curkv_train.eval.statistics import Bootstrap
from curkv_train.runtime.cache import CurKVCache
from curkv_train.runtime.cache_config import ComputeConfig, TierConfig
from curkv_train.runtime.scorer import Scorer

FULL, STREAMING_LLM, CURKV, CURKV_SCORE_ONLY, CURKV_COLD, CURKV_COMPENSATED, RECENCY = (
    "full", "streaming_llm", "curkv", "curkv_score_only", "curkv_cold", "curkv_compensated", "recency")


@dataclass(frozen=True)
class MemorySetting:
    """One memory setting every compressing method runs at: the column ``label`` (``0.5``, ``512 tokens``, ``2.0 MiB``),
    the runtime cache's ``keep_ratio`` ρ (1.0 under a budget), the budget ``max_tokens`` / ``max_bytes``, and the
    compression ``ratio`` 1 − ρ of a ratio setting."""

    label: str
    keep_ratio: float = 1.0
    max_tokens: int | None = None
    max_bytes: int | None = None
    ratio: float | None = None

    def cache_options(self) -> dict:
        """CurKVCache keyword arguments of this setting."""
        return {"keep_ratio": self.keep_ratio, "max_tokens": self.max_tokens, "max_bytes": self.max_bytes}

    def record(self) -> dict:
        """The setting as a plain dict (results.json)."""
        return asdict(self)


def memory_settings(ratios: list[float], budget_tokens: list[int] | None = None,
                    budget_bytes: list[int] | None = None) -> list[MemorySetting]:
    """Ratio settings, then token budgets, then byte budgets (one-line errors for values out of range)."""
    settings = []
    for ratio in ratios:
        if not 0.0 <= ratio < 1.0:
            raise CurKVError(f"compression ratios must lie in [0, 1), got {ratio}")
        settings.append(MemorySetting(f"{ratio:g}", check_keep_ratio(1.0 - ratio), ratio=ratio))
    for tokens in budget_tokens or []:
        if tokens < 1:
            raise CurKVError(f"--budget_tokens must be positive, got {tokens}")
        settings.append(MemorySetting(f"{tokens} tokens", max_tokens=tokens))
    for size in budget_bytes or []:
        if size < 1:
            raise CurKVError(f"--budget_bytes must be positive, got {size}")
        settings.append(MemorySetting(f"{size / 2**20:.3g} MiB", max_bytes=size))
    if not settings:
        raise CurKVError("the streaming task needs a compression ratio or a budget (--ratios, --budget_tokens, "
                         "--budget_bytes)")
    labels = [setting.label for setting in settings]
    if len(set(labels)) != len(labels):  # one results cell per label: a repeat would drop rows
        raise CurKVError(f"memory settings repeat ({', '.join(labels)}); give each ratio or budget once")
    return settings


@dataclass
class StreamSettings:
    """How the streaming task runs: the ``memory`` settings every compressing method runs at; ``prefix`` tokens
    prefilled at once (the perplexity is over the rest), then ``chunk`` tokens per step; ``segment`` scored tokens
    per recorded segment; the caches' kernel ``backend``; the bootstrap's ``seed`` and ``resamples``."""

    memory: list[MemorySetting]
    prefix: int = 1024
    chunk: int = 64
    segment: int = 512
    backend: str = "auto"
    seed: int = 0
    resamples: int = 2000
    bootstrap: Bootstrap = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if self.prefix < 1 or self.chunk < 1 or self.segment < 1:
            raise CurKVError(f"--stream_prefix, --stream_chunk and --stream_segment must be at least 1, got "
                             f"{self.prefix}, {self.chunk} and {self.segment}")
        self.bootstrap = Bootstrap(resamples=self.resamples, seed=self.seed)

    def check_length(self, length: int, max_positions: int | None) -> None:
        """A CurKVError unless documents of ``length`` tokens leave tokens after the prefix and fit the model."""
        if length <= self.prefix:
            raise CurKVError(f"--stream_length {length} must exceed --stream_prefix {self.prefix} (the perplexity "
                             "is over the tokens after the prefix)")
        if max_positions and length > max_positions:
            raise CurKVError(f"--stream_length {length} exceeds the model's {max_positions} positions")


@dataclass
class StreamMethod:
    """A streaming method: its name and how to build its cache at a memory setting (``full`` ignores it)."""

    name: str
    build: Callable[[MemorySetting], Cache]


def stream_methods(model: PreTrainedModel, scorers: dict[str, Scorer], carrier: Scorer, settings: StreamSettings, *,
                   main: str | None) -> list[StreamMethod]:
    """Every streaming method: ``scorers`` by method name (``curkv``, ``curkv:LABEL``; ``main`` the main one's, None
    without a scorer); ``carrier``: the scorer whose spans and observation the recency caches copy."""
    backend = settings.backend
    suffix = main[len(CURKV):] if main else ""

    def curkv(scorer: Scorer, layer_budget: str = "scorer", **tiers) -> Callable[[MemorySetting], Cache]:
        return lambda memory: CurKVCache(scorer, model=model, layer_budget=layer_budget, tiers=TierConfig(**tiers),
                                         compute=ComputeConfig(backend=backend), **memory.cache_options())

    def recency(observe: bool = True, layer_budget: str = "scorer", **tiers) -> Callable[[MemorySetting], Cache]:
        return lambda memory: RecencyCache(carrier, model=model, observe=observe, layer_budget=layer_budget,
                                           tiers=TierConfig(**tiers), compute=ComputeConfig(backend=backend),
                                           **memory.cache_options())

    methods = [StreamMethod(FULL, lambda memory: plain_cache(model)),
               StreamMethod(STREAMING_LLM, recency(cold=False, observe=False, layer_budget="uniform"))]
    if main:
        scorer = scorers[main]
        methods += [StreamMethod(main, curkv(scorer)),
                    StreamMethod(CURKV_UNIFORM + suffix, curkv(scorer, layer_budget="uniform")),
                    StreamMethod(CURKV_SCORE_ONLY + suffix, curkv(scorer, recent_share=0.0)),
                    StreamMethod(CURKV_COLD + suffix, curkv(scorer, cold=True, compensation=False)),
                    StreamMethod(CURKV_COMPENSATED + suffix, curkv(scorer, cold=True))]
    methods.append(StreamMethod(RECENCY, recency()))
    return methods + [StreamMethod(name, curkv(scorer)) for name, scorer in scorers.items() if name != main]


def select_rows(methods: list[StreamMethod], names: list[str] | None) -> list[StreamMethod]:
    """The methods named in ``names`` (all if None), ``full`` always (every row is measured against it);
    a one-line CurKVError for a name no method has."""
    if not names:
        return methods
    available = [method.name for method in methods]
    unknown = [name for name in names if name not in available]
    if unknown:
        raise CurKVError(f"unknown streaming row(s) {', '.join(map(repr, unknown))}; this run has: "
                         f"{', '.join(available)}")
    return [method for method in methods if method.name == FULL or method.name in names]


def check_memory(model: PreTrainedModel, scorers: dict[str, Scorer], carrier: Scorer,
                 settings: StreamSettings) -> None:
    """A one-line CurKVError, before anything runs, for a memory setting some cache cannot hold
    (a budget below the sinks, hot tier and a window of arrivals of a scorer's spans)."""
    for memory in settings.memory:
        for name, scorer in {"the recency caches": carrier, **scorers}.items():
            for cls in (CurKVCache, RecencyCache):
                try:
                    cls(scorer, model=model, **memory.cache_options())
                except CurKVError as error:
                    raise CurKVError(f"streaming setting {memory.label} for {name}: {error}") from None
